"""Lightning-indexer logits: the Pallas Triton-backend kernel (the portable path: any GPU, f32,
interpret mode). Same contract as `reference.indexer_logits_reference`."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ..device import next_pow2
from .layout import FP8_E4M3, max_tiles, tile_schedule

# fp8 MMA with the head dim accumulated in the tensor core's own accumulator. Triton lowers an fp8
# tt.dot whose maxNumImpreciseAcc is < 32 (Pallas always emits 0: "exact f32 accumulation") to
# the legacy mma.sync path; Hopper's wgmma needs maxNumImpreciseAcc >= 32. With K = D = 128 the
# whole dot is one accumulation chain, exactly what DeepGEMM's fp8 MQA-logits kernels do. This is
# a private primitive with a Triton lowering rule registered through Pallas' (private) lowering
# table; if that table is not importable, the kernel uses lax.dot_general (mma.sync) instead.
FP8_IMPRECISE_ACC = 128

try:
    from jax._src import core as _jax_core
    from jax._src.lib.mlir import ir as _ir
    from jax._src.lib.triton import dialect as _tt
    from jax._src.pallas.triton import lowering as _tl

    _fp8_dot_p = _jax_core.Primitive("indexer_fp8_dot")

    @_fp8_dot_p.def_abstract_eval
    def _fp8_dot_abstract(a, b, *, max_num_imprecise_acc):
        del max_num_imprecise_acc
        return _jax_core.ShapedArray((a.shape[0], b.shape[0]), jnp.float32)

    @_tl.register_lowering(_fp8_dot_p)
    def _fp8_dot_triton(ctx, a, b, *, max_num_imprecise_acc):
        """a [M, K] x b [N, K] -> [M, N] f32 (b contracted on its last dim, like q . k)."""
        b = _tt.trans(b, (1, 0))
        m = _ir.RankedTensorType(a.type).shape[0]
        n = _ir.RankedTensorType(b.type).shape[1]
        acc = _tl._zeros(_ir.RankedTensorType.get([m, n], _ir.F32Type.get()))
        return _tt.dot(a, b, acc, max_num_imprecise_acc=max_num_imprecise_acc)

    def _fp8_dot(a, b, max_num_imprecise_acc):
        return _fp8_dot_p.bind(a, b, max_num_imprecise_acc=max_num_imprecise_acc)
except Exception:  # noqa: BLE001  (private API moved: fall back to the portable dot)
    _fp8_dot = None


_TARGET_PROGRAMS = 1024  # enough programs to fill a Hopper GPU's SMs several times over


@dataclasses.dataclass(frozen=True)
class IndexerTiling:
    """Static tiling of `indexer_logits`.

    block_rows: query rows of one sequence per program (each row is its own [Hi, D] x [D, BK] dot).
    block_keys: keys per inner step (a power of two; need not be a multiple of page_size).
    chunk: keys per program (a multiple of block_keys); the key axis is split over programs.
    """
    block_rows: int
    block_keys: int
    chunk: int
    num_warps: int
    num_stages: int


def choose_tiling(num_rows, num_seqs, num_keys, *, block_rows=None, block_keys=None, chunk=None,
                  num_warps=None, num_stages=None) -> IndexerTiling:
    """Pick a tiling from the static shapes: prefill-like batches (many rows per sequence) get 4
    rows per program so each gathered key block feeds 4 x Hi rows of MMA; decode-like ones (1-2
    rows per sequence, long contexts) get 1-2 rows and a key axis split over programs."""
    rows_per_seq = num_rows / max(1, min(num_seqs, num_rows))
    if block_rows is None:
        block_rows = 1 if rows_per_seq < 1.5 else (2 if rows_per_seq < 3 else 4)
    if block_keys is None:
        block_keys = 64
    block_keys = max(16, min(block_keys, next_pow2(num_keys)))
    num_tiles = max_tiles(num_rows, num_seqs, block_rows)
    key_blocks = pl.cdiv(num_keys, block_keys)
    if chunk is None:
        splits = max(1, min(key_blocks, pl.cdiv(_TARGET_PROGRAMS, num_tiles)))
        chunk = pl.cdiv(key_blocks, splits) * block_keys
    chunk = max(block_keys, pl.cdiv(chunk, block_keys) * block_keys)
    return IndexerTiling(block_rows, block_keys, chunk, num_warps or 4, num_stages or 3)


def _indexer_kernel(tile_rows_ref, tile_meta_ref, row_end_ref, q_ref, w_ref, bt_ref, k_ref, *rest,
                    page_size, num_pages_per_seq, num_keys, tiling: IndexerTiling, has_scale,
                    dot_dtype, precision, fast_fp8, fp8_imprecise_acc):
    if has_scale:
        ks_ref, out_ref = rest
    else:
        (out_ref,) = rest
    br, bk, chunk = tiling.block_rows, tiling.block_keys, tiling.chunk
    d = q_ref.shape[-1]
    t = pl.program_id(0)
    split = pl.program_id(1)
    seq = tile_meta_ref[t, 0]
    tile_end = tile_meta_ref[t, 1]

    rows, valid, ends, qs, ws = [], [], [], [], []
    for r in range(br):
        row = tile_rows_ref[t, r]
        ok = row >= 0
        row = jnp.maximum(row, 0)
        rows.append(row)
        valid.append(ok)
        ends.append(jnp.where(ok, row_end_ref[row], 0))
        q_r = q_ref[row]  # [Hi, D]
        qs.append(q_r if q_r.dtype == dot_dtype else q_r.astype(dot_dtype))
        ws.append(w_ref[row])  # [Hi] f32

    start = split * chunk
    n_blocks = chunk // bk
    stop = jnp.minimum(tile_end, start + chunk)
    n_compute = jnp.clip((stop - start + bk - 1) // bk, 0, n_blocks)
    lane = jnp.arange(bk, dtype=jnp.int32)
    dcol = jnp.arange(d, dtype=jnp.int32)

    def compute(i, carry):
        col0 = start + i * bk
        cols = col0 + lane
        in_range = cols < num_keys
        pidx = jnp.where(in_range, seq * num_pages_per_seq + cols // page_size, 0)
        page = jnp.maximum(pltriton.load(bt_ref.at[pidx], mask=in_range, other=0), 0)
        slots = page * page_size + cols % page_size
        k = k_ref[slots[:, None], dcol[None, :]]  # [BK, D] gathered through the block table
        if k.dtype != dot_dtype:
            k = k.astype(dot_dtype)
        scale = ks_ref[slots] if has_scale else None
        for r in range(br):
            if fast_fp8:
                s = _fp8_dot(qs[r], k, fp8_imprecise_acc)  # [Hi, BK] f32
            else:
                s = jax.lax.dot_general(qs[r], k, (((1,), (1,)), ((), ())), precision=precision,
                                        preferred_element_type=jnp.float32)  # [Hi, BK]
            v = jnp.sum(jnp.maximum(s, 0.0) * ws[r][:, None], axis=0)  # [BK]
            if has_scale:
                v = v * scale
            v = jnp.where(cols < ends[r], v, -jnp.inf)
            pltriton.store(out_ref.at[rows[r], pl.ds(col0, bk)], v, mask=in_range & valid[r])
        return carry

    def fill(i, carry):
        col0 = start + i * bk
        cols = col0 + lane
        neg = jnp.full((bk,), -jnp.inf, jnp.float32)
        for r in range(br):
            pltriton.store(out_ref.at[rows[r], pl.ds(col0, bk)], neg, mask=(cols < num_keys) & valid[r])
        return carry

    jax.lax.fori_loop(0, n_compute, compute, 0)
    jax.lax.fori_loop(n_compute, n_blocks, fill, 0)


def indexer_logits_triton(q, weights, k_cache, k_scale, block_tables, row_seq, row_end, *, page_size,
                          interpret=False, fp8_imprecise_acc=FP8_IMPRECISE_ACC, **tiling_overrides):
    """Indexer logits, Pallas (Triton backend) kernel. Same contract as `reference.indexer_logits_reference`.

    q: [N, Hi, D] (e4m3 | bf16 | f32); weights [N, Hi] f32; k_cache [num_slots, D] (same dtype as q
    for the fast path; otherwise both are upcast to f32 in the kernel); k_scale [num_slots] f32
    (>= 0, as every act_quant scale is) or None; block_tables [S, W] int32; row_seq, row_end [N].
    Returns [N, W * page_size] f32, -inf at positions >= row_end[n].
    tiling_overrides: block_rows, block_keys, chunk, num_warps, num_stages (see `choose_tiling`).
    fp8_imprecise_acc: for fp8 on the GPU, K elements accumulated inside the tensor core before a
    f32 add (Triton's maxNumImpreciseAcc; >= 32 lets Hopper use wgmma, 0 forces mma.sync with
    exact f32 accumulation). Interpret mode always accumulates in f32.

    Route and tiling. The grid is (row tiles, key chunks). Rows are grouped by sequence in the
    wrapper (`layout.tile_schedule`: a counting sort by row_seq, then tiles of <= block_rows rows of
    ONE sequence), so the rows of a program share their keys and ragged batches (several sequences,
    any row order) need no per-row gathers. A program loads its rows' q ([Hi, D] each) and weights
    once, then walks its key chunk in blocks of block_keys positions: page ids are gathered from the
    block table per position (pos // page_size), the keys as one [BK, D] vector gather from the
    cache (so BK need not be a multiple of page_size), one MMA per row [Hi, D] x [D, BK] with fp32
    accumulation, ReLU, weighted head sum, k_scale, causal/ragged mask, and a [BK] store.
    Blocks at or past the tile's largest row_end skip loads and MMA and only write -inf, so a
    causal prefill does about half the work of the full rectangle. Nothing of size [N, Hi, L]
    exists outside registers. Prefill (many rows per sequence) uses 4 rows per program (each key
    block feeds 4 x 64 MMA rows); decode (1-2 rows per sequence, up to 128K keys) uses 1-2 rows
    and splits the key axis over programs so a small batch still fills the GPU.

    Why Triton here: the Triton backend has vector gathers (`ref[idx_vector]`) and masked
    loads/stores, so one kernel covers any page size, dtype (f32 included), GPU and interpret
    mode. It is the portable path: on Hopper the Mosaic GPU kernels are several times faster for
    both prefill (MMA-bound) and decode (bandwidth-bound; see `api.indexer_logits`).
    """
    n, hi, d = q.shape
    num_seqs, pages_per_seq = block_tables.shape
    num_keys = pages_per_seq * page_size
    if n == 0 or num_keys == 0:
        return jnp.full((n, num_keys), -jnp.inf, jnp.float32)

    if q.dtype == k_cache.dtype and q.dtype != jnp.float32:
        dot_dtype, precision = q.dtype, None
    else:
        dot_dtype, precision = jnp.dtype(jnp.float32), jax.lax.Precision.HIGHEST

    # The MMA needs power-of-two blocks of at least 16 in each dim (K >= 32 for fp8): pad heads
    # (weight 0) and D (zeros); a no-op for the real Hi=64, D=128.
    hi_p = max(16, next_pow2(hi))
    d_p = max(32 if jnp.dtype(dot_dtype).itemsize == 1 else 16, next_pow2(d))  # fp8 MMA: K >= 32
    weights = weights.astype(jnp.float32)
    if hi_p != hi:
        q = jnp.pad(q, ((0, 0), (0, hi_p - hi), (0, 0)))
        weights = jnp.pad(weights, ((0, 0), (0, hi_p - hi)))
    if d_p != d:
        q = jnp.pad(q, ((0, 0), (0, 0), (0, d_p - d)))
        k_cache = jnp.pad(k_cache, ((0, 0), (0, d_p - d)))

    tiling = choose_tiling(n, num_seqs, num_keys, **tiling_overrides)
    tile_rows, tile_meta = tile_schedule(row_seq, row_end, num_seqs, num_keys, tiling.block_rows)
    grid = (tile_rows.shape[0], pl.cdiv(num_keys, tiling.chunk))

    has_scale = k_scale is not None
    args = [tile_rows, tile_meta, row_end.astype(jnp.int32), q, weights,
            block_tables.astype(jnp.int32).reshape(-1), k_cache]
    if has_scale:
        args.append(k_scale.astype(jnp.float32))
    kernel = functools.partial(
        _indexer_kernel, page_size=page_size, num_pages_per_seq=pages_per_seq, num_keys=num_keys,
        tiling=tiling, has_scale=has_scale, dot_dtype=jnp.dtype(dot_dtype), precision=precision,
        fast_fp8=(dot_dtype == FP8_E4M3 and not interpret and _fp8_dot is not None
                  and fp8_imprecise_acc > 0),
        fp8_imprecise_acc=int(fp8_imprecise_acc))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n, num_keys), jnp.float32),
        grid=grid,
        compiler_params=pltriton.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages),
        interpret=interpret,
        name="indexer_logits",
    )(*args)
