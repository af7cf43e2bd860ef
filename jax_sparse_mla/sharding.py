"""One layer on a `jax.sharding.Mesh`: heads over a tensor axis, sequences over a data axis.

The mesh has (at least) two named axes, `"data"` (size dp) and `"tensor"` (size tp): those are the
defaults of every function's `data_axis` / `tensor_axis` arguments, which take other names (a
MaxText-style mesh's, say) and apply them to the mesh, the parameter and cache specs and the
shard_map alike. `sharded_forward` wraps `model.forward` in `jax.shard_map`: every device runs the
ordinary forward on its slice of heads (`shard_config`: H / tp attention heads; o_proj's partial
sums are summed over the tensor axis) and on its own data shard's batch (`plan_data_parallel`: one
plan for all shards, their metadata concatenated). Placement (`param_specs` / `shard_params`,
`cache_shardings` / `init_sharded_cache`): q_b_proj, kv_b_proj and o_proj split by head over
"tensor", every other parameter (the latent's projections, the whole indexer) replicated; one
PagedCache of dp * P pages split along the page axis over "data" (shard d holds global pages
[d * P, (d + 1) * P), its block tables local ids 0..P-1) and replicated over "tensor"; hidden and
out [dp * T, hidden_size], rows [d * T, (d + 1) * T) data shard d's.

Why: tensor parallelism as vLLM / SGLang shard MLA attention, with no [rows, keys] logits crossing
devices (the indexer is whole on every device). Placement in full, what was decided and why:
docs/design/sharding.md.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .cache import PagedCache, init_cache
from .config import MLAConfig
from .model import PlanJit, check_arguments, check_cache_not_donated, forward
from .params import param_shapes
from .plan import (BatchMeta, BatchPlan, BucketPolicy, Request, check_batch, pad_ids, padded_sizes, plan_host,
                   route_codes)
from .validate import check_type, is_int

DATA = "data"
TENSOR = "tensor"
HEAD_ROWS = ("q_b_proj.weight", "kv_b_proj.weight")
HEAD_COLUMNS = ("o_proj.weight",)


def make_mesh(data: int, tensor: int, devices: Sequence[jax.Device] | None = None, *, data_axis: str = DATA,
              tensor_axis: str = TENSOR) -> Mesh:
    """A (data, tensor) mesh over the first data * tensor devices (jax.devices() by default),
    its axes named data_axis and tensor_axis."""
    devices = list(jax.devices() if devices is None else devices)
    if data < 1 or tensor < 1 or data * tensor > len(devices):
        raise ValueError(f"a ({data}, {tensor}) mesh needs {data * tensor} devices, {len(devices)} are available")
    if data_axis == tensor_axis:
        raise ValueError(f"data_axis and tensor_axis must differ, both are {data_axis!r}")
    return Mesh(np.array(devices[: data * tensor]).reshape(data, tensor), (data_axis, tensor_axis))


def _axis_sizes(mesh: Mesh, data_axis: str = DATA, tensor_axis: str = TENSOR) -> tuple[int, int]:
    missing = [a for a in (data_axis, tensor_axis) if a not in mesh.shape]
    if missing:
        raise ValueError(f"the mesh needs axes {data_axis!r} and {tensor_axis!r}; it has {tuple(mesh.axis_names)}")
    return mesh.shape[data_axis], mesh.shape[tensor_axis]


def shard_config(config: MLAConfig, tensor: int) -> MLAConfig:
    """The config one tensor shard sees: H / tensor attention heads (the indexer is whole on every shard)."""
    if config.num_attention_heads % tensor:
        raise ValueError(f"num_attention_heads={config.num_attention_heads} does not split over a tensor axis "
                         f"of size {tensor}")
    return dataclasses.replace(config, num_attention_heads=config.num_attention_heads // tensor)


def param_specs(config: MLAConfig, *, tensor_axis: str = TENSOR) -> dict[str, P]:
    """PartitionSpec of each parameter (HF name): head-split rows / columns over tensor_axis, others replicated."""
    specs = {}
    for name in param_shapes(config):
        specs[name] = (P(tensor_axis, None) if name in HEAD_ROWS else P(None, tensor_axis) if name in HEAD_COLUMNS
                       else P())
    return specs


def param_shardings(mesh: Mesh, config: MLAConfig, *, data_axis: str = DATA,
                    tensor_axis: str = TENSOR) -> dict[str, NamedSharding]:
    _, tp = _axis_sizes(mesh, data_axis, tensor_axis)
    shard_config(config, tp)  # heads must divide
    return {name: NamedSharding(mesh, spec) for name, spec in param_specs(config, tensor_axis=tensor_axis).items()}


def shard_params(params: dict, mesh: Mesh, config: MLAConfig, *, data_axis: str = DATA,
                 tensor_axis: str = TENSOR) -> dict[str, jax.Array]:
    """Places full (unsharded) params on the mesh as `param_specs` says."""
    return jax.device_put(params, param_shardings(mesh, config, data_axis=data_axis, tensor_axis=tensor_axis))


def cache_specs(config: MLAConfig, *, data_axis: str = DATA) -> PagedCache:
    """A PagedCache of PartitionSpecs (None where the config has no such field): pages over data_axis."""
    abstract = jax.eval_shape(lambda: init_cache(config, 1))
    return jax.tree.map(lambda _: P(data_axis), abstract)


def cache_shardings(mesh: Mesh, config: MLAConfig, *, data_axis: str = DATA) -> PagedCache:
    """A PagedCache of NamedShardings (None where the config has no such field): pages over data_axis."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), cache_specs(config, data_axis=data_axis))


