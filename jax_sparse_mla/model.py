"""The functional core: one sparse-MLA layer step over a planned batch.

`forward` projects every row and writes both paged caches, then runs the plan's program. A static
plan's (the exact program) is one of two: the dense program sends short prefills through dense
causal MHA (k_nope and v up-projected from the latent cache) and scores the rows in
meta.sparse_rows (decodes, long prefills): those routed masked run in the same dense MHA call
restricted to their top-k positions (masked MHA), the others attend sparsely; the sparse program
scores every row with the lightning indexer, takes top-k and runs absorbed sparse attention over
the selected latent rows. A cond plan's (the serving program, `_cond_program`) holds those of
the stages its batch needs, each at a size lax.switch picks at run time (no conditional where a
stage has one size).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from . import cache as cache_lib
from . import kernels as kernel_ops
from . import ops
from .config import MLAConfig, check_config_type
from .params import check_params
from .plan import BatchMeta, BatchPlan, RowGroup
from .validate import INT32_MAX, array_dtype, check_not_deleted, check_type


def _precision(config: MLAConfig):
    return ops.matmul_precision(config.jnp_dtype)


def linear(x, weight, config: MLAConfig, *, dtype=jnp.float32, in_f32: bool = True, rows=None):
    """x: [..., in] @ weight[out, in]^T -> [..., out] in dtype, accumulated in float32 (operands
    in config.dtype). in_f32 (Implementations.dots_in_f32): the product in float32, then rounded
    to dtype; else the dot writes dtype itself (a GPU's accumulates in float32 whatever it
    writes: no float32 product and no convert kernel, 0.2 ms for q_b_proj's at 4096 rows on an
    H100). The same rounding either way.
    rows: None, or (count, OpImpl of row_matmul): x [T, in]'s first `count` rows (an int32
    scalar, traced) through the row_matmul kernel, zero past them (`_over_rows`)."""
    if rows is not None:
        count, impl = rows
        dt = config.jnp_dtype
        return kernel_ops.row_matmul(x.astype(dt), weight.astype(dt), count, out_dtype=dtype, **impl.kwargs)
    out = jnp.einsum("...i,oi->...o", x.astype(config.jnp_dtype), weight.astype(config.jnp_dtype),
                     precision=_precision(config), preferred_element_type=jnp.float32 if in_f32 else dtype)
    return out.astype(dtype)


def per_head(spec: str, a, w, config: MLAConfig, *, in_f32: bool, dtype=jnp.float32):
    """A per-head einsum with W_UK / W_UV [H, d, R] -> dtype, accumulated in float32. The operands
    keep their own (promoted) dtype: a GPU's TF32 reads bf16 values exactly, so a float32 copy of
    bf16 rows and weights only costs bytes (its f32 rows were most of a decode step's padding
    cost). in_f32 (Implementations.dots_in_f32: XLA's CPU backend has no batched bf16 x bf16
    -> f32 dot) casts them to float32 first."""
    operands = jnp.dtype(jnp.float32 if in_f32 else jnp.promote_types(a.dtype, w.dtype))
    out = jnp.einsum(spec, a.astype(operands), w.astype(operands), precision=_precision(config),
                     preferred_element_type=jnp.float32 if operands == jnp.float32 else dtype)
    return out.astype(dtype)


def projection_matmuls(params, x, config: MLAConfig, *, in_f32: bool = True, rows=None):
    """The projections' matmuls over rows, x [T, hidden] -> (qr [T, q_lora] (q_a_proj, normed),
    q [T, H * qk_head_dim] (q_b_proj), kv [T, R + rope] (kv_a_proj_with_mqa), k [T, D]
    (indexer.wk)), float32 but q in config.dtype (rounded where DeepSeek's reference rounds it:
    the layer's largest row-wise tensor, at half the memory traffic): the part of the
    projections whose cost follows the rows (a cond plan runs it over about its real rows);
    `projections` finishes them row by row. q_b_proj stays one
    matmul: as two over slices of its weight, both dispatches' layer steps took 0.07-0.13 ms
    longer on an H100 (the slices copied every step). in_f32: linear's, for q. rows: linear's,
    for q_b_proj only (the matmuls over x run over every row through XLA: cheaper than row_matmul
    over the live rows of a mostly live bucket, docs/design/row_matmul.md)."""
    c_ = config
    qr = ops.rms_norm(linear(x, params["q_a_proj.weight"], c_), params["q_a_layernorm.weight"], c_.rms_norm_eps)
    return (qr, linear(qr, params["q_b_proj.weight"], c_, dtype=c_.jnp_dtype, in_f32=in_f32, rows=rows),
            linear(x, params["kv_a_proj_with_mqa.weight"], c_),
            linear(x, params["indexer.wk.weight"], c_))


def projections(params, matmuls, positions, config: MLAConfig):
    """Latent and indexer key of each row from projection_matmuls' output and positions [T] ->
    (qr, q [T, H, qk_head] (q_b_proj's output: `query_parts` of the rows a stage reads), c [T, R],
    k_pe [T, rope] (rope applied), k_index [T, D]), float32 but q (config.dtype)."""
    c_ = config
    qr, q, kv, k = matmuls
    c = ops.rms_norm(kv[:, : c_.kv_lora_rank], params["kv_a_layernorm.weight"], c_.rms_norm_eps)
    k_pe = ops.rope_interleaved(kv[:, c_.kv_lora_rank:], positions, c_)
    return (qr, q.reshape(q.shape[0], c_.num_attention_heads, c_.qk_head_dim), c, k_pe,
            _indexer_key(params, k, positions, c_))


def query_parts(q, positions, config: MLAConfig):
    """q [N, H, qk_head] (q_b_proj's output, config.dtype) of rows at positions [N] -> (q_nope [N,
    H, nope], q_pe [N, H, rope] (rope applied)), config.dtype (DeepSeek's reference rounds q's
    rope there too). Each stage computes its own rows' where it reads them: in a cond program a
    split outside the stages' conditionals is written out for their branches (0.17 ms a step at
    4096 rows, H100)."""
    c_ = config
    q_pe = ops.rope_interleaved(q[..., c_.qk_nope_head_dim:], positions, c_)
    return q[..., : c_.qk_nope_head_dim], q_pe.astype(c_.jnp_dtype)


def mla_projections(params, x, positions, config: MLAConfig):
    """Queries and the latent of each row.

    x: [T, hidden], positions: [T] -> qr [T, q_lora], q_nope [T, H, nope], q_pe [T, H, rope] (rope
    applied), c [T, R], k_pe [T, rope] (rope applied); float32 but q_nope and q_pe (config.dtype).
    """
    qr, q, c, k_pe, _ = projections(params, projection_matmuls(params, x, config), positions, config)
    return (qr, *query_parts(q, positions, config), c, k_pe)


def _indexer_key(params, k, positions, config: MLAConfig):
    """LayerNorm, NeoX rope on the first rope dims, Hadamard of wk x (k [T, D] f32) -> [T, D] f32."""
    k = ops.layer_norm(k, params["indexer.k_norm.weight"], params["indexer.k_norm.bias"], 1e-6)
    return ops.hadamard(ops.rope_neox_prefix(k, positions, config))


def indexer_keys(params, x, positions, config: MLAConfig):
    """Indexer key of each row: LayerNorm(wk x), NeoX rope on the first rope dims, Hadamard. [T, D] f32."""
    return _indexer_key(params, linear(x, params["indexer.wk.weight"], config), positions, config)


def indexer_queries(params, x, qr, positions, config: MLAConfig):
    """Indexer queries and head weights: (q [N, Hi, D] in the indexer dtype, weights [N, Hi] f32).

    On the fp8 path q is e4m3 and each (row, head) scale is folded into the weights.
    """
    c_ = config
    q = linear(qr, params["indexer.wq_b.weight"], c_).reshape(qr.shape[0], c_.index_n_heads, c_.index_head_dim)
    q = ops.hadamard(ops.rope_neox_prefix(q, positions, c_))
    weights = linear(x, params["indexer.weights_proj.weight"], c_) * (
        c_.index_n_heads ** -0.5 * c_.index_head_dim ** -0.5)
    if c_.indexer_dtype == "fp8":
        q, q_scale = ops.act_quant(q)
        return q, weights * q_scale
    return ops.cast_rounded(q, jnp.dtype(c_.indexer_dtype)), weights


def positions_to_slots(key_positions, block_tables, row_seq, page_size: int):
    """key_positions: [N, K] (-1 padded), block_tables: [S, W], row_seq: [N] -> cache slots [N, K]
    (-1 kept, and -1 for a position on a -1 page: never a negative slot that names another page)."""
    safe = jnp.maximum(key_positions, 0)
    pages = block_tables[row_seq[:, None], safe // page_size]
    return jnp.where((key_positions >= 0) & (pages >= 0), pages * page_size + safe % page_size, -1)


def advance_decodes(meta: BatchMeta, steps, page_size: int) -> BatchMeta:
    """The metadata of a decode-only batch `steps` tokens later (earlier where negative; an int32
    scalar, traced): each real row's position + steps and the cache slot it then writes
    (positions_to_slots over the same block tables), the rest as it is. Why: a program that runs
    several decode steps moves its batch on the device instead of the host planning every step.
    Valid while every row is its sequence's only one and the tables hold the new position's page
    (the caller's: the engine plans a run at its last step's lengths)."""
    real = meta.positions >= 0
    positions = jnp.where(real, meta.positions + steps, -1)
    slots = positions_to_slots(positions[:, None], meta.block_tables, meta.row_seq, page_size)[:, 0]
    return dataclasses.replace(meta, positions=positions, slot_mapping=slots)


def take_rows(a, rows):
    """a[rows] with rows -1 padded: padding rows are zeros, selected (row 0, which they read, may
    hold another request's NaN, and 0 * NaN = NaN wherever a padding row is masked by a product)."""
    taken = a[jnp.maximum(rows, 0)]
    return jnp.where((rows >= 0).reshape(rows.shape + (1,) * (taken.ndim - rows.ndim)), taken,
                     jnp.zeros((), taken.dtype))


def _put_rows(a, rows, values):
    """a with a[rows] = values, rows [N] distinct and -1 padded (padding rows write nowhere).

    Done as a gather: each row of a takes its value row through the inverse map (a scatter of N
    int32s), then one select. XLA's GPU scatter of whole rows wrote element by element: 0.60 ms
    for the dense call's [4096, 128, 128] bf16 output on an H100, about 9% of a 4K prefill step,
    where a gather of as many rows takes ~0.15 ms (docs/design/dispatch.md)."""
    if rows.shape[0] == 0:
        return a
    index = jnp.full((a.shape[0],), -1, jnp.int32).at[jnp.where(rows >= 0, rows, a.shape[0])].set(
        jnp.arange(rows.shape[0], dtype=jnp.int32), mode="drop")  # row of a -> its row of values, or -1
    taken = values[jnp.maximum(index, 0)]
    return jnp.where((index >= 0).reshape(index.shape + (1,) * (a.ndim - 1)), taken, a)


def _depend_on(x, unused):
    """x, made to depend on `unused` (top-k positions, always >= -1) so that XLA keeps computing it:
    the skip_indexer=False baseline must pay for scoring that no row reads. (An optimization
    barrier does not survive XLA's dead-code elimination of unused tuple elements.)"""
    return x + jnp.where(jnp.min(unused) < -1, jnp.nan, 0.0)


def _nonfinite_rows(x, meta: BatchMeta, num_seqs: int):
    """[T] bool: the real rows at or after a row of their own request whose input x [T, hidden]
    holds a non-finite value in this step.

    The dense route shows such a NaN in exactly those rows (causal attention reads the bad row's
    keys). The scored routes would not: every indexer logit of a NaN row is NaN, top-k counts NaN
    as invalid, and a row that selects nothing attends nothing (0). forward sets these rows to NaN
    on every route, so that a corrupted request never looks healthy; other requests' rows are
    untouched (the flag follows meta.row_seq)."""
    real = meta.positions >= 0
    # the row flags written out first: at 8192 rows the scatter's fusion took 0.17 ms (H100), likely
    # each row's reduction over its hidden values fused into the scatter's indices (not yet timed apart)
    bad = jax.lax.optimization_barrier(real & ~jnp.all(jnp.isfinite(x), axis=-1))
    # only the bad rows reach the scatter (the others are dropped): a scatter-min of every row
    # into its sequence's entry serialises on one entry per sequence
    first_bad = jnp.full((num_seqs,), INT32_MAX, jnp.int32).at[jnp.where(bad, meta.row_seq, num_seqs)].min(
        meta.positions, mode="drop")
    return real & (meta.positions >= first_bad[meta.row_seq])


def check_arguments(params, hidden, cache, meta, plan, config, kernels, tensor_axis=None) -> None:
    """The checks of a layer step's arguments that do not depend on the plan's sizes, shared by
    every entry point that runs one (forward, sharding.sharded_forward,
    data_parallel.data_parallel_step; nnx_layer and the serving engine through these):
    ValueError naming the first argument that is not what forward's docstring says: config an
    MLAConfig, plan a BatchPlan, meta a BatchMeta, kernels one of kernels.CHOICES, tensor_axis
    None or a str (a mesh axis name), hidden a floating-point array, cache a PagedCache of
    config's layout (cache.check_cache), params a dict of config's arrays (params.check_params).
    The shapes against the plan are each caller's (forward's and sharded_forward's differ)."""
    check_config_type(config)
    check_type(plan, "plan", BatchPlan, "a BatchPlan (from plan_batch or sharding.plan_data_parallel)")
    check_type(meta, "meta", BatchMeta, "a BatchMeta (from plan_batch or sharding.plan_data_parallel)")
    kernel_ops.check_kernels(kernels)
    if tensor_axis is not None and not isinstance(tensor_axis, str):
        raise ValueError(f"tensor_axis must be None or a mesh axis name (a str), got {tensor_axis!r}")
    dtype = array_dtype(hidden)
    if dtype is None:
        raise ValueError(f"hidden must be an array [num_tokens, hidden_size], got {type(hidden).__name__}")
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"hidden must be floating point, got {dtype}")
    cache_lib.check_cache(cache, config)
    check_params(params, config)


