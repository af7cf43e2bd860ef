"""The sharded-vs-one-device comparison the sharding tests run in a subprocess with virtual CPU
devices (XLA_FLAGS must be set before jax starts, so it cannot run in the test process)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_sparse_mla import MLAConfig, Request, init_cache, init_params, plan_batch
from jax_sparse_mla.model import jit_forward
from jax_sparse_mla.sharding import init_sharded_cache, jit_sharded_forward, make_mesh, plan_data_parallel, shard_params

TINY = MLAConfig.tiny()  # 4 heads, 4 index heads, topk 16, page 4
PAGES = 32  # per data shard

# Steps of work per data shard: {shard: [(seq_id, length of the sequence, new tokens)]}.
# 1: a long prefill (sparse rows) next to short ones (dense MHA): the dense program.
# 2: decodes only. 3: a short prefill and a decode next to a decode-only shard: dense program.
# 4: one shard idle. On a mesh with one data shard, that shard gets all the work.
STEPS = [
    {0: [("a", 37, 37)], 1: [("b", 11, 11), ("c", 16, 16)]},
    {0: [("a", 0, 1)], 1: [("b", 0, 1), ("c", 0, 1)]},
    {0: [("d", 10, 10), ("a", 0, 1)], 1: [("c", 0, 1)]},
    {0: [], 1: [("b", 0, 1)]},
]
ROUTES = ["dense", "sparse", "dense", "sparse"]


def mesh_errors(meshes, kv_cache_dtype="bfloat16", dispatch="static"):
    """For each (data, tensor) mesh: the largest relative error of any step's output rows and of the
    final caches against one-device forward runs of each shard's own batch, the step routes and
    the plans' fp8 splits (BatchPlan.num_upfront_rows). dispatch="cond" (meshes with one data
    shard): the step is plan_batch's cond plan (plan_data_parallel's with several data shards),
    and its route whether some shard's meta.branches runs the dense call; the
    one-device runs use cond plans too."""
    config = dataclasses.replace(TINY, kv_cache_dtype=kv_cache_dtype)
    rng = np.random.default_rng(0)
    params = init_params(config, jax.random.key(0))
    results = {}
    for dp, tp in meshes:
        mesh = make_mesh(dp, tp)
        sharded_params = shard_params(params, mesh, config)
        cache = init_sharded_cache(config, mesh, PAGES)
        local_caches = [init_cache(config, PAGES) for _ in range(dp)]
        seqs = [dict() for _ in range(dp)]  # per shard: seq_id -> [hidden rows, done, block table]
        free = [list(range(PAGES)) for _ in range(dp)]
        worst, routes, splits, indexer_shards, score_chunks = 0.0, [], [], [], []
        for step in STEPS:
            shards, rows = [], []
            for d in range(dp):
                reqs, x = [], []
                work = [w for k in sorted(step) if k % dp == d for w in step[k]]  # one shard: all the work
                for sid, length, n in work:
                    if sid not in seqs[d]:  # a new sequence: random hidden states, shuffled pages
                        num = -(-length // config.page_size) + 1
                        pages = [free[d].pop(int(rng.integers(len(free[d])))) for _ in range(num)]
                        states = rng.standard_normal((length + 4, config.hidden_size)).astype(np.float32)
                        seqs[d][sid] = [states, 0, pages]
                    h, done, table = seqs[d][sid]
                    reqs.append(Request(done, n, table))
                    x.append(h[done:done + n])
                    seqs[d][sid][1] += n
                shards.append(reqs)
                rows.append(np.concatenate(x) if x else np.zeros((0, config.hidden_size), np.float32))
            if dispatch == "cond" and dp == 1:  # plan_batch's own plan
                plan, meta = plan_batch(config, shards[0], num_pages=PAGES, dispatch="cond", tensor_parallel=tp)
                routes.append("dense" if plan.dense_keys_picked(meta.branches[1]) else "sparse")
            elif dispatch == "cond":  # each shard's stage sizes in its own meta.branches
                plan, meta = plan_data_parallel(config, shards, pages_per_shard=PAGES, tensor_parallel=tp,
                                                dispatch="cond")
                picks = np.asarray(meta.branches).reshape(dp, -1)[:, 1]
                routes.append("dense" if any(plan.dense_keys_picked(i) for i in picks) else "sparse")
            else:
                plan, meta = plan_data_parallel(config, shards, pages_per_shard=PAGES, tensor_parallel=tp)
                routes.append(plan.route)
            splits.append(plan.num_upfront_rows)
            indexer_shards += [g.indexer_shards for g in plan.groups]
            score_chunks += [g.score_chunks for g in plan.groups]
            T = plan.num_tokens
            hidden = np.zeros((dp * T, config.hidden_size), np.float32)
            for d in range(dp):
                hidden[d * T:d * T + len(rows[d])] = rows[d]
            out, cache = jit_sharded_forward(sharded_params, jnp.asarray(hidden), cache, meta, mesh=mesh,
                                             plan=plan, config=config)
            out = np.asarray(out)
            for d in range(dp):
                assert not np.any(out[d * T + len(rows[d]):(d + 1) * T]), "padding rows must give 0"
                if not shards[d]:
                    continue
                p1, m1 = plan_batch(config, shards[d], num_pages=PAGES, dispatch=dispatch)
                x1 = np.zeros((p1.num_tokens, config.hidden_size), np.float32)
                x1[:len(rows[d])] = rows[d]
                ref, local_caches[d] = jit_forward(params, jnp.asarray(x1), local_caches[d], m1, plan=p1, config=config)
                got = out[d * T:d * T + len(rows[d])]
                want = np.asarray(ref)[:len(rows[d])]
                worst = max(worst, float(np.linalg.norm(got - want) / np.linalg.norm(want)))
        for name in ("latent", "k_pe", "index_k", "index_k_scale"):
            whole = np.asarray(getattr(cache, name).astype(jnp.float32))
            for d in range(dp):
                want = np.asarray(getattr(local_caches[d], name).astype(jnp.float32))
                got = whole[d * PAGES:(d + 1) * PAGES]
                worst = max(worst, float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)))
        results[f"{dp}x{tp}"] = {
            "err": worst, "routes": routes, "splits": splits,
            # pages per device (each holds its data shard's pages) and q_b_proj rows per device (its heads)
            "cache_pages": sorted(s.data.shape[0] for s in cache.latent.addressable_shards),
            "index_pages": sorted(s.data.shape[0] for s in cache.index_k.addressable_shards),
            "q_b_rows": sorted(s.data.shape[0] for s in sharded_params["q_b_proj.weight"].addressable_shards),
            "wq_b_rows": sorted(s.data.shape[0] for s in sharded_params["indexer.wq_b.weight"].addressable_shards),
            "indexer_shards": indexer_shards, "score_chunks": score_chunks}
    return results


def poisoned_rows(dp, tp, dispatch="static"):
    """A short prefill (dense MHA) beside a long one (scored) whose hidden row 5 holds a NaN,
    through sharded_forward on a (dp, tp) mesh (the non-finite rows set on each tensor shard's
    partial output, which the sum over the shards keeps NaN) and through the one-device forward: {"nan_rows", "ref_nan_rows":
    the rows that are NaN in every column, "partial": rows NaN in some columns only, "err": the
    other rows' largest relative difference}."""
    config = TINY
    params = init_params(config, jax.random.key(0))
    mesh = make_mesh(dp, tp)
    reqs = [Request(0, 8, [0, 1]), Request(0, 20, [2, 3, 4, 5, 6])]
    x = np.random.default_rng(2).standard_normal((28, config.hidden_size)).astype(np.float32)
    x[8 + 5, 3] = np.nan
    if dispatch == "cond" and dp == 1:
        plan, meta = plan_batch(config, reqs, num_pages=PAGES, dispatch="cond", tensor_parallel=tp)
    else:
        plan, meta = plan_data_parallel(config, [reqs] + [[]] * (dp - 1), pages_per_shard=PAGES, tensor_parallel=tp,
                                        dispatch=dispatch)
    hidden = np.zeros((dp * plan.num_tokens, config.hidden_size), np.float32)
    hidden[:28] = x
    out, _ = jit_sharded_forward(shard_params(params, mesh, config), jnp.asarray(hidden),
                                 init_sharded_cache(config, mesh, PAGES), meta, mesh=mesh, plan=plan, config=config)
    p1, m1 = plan_batch(config, reqs, num_pages=PAGES, dispatch=dispatch)
    x1 = np.zeros((p1.num_tokens, config.hidden_size), np.float32)
    x1[:28] = x
    ref, _ = jit_forward(params, jnp.asarray(x1), init_cache(config, PAGES), m1, plan=p1, config=config)
    out, ref = np.asarray(out)[:28], np.asarray(ref)[:28]
    nan = np.isnan(out).all(-1)
    healthy = ~nan & ~np.isnan(ref).any(-1)
    return {"nan_rows": np.flatnonzero(nan).tolist(), "ref_nan_rows": np.flatnonzero(np.isnan(ref).all(-1)).tolist(),
            "partial": int((np.isnan(out).any(-1) & ~nan).sum()),
            "err": float(np.linalg.norm(out[healthy] - ref[healthy]) / np.linalg.norm(ref[healthy]))}


# Steps per device for data_parallel: each device's own requests, routes differing by device.
DEVICE_STEPS = [
    [[("a", 37, 37)], [("b", 11, 11), ("c", 5, 5)]],   # masked MHA (the dense program) | dense program
    [[("a", 0, 1)], [("b", 0, 1), ("d", 6, 6)]],       # sparse | dense (a prefill beside a decode)
    [[], [("c", 0, 1)]],                               # idle | sparse
]


def device_parallel_errors(kv_cache_dtype="bfloat16"):
    """data_parallel on every device of the process against one-device jit_forward runs of each
    device's own batch: the largest relative difference of any output or final cache, the routes
    per step and device, and whether every output and cache stayed on its own device."""
    from jax_sparse_mla.data_parallel import data_parallel_step, init_device_caches, plan_shards, replicate_params

    config = dataclasses.replace(TINY, kv_cache_dtype=kv_cache_dtype)
    devices = jax.devices()[:2]
    rng = np.random.default_rng(1)
    params = init_params(config, jax.random.key(0))
    per_device = replicate_params(params, devices)
    caches = init_device_caches(config, devices, PAGES)
    local = [init_cache(config, PAGES) for _ in devices]  # the one-device runs, on the default device
    seqs = [dict() for _ in devices]
    free = [list(range(PAGES)) for _ in devices]
    worst, routes, placed = 0.0, [], True
    for step in DEVICE_STEPS:
        shards, rows = [], []
        for d, work in enumerate(step):
            reqs, x = [], []
            for sid, length, n in work:
                if sid not in seqs[d]:
                    pages = [free[d].pop(int(rng.integers(len(free[d])))) for _ in range(-(-length // config.page_size) + 1)]
                    seqs[d][sid] = [rng.standard_normal((length + 4, config.hidden_size)).astype(np.float32), 0, pages]
                h, done, table = seqs[d][sid]
                reqs.append(Request(done, n, table))
                x.append(h[done:done + n])
                seqs[d][sid][1] += n
            shards.append(reqs)
            rows.append(np.concatenate(x) if x else None)
        plans = plan_shards(config, shards, devices, pages_per_device=PAGES)
        routes.append([None if p is None else p[0].program for p in plans])
        hidden = []
        for p, r in zip(plans, rows):
            if p is None:
                hidden.append(None)
                continue
            x = np.zeros((p[0].num_tokens, config.hidden_size), np.float32)
            x[:len(r)] = r
            hidden.append(jnp.asarray(x))
        outs, caches = data_parallel_step(per_device, hidden, caches, plans, config=config)
        for d, (out, p) in enumerate(zip(outs, plans)):
            if p is None:
                placed &= out is None
                continue
            placed &= out.devices() == {devices[d]}
            p1, m1 = plan_batch(config, shards[d], num_pages=PAGES)
            ref, local[d] = jit_forward(params, hidden[d], local[d], m1, plan=p1, config=config)
            worst = max(worst, float(np.abs(np.asarray(out) - np.asarray(ref)).max() / np.abs(np.asarray(ref)).max()))
    for d, (cache, want) in enumerate(zip(caches, local)):
        placed &= all(leaf.devices() == {devices[d]} for leaf in jax.tree.leaves(cache))
        for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(want)):
            a, b = np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32))
            worst = max(worst, float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)))
    return {"err": worst, "routes": routes, "placed": bool(placed)}


