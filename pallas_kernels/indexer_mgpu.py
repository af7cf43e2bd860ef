"""Lightning-indexer logits for prefill: a Pallas Mosaic GPU kernel (Hopper wgmma, TMA, warp
specialisation). Same contract as `pallas_kernels.indexer.indexer_logits_reference`:
    logits[n, s] = sum_h weights[n, h] * relu(q[n, h] . k[s]) * k_scale[s]   for s < row_end[n]
and -inf elsewhere, keys addressed through the row's block table.

Layout of the work. The wrapper (XLA) gathers each sequence's keys from the paged cache into a
contiguous [num_seqs * Lp, D] buffer (Lp = keys per sequence rounded up to block_keys; a few MB,
noise next to the matmul) and groups the rows by sequence into tiles of block_rows rows. One CTA
per tile, three warpgroups:
  * a memory warpgroup streams key tiles [block_keys, D] (and their scales) into a ring of SMEM
    slots by TMA, and writes -inf past the tile's last causal key block;
  * two compute warpgroups take alternate key tiles. For each of the tile's rows, one wgmma
    [block_keys keys, D] x [D, Hi heads] (keys as A, the row's q as a K-major B, both in SMEM;
    the accumulator rows are keys), then ReLU, the head-weighted sum as a row reduction of the
    WGMMA layout, the key scales and the causal mask give block_keys logits, staged in SMEM and
    written by one TMA per row. While one warpgroup runs its epilogue the other's wgmmas run.
The rows' q ([block_rows, Hi, D]) and weights stay in SMEM for the whole key loop; nothing of
size [rows, Hi, keys] exists outside registers. Key blocks at or past the tile's largest row_end
are skipped (a causal prefill does about half of the rectangle), tiles run heaviest first.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ._shapes import next_pow2

FP8_E4M3 = jnp.dtype(jnp.float8_e4m3fn)
BLOCK_KEYS = 64  # wgmma M: one warpgroup's accumulator rows
_COMPUTE_WGS = 2
_SMEM_Q_BYTES = 128 * 1024  # SMEM budget for the rows' q (the H200 has 227 KiB per CTA)


@dataclasses.dataclass(frozen=True)
class MgpuTiling:
    """block_rows: rows of one sequence per CTA (their q stays in SMEM); stages: key tiles in
    flight; group: rows whose wgmmas are issued together before one wait (accumulator registers:
    group * Hi / 4 per thread)."""
    block_rows: int
    stages: int
    group: int


def choose_mgpu_tiling(dtype, hi, d, *, block_rows=None, stages=None, group=None) -> MgpuTiling:
    q_row_bytes = hi * d * jnp.dtype(dtype).itemsize
    group = group or 4
    if block_rows is None:
        block_rows = max(group, min(16, _SMEM_Q_BYTES // q_row_bytes) // group * group)
    if block_rows % group:
        raise ValueError(f"block_rows={block_rows} must be a multiple of group={group}")
    return MgpuTiling(block_rows, stages or 4, group)


def _padded_dims(hi, d, dtype):
    """wgmma needs N = heads % 8 == 0 and a K row of 32, 64 or a multiple of 128 bytes (the
    swizzle); pad heads (weight 0) and D (zeros). No-op for the real Hi=64, D=128."""
    itemsize = jnp.dtype(dtype).itemsize
    hi_p = -(-hi // 8) * 8
    row_bytes = d * itemsize
    if row_bytes <= 128:
        row_bytes = max(32, next_pow2(row_bytes))
    else:
        row_bytes = -(-row_bytes // 128) * 128
    return hi_p, row_bytes // itemsize, min(128, row_bytes)


def _meta_width(block_rows):
    return -(-(2 + 2 * block_rows) // 4) * 4  # int32 row of 16-byte multiple (TMA)


def _kernel(meta_ref, q_ref, w_ref, k_ref, ks_ref, out_ref, *, tiling: MgpuTiling, hi, d,
            keys_per_seq, swizzle, dtype):
    br, stages, group = tiling.block_rows, tiling.stages, tiling.group
    bk = BLOCK_KEYS
    out_blocks = out_ref.shape[1] // bk
    tile = lax.axis_index("tile")
    transforms = (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
                  plgpu.SwizzleTransform(swizzle))

    def body(meta_smem, q_smem, w_smem, k_smem, ks_smem, o_smem, fill_smem,
             meta_bar, q_bar, k_bar, consumed_bar):
        wg = lax.axis_index("wg")

        def tile_header():
            plgpu.barrier_wait(meta_bar)
            seq, tile_end = meta_smem[0], meta_smem[1]
            return seq, pl.cdiv(tile_end, bk)

        @pl.when(wg == _COMPUTE_WGS)
        def _memory_wg():
            plgpu.set_max_registers(40, action="decrease")
            plgpu.copy_gmem_to_smem(meta_ref.at[tile], meta_smem, meta_bar)
            plgpu.copy_gmem_to_smem(w_ref.at[tile], w_smem, q_bar)
            fill_smem[...] = jnp.full((bk,), -jnp.inf, jnp.float32)
            plgpu.commit_smem()
            seq, n_steps = tile_header()
            for j in range(br):  # empty row slots load row 0 (never stored): one arrival each
                plgpu.copy_gmem_to_smem(q_ref.at[jnp.maximum(meta_smem[2 + j], 0)], q_smem.at[j], q_bar)

            @pl.loop(0, n_steps)
            def _load(step):
                slot = lax.rem(step, stages)

                @pl.when(step >= stages)
                def _():
                    plgpu.barrier_wait(consumed_bar.at[slot])
                    plgpu.commit_smem()  # order the consumer's reads (generic proxy) before TMA's writes

                keys = pl.ds(seq * keys_per_seq + step * bk, bk)
                plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem.at[slot], k_bar.at[slot])
                plgpu.copy_gmem_to_smem(ks_ref.at[keys], ks_smem.at[slot], k_bar.at[slot])

            for j in range(br):  # -inf past the last computed key block
                row = meta_smem[2 + j]

                @pl.when(row >= 0)
                def _fill_row():
                    @pl.loop(n_steps, out_blocks)
                    def _fill(b):
                        plgpu.copy_smem_to_gmem(fill_smem, out_ref.at[row, pl.ds(b * bk, bk)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg < _COMPUTE_WGS)
        def _compute_wg():
            plgpu.set_max_registers(232, action="increase")
            _, n_steps = tile_header()
            plgpu.barrier_wait(q_bar)
            lane = plgpu.broadcasted_iota(jnp.int32, (bk,), 0, layout=plgpu.Layout.WGMMA.reduce(1))

            @pl.loop(0, (n_steps - wg + 1) // _COMPUTE_WGS)
            def _step(i):
                step = wg + _COMPUTE_WGS * i
                slot = lax.rem(step, stages)
                buf = lax.rem(i, 2)
                out_tile = o_smem.at[wg, buf]
                plgpu.barrier_wait(k_bar.at[slot])
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # out_tile's stores of step i - 2
                k_scale = plgpu.load(ks_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
                pos = lane + step * bk
                for g in range(br // group):
                    rows = range(g * group, (g + 1) * group)

                    def mma(*accs, rows=rows):
                        for acc, j in zip(accs, rows):
                            plgpu.wgmma(acc, k_smem.at[slot], q_smem.at[j].T)
                        plgpu.wgmma_wait(0)
                        return [acc[...] for acc in accs]

                    scores = pl.run_scoped(mma, *[plgpu.ACC((bk, hi), jnp.float32)] * group)
                    for s, j in zip(scores, rows):
                        w = plgpu.load(w_smem.at[j], layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
                        logit = jnp.sum(jnp.maximum(s, 0.0) * lax.broadcast_in_dim(w, (bk, hi), [1]), axis=1)
                        logit = jnp.where(pos < meta_smem[2 + br + j], logit * k_scale, -jnp.inf)
                        out_tile[j] = logit

                @pl.when(step + stages < n_steps)  # the memory warpgroup refills this slot
                def _release():
                    plgpu.barrier_arrive(consumed_bar.at[slot])

                plgpu.commit_smem()
                for j in range(br):
                    row = meta_smem[2 + j]

                    @pl.when(row >= 0)
                    def _store():
                        plgpu.copy_smem_to_gmem(out_tile.at[j], out_ref.at[row, pl.ds(step * bk, bk)],
                                                commit_group=False)
                plgpu.commit_smem_to_gmem_group()

            plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(
        body,
        plgpu.SMEM((meta_ref.shape[1],), jnp.int32),
        plgpu.SMEM((br, hi, d), dtype, transforms=transforms),
        plgpu.SMEM((br, hi), jnp.float32),
        plgpu.SMEM((stages, bk, d), dtype, transforms=transforms),
        plgpu.SMEM((stages, bk), jnp.float32),
        plgpu.SMEM((_COMPUTE_WGS, 2, br, bk), jnp.float32),
        plgpu.SMEM((bk,), jnp.float32),
        plgpu.Barrier(num_arrivals=1),
        plgpu.Barrier(num_arrivals=br + 1),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        collective_axes="wg",
    )


def _tiles(row_seq, row_end, num_seqs, num_keys, block_rows):
    """Row tiles of one sequence each, heaviest (largest row_end) first.

    Returns meta [T, M] int32: (sequence, tile_end, row ids (-1 = empty), row ends), and the
    row ids [T, BR] (to gather the weights)."""
    from .indexer import _tile_schedule  # the Triton kernel's grouping of rows by sequence
    tile_rows, tile_meta = _tile_schedule(row_seq, row_end, num_seqs, num_keys, block_rows)
    order = jnp.argsort(-tile_meta[:, 1], stable=True)
    tile_rows, tile_meta = tile_rows[order], tile_meta[order]
    ends = jnp.where(tile_rows >= 0, jnp.clip(row_end.astype(jnp.int32)[jnp.maximum(tile_rows, 0)], 0, num_keys), 0)
    meta = jnp.concatenate([tile_meta, tile_rows, ends], axis=1)
    pad = _meta_width(block_rows) - meta.shape[1]
    return jnp.pad(meta, ((0, 0), (0, pad))), tile_rows


def indexer_logits_mgpu(q, weights, k_cache, k_scale, block_tables, row_seq, row_end, *, page_size,
                        interpret=False, **tiling_overrides):
    """Indexer logits, Pallas Mosaic GPU kernel (prefill-shaped batches on Hopper).

    q: [N, Hi, D] e4m3 or bf16; weights [N, Hi] f32; k_cache [num_slots, D] (same dtype as q);
    k_scale [num_slots] f32 or None; block_tables [S, W] int32; row_seq, row_end [N] int32.
    Returns [N, W * page_size] f32, -inf at positions >= row_end[n].
    tiling_overrides: block_rows, stages, group (see `MgpuTiling`). interpret: run in the Mosaic
    GPU interpreter (CPU tests).
    """
    n, hi, d = q.shape
    num_seqs, pages_per_seq = block_tables.shape
    num_keys = pages_per_seq * page_size
    if q.dtype != k_cache.dtype or q.dtype not in (FP8_E4M3, jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"q and k_cache must both be float8_e4m3fn or bfloat16, got {q.dtype}, {k_cache.dtype}")
    if n == 0 or num_keys == 0:
        return jnp.full((n, num_keys), -jnp.inf, jnp.float32)
    dtype = q.dtype
    hi_p, d_p, swizzle = _padded_dims(hi, d, dtype)
    weights = weights.astype(jnp.float32)
    if (hi_p, d_p) != (hi, d):
        q = jnp.pad(q, ((0, 0), (0, hi_p - hi), (0, d_p - d)))
        weights = jnp.pad(weights, ((0, 0), (0, hi_p - hi)))
        k_cache = jnp.pad(k_cache, ((0, 0), (0, d_p - d)))
    tiling = choose_mgpu_tiling(dtype, hi_p, d_p, **tiling_overrides)

    # Contiguous keys per sequence, padded to whole key blocks: [S * Lp, D], [S * Lp].
    from .indexer import gather_paged_rows
    keys_per_seq = pl.cdiv(num_keys, BLOCK_KEYS) * BLOCK_KEYS
    pad_keys = ((0, 0), (0, keys_per_seq - num_keys))
    keys = jnp.pad(gather_paged_rows(k_cache, block_tables, page_size), pad_keys + ((0, 0),))
    scales = (jnp.ones((num_seqs, num_keys), jnp.float32) if k_scale is None
              else gather_paged_rows(k_scale.astype(jnp.float32), block_tables, page_size))
    scales = jnp.pad(scales, pad_keys)

    meta, tile_rows = _tiles(row_seq, row_end, num_seqs, num_keys, tiling.block_rows)
    tile_weights = jnp.where(tile_rows[..., None] >= 0, weights[jnp.maximum(tile_rows, 0)], 0.0)

    kernel = plgpu.kernel(
        functools.partial(_kernel, tiling=tiling, hi=hi_p, d=d_p, keys_per_seq=keys_per_seq,
                          swizzle=swizzle, dtype=dtype),
        out_type=jax.ShapeDtypeStruct((n, keys_per_seq), jnp.float32),
        grid=(meta.shape[0],),
        grid_names=("tile",),
        num_threads=_COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name="indexer_logits_mgpu",
    )
    out = kernel(meta, q, tile_weights, keys.reshape(num_seqs * keys_per_seq, d_p), scales.reshape(-1))
    return out if keys_per_seq == num_keys else out[:, :num_keys]