def check_inputs(params, hidden, cache, meta: BatchMeta, plan: BatchPlan, config: MLAConfig,
                 tensor_parallel: int = 1) -> None:
    """forward's checks of its arguments' sizes against the plan, once check_arguments has passed,
    for callers that must check several layer steps before running any (data_parallel_step).
    ValueError naming the argument and the field or tensor: a plan for another config, tensor
    axis size or cache size, or planned without num_pages (its page ids unchecked), hidden or
    meta of the wrong shape, and an array already deleted (donated to an earlier call; concrete
    arguments only)."""
    if plan.tensor_parallel != tensor_parallel:
        raise ValueError(f"the plan was made for a tensor axis of size {plan.tensor_parallel}, this forward runs "
                         f"under one of size {tensor_parallel}: run it through sharding.sharded_forward on such a mesh")
    plan.check_config(config, tensor_parallel)  # slots, routes and the fp8 split were computed for that config
    if len(hidden.shape) != 2 or hidden.shape != (plan.num_tokens, config.hidden_size):
        raise ValueError(f"hidden has shape {hidden.shape}, expected [plan.num_tokens, hidden_size] = "
                         f"{[plan.num_tokens, config.hidden_size]}")
    if plan.num_pages is None:
        raise ValueError(f"plan.num_pages is None: plan the batch with num_pages=cache.num_pages ({cache.num_pages}): "
                         "only then are its page ids checked against the cache (an id past it would read "
                         "clamped slots and write nowhere)")
    if plan.num_pages != cache.num_pages:
        raise ValueError(f"the plan was validated for {plan.num_pages} pages, the cache has {cache.num_pages}")
    for name, shape in BatchMeta.shapes(plan).items():
        got = getattr(meta, name)
        if got is not None and got.shape != shape:  # (a missing branches: below)
            raise ValueError(f"meta.{name} has shape {got.shape}, expected {shape} for this plan (was it made by plan_batch?)")
    if (meta.branches is None) != (plan.use_dense_mha is not None):
        raise ValueError("meta.branches must be set exactly for dispatch='cond' plans (use_dense_mha None)")
    check_not_deleted({"hidden": hidden, **{f"params[{name!r}]": p for name, p in params.items()},
                       **{f"cache.{name}": a for name, a in cache.arrays().items()},
                       **{f"meta.{f.name}": getattr(meta, f.name) for f in dataclasses.fields(meta)}})