def init_sharded_cache(config: MLAConfig, mesh: Mesh, pages_per_shard: int, *, data_axis: str = DATA,
                       tensor_axis: str = TENSOR) -> PagedCache:
    """An empty cache of data * pages_per_shard pages, created in place on the mesh."""
    dp, _ = _axis_sizes(mesh, data_axis, tensor_axis)
    return jax.jit(lambda: init_cache(config, dp * pages_per_shard),
                   out_shardings=cache_shardings(mesh, config, data_axis=data_axis))()


# ---- data-parallel plans -----------------------------------------------------------------------

def _merge_upfront_splits(plan: BatchPlan, plans: dict, sparse_rows: dict, buckets: BucketPolicy):
    """The fp8 split (BatchPlan.num_upfront_rows) common to every shard: when some shard's own
    plan split, every shard lists its split prefill rows and pages (none where its plan did not
    split) and its other sparse rows `sparse_rows[d]` as kernel rows, padded to the largest
    shard's buckets. plans: {shard: (plan, host meta)} -> (plan, {shard: (plan, host meta)})."""
    if not any(m.upfront_rows.shape[0] for _, m in plans.values()):  # (plans may hold the merged plan)
        return plan, plans

    def ids(a):  # the entries of a -1 padded id list
        return a[a >= 0]

    upfront = {d: ids(m.upfront_rows) for d, (_, m) in plans.items()}
    pages = {d: ids(m.upfront_pages) for d, (_, m) in plans.items()}
    kernel = {d: sparse_rows[d][~np.isin(sparse_rows[d], upfront[d])] for d in plans}  # the shard's other sparse rows
    plan = dataclasses.replace(
        plan, num_upfront_rows=max(BucketPolicy.round_up(len(r), 1) for r in upfront.values()),
        num_kernel_rows=max(BucketPolicy.round_up(len(r), 1) if len(r) else 0 for r in kernel.values()),
        num_upfront_pages=max(BucketPolicy.round_up(len(p), buckets.min_pages_per_seq) for p in pages.values()))
    return plan, {d: (plan, dataclasses.replace(
        m, upfront_rows=pad_ids(upfront[d], plan.num_upfront_rows),
        kernel_rows=pad_ids(kernel[d], plan.num_kernel_rows),
        upfront_pages=pad_ids(pages[d], plan.num_upfront_pages))) for d, (_, m) in plans.items()}