def device_parallel_refusals():
    """data_parallel_step on 2 devices with device 0's inputs good and one of device 1's bad:
    for each bad input, the error message and whether device 0's cache is still alive (not
    donated to a step that ran before the refusal)."""
    from jax_sparse_mla.data_parallel import data_parallel_step, init_device_caches, plan_shards, replicate_params

    devices = jax.devices()[:2]
    params = replicate_params(init_params(TINY, jax.random.key(0)), devices)
    shards = [[Request(0, 5, [0, 1])], [Request(0, 9, [2, 3, 4])]]
    plans = plan_shards(TINY, shards, devices, pages_per_device=PAGES)
    hidden = [jnp.zeros((p.num_tokens, TINY.hidden_size), jnp.float32) for p, _ in plans]
    other_pages = plan_shards(TINY, shards, devices, pages_per_device=PAGES // 2)[1]
    other_tensor = plan_batch(TINY, shards[1], num_pages=PAGES, tensor_parallel=2)
    no_wk = {k: v for k, v in params[1].items() if k != "indexer.wk.weight"}
    bad = {"hidden": dict(hidden=[hidden[0], jnp.zeros((hidden[1].shape[0] + 1, TINY.hidden_size))]),
           "pages": dict(plans=[plans[0], other_pages]),
           "tensor": dict(plans=[plans[0], other_tensor]),
           "params": dict(params=[params[0], no_wk]),
           "deleted": dict(caches="delete 1")}
    out = {}
    for name, changes in bad.items():
        caches = init_device_caches(TINY, devices, PAGES)
        if changes.get("caches") == "delete 1":
            caches[1].latent.delete()
        args = dict(params=params, hidden=hidden, caches=caches, plans=plans)
        args.update({k: v for k, v in changes.items() if k != "caches"})
        try:
            data_parallel_step(args["params"], args["hidden"], args["caches"], args["plans"], config=TINY)
            message = None
        except ValueError as e:
            message = str(e)
        out[name] = {"message": message,
                     "device 0 cache alive": not any(a.is_deleted() for a in jax.tree.leaves(caches[0]))}
    return out