def _pick(a, rows):
    """a's rows of a stage: rows None (every row), an int n (the first n: a slice, no gather) or
    [N] row ids (-1 padded: take_rows)."""
    if rows is None:
        return a
    return a[:rows] if isinstance(rows, int) else take_rows(a, rows)


def _row_ids(rows, num_tokens: int):
    """A stage's rows as _pick takes them (None, an int n, [N] row ids) -> [N] int32 row ids."""
    if rows is None or isinstance(rows, int):
        return jnp.arange(num_tokens, dtype=jnp.int32)[:rows]
    return rows


def _dense_prefill(q, positions, w_uk, w_uv, cache: cache_lib.PagedCache, meta: BatchMeta, config: MLAConfig,
                   impl: kernel_ops.OpImpl, in_f32: bool, num_keys: int | None = None, select=None, max_kv_len=None):
    """Dense causal MHA of the sequences routed dense or masked, packed (no padding to the longest).

    q [T, H, qk_head], positions [T] (>= 0): every row's q_b_proj output, not yet split or roped
    (`query_parts` does that for the call's rows), and position; w_uk [H, nope, R], w_uv [H, v, R];
    keys from the cache slots meta.dense_key_slots (their first num_keys only, when given: the
    caller knows the real keys fit), K of them; queries of the first K rows of meta.dense_rows
    (a sequence's rows are at most its keys, so those hold every real one: the call's query side
    follows its keys, not the bucket). select: None, or rows [N] -> [N, topk] key positions per
    row (masked MHA: `_dense_selection`), with max_kv_len a bound on a sequence's keys. Returns
    (rows [N] = meta.dense_rows[:K], N = min(K, T), out [N, H, v] in config.dtype of those rows;
    padding rows 0).
    in_f32: per_head's.
    """
    c_ = config
    dt = c_.jnp_dtype
    with jax.named_scope("dense_kv_up"):
        slots = meta.dense_key_slots[:num_keys]  # [K]: each dense sequence's context + new keys, packed
        rows = meta.dense_rows[:slots.shape[0]]
        scale = None if cache.latent_scale is None else take_rows(cache.flat("latent_scale"), slots)
        c = kernel_ops.dequantize_latent(take_rows(cache.flat("latent"), slots), scale)  # [K, R]
        if c_.kv_cache_dtype != "float32":  # exact in dt: bf16, or e4m3 times a power-of-two scale
            c = c.astype(dt)
        k_pe = take_rows(cache.flat("k_pe"), slots).astype(dt)  # [K, rope]
        k_nope = per_head("kr,hnr->khn", c, w_uk, c_, in_f32=in_f32, dtype=dt)
        v = per_head("kr,hvr->khv", c, w_uv, c_, in_f32=in_f32, dtype=dt)
        k_pe = jnp.broadcast_to(k_pe[:, None], (k_pe.shape[0], c_.num_attention_heads, k_pe.shape[-1]))
        k = jnp.concatenate([k_nope, k_pe], -1)  # [K, H, qk]
        q = jnp.concatenate(query_parts(take_rows(q, rows), take_rows(positions, rows), c_), -1)  # [N, H, qk]
    with jax.named_scope("dense_mha"):
        out = kernel_ops.dense_mha(q, k, v, meta.dense_query_start, meta.dense_key_start,
                                   scale=c_.softmax_scale, selection=None if select is None else select(rows),
                                   max_kv_len=max_kv_len, **impl.kwargs)
    return rows, out.astype(dt)


