"""Lightning-indexer logits: a Pallas Mosaic GPU kernel (Hopper wgmma, TMA, warp specialisation).

Same contract as `pallas_kernels.indexer.indexer_logits_reference`:
    logits[n, s] = sum_h weights[n, h] * relu(q[n, h] . k[s]) * k_scale[s]   for s < row_end[n]
and -inf elsewhere, keys addressed by position s of the row's sequence through its block table.

Layout of the work. Rows are grouped by sequence into tiles of block_rows rows (in the wrapper,
XLA); the key axis is cut into blocks of 64 keys (the wgmma M) and, when there are few tiles
(decode, short prefills), into `splits` chunks of blocks. One CTA per (tile, chunk), three
warpgroups:
  * a memory warpgroup streams key blocks [64, D] (and their scales) straight from the paged
    cache into a ring of SMEM slots by TMA (one page lookup per block: page_size % 64 == 0; other
    page sizes are first gathered into contiguous keys by XLA), and writes -inf over the chunk's
    blocks at or past the tile's last causal key;
  * two compute warpgroups take alternate key blocks. For each group of rows (4 at the real
    dims) one wgmma [64 keys, D] x [D, group * Hi] (keys as A, the rows' q side by side as a
    K-major B, both in SMEM; accumulator rows are keys); per row, ReLU, the head-weighted sum as
    a row reduction of the WGMMA layout, key scales and the causal mask give 64 logits, staged
    in SMEM and written by one TMA per row.
    While one warpgroup runs its epilogue the other's wgmmas run.
The tile's q [block_rows, Hi, D] and weights stay in SMEM for the whole chunk; nothing of size
[rows, Hi, keys] exists outside registers. Key blocks at or past the tile's largest row_end are
skipped (a causal prefill does about half of the rectangle); tiles run heaviest first.
The warpgroup skeleton (register split, the ring's load and compute loops, the -inf tail and the
final drain: `_warpgroups`, `_load_ring`, `_consume_ring`, `_fill_tail_and_drain`) is shared with
the decode kernel `indexer_decode_mgpu`, which differs in where page ids come from and in the
work per ring slot.

Why Mosaic GPU (measured on the H200, fp8, Hi=64, D=128, 2 * valid pairs * Hi * D): causal
prefill at T = S = 8K runs at 582 TFLOP/s, 2.4x the Triton-backend kernel (247; its fp8 dots
reach wgmma only through a private lowering hook). One wgmma per row (N = Hi) measured 503;
keys in registers as the A operand changed nothing (500) and were dropped. Decode (1-2 rows
per sequence) ran 555 GB/s here at B=32, C=32K (a page id fetched from GMEM before each load), so
`indexer.indexer_logits` sends only prefill-shaped batches here and decode to
`indexer_decode_mgpu` (3101 GB/s there).
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
from .indexer_layout import FP8_E4M3, _max_tiles, _tile_schedule, gather_paged_rows

BLOCK_KEYS = 64  # wgmma M: one warpgroup's accumulator rows
_COMPUTE_WGS = 2
_SMEM_Q_BYTES = 128 * 1024  # SMEM budget for the tile's q (the H200 has 227 KiB per CTA)
_TARGET_CTAS = 264  # two waves of the H200's 132 SMs


@dataclasses.dataclass(frozen=True)
class MgpuTiling:
    """block_rows: rows of one sequence per CTA (their q stays in SMEM); group: rows whose q
    share one wgmma (N = group * Hi <= 256; accumulator: group * Hi / 4 registers per thread);
    stages: key blocks in flight (even); splits: key chunks per tile (CTAs per tile)."""
    block_rows: int
    group: int
    stages: int
    splits: int


def choose_mgpu_tiling(num_rows, num_seqs, key_blocks, dtype, hi, d, *, block_rows=None, group=None,
                       stages=None, splits=None) -> MgpuTiling:
    """Prefill (many rows per sequence): as many rows per CTA as SMEM holds (16 for fp8 at the
    real dims), one chunk. Decode (1-2 rows per sequence): tiles of those rows and the key axis
    split over CTAs until about _TARGET_CTAS of them exist."""
    rows_per_seq = num_rows / max(1, min(num_seqs, num_rows))
    q_row_bytes = hi * d * jnp.dtype(dtype).itemsize
    if block_rows is None:
        block_rows = min(next_pow2(int(rows_per_seq + 0.5)), 16, max(1, _SMEM_Q_BYTES // q_row_bytes))
    if group is None:
        group = max([g for g in range(1, block_rows + 1) if block_rows % g == 0 and g * hi <= 256], default=1)
    if block_rows % group or group * hi > 256:
        raise ValueError(f"block_rows={block_rows} must be a multiple of group={group} and "
                         f"group * heads={group * hi} <= 256 (wgmma N)")
    stages = stages or 4
    if stages % _COMPUTE_WGS:
        # Block i uses slot i % stages and compute warpgroup i % 2: an even ring gives each slot
        # one warpgroup, which then waits on every phase of its barrier (a hang otherwise).
        raise ValueError(f"stages={stages} must be a multiple of {_COMPUTE_WGS}")
    if splits is None:
        splits = max(1, min(key_blocks, pl.cdiv(_TARGET_CTAS, _max_tiles(num_rows, num_seqs, block_rows))))
    return MgpuTiling(block_rows, group, stages, splits)


def _padded_inputs(q, weights, k_cache):
    """Checks dtypes and pads for wgmma: N = heads % 8 == 0 and a K row of 32, 64 or a multiple of
    128 bytes (the swizzle); heads get weight 0, D zeros. No-op for the real Hi=64, D=128.

    Returns (q [N, Hi_p, D_p], weights [N, Hi_p] f32, k_cache [num_slots, D_p], swizzle bytes).
    """
    if q.dtype != k_cache.dtype or q.dtype not in (FP8_E4M3, jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"q and k_cache must both be float8_e4m3fn or bfloat16, got {q.dtype}, {k_cache.dtype}")
    _, hi, d = q.shape
    itemsize = q.dtype.itemsize
    row_bytes = d * itemsize
    if row_bytes <= 128:
        row_bytes = max(32, next_pow2(row_bytes))
    else:
        row_bytes = -(-row_bytes // 128) * 128
    hi_p, d_p = -(-hi // 8) * 8, row_bytes // itemsize
    weights = weights.astype(jnp.float32)
    if (hi_p, d_p) != (hi, d):
        q = jnp.pad(q, ((0, 0), (0, hi_p - hi), (0, d_p - d)))
        weights = jnp.pad(weights, ((0, 0), (0, hi_p - hi)))
        k_cache = jnp.pad(k_cache, ((0, 0), (0, d_p - d)))
    return q, weights, k_cache, min(128, row_bytes)


def _warpgroups(memory, compute):
    """Warp specialisation: warpgroup _COMPUTE_WGS streams keys with few registers (memory()); the
    compute warpgroups take the registers it gives up (compute(wg), wg in [0, _COMPUTE_WGS))."""
    wg = lax.axis_index("wg")

    @pl.when(wg == _COMPUTE_WGS)
    def _memory_wg():
        plgpu.set_max_registers(40, action="decrease")
        memory()

    @pl.when(wg < _COMPUTE_WGS)
    def _compute_wg():
        plgpu.set_max_registers(232, action="increase")
        compute(wg)


def _chunk_blocks(tile_end, first, chunk, step_blocks=1):
    """(first key block past the tile's last valid key tile_end, the chunk's key blocks to
    compute, pipeline steps of step_blocks blocks)."""
    stop = pl.cdiv(tile_end, BLOCK_KEYS)
    n_blocks = jnp.clip(stop - first, 0, chunk)
    return stop, n_blocks, n_blocks if step_blocks == 1 else pl.cdiv(n_blocks, step_blocks)


def _chunk_header(meta_smem, meta_bar, first, chunk, step_blocks=1):
    """Waits for the tile's metadata, then `_chunk_blocks` of its end (meta_smem[1])."""
    plgpu.barrier_wait(meta_bar)
    return _chunk_blocks(meta_smem[1], first, chunk, step_blocks)