def plan_data_parallel(config: MLAConfig, shards: Sequence[Sequence[Request]], *, pages_per_shard: int,
                       force_sparse: bool = False, skip_indexer: bool = True,
                       buckets: BucketPolicy = BucketPolicy(), tensor_parallel: int = 1,
                       dispatch: str = "static", prefill_route: str | None = None) -> tuple[BatchPlan, BatchMeta]:
    """One plan for every data shard, and their metadata concatenated along axis 0.

    shards[d]: data shard d's requests (may be empty), block tables in local page ids
    [0, pages_per_shard). Sizes are padded to the largest shard's buckets.
    dispatch "static": route the dense program when any shard has a short prefill (every other
      row of every shard, decodes and long prefills alike, attends sparsely in it); otherwise the
      all-sparse program. Long prefills attend sparsely (prefill_route must be "sparse" or None:
      one program for every shard has no masked rows; per-device plans,
      jax_sparse_mla.data_parallel, route them as plan_batch does). An fp8 cache's prefill /
      decode split (BatchPlan.num_upfront_rows) applies to every shard as soon as one shard's
      own plan splits.
    dispatch "cond": every shard's plan_batch cond plan under the common buckets and with the
      stages of every shard's (the union), which is one plan, each shard with its own stage sizes in its
      meta.branches (prefill_route as plan_batch's, None: "auto"): the serving program on a
      mesh with several data shards.
    tensor_parallel: the mesh's tensor-axis size (BatchPlan.tensor_parallel: the kernel choices
    are made for one shard's heads; sharded_forward refuses a plan made for another size).
    Other options as in plan_batch. Raises ValueError naming the shard for invalid requests.
    Each shard is planned on the host (a cond plan's shard twice when it lacks a stage another
    shard needs); the merged metadata goes to the device once, at the end.
    """
    if isinstance(shards, (str, bytes)) or not isinstance(shards, Sequence):
        raise ValueError(f"shards must be a sequence of request lists (one per data shard), "
                         f"got {type(shards).__name__}")
    for d, reqs in enumerate(shards):
        if isinstance(reqs, (str, bytes, Request)) or not isinstance(reqs, Sequence):
            raise ValueError(f"data shard {d}: expected a sequence of Requests, got {type(reqs).__name__}")
    if not is_int(pages_per_shard) or pages_per_shard < 1:
        raise ValueError(f"pages_per_shard must be a positive int, got {pages_per_shard!r}")
    if dispatch == "static" and prefill_route not in (None, "sparse"):
        raise ValueError(f'prefill_route must be "sparse" (or None) with dispatch="static": one static program for '
                         f'every shard attends long prefills sparsely; got {prefill_route!r} (dispatch="cond" routes '
                         "them per request)")
    prefill_route = ("sparse" if dispatch == "static" else "auto") if prefill_route is None else prefill_route
    active = [d for d, reqs in enumerate(shards) if len(reqs)]
    if not active:
        raise ValueError("empty batch: plan_data_parallel needs at least one request in some shard")

    checked = {}
    for d in active:
        try:
            checked[d], num_pages = check_batch(config, shards[d], pages_per_shard, force_sparse, skip_indexer,
                                                buckets, dispatch, tensor_parallel, prefill_route)
        except ValueError as e:
            raise ValueError(f"data shard {d}: {e}") from None
    force_sparse, skip_indexer = bool(force_sparse), bool(skip_indexer)
    # every shard's sizes padded to the largest shard's buckets
    sizes = [padded_sizes(config, b, route_codes(config, b.context_lens, b.query_lens, force_sparse, "sparse"),
                          buckets) for b in checked.values()]
    common = dataclasses.replace(
        buckets, min_tokens=max(s[0] for s in sizes), min_seqs=max(s[1] for s in sizes),
        min_pages_per_seq=max(s[2] for s in sizes), min_dense_keys=max([buckets.min_dense_keys] + [s[3] for s in sizes]))
    def plan_shards(stages=None, which=checked):
        return {d: plan_host(config, checked[d], num_pages=num_pages, force_sparse=force_sparse,
                             skip_indexer=skip_indexer, buckets=common, dispatch=dispatch,
                             tensor_parallel=int(tensor_parallel), prefill_route=prefill_route, stages=stages)
                for d in which}
    plans = plan_shards()
    base = next(iter(plans.values()))[0]
    if dispatch == "cond":  # one plan (the common buckets', every shard's stages), each shard's own stage sizes
        own = {d: (bool(p.num_dense_keys), bool(p.num_sparse_tokens)) for d, (p, _) in plans.items()}
        stages = (any(s[0] for s in own.values()), any(s[1] for s in own.values()))
        plans.update(plan_shards(stages, [d for d, s in own.items() if s != stages]))  # the others have them
        base = next(iter(plans.values()))[0]
        assert all(p == base for p, _ in plans.values())
        return base, _concatenate(base, plans, len(shards))
    dense = any(p.use_dense_mha for p, _ in plans.values())
    # Each shard's sparse rows: plan_batch's for dense-routed shards, every real row otherwise.
    rows = {d: (m.sparse_rows if p.use_dense_mha else np.flatnonzero(m.positions >= 0)) for d, (p, m) in plans.items()}
    rows = {d: r[r >= 0] for d, r in rows.items()}
    if dense:
        num_sparse = max(BucketPolicy.round_up(len(r), 1) if len(r) else 0 for r in rows.values())
        plan = dataclasses.replace(base, use_dense_mha=True, num_sparse_tokens=num_sparse,
                                   num_dense_keys=common.min_dense_keys)
        for d, (p, m) in plans.items():  # (dense_key_slots is empty for a shard planned all-sparse)
            plans[d] = (plan, dataclasses.replace(m, sparse_rows=pad_ids(rows[d], num_sparse),
                                                  masked_flags=np.zeros(num_sparse, np.int32),
                                                  dense_key_slots=pad_ids(m.dense_key_slots, plan.num_dense_keys)))
    else:
        plan = base
    assert all(p.num_tokens == plan.num_tokens and p.pages_per_seq == plan.pages_per_seq
               for p, _ in plans.values())  # the common buckets make every size agree
    plan, plans = _merge_upfront_splits(plan, plans, rows, common)
    return plan, _concatenate(plan, plans, len(shards))