def _dense_selection(meta: BatchMeta, top_positions, scored_index, topk: int, dense_rows):
    """[N, topk] key positions for each of dense_rows [N] (a prefix of meta.dense_rows; -1
    padded): a masked row's top-k (top_positions [num_sparse_tokens, topk], of meta.sparse_rows;
    scored_index [T]: a row's index there, -1 if not scored), every causal position of a dense
    row's (its sequence has <= topk tokens). Gathers of whole rows only (no [N, topk] scatter)."""
    rows = jnp.maximum(dense_rows, 0)
    idx = scored_index[rows]
    masked = (dense_rows >= 0) & (idx >= 0) & (meta.masked_flags[jnp.maximum(idx, 0)] > 0)
    k = jnp.arange(topk, dtype=jnp.int32)
    every = jnp.where(k[None, :] <= meta.positions[rows][:, None], k[None, :], -1)
    chosen = jnp.where(masked[:, None], top_positions[jnp.maximum(idx, 0)], every)
    return jnp.where(dense_rows[:, None] >= 0, chosen, -1)


def _topk_positions(params, x, qr, positions, cache: cache_lib.PagedCache, meta: BatchMeta, rows, group: RowGroup,
                    *, config: MLAConfig, impl: kernel_ops.Implementations, tensor_axis: str | None):
    """Indexer scoring and top-k of `rows` ([N] row ids, -1 padded; None: every row; an int N:
    the first N) -> key positions [N, topk] in each row's sequence (-1 padded).

    x [T, hidden], qr [T, q_lora], positions [T]: every row's input, q latent and position (the
    indexer's queries are projected here, for the scored rows only); group: the plan's RowGroup of
    these rows (its Mosaic indexer kernel shape and its split over tensor shards). The indexer's
    weights are whole on every tensor shard: with group.indexer_shards = tp > 1 shard s scores
    rows s, s + tp, s + 2 tp, ... (striped: a causal prefill's row costs grow with its position,
    so contiguous shares would leave the last shard the most work; each share stays in sequence
    order) and the shards all-gather the positions; else every shard scores every row (the same
    positions everywhere, no communication).
    """
    tp = group.indexer_shards
    if tp > 1:
        ids = _row_ids(rows, meta.positions.shape[0])
        mine = ids.reshape(-1, tp)[:, jax.lax.axis_index(tensor_axis)]  # [N / tp]
        top = _score_rows(params, x, qr, positions, cache, meta, mine, group, config=config, impl=impl)
        gathered = jax.lax.all_gather(top, tensor_axis)  # [tp, N / tp, topk]: shard s holds rows s::tp
        return jnp.swapaxes(gathered, 0, 1).reshape(ids.shape[0], -1)
    return _score_rows(params, x, qr, positions, cache, meta, rows, group, config=config, impl=impl)