def _load_tile_rows(meta_smem, q_ref, w_ref, q_smem, w_smem, q_bar, tile):
    """The tile's weights [BR, Hi] and the q of its rows (meta_smem[2 + j]; an empty row slot loads
    row 0, never stored: one arrival each) into SMEM, arriving on q_bar (1 + BR arrivals)."""
    plgpu.copy_gmem_to_smem(w_ref.at[tile], w_smem, q_bar)
    hi = q_ref.shape[1]
    for j in range(w_smem.shape[0]):
        plgpu.copy_gmem_to_smem(q_ref.at[jnp.maximum(meta_smem[2 + j], 0)], q_smem.at[pl.ds(j * hi, hi)], q_bar)


def _load_ring(n_steps, stages, consumed_bar, load, init_carry=None):
    """The memory warpgroup's loop: pipeline step s fills ring slot s % stages, from the second lap
    on once its compute warpgroup released it. load(step, slot[, carry]) issues the step's TMAs
    (arriving on the slot's barrier) [and returns the next carry]."""
    def body(step, *carry):
        slot = lax.rem(step, stages)

        @pl.when(step >= stages)
        def _():
            plgpu.barrier_wait(consumed_bar.at[slot])
            plgpu.commit_smem()  # order the consumer's reads (generic proxy) before TMA's writes

        return load(step, slot, *carry)

    pl.loop(0, n_steps, init_carry=init_carry)(body)


