"""sharded_forward on (data, tensor) meshes of virtual CPU devices against the one-device forward.

XLA_FLAGS must be set before jax starts, and conftest has started it with one device: the mesh
runs happen in a subprocess with 4 virtual devices (`_mesh_errors` below is what it runs).
"""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_mla
from jax_sparse_mla import MLAConfig, Request, init_cache, init_params, plan_batch
from jax_sparse_mla.model import jit_forward
from jax_sparse_mla.sharding import (make_mesh, param_specs, plan_data_parallel, shard_config,
                                     jit_sharded_forward, init_sharded_cache, shard_params)

TINY = MLAConfig.tiny()  # 4 heads, 4 index heads, topk 16, page 4
PAGES = 32  # per data shard
MESHES = [(1, 2), (2, 2), (1, 4)]  # (data, tensor)
TOL = 1e-4

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


def _mesh_errors(meshes, kv_cache_dtype="bfloat16"):
    """For each (data, tensor) mesh: the largest relative error of any step's output rows and of the
    final caches against one-device forward runs of each shard's own batch, the step routes and
    the plans' fp8 splits (BatchPlan.num_upfront_rows)."""
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
        worst, routes, splits = 0.0, [], []
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
            plan, meta = plan_data_parallel(config, shards, pages_per_shard=PAGES, tensor_parallel=tp)
            routes.append(plan.route)
            splits.append(plan.num_upfront_rows)
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
                p1, m1 = plan_batch(config, shards[d], num_pages=PAGES)
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
            "q_b_rows": sorted(s.data.shape[0] for s in sharded_params["q_b_proj.weight"].addressable_shards)}
    return results


def _mesh_errors_on_4_cpus(code):
    """Runs `code` (which prints 'RESULT <json>') with 4 virtual CPU devices -> the json."""
    root = pathlib.Path(jax_sparse_mla.__file__).absolute().parent.parent  # the checkout under test
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module")
def mesh_results():
    return _mesh_errors_on_4_cpus(f"import json; from tests.test_sharding import _mesh_errors; "
                                  f"print('RESULT', json.dumps(_mesh_errors({MESHES!r})))")


@pytest.mark.parametrize("dp,tp", MESHES)
def test_mesh_matches_one_device(mesh_results, dp, tp):
    r = mesh_results[f"{dp}x{tp}"]
    assert r["routes"] == ROUTES
    assert r["err"] < TOL, r
    assert r["cache_pages"] == r["index_pages"] == [PAGES] * (dp * tp)  # split over data, copied over tensor
    assert r["q_b_rows"] == [TINY.num_attention_heads // tp * TINY.qk_head_dim] * (dp * tp)


def test_fp8_split_mesh_matches_one_device():
    """An fp8 latent cache with the prefill / decode split (threshold lowered so that the tiny
    config's long prefill splits): the data shards' common split gives each shard's one-device
    outputs and caches."""
    r = _mesh_errors_on_4_cpus(
        "import json; from jax_sparse_mla import policy; policy.UPFRONT_MIN_USES = 1; "
        "from tests.test_sharding import _mesh_errors; print('RESULT', json.dumps(_mesh_errors([(2, 2)], 'fp8')))")
    r = r["2x2"]
    assert r["routes"] == ROUTES and r["err"] < TOL, r
    assert r["splits"][0] > 0  # step 1: the long prefill's rows over their own pages


def test_param_specs_split_heads():
    specs = param_specs(TINY)
    assert specs["q_b_proj.weight"] == jax.sharding.PartitionSpec("tensor", None)
    assert specs["o_proj.weight"] == jax.sharding.PartitionSpec(None, "tensor")
    assert specs["indexer.weights_proj.weight"] == jax.sharding.PartitionSpec("tensor", None)
    assert specs["indexer.wk.weight"] == jax.sharding.PartitionSpec()
    local = shard_config(TINY, 2)
    assert (local.num_attention_heads, local.index_n_heads) == (2, 2)
    with pytest.raises(ValueError, match="num_attention_heads=4 does not split over a tensor axis of size 3"):
        shard_config(TINY, 3)


def test_plan_data_parallel_common_plan_and_errors(monkeypatch):
    short = [Request(0, 5, [0, 1])]
    decode = [Request(9, 1, [0, 1, 2]), Request(3, 1, [3])]
    plan, meta = plan_data_parallel(TINY, [short, decode, []], pages_per_shard=8)
    assert plan.route == "dense" and plan.num_sparse_tokens == 2 and plan.num_scored_tokens == 2
    T = plan.num_tokens
    assert meta.positions.shape == (3 * T,) and meta.block_tables.shape == (3 * plan.num_seqs, plan.pages_per_seq)
    np.testing.assert_array_equal(np.asarray(meta.sparse_rows), [-1, -1, 0, 1, -1, -1])
    assert np.all(np.asarray(meta.positions[2 * T:]) == -1)  # the idle shard is all padding
    long_ = [Request(0, 20, list(range(5)))]
    plan, meta = plan_data_parallel(TINY, [short, long_], pages_per_shard=8)
    assert plan.route == "dense" and plan.num_sparse_tokens == 32  # the long prefill's rows attend sparsely
    assert plan_data_parallel(TINY, [long_, long_], pages_per_shard=8)[0].route == "sparse"
    # fp8 cache: one shard's split (its long prefill) becomes every shard's
    fp8 = dataclasses.replace(TINY, kv_cache_dtype="fp8")
    from jax_sparse_mla import policy
    monkeypatch.setattr(policy, "UPFRONT_MIN_USES", 1)
    assert plan_batch(fp8, long_)[0].num_upfront_rows == 32
    short_and_decode = [Request(0, 5, [0, 1]), Request(9, 1, [2, 3, 4])]  # rows 0-4 dense, row 5 a decode
    plan, meta = plan_data_parallel(fp8, [short_and_decode, long_], pages_per_shard=8)
    assert plan.route == "dense" and (plan.num_upfront_rows, plan.num_kernel_rows, plan.num_upfront_pages) == (32, 1, 8)
    np.testing.assert_array_equal(meta.upfront_rows, [-1] * 32 + list(range(20)) + [-1] * 12)
    np.testing.assert_array_equal(meta.kernel_rows, [5, -1])
    np.testing.assert_array_equal(meta.upfront_pages, [-1] * 8 + [0, 1, 2, 3, 4, -1, -1, -1])
    assert plan_data_parallel(TINY, [short_and_decode, long_], pages_per_shard=8)[0].num_upfront_rows == 0
    with pytest.raises(ValueError, match="data shard 1: request 0: page id 9 is outside"):
        plan_data_parallel(TINY, [short, [Request(0, 3, [9])]], pages_per_shard=8)
    with pytest.raises(ValueError, match="at least one request"):
        plan_data_parallel(TINY, [[], []], pages_per_shard=8)


@pytest.mark.gpu
def test_two_gpus_match_one_device():
    """On a machine with >= 2 GPUs (the Pallas kernels inside shard_map): tensor and data parallel."""
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 GPUs")
    for name, r in _mesh_errors([(1, 2), (2, 1)]).items():
        assert r["routes"] == ROUTES and r["err"] < TOL, (name, r)