def _concatenate(plan: BatchPlan, plans: dict, num_shards: int) -> BatchMeta:
    """The shards' host metadata of `plan` (plans: {shard: (plan, meta)}; an idle shard's is
    BatchMeta.empty) concatenated along axis 0, on the device."""
    metas = [plans[d][1] if d in plans else BatchMeta.empty(plan) for d in range(num_shards)]
    for m in metas:
        for name, shape in BatchMeta.shapes(plan).items():
            assert getattr(m, name).shape == shape, (name, getattr(m, name).shape, shape)
    merged = jax.tree.map(lambda *fields: np.concatenate(fields), *metas)
    return jax.tree.map(jnp.asarray, merged)


# ---- the sharded step ----------------------------------------------------------------------------

def _meta_specs(meta: BatchMeta, data_axis: str) -> BatchMeta:
    """A BatchMeta of PartitionSpecs for sharded_forward's shard_map: every field split over
    data_axis (a cond plan's branches too: each shard runs its own stage sizes); None fields
    stay None."""
    return jax.tree.map(lambda _: P(data_axis), meta)


def sharded_forward(params, hidden, cache: PagedCache, meta: BatchMeta, *, mesh: Mesh, plan: BatchPlan,
                    config: MLAConfig, kernels: str = "auto", data_axis: str = DATA, tensor_axis: str = TENSOR):
    """`model.forward` over a (data, tensor) mesh; see the module docstring for every layout.

    params: full HF-named dict (sharded as param_specs, or placed there by jit);
    hidden: [dp * plan.num_tokens, hidden_size]; cache: PagedCache of dp * pages_per_shard pages;
    meta: from plan_data_parallel (dispatch "static" or "cond"), or on a mesh with one data
    shard from plan_batch(..., tensor_parallel=tp). Returns (out [dp * plan.num_tokens,
    hidden_size], new cache).
    plan: planned with this (full) config, which is checked (BatchPlan.check_config), and for this
    mesh's tensor size (BatchPlan.tensor_parallel); each shard's forward gets this plan and its
    per-shard config, and checks one against the other (BatchPlan.check_config(config, shards=tp)).
    data_axis / tensor_axis: the mesh's axis names for the sequences and the heads.
    An argument of another type (model.check_arguments; mesh a Mesh) or size raises ValueError naming it.
    Jit with mesh, plan, config, kernels and the axis names static (`jit_sharded_forward`).
    """
    check_arguments(params, hidden, cache, meta, plan, config, kernels, tensor_axis)
    check_type(mesh, "mesh", (Mesh, jax.sharding.AbstractMesh), "a jax.sharding.Mesh (make_mesh)")
    dp, tp = _axis_sizes(mesh, data_axis, tensor_axis)
    plan.check_config(config)  # planned with the full config
    if plan.tensor_parallel != tp:
        raise ValueError(f"the plan was made for a tensor axis of size {plan.tensor_parallel}, the mesh's has {tp}: "
                         f"plan with plan_data_parallel(..., tensor_parallel={tp})")
    local = shard_config(config, tp)
    if hidden.shape != (dp * plan.num_tokens, config.hidden_size):
        raise ValueError(f"hidden has shape {hidden.shape}, expected [data * plan.num_tokens, hidden_size] = "
                         f"{[dp * plan.num_tokens, config.hidden_size]}")
    if cache.num_pages % dp:
        raise ValueError(f"the cache's {cache.num_pages} pages do not split over a data axis of size {dp}")
    if meta.positions.shape != (dp * plan.num_tokens,):
        raise ValueError(f"meta.positions has shape {meta.positions.shape}, expected {(dp * plan.num_tokens,)}: "
                         "make meta with plan_data_parallel for this mesh's data axis")

    def per_shard(params, hidden, cache, meta):
        return forward(params, hidden, cache, meta, plan=plan, config=local, kernels=kernels,
                       tensor_axis=tensor_axis if tp > 1 else None)

    # check_vma=False: the Pallas kernels inside forward carry no varying-axes annotations. The
    # outputs are replicated over "tensor" by construction (psum; identical cache writes).
    rows = P(data_axis)
    step = jax.shard_map(per_shard, mesh=mesh,
                         in_specs=(param_specs(config, tensor_axis=tensor_axis), rows, rows, _meta_specs(meta, data_axis)),
                         out_specs=(rows, rows), check_vma=False)
    return step(params, hidden, cache, meta)


_jitted_sharded_forward = PlanJit(sharded_forward,
                                  static_argnames=("mesh", "plan", "config", "kernels", "data_axis", "tensor_axis"),
                                  donate_argnames=("cache",))


def jit_sharded_forward(params, hidden, cache: PagedCache, meta: BatchMeta, *, mesh: Mesh, plan: BatchPlan,
                        config: MLAConfig, kernels: str = "auto", data_axis: str = DATA, tensor_axis: str = TENSOR):
    """`sharded_forward` jitted (mesh, plan, config, kernels and the axis names static) with the
    cache DONATED: continue with the cache it returns. A cache an earlier call donated raises
    ValueError naming the array and the fix (model.check_cache_not_donated), not jax's bare
    "Array has been deleted"."""
    check_cache_not_donated(cache)
    return _jitted_sharded_forward(params, hidden, cache, meta, mesh=mesh, plan=plan, config=config, kernels=kernels,
                                   data_axis=data_axis, tensor_axis=tensor_axis)