def _score_rows(params, x, qr, positions, cache: cache_lib.PagedCache, meta: BatchMeta, rows, group: RowGroup, *,
                config: MLAConfig, impl: kernel_ops.Implementations):
    """_topk_positions on one device: indexer queries, logits and top-k of `rows` (as _pick's),
    in group.score_chunks chunks of rows (row ids, -1 padded to whole chunks), each chunk's
    scoring made to wait for the previous chunk's top-k, so that one chunk's logits exist at a
    time (policy.SCORING_WORKSPACE_BYTES)."""
    if group.score_chunks == 1:
        return _score_chunk(params, x, qr, positions, cache, meta, rows, config=config, group=group, impl=impl)
    ids = _row_ids(rows, meta.positions.shape[0])
    n = ids.shape[0]
    size = -(-n // group.score_chunks)
    ids = jnp.pad(ids, (0, size * group.score_chunks - n), constant_values=-1).reshape(group.score_chunks, size)
    # one jitted function for every chunk: its kernels are lowered once, not once a chunk
    score = jax.jit(functools.partial(_score_chunk, config=config, group=group, impl=impl))
    tops = []
    for chunk in ids:
        if tops:  # top-k positions are >= -1: a select XLA cannot drop, which orders the chunks
            chunk = jnp.where(jnp.min(tops[-1]) < -1, -1, chunk)
        tops.append(score(params, x, qr, positions, cache, meta, chunk))
    return jnp.concatenate(tops)[:n]


def _score_chunk(params, x, qr, positions, cache: cache_lib.PagedCache, meta: BatchMeta, rows, *,
                 config: MLAConfig, group: RowGroup, impl: kernel_ops.Implementations):
    """Indexer queries, logits and top-k of `rows` (as _pick's) in one call of each kernel."""
    c_ = config
    row_pos = _pick(meta.positions, rows)
    row_end = jnp.where(row_pos >= 0, row_pos + 1, 0)
    if rows is not None and not isinstance(rows, int):
        row_end = jnp.where(rows >= 0, row_end, 0)
    with jax.named_scope("indexer_queries"):
        q_i, w_i = indexer_queries(params, _pick(x, rows), _pick(qr, rows), _pick(positions, rows), c_)
    with jax.named_scope("indexer_logits"):
        logits = kernel_ops.indexer_logits(q_i, w_i, cache.flat("index_k"), cache.flat("index_k_scale"),
                                           meta.block_tables, _pick(meta.row_seq, rows), row_end,
                                           page_size=c_.page_size, kernel=group.indexer_kernel, clean=False,
                                           **impl.indexer_logits.kwargs)  # topk reads only [0, row_end)
    with jax.named_scope("indexer_topk"):
        return kernel_ops.topk(logits, c_.index_topk, lengths=row_end, **impl.topk.kwargs)  # a row reads its causal keys


def _sparse_attention(q, positions, w_uk, w_uv, cache: cache_lib.PagedCache, meta: BatchMeta, rows, top_positions,
                      pages, group: RowGroup, *, config: MLAConfig, impl: kernel_ops.OpImpl, in_f32: bool):
    """Absorbed sparse attention of `rows` (as _pick's) over their top-k key positions [N, topk]
    (-1 padded), on `pages` (page ids, -1 ignored) -> [N, H, v] in config.dtype. q, positions,
    w_uk, w_uv as in _dense_prefill; group: the plan's RowGroup of these rows (its fp8
    dequantisation route); in_f32: per_head's."""
    c_ = config
    dt = c_.jnp_dtype
    slots = positions_to_slots(top_positions, meta.block_tables, _pick(meta.row_seq, rows), c_.page_size)
    with jax.named_scope("sparse_attention"):
        q_nope, q_pe = query_parts(_pick(q, rows), _pick(positions, rows), c_)
        q_lat = per_head("thn,hnr->thr", q_nope, w_uk, c_, in_f32=in_f32, dtype=dt)
        q_abs = jnp.concatenate([q_lat, q_pe], -1)  # (q_pe is in config.dtype)
        out_lat, _ = kernel_ops.sparse_mla(q_abs, cache.flat("latent"), cache.flat("latent_scale"),
                                           cache.flat("k_pe"), slots, scale=c_.softmax_scale, pages=pages,
                                           page_size=c_.page_size, dequantize=group.dequantize, **impl.kwargs)
        return per_head("thr,hvr->thv", out_lat, w_uv, c_, in_f32=in_f32, dtype=dt)


def _sparse_groups(plan: BatchPlan, meta: BatchMeta, rows):
    """The sparsely attending rows (`rows`: None, every row, or meta.sparse_rows) as [(the plan's
    RowGroup, row ids, the pages their keys lie on)]: with the plan's fp8 split, the prefill rows
    over their own pages (the copy dequantised upfront covers only those) and the decode rows;
    else one group over every sequence's pages."""
    if not plan.num_upfront_rows:
        return [(plan.group("all" if rows is None else "sparse"), rows, meta.block_tables)]
    groups = [(plan.group("upfront"), meta.upfront_rows, meta.upfront_pages)]
    if plan.num_kernel_rows:
        groups.append((plan.group("kernel"), meta.kernel_rows, meta.block_tables))
    return groups


def _attend_sparsely(score, attend, plan: BatchPlan, meta: BatchMeta, out_heads, *, rows, all_positions=None):
    """out_heads [T, H, v] with `rows` (None: every row) attended sparsely, group by group
    (`_sparse_groups`). score(rows, group) -> top-k positions [N, topk] (_topk_positions over
    the step's rows and cache); attend(rows, top_positions, pages, group) -> [N, H, v]
    (_sparse_attention likewise); positions from all_positions [T, topk] when given (every row
    scored), else scored per group."""
    for group, group_rows, pages in _sparse_groups(plan, meta, rows):
        if all_positions is None:
            top = score(group_rows, group)
        else:  # -1 rows (padding, rows attending masked) select nothing: take_rows would give position 0
            top = _pick(all_positions, group_rows)
            if group_rows is not None:
                top = jnp.where(group_rows[:, None] >= 0, top, -1)
        out = attend(group_rows, top, pages, group)
        out_heads = out if group_rows is None else _put_rows(out_heads, group_rows, out)
    return out_heads


def _sparse_program(score, attend, plan: BatchPlan, meta: BatchMeta, out: jax.ShapeDtypeStruct):
    """Every row scored, top-k'd and attended sparsely -> out ([T, H, v] in config.dtype)."""
    return _attend_sparsely(score, attend, plan, meta, jnp.zeros(out.shape, out.dtype), rows=None)


def _dense_program(score, attend, dense, plan: BatchPlan, meta: BatchMeta, out: jax.ShapeDtypeStruct, topk: int):
    """Short prefills as dense MHA (dense(...) -> (rows, out): _dense_prefill), meta.sparse_rows
    scored, those of them meta.masked_flags marks as masked MHA in the same dense call (a plan
    with `masked`) and the others sparsely -> out ([T, H, v] in config.dtype).

    Scores only meta.sparse_rows, or every row when plan.skip_indexer is False (the baseline).
    """
    T = plan.num_tokens
    all_positions = None if plan.skip_indexer else score(None, plan.group("all"))
    attending = meta.sparse_rows
    if plan.masked != "none":
        # every scored row at once; the masked ones' positions select their keys in the dense call
        num_scored = plan.num_sparse_tokens
        scored_index = _put_rows(jnp.full((T,), -1, jnp.int32), meta.sparse_rows,
                                 jnp.arange(num_scored, dtype=jnp.int32))
        if all_positions is None:
            top = score(meta.sparse_rows, plan.group("sparse"))
            if plan.masked == "some":  # the other rows' sparse attention picks its rows' positions
                all_positions = jnp.where(scored_index[:, None] >= 0, top[jnp.maximum(scored_index, 0)], -1)
        else:
            top = _pick(all_positions, meta.sparse_rows)
        # a sequence's keys fit its block table (pages_per_seq pages) and the dense keys
        max_kv_len = min(plan.num_dense_keys, plan.pages_per_seq * plan.config.page_size)
        rows, dense_out = dense(select=functools.partial(_dense_selection, meta, top, scored_index, topk),
                                max_kv_len=max_kv_len)
        attending = jnp.where(meta.masked_flags > 0, -1, meta.sparse_rows)
    else:
        rows, dense_out = dense()
    out_heads = _put_rows(jnp.zeros(out.shape, out.dtype), rows, dense_out)
    if plan.num_sparse_tokens and plan.masked != "all":
        out_heads = _attend_sparsely(score, attend, plan, meta, out_heads, rows=attending,
                                     all_positions=all_positions)
    if not plan.skip_indexer:  # baseline: keep scoring that (mostly) no row reads
        out_heads = _depend_on(out_heads, all_positions)
    return out_heads


def _pad_rows(arrays, num_rows: int):
    """Each array (or a tuple of them) [n, ...] zero-padded to [num_rows, ...]."""
    if isinstance(arrays, tuple):
        return tuple(_pad_rows(a, num_rows) for a in arrays)
    return jnp.pad(arrays, [(0, num_rows - arrays.shape[0])] + [(0, 0)] * (arrays.ndim - 1))


def _switch(index, branches, *operands):
    """jax.lax.switch, or the branch called directly where there is one or the index is a
    constant (a numpy integer: meta.branches given as numpy, the stages' sizes fixed at trace
    time): XLA's GPU conditional copies its index to the host and waits for it (the GPU idles
    until the host launches the branch), so a stage of one size has none."""
    if len(branches) == 1:
        return branches[0](*operands)
    if isinstance(index, (int, np.integer)):  # clamped, as lax.switch clamps
        return branches[min(max(int(index), 0), len(branches) - 1)](*operands)
    return jax.lax.switch(index, branches, *operands)


def _over_rows(fn, plan: BatchPlan, meta: BatchMeta, impl: kernel_ops.OpImpl):
    """fn(n, rows): a matmul stage over the first n rows, padded to num_tokens (rows: linear's).
    A cond plan whose plan.row_sizes has several sizes runs it over its real rows (padding rows
    cost those matmuls full FLOPs): with the row_matmul kernel where `kernels.row_kernel` picks it
    for the bucket (impl: Implementations.row_matmul) over every row, the real ones counted at run
    time (the plan puts padding last); else at the size meta.branches[3] picks (the real rows
    rounded up to plan.projection_ladder's next size), a conditional. A static plan, and a ladder
    of one size, over every row."""
    kernel = kernel_ops.row_kernel(impl, plan.num_tokens)
    if len(plan.row_sizes) > 1 and kernel is not None:
        return fn(plan.num_tokens, (jnp.sum(meta.positions >= 0, dtype=jnp.int32), kernel))
    return _switch(meta.branches[3] if plan.row_sizes else None,
                   [functools.partial(fn, n, None) for n in plan.row_sizes or (plan.num_tokens,)])


def _cond_program(score, attend, dense, plan: BatchPlan, meta: BatchMeta, out: jax.ShapeDtypeStruct, topk: int):
    """The serving program (dispatch="cond") -> out ([T, H, v] in config.dtype). Its stages
    are those the plan holds (a dense call where num_dense_keys, scoring and sparse attention
    where num_sparse_tokens), each run at the size meta.branches picks from the plan's sizes
    (0: the stage does not run this step; one size: no conditional):

    1. scoring of meta.sparse_rows[:n] (n and the indexer kernel's shape from plan.score_calls;
       every row, the baseline, without skip_indexer): top-k positions [T, topk] aligned with
       meta.sparse_rows, -1 past n;
    2. the dense MHA call (`dense`: _dense_prefill) over the first k of meta.dense_key_slots
       (plan.dense_calls: k, and whether the rows meta.masked_flags marks are restricted to their
       top-k positions);
    3. sparse attention of meta.sparse_rows[:n] (n from plan.attend_sizes; the plan puts the
       sparsely attending rows first, the masked ones are skipped).
    Without a dense call (and with skip_indexer) every scored row attends sparsely: 1 and 3 are
    one stage (one conditional). Each stage's every size is compiled into the program, so the program is one
    per shape bucket and stage set, and a step pays for its real rows and keys, up to the
    ladders' steps.
    """
    T = plan.num_tokens
    zeros = jnp.zeros(out.shape, out.dtype)
    if not plan.key_sizes and plan.skip_indexer:  # every row attends sparsely: sparse_rows is 0, 1, ...
        def scored_and_attended(n, kernel):
            def run():
                if n == 0:
                    return zeros
                group = plan.group("sparse", n, kernel)
                return _pad_rows(attend(n, score(n, group), meta.block_tables, group), T)
            return run
        return _switch(meta.branches[0], [scored_and_attended(*call) for call in plan.score_calls])

    none = jnp.full((T, topk), -1, jnp.int32)
    all_positions = None
    if not plan.skip_indexer:  # baseline: every row scored
        all_positions = score(None, plan.group("all"))
        top = jnp.where(meta.sparse_rows[:, None] >= 0, _pick(all_positions, meta.sparse_rows), -1)
    elif plan.score_calls:
        def scoring(n, kernel):
            if n == 0:
                return lambda: none
            return lambda: jnp.concatenate([score(meta.sparse_rows[:n], plan.group("sparse", n, kernel)), none[n:]])
        top = _switch(meta.branches[0], [scoring(*call) for call in plan.score_calls])

    out_heads = zeros
    if plan.key_sizes:
        scored_index = _put_rows(jnp.full((T,), -1, jnp.int32), meta.sparse_rows,
                                 jnp.arange(plan.num_sparse_tokens, dtype=jnp.int32))
        longest = plan.pages_per_seq * plan.config.page_size  # a sequence's keys fit its block table

        def dense_call(num_keys, masked):
            def run():
                if num_keys == 0:
                    return zeros
                if masked:
                    rows, dense_out = dense(num_keys=num_keys, max_kv_len=min(num_keys, longest),
                                            select=functools.partial(_dense_selection, meta, top, scored_index, topk))
                else:
                    rows, dense_out = dense(num_keys=num_keys)
                return _put_rows(zeros, rows, dense_out)
            return run
        out_heads = _switch(meta.branches[1], [dense_call(*call) for call in plan.dense_calls])

    def attending(n):
        def run(out_heads):
            if n == 0:
                return out_heads
            rows = jnp.where(meta.masked_flags[:n] > 0, -1, meta.sparse_rows[:n])
            attended = attend(rows, jnp.where(rows[:, None] >= 0, top[:n], -1), meta.block_tables,
                              plan.group("sparse", n))
            return _put_rows(out_heads, rows, attended)
        return run

    if plan.attend_sizes:
        out_heads = _switch(meta.branches[2], [attending(n) for n in plan.attend_sizes], out_heads)
    if all_positions is not None:  # baseline: keep scoring that (mostly) no row reads
        out_heads = _depend_on(out_heads, all_positions)
    return out_heads


def forward(params: Mapping[str, jax.Array], hidden: jax.Array, cache: cache_lib.PagedCache, meta: BatchMeta, *,
            plan: BatchPlan, config: MLAConfig, kernels: kernel_ops.Kernels = "auto",
            tensor_axis: str | None = None) -> tuple[jax.Array, cache_lib.PagedCache]:
    """One attention layer step over a planned batch.

    params: HF-named dict of arrays (see params.py); hidden: floating-point array
    [plan.num_tokens, hidden_size], rows in plan_batch's order, padding last; cache: PagedCache
    (donate it under jit); meta: BatchMeta; plan: BatchPlan (both from plan_batch, given
    num_pages=cache.num_pages); config: MLAConfig; kernels: one of kernels.CHOICES ("auto":
    the Mosaic / Triton kernels on a GPU, XLA elsewhere). Returns (out [num_tokens, hidden_size] in
    config.dtype, new cache). Padding rows give 0; the rows of a request at and after one whose
    hidden row is not finite give NaN on every route. An argument of another type or shape raises
    ValueError naming it (check_arguments, then the plan's sizes).
    Jit with plan, config and kernels static.
    tensor_axis: inside shard_map, the mesh axis that splits the attention heads (sharding.py):
      params and config hold this shard's attention heads and the whole indexer; the output is
      summed over the axis, and scoring is split over it by rows where the plan says so
      (RowGroup.indexer_shards: the top-k positions are all-gathered).
    """
    check_arguments(params, hidden, cache, meta, plan, config, kernels, tensor_axis)
    check_inputs(params, hidden, cache, meta, plan, config, 1 if tensor_axis is None else jax.lax.axis_size(tensor_axis))
    impl = kernel_ops.resolve(kernels, config)  # every device-dependent choice, once
    c_ = config
    T, H = plan.num_tokens, c_.num_attention_heads
    x = hidden.astype(c_.jnp_dtype)
    positions = jnp.maximum(meta.positions, 0)

    def project(n, rows):  # the first n rows' matmuls, zero past them
        return _pad_rows(projection_matmuls(params, x[:n], c_, in_f32=impl.dots_in_f32, rows=rows), T)

    with jax.named_scope("projections"):  # row-wise work outside the conditional, fused into its readers
        qr, q, c, k_pe, k_index = projections(params, _over_rows(project, plan, meta, impl.row_matmul), positions,
                                              c_)
    # Both caches are written first: the dense program still fills the indexer key cache,
    # or later decode steps would score against stale keys.
    with jax.named_scope("cache_write"):
        cache = cache_lib.write(cache, meta.slot_mapping,
                                {**cache_lib.encode_latent(c, k_pe, c_), **cache_lib.encode_index_keys(k_index, c_)})

    kv_b = params["kv_b_proj.weight"].reshape(H, c_.qk_nope_head_dim + c_.v_head_dim, c_.kv_lora_rank)
    w_uk, w_uv = kv_b[:, : c_.qk_nope_head_dim], kv_b[:, c_.qk_nope_head_dim:]  # [H, nope, R], [H, v, R]
    # The stages over this step's rows and written cache: what each reads is in its arguments.
    score = functools.partial(_topk_positions, params, x, qr, positions, cache, meta, config=c_, impl=impl,
                              tensor_axis=tensor_axis)
    attend = functools.partial(_sparse_attention, q, positions, w_uk, w_uv, cache, meta, config=c_,
                               impl=impl.sparse_mla, in_f32=impl.dots_in_f32)
    dense = functools.partial(_dense_prefill, q, positions, w_uk, w_uv, cache, meta, c_, impl.dense_mha,
                              impl.dots_in_f32)
    heads = jax.ShapeDtypeStruct((T, H, c_.v_head_dim), c_.jnp_dtype)  # (o_proj reads it in config.dtype)
    if plan.use_dense_mha is None:  # dispatch="cond": the serving program
        out_heads = _cond_program(score, attend, dense, plan, meta, heads, c_.index_topk)
    elif plan.use_dense_mha:
        out_heads = _dense_program(score, attend, dense, plan, meta, heads, c_.index_topk)
    else:
        out_heads = _sparse_program(score, attend, plan, meta, heads)

    # a request's own non-finite input shows in its rows on every route (see _nonfinite_rows)
    nonfinite = _nonfinite_rows(x, meta, plan.num_seqs)

    def o_proj(n, rows):  # the first n rows' output, zero past them (in config.dtype, unless summed over shards)
        out = linear(out_heads[:n].reshape(n, H * c_.v_head_dim), params["o_proj.weight"], c_,
                     dtype=jnp.float32 if tensor_axis is not None else c_.jnp_dtype, in_f32=impl.dots_in_f32,
                     rows=rows)
        # NaN set on the n rows, fused into their padding (a select over every row of the bucket
        # took 0.18 ms at 8192 rows, H100); a NaN partial sum stays NaN through the psum
        return _pad_rows(jnp.where(nonfinite[:n, None], jnp.nan, out), T)

    with jax.named_scope("o_proj"):
        out = _over_rows(o_proj, plan, meta, impl.row_matmul)
        if tensor_axis is not None:  # o_proj's columns are split by head: partial sums, in float32
            out = jax.lax.psum(out, tensor_axis).astype(c_.jnp_dtype)
    return out, cache


COMMAND_BUFFERS_OFF = {"xla_gpu_enable_command_buffer": ""}  # XLA's compiler option: no CUDA graphs
# XLA's default command-buffer types (jax 0.11.2): what a program without that option captures
# (the benches add CONDITIONAL or WHILE to them)
DEFAULT_COMMAND_TYPES = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION"


def compiler_options(plan: BatchPlan) -> dict[str, str]:
    """The XLA compiler options of a program that runs forward on `plan` (PlanJit: jit_forward,
    sharding.jit_sharded_forward, the serving engine's step). Where the program has conditionals
    (plan.has_conditionals) XLA's command buffers (CUDA graphs) are off: around the conditionals
    they cost 1.2-2.6x the static program's step on an H100, against 1.09-1.17x without them.
    Elsewhere XLA's defaults: a step's runs of kernels launch as graphs, not one by one from the
    host (docs/design/dispatch.md)."""
    return COMMAND_BUFFERS_OFF if plan.has_conditionals else {}


class PlanJit:
    """`fn` jitted with static_argnames (plan among them, passed by keyword) and donate_argnames,
    each plan's program compiled with compiler_options(plan): one jax.jit per distinct options.
    Called, `.lower(...)` and `._cache_size()` (the executables compiled so far) as a jax.jit; a
    top-level program (compiler options are a whole program's: inside another jit, call the
    function itself)."""

    def __init__(self, fn, *, static_argnames: tuple[str, ...], donate_argnames: tuple[str, ...]):
        functools.update_wrapper(self, fn)
        self._static, self._donate = static_argnames, donate_argnames
        self._jits: dict[tuple, jax.stages.Wrapped] = {}

    def _jit(self, plan: BatchPlan):
        options = compiler_options(plan)
        key = tuple(sorted(options.items()))
        jitted = self._jits.get(key)
        if jitted is None:  # (setdefault: two threads asking at once share the first one)
            jitted = self._jits.setdefault(key, jax.jit(self.__wrapped__, static_argnames=self._static,
                                                        donate_argnames=self._donate, compiler_options=options or None))
        return jitted

    def __call__(self, *args, plan: BatchPlan, **kwargs):
        return self._jit(plan)(*args, plan=plan, **kwargs)

    def lower(self, *args, plan: BatchPlan, **kwargs) -> jax.stages.Lowered:
        return self._jit(plan).lower(*args, plan=plan, **kwargs)

    def _cache_size(self) -> int:
        return sum(jitted._cache_size() for jitted in self._jits.values())


_jitted_forward = PlanJit(forward, static_argnames=("plan", "config", "kernels"), donate_argnames=("cache",))


def check_cache_not_donated(cache) -> None:
    """ValueError naming the array and the fix when a PagedCache's arrays were donated to an
    earlier jitted step (validate.check_not_deleted), before a dispatch would raise jax's bare
    "Array has been deleted" (another type: forward's checks name it)."""
    if isinstance(cache, cache_lib.PagedCache):
        check_not_deleted({f"cache.{name}": a for name, a in cache.arrays().items()})


def jit_forward(params: Mapping[str, jax.Array], hidden: jax.Array, cache: cache_lib.PagedCache, meta: BatchMeta,
                *, plan: BatchPlan, config: MLAConfig, kernels: kernel_ops.Kernels = "auto"
                ) -> tuple[jax.Array, cache_lib.PagedCache]:
    """`forward` jitted, with plan, config and kernels static (one executable per distinct plan)
    and the cache DONATED: the call deletes the input cache's arrays and writes the new cache in
    their place (no copy of the layer's largest buffer), so always continue with the cache it
    returns: `out, cache = jit_forward(params, hidden, cache, meta, plan=plan, config=config)`.

    Arguments and result as forward's. A deleted input cache (passed again after an earlier
    call donated it) raises ValueError naming the array and this fix (validate.check_not_deleted),
    checked before the dispatch, which would raise jax's bare "Array has been deleted".
    `jit_forward.lower(...)` (AOT lowering, as jax.jit's) and `jit_forward._cache_size()` (the
    executables compiled so far) are the jitted function's.
    """
    check_cache_not_donated(cache)
    return _jitted_forward(params, hidden, cache, meta, plan=plan, config=config, kernels=kernels)


jit_forward.lower = _jitted_forward.lower
jit_forward._cache_size = _jitted_forward._cache_size