def _fill_tail_and_drain(rows, fill_smem, stop, first, chunk, out_blocks, out_block):
    """The memory warpgroup's end: -inf (fill_smem, 2 key blocks of SMEM) stored to out_block(row, b)
    for each of the tile's rows (row ids, -1 = none) and the chunk's key blocks b at or past
    `stop` (the tile's end) and before out_blocks; then waits until the stores have read SMEM
    (the writes land by kernel end)."""
    fill_smem[...] = jnp.full(fill_smem.shape, -jnp.inf, jnp.float32)
    plgpu.commit_smem()
    for row in rows:
        @pl.when(row >= 0)
        def _fill_row():
            @pl.loop(jnp.maximum(stop, first), jnp.minimum(first + chunk, out_blocks))
            def _fill(b):
                plgpu.copy_smem_to_gmem(fill_smem.at[:BLOCK_KEYS], out_block(row, b))
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _consume_ring(wg, n_steps, stages, q_bar, k_bar, consumed_bar, o_smem, compute, store, prologue=lambda: None):
    """Compute warpgroup wg's pipeline steps wg, wg + _COMPUTE_WGS, ...: once q (q_bar) has landed
    and state = prologue(), per step waits for its ring slot's keys and until the stores of its
    SMEM output tile (o_smem[wg, i % 2]) two steps back have read it, then
    compute(step, slot, out_tile, lane, state, release) fills out_tile (lane: [64] key offsets in
    the WGMMA row layout; release(): hands the slot back to the memory warpgroup once its keys
    are read) and store(step, out_tile) issues out_tile's TMA stores (one commit group)."""
    lane = plgpu.broadcasted_iota(jnp.int32, (BLOCK_KEYS,), 0, layout=plgpu.Layout.WGMMA.reduce(1))

    @pl.when(n_steps > 0)
    def _():
        plgpu.barrier_wait(q_bar)
        state = prologue()

        @pl.loop(0, (n_steps - wg + _COMPUTE_WGS - 1) // _COMPUTE_WGS)
        def _step(i):
            step = wg + _COMPUTE_WGS * i
            slot = lax.rem(step, stages)
            out_tile = o_smem.at[wg, lax.rem(i, 2)]
            plgpu.barrier_wait(k_bar.at[slot])
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # out_tile's stores of step i - 2

            def release():
                @pl.when(step + stages < n_steps)  # else no refill follows
                def _():
                    plgpu.barrier_arrive(consumed_bar.at[slot])

            compute(step, slot, out_tile, lane, state, release)
            plgpu.commit_smem()
            store(step, out_tile)
            plgpu.commit_smem_to_gmem_group()

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _row_logits(scores, w, k_scale, pos, row_end):
    """One row's logits of a key block: scores [bk, Hi] f32, w [Hi] f32, k_scale [bk] f32 or None,
    pos [bk] key positions -> [bk] sum_h w_h ReLU(scores_h) (x k_scale), -inf at pos >= row_end."""
    bk, hi = scores.shape
    logit = jnp.sum(jnp.maximum(scores, 0.0) * lax.broadcast_in_dim(w, (bk, hi), [1]), axis=1)
    if k_scale is not None:
        logit = logit * k_scale
    return jnp.where(pos < row_end, logit, -jnp.inf)


def _meta_width(block_rows):
    return -(-(2 + 2 * block_rows) // 4) * 4  # int32 row of 16-byte multiple (TMA)


def _ring_kernel(kernel, out_type, grid, name, interpret):
    """plgpu.kernel of a ring kernel body: grid (key chunks "split", row tiles "tile"), one memory
    and _COMPUTE_WGS compute warpgroups ("wg")."""
    return plgpu.kernel(
        kernel,
        out_type=out_type,
        grid=grid,
        grid_names=("split", "tile"),
        num_threads=_COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name=name,
    )


def _kernel(meta_ref, q_ref, w_ref, bt_ref, k_ref, *rest, tiling: MgpuTiling, page_size, chunk,
            swizzle):
    """meta [T, M] int32 (sequence, tile end, row ids, row ends); q [N, Hi, D]; w [T, BR, Hi] f32;
    bt [S, W] int32; k [slots, D]; k_scale [slots] f32 (if present); out [N, Lp] f32."""
    *ks_ref, out_ref = rest
    ks_ref = ks_ref[0] if ks_ref else None
    br, group, stages = tiling.block_rows, tiling.group, tiling.stages
    _, hi, d = q_ref.shape
    bk = BLOCK_KEYS
    out_blocks = out_ref.shape[1] // bk
    tile = lax.axis_index("tile")
    first = lax.axis_index("split") * chunk  # the chunk's first key block
    transforms = (plgpu.TilingTransform((8, swizzle // q_ref.dtype.itemsize)), plgpu.SwizzleTransform(swizzle))

    def body(meta_smem, q_smem, w_smem, k_smem, ks_smem, o_smem, fill_smem,
             meta_bar, q_bar, k_bar, consumed_bar):

        def memory():
            plgpu.copy_gmem_to_smem(meta_ref.at[tile], meta_smem, meta_bar)
            stop, _, n_steps = _chunk_header(meta_smem, meta_bar, first, chunk)
            seq = meta_smem[0]

            @pl.when(n_steps > 0)
            def _():
                _load_tile_rows(meta_smem, q_ref, w_ref, q_smem, w_smem, q_bar, tile)

            def block_slot(step):
                """Cache slot of the chunk's key block `step` (a block table read from GMEM)."""
                key = (first + jnp.minimum(step, chunk - 1)) * bk
                page = jnp.maximum(bt_ref[seq, jnp.minimum(key // page_size, bt_ref.shape[1] - 1)], 0)
                return page * page_size + lax.rem(key, page_size)

            def load_keys(step, slot, slot0):
                keys = pl.ds(pl.multiple_of(slot0, bk), bk)
                plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem.at[slot], k_bar.at[slot])
                if ks_ref is not None:
                    plgpu.copy_gmem_to_smem(ks_ref.at[keys], ks_smem.at[slot], k_bar.at[slot])
                return block_slot(step + 1)  # in flight while the next step waits for its slot

            _load_ring(n_steps, stages, consumed_bar, load_keys, init_carry=block_slot(0))
            _fill_tail_and_drain([meta_smem[2 + j] for j in range(br)], fill_smem, stop, first, chunk, out_blocks,
                                 lambda row, b: out_ref.at[row, pl.ds(b * bk, bk)])

        def compute(wg):
            _, _, n_steps = _chunk_header(meta_smem, meta_bar, first, chunk)

            def logits(step, slot, out_tile, lane, _, release):
                k_scale = None if ks_ref is None else plgpu.load(
                    ks_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
                pos = lane + (first + step) * bk
                for g in range(br // group):
                    rows = range(g * group, (g + 1) * group)

                    def mma(acc, rows=rows):  # the group's q rows side by side: N = group * Hi
                        plgpu.wgmma(acc, k_smem.at[slot], q_smem.at[pl.ds(rows[0] * hi, group * hi)].T)
                        plgpu.wgmma_wait(0)
                        return acc[...]

                    scores = pl.run_scoped(mma, plgpu.ACC((bk, group * hi), jnp.float32))
                    for r, j in enumerate(rows):
                        w = plgpu.load(w_smem.at[j], layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
                        out_tile[j] = _row_logits(scores[:, r * hi:(r + 1) * hi], w, k_scale, pos,
                                                  meta_smem[2 + br + j])
                release()

            def store(step, out_tile):
                for j in range(br):
                    row = meta_smem[2 + j]

                    @pl.when(row >= 0)
                    def _store():
                        plgpu.copy_smem_to_gmem(out_tile.at[j], out_ref.at[row, pl.ds((first + step) * bk, bk)],
                                                commit_group=False)

            _consume_ring(wg, n_steps, stages, q_bar, k_bar, consumed_bar, o_smem, logits, store)

        _warpgroups(memory, compute)

    pl.run_scoped(
        body,
        plgpu.SMEM((meta_ref.shape[1],), jnp.int32),
        plgpu.SMEM((br * hi, d), q_ref.dtype, transforms=transforms),
        plgpu.SMEM((br, hi), jnp.float32),
        plgpu.SMEM((stages, bk, d), q_ref.dtype, transforms=transforms),
        plgpu.SMEM((stages, bk), jnp.float32),
        plgpu.SMEM((_COMPUTE_WGS, 2, br, bk), jnp.float32),
        plgpu.SMEM((2 * bk,), jnp.float32),  # -inf; splat stores need a multiple of 128 elements
        plgpu.Barrier(num_arrivals=1),
        plgpu.Barrier(num_arrivals=br + 1),
        plgpu.Barrier(num_arrivals=1 if ks_ref is None else 2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        collective_axes="wg",
    )


def _tiles(row_seq, row_end, num_seqs, num_keys, block_rows):
    """Row tiles of one sequence each, heaviest (largest row_end) first.

    Returns meta [T, M] int32: (sequence, tile end, row ids (-1 = empty), row ends), and the row
    ids [T, BR] (to gather the weights)."""
    tile_rows, tile_meta = _tile_schedule(row_seq, row_end, num_seqs, num_keys, block_rows)
    order = jnp.argsort(-tile_meta[:, 1], stable=True)
    tile_rows, tile_meta = tile_rows[order], tile_meta[order]
    ends = jnp.where(tile_rows >= 0, jnp.clip(row_end.astype(jnp.int32)[jnp.maximum(tile_rows, 0)], 0, num_keys), 0)
    meta = jnp.concatenate([tile_meta, tile_rows, ends], axis=1)
    return jnp.pad(meta, ((0, 0), (0, _meta_width(block_rows) - meta.shape[1]))), tile_rows


def indexer_logits_mgpu(q, weights, k_cache, k_scale, block_tables, row_seq, row_end, *, page_size,
                        interpret=False, **tiling_overrides):
    """Indexer logits, Pallas Mosaic GPU kernel (Hopper). Same contract as
    `indexer_logits_reference`.

    q: [N, Hi, D] e4m3 or bf16; weights [N, Hi] f32; k_cache [num_slots, D] (same dtype as q);
    k_scale [num_slots] f32 or None; block_tables [S, W] int32; row_seq, row_end [N] int32.
    Returns [N, W * page_size] f32, -inf at positions >= row_end[n].
    tiling_overrides: block_rows, group, stages, splits (see `MgpuTiling`). interpret: run in
    the Mosaic GPU interpreter (CPU tests).
    """
    q, weights, k_cache, swizzle = _padded_inputs(q, weights, k_cache)
    n, hi_p, d_p = q.shape
    num_seqs, pages_per_seq = block_tables.shape
    num_keys = pages_per_seq * page_size
    if n == 0 or num_keys == 0:
        return jnp.full((n, num_keys), -jnp.inf, jnp.float32)
    block_tables = block_tables.astype(jnp.int32)
    key_blocks = pl.cdiv(num_keys, BLOCK_KEYS)
    if page_size % BLOCK_KEYS:
        # A key block would straddle pages: gather each sequence's keys into one contiguous
        # "page" of whole blocks first (XLA; the real cache has 64-token pages).
        pad = ((0, 0), (0, key_blocks * BLOCK_KEYS - num_keys))
        k_cache = jnp.pad(gather_paged_rows(k_cache, block_tables, page_size), pad + ((0, 0),))
        k_cache = k_cache.reshape(num_seqs * key_blocks * BLOCK_KEYS, d_p)
        if k_scale is not None:
            k_scale = jnp.pad(gather_paged_rows(k_scale, block_tables, page_size), pad).reshape(-1)
        block_tables = jnp.arange(num_seqs, dtype=jnp.int32)[:, None]
        page_size = key_blocks * BLOCK_KEYS
    tiling = choose_mgpu_tiling(n, num_seqs, key_blocks, q.dtype, hi_p, d_p, **tiling_overrides)
    chunk = pl.cdiv(key_blocks, tiling.splits)

    meta, tile_rows = _tiles(row_seq, row_end, num_seqs, num_keys, tiling.block_rows)
    tile_weights = jnp.where(tile_rows[..., None] >= 0, weights[jnp.maximum(tile_rows, 0)], 0.0)
    args = [meta, q, tile_weights, block_tables, k_cache]
    if k_scale is not None:
        args.append(k_scale.astype(jnp.float32))
    kernel = _ring_kernel(
        functools.partial(_kernel, tiling=tiling, page_size=page_size, chunk=chunk, swizzle=swizzle),
        jax.ShapeDtypeStruct((n, key_blocks * BLOCK_KEYS), jnp.float32), (tiling.splits, meta.shape[0]),
        "indexer_logits_mgpu", interpret)
    out = kernel(*args)
    return out if out.shape[1] == num_keys else out[:, :num_keys]
