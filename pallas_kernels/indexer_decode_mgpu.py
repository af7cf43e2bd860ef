"""Lightning-indexer decode logits: a Pallas Mosaic GPU kernel (Hopper TMA + wgmma), bandwidth-bound.

Same contract as `pallas_kernels.indexer.indexer_logits_reference`:
    logits[n, s] = sum_h weights[n, h] * relu(q[n, h] . k[s]) * k_scale[s]   for s < row_end[n]
and -inf elsewhere, keys addressed by position s of the row's sequence through its block table.

Decode has 1-2 query rows per sequence and up to 128K keys each: every key byte is read once and
feeds only 2 * rows * Hi * D flops (~124 flop/byte at fp8, one row), so the kernel is a stream
over the key cache and its speed is the bytes it keeps in flight. Layout of the work:
  * rows are grouped by sequence into tiles of block_rows rows (1: every row its own tile, no
    sort; 2 for MTP, whose rows then share one read of the keys); the key axis is cut into
    64-key blocks (the cache's pages; other page sizes are mapped to 64-key pages first) and
    into chunks of `chunk` blocks, one CTA per (tile, chunk), with `chunk` picked so the CTAs
    fill whole waves of the GPU's SMs;
  * a memory warpgroup holds the chunk's block-table slice in SMEM, so no page lookup waits on
    GMEM. With one row per tile the kernel reads the row's sequence and end itself (no XLA op
    runs before it) and loads, at once, the row's q, weights and the table slice of sequence
    `tile` (rows in sequence order, one per sequence: the usual decode batch), reloading the
    slice when the row's sequence is another; with two rows per tile (MTP) the wrapper's tile
    schedule (XLA) gives the tile's metadata and gathers its sequence's table row. It then
    streams key blocks [64, D] and their scales by TMA into a ring of `stages` SMEM slots of
    `step_blocks` blocks each (96 KiB of keys in flight per SM; 64 KiB for a CTA of at most 8
    steps), and writes -inf over the chunk's blocks at or past the tile's last valid key;
  * two compute warpgroups take alternate slots: per block one wgmma [64 keys, D] x
    [D, block_rows * Hi] (the tile's q side by side, SMEM), then per row ReLU, the
    head-weighted sum as a row reduction of the WGMMA layout, key scales and the ragged mask;
    64 logits per row and block go out by TMA from a double-buffered SMEM tile.
Nothing of size [rows, Hi, keys] exists outside registers.

Measured on the H200 (fp8 keys + scales, 64 heads x 128, shuffled pages of 64, one row per
sequence; scripts/bench_indexer.py: 20 dependent calls unrolled in one jit over L2-cold copies of
the cache, one CUDA graph with the Mosaic calls; "alone" = the kernel's own device time in a
profiler trace of that chain, against the copy fusion alone on the same bytes, the like-for-like
number the 70% target is read against; without XLA command buffers each Mosaic launch costs ~8 us
of host time):
  * Why Mosaic GPU: B=32 C=32K reads 3291 GB/s of key bytes a call (81% of the copy in the same
    run); the Triton-backend kernel 595 GB/s (one program per (row, chunk), vector loads, one
    table load per key); a decode tiling of the Mosaic prefill kernel 521-555 GB/s (its page id
    read from GMEM just before each block's TMA). Alone (session 7): B=32 C=32K 38.1-38.6 us,
    B=128 C=32K 145 us (3.6-3.8 TB/s, 87-90% of the copy alone).
  * B=1 C=128K (17.3 MB) is latency-bound: alone 6.86-6.90 us, 70.5% of the copy alone (3.56
    TB/s) in session 9's bench (6.97-7.04 us, 68.8-70.0%, in session 7's runs; the 1.2% came from
    one-row tiles no longer allocating the two-row tiles' metadata buffer and barrier, 6.86 vs
    6.94 us in 5 interleaved rounds, a layout change rather than less work). Its timeline (Mosaic GPU profiler, one L2-cold
    call, medians / max over the 128 CTAs): table slice in at 0.9 us, first keys requested at
    1.1 and landed at 2.8 (max 4.2: every CTA requests its ring at once), last keys requested at
    4.9 (max 5.8), last logits at 6.7 (max 7.6); a compute step (2 blocks) is 0.38 us of math
    and 0.14 of stores. More or fewer CTAs are slower (64: 11.0 us, 256: 9.6, 128: 7.5, warm L2).
    Reading the row metadata and the table in the kernel (not in an XLA fusion before it) took
    the kernel alone from 7.87 to 7.25 us.
  * Tiling: 2 blocks per slot (B=32 C=32K 81% vs 76% of copy with 1); a CTA of at most 8 steps
    keeps 4 slots in flight, not 6 (B=1 C=128K alone 7.01 vs 7.26 us), while long chunks need 6
    (4 slots: B=32 C=32K, B=32 C=128K, B=128 C=32K 4.5-4.7% slower).
  * The key scales (3% of the bytes, 2048 copies of 256 B at B=1 C=128K) cost their bytes and no
    more: without them (a diagnostic) B=1 C=128K is 3.2% faster alone (6.82 vs 7.04 us); stored
    right after their page's keys (a cache layout change, still a copy each) 7.01 (noise).
  Measured and not kept (B=1 C=128K alone unless said; outputs identical to the kernel's): the
  scales read by the compute warpgroups with plain loads from GMEM, one step ahead +8.6% (B=32
  C=32K +9.5%) or issued with their step's keys +3.2% (B=32 +4.3%, B=128 +2.3%); the chunk's last
  2 blocks as two 1-block steps, one per compute warpgroup, +3.2% (with page ids read before the
  copies +3.9%, with one store per 2-block step +3.4%; B=32 +1.3%); the chunk's steps beyond the
  ring prefetched into L2 (TMA prefetch) once its first keys landed +9.3%, at once +9.8%, with a
  2-slot ring +30%; compute warpgroups taking steps in the order their keys land +15% a call;
  the first steps' page ids by plain loads, their keys issued before the table's TMA lands +7%
  a call; the scales on a barrier of their own 7.38 vs 7.30 us; one block per slot 7.41 / 7.36 /
  7.26 / 7.68 us with 12 / 8 / 6 / 4 slots vs 6.98; a 32 KiB ring 8.61 us; a ring holding the
  whole chunk +1% a call. Pages in order instead of shuffled: -2.7% a call. Session 9: the scales
  copied by the compute warpgroups' own cp.async (16 bytes a lane, 8 lanes a warp per step, two
  own steps ahead into a 3-deep buffer, a warp sync before reading: no scale TMAs at all) +2.5%
  at B=1 C=128K (7.15 vs 6.98 us), +2.3% at B=32 C=32K, +1.4% at B=128 C=128K; the same run
  without scales (their bytes too) 6.82 us, 71% of the copy: the scales are not what holds B=1
  below 70%.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .indexer_layout import _tile_schedule, gather_paged_rows
from .indexer_mgpu import (
    _COMPUTE_WGS,
    BLOCK_KEYS,
    _chunk_blocks,
    _chunk_header,
    _consume_ring,
    _fill_tail_and_drain,
    _load_ring,
    _load_tile_rows,
    _meta_width,
    _padded_inputs,
    _ring_kernel,
    _row_logits,
    _warpgroups,
)

_KEY_RING_BYTES = 96 * 1024  # SMEM for key blocks in flight per CTA (one CTA per SM)
_SHORT_CHUNK_STEPS, _SHORT_CHUNK_STAGES = 8, 4  # a CTA of <= 8 steps keeps <= 4 in flight (B=1 C=128K: faster)
_MAX_STAGES = 32  # Mosaic GPU initialises at most 32 mbarriers per group (the ring's two groups)
_STEP_BYTES = 16 * 1024  # keys x rows per ring slot: 2 fp8 blocks of 1 row (81% vs 76% of copy BW with 1)
_MAX_CHUNK = 256  # key blocks per CTA: its block-table slice is one TMA box (<= 256 per dim)
_CTA_OVERHEAD_BLOCKS = 4  # a CTA's start/drain, in key blocks of streaming time (chunk cost model)


@dataclasses.dataclass(frozen=True)
class DecodeTiling:
    """block_rows: rows of one sequence per CTA (one wgmma, N = block_rows * Hi <= 256);
    chunk: key blocks (of 64) per CTA, a multiple of 4 up to 256 (its block-table slice is one TMA);
    step_blocks: key blocks per pipeline step (one ring slot, one barrier round trip, one
    wgmma per block); stages: ring slots (even: the two compute warpgroups alternate)."""
    block_rows: int
    chunk: int
    step_blocks: int
    stages: int


def _num_sms():
    return getattr(jax.devices()[0], "core_count", None) or 132


def choose_decode_tiling(num_rows, num_seqs, key_blocks, dtype, hi, d, *, block_rows=None, chunk=None,
                         step_blocks=None, stages=None, num_sms=None) -> DecodeTiling:
    """block_rows: the rows per sequence (rounded up to a power of two, N <= 256). chunk: the
    multiple of 4 that minimises waves * (chunk + per-CTA overhead) over the grid of
    tiles x ceil(key_blocks / chunk) CTAs. step_blocks: _STEP_BYTES of keys per slot and tile row
    (2 blocks at fp8 and one row; 1 at bf16 or two rows, whose wgmmas already hold twice the
    registers and work per block). stages: as many slots as _KEY_RING_BYTES holds (even), at most
    _MAX_STAGES (small dims: tiny slots), and at most _SHORT_CHUNK_STAGES for a chunk of at most
    _SHORT_CHUNK_STEPS steps: when every CTA requests its whole ring at once and holds few steps
    (B=1 at 128K), a shallower ring queues less (H200: 7.01 vs 7.26 us a call alone); long chunks
    (B=32/128) need the deeper one (4 slots there: 4.5-4.7% slower)."""
    rows_per_seq = num_rows / max(1, min(num_seqs, num_rows))
    if block_rows is None:
        block_rows = 1 if rows_per_seq < 1.5 else min(1 << (int(rows_per_seq + 0.5) - 1).bit_length(),
                                                      max(1, 256 // hi))
    if block_rows * hi > 256:
        raise ValueError(f"block_rows * heads = {block_rows * hi} > 256 (wgmma N)")
    if chunk is None:
        tiles = -(-num_rows // block_rows)  # busy tiles when rows split evenly (the rest exit at once)
        sms = num_sms or _num_sms()
        best = None
        for c in range(4, min(_MAX_CHUNK, -(-key_blocks // 4) * 4) + 1, 4):
            waves = -(-tiles * -(-key_blocks // c) // sms)
            cost = (waves * (c + _CTA_OVERHEAD_BLOCKS), -c)
            if best is None or cost < best[0]:
                best = (cost, c)
        chunk = best[1]
    if chunk % 4 or not 4 <= chunk <= _MAX_CHUNK:
        raise ValueError(f"chunk={chunk} must be a multiple of 4 in [4, {_MAX_CHUNK}] (the block-table "
                         "slice is one TMA box of 16-byte multiple)")
    block_bytes = BLOCK_KEYS * d * jnp.dtype(dtype).itemsize
    step_blocks = step_blocks or max(1, _STEP_BYTES // (block_bytes * block_rows))
    if stages is None:
        slot_bytes = step_blocks * block_bytes
        stages = max(2, min(_MAX_STAGES, _KEY_RING_BYTES // slot_bytes) // 2 * 2)
        if -(-chunk // step_blocks) <= _SHORT_CHUNK_STEPS:
            stages = min(stages, _SHORT_CHUNK_STAGES)
    if stages % _COMPUTE_WGS or stages > _MAX_STAGES:
        raise ValueError(f"stages={stages} must be a multiple of {_COMPUTE_WGS} and at most {_MAX_STAGES} "
                         "(mbarriers per group)")
    return DecodeTiling(block_rows, chunk, step_blocks, stages)


def _kernel(*refs, tiling: DecodeTiling, swizzle, num_keys, scaled):
    """One row per tile (block_rows 1): row_seq [N], row_end [N] int32 read by the kernel itself,
    bt [S, Wp] int32 (the sequences' 64-key pages, Wp a multiple of chunk). Else: meta [T, M]
    int32 (sequence, tile end, row ids, row ends), bt [T, Wp] (each tile's sequence's row,
    gathered by the wrapper). Then q [N, Hi, D]; w [T, BR, Hi] f32; k [slots, D]; k_scale [slots]
    f32 (if scaled); out [N, KB, 64] f32 (KB key blocks)."""
    br, chunk, sb, stages = tiling.block_rows, tiling.chunk, tiling.step_blocks, tiling.stages
    if br == 1:
        row_seq_ref, row_end_ref, q_ref, w_ref, bt_ref, k_ref, *rest = refs
    else:
        meta_ref, q_ref, w_ref, bt_ref, k_ref, *rest = refs
    ks_ref, out_ref = rest if scaled else (None, *rest)
    _, hi, d = q_ref.shape
    bk = BLOCK_KEYS
    out_blocks = out_ref.shape[1]
    tile = lax.axis_index("tile")
    first = lax.axis_index("split") * chunk  # the chunk's first key block
    transforms = (plgpu.TilingTransform((8, swizzle // q_ref.dtype.itemsize)), plgpu.SwizzleTransform(swizzle))

    def row_end():  # one row per tile: the tile is the row, its end read from GMEM (no barrier)
        return jnp.clip(row_end_ref[tile], 0, num_keys)

    def tile_header(meta):
        """(tile rows (-1 = none), their ends, `_chunk_blocks` of the tile's end)."""
        if br == 1:
            end = row_end()
            return [tile], [end], _chunk_blocks(end, first, chunk, sb)
        meta_smem, meta_bar = meta
        blocks = _chunk_header(meta_smem, meta_bar, first, chunk, sb)
        return [meta_smem[2 + j] for j in range(br)], [meta_smem[2 + br + j] for j in range(br)], blocks

    def body(meta, bt_smem, q_smem, w_smem, k_smem, ks_smem, o_smem, fill_smem, bt_bar, q_bar, k_bar, consumed_bar):
        """meta: (meta_smem, meta_bar), the tile's metadata row and its barrier; None for one row a tile."""

        def one_row_prologue():
            """One row per tile: its q, weights and the block-table slice of sequence `tile` (rows in
            sequence order, one per sequence: the usual decode batch) go out at once, the slice
            reloaded if the row's sequence is another. -> (rows, stop, n_blocks, n_steps)."""
            guess = jnp.minimum(tile, bt_ref.shape[0] - 1)
            plgpu.copy_gmem_to_smem(bt_ref.at[guess, pl.ds(first, chunk)], bt_smem, bt_bar)
            plgpu.copy_gmem_to_smem(w_ref.at[tile], w_smem, q_bar)
            plgpu.copy_gmem_to_smem(q_ref.at[tile], q_smem, q_bar)
            seq = jnp.clip(row_seq_ref[tile], 0, bt_ref.shape[0] - 1)
            rows, _, (stop, n_blocks, n_steps) = tile_header(meta)

            @pl.when(n_steps == 0)  # no compute warpgroup waits for q then: drain it before exit
            def _drain_q():
                plgpu.barrier_wait(q_bar)

            plgpu.barrier_wait(bt_bar)

            @pl.when((seq != guess) & (n_steps > 0))
            def _reload_table():
                plgpu.copy_gmem_to_smem(bt_ref.at[seq, pl.ds(first, chunk)], bt_smem, bt_bar)
                plgpu.barrier_wait(bt_bar)

            return rows, stop, n_blocks, n_steps

        def mtp_prologue():
            """Rows of one sequence per tile: the tile's metadata and table slice go out at once, its
            rows' q and weights once the metadata is in. -> (rows, stop, n_blocks, n_steps)."""
            meta_smem, meta_bar = meta
            plgpu.copy_gmem_to_smem(meta_ref.at[tile], meta_smem, meta_bar)
            plgpu.copy_gmem_to_smem(bt_ref.at[tile, pl.ds(first, chunk)], bt_smem, bt_bar)
            rows, _, (stop, n_blocks, n_steps) = tile_header(meta)

            @pl.when(n_steps > 0)
            def _():
                _load_tile_rows(meta_smem, q_ref, w_ref, q_smem, w_smem, q_bar, tile)

            plgpu.barrier_wait(bt_bar)
            return rows, stop, n_blocks, n_steps

        def memory():
            # Keys wait only for the chunk's table slice, held in SMEM: no page lookup waits on GMEM.
            rows, stop, n_blocks, n_steps = one_row_prologue() if br == 1 else mtp_prologue()

            def load_keys(step, slot):
                for b in range(sb):
                    block = jnp.minimum(step * sb + b, n_blocks - 1)  # a short last step repeats its last block
                    keys = pl.ds(pl.multiple_of(jnp.maximum(bt_smem[block], 0) * bk, bk), bk)
                    plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem.at[slot, b], k_bar.at[slot])
                    if scaled:
                        plgpu.copy_gmem_to_smem(ks_ref.at[keys], ks_smem.at[slot, b], k_bar.at[slot])

            _load_ring(n_steps, stages, consumed_bar, load_keys)
            _fill_tail_and_drain(rows, fill_smem, stop, first, chunk, out_blocks, lambda row, b: out_ref.at[row, b])

        def compute(wg):
            rows, ends, (_, n_blocks, n_steps) = tile_header(meta)

            def row_weights():
                return [plgpu.load(w_smem.at[j], layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
                        for j in range(br)]

            def logits(step, slot, out_tile, lane, ws, release):
                def mma(*accs):  # per block, the tile's q rows side by side: N = block_rows * Hi
                    for b, acc in enumerate(accs):
                        plgpu.wgmma(acc, k_smem.at[slot, b], q_smem.T)
                    plgpu.wgmma_wait(0)
                    return [acc[...] for acc in accs]

                scores = pl.run_scoped(mma, *[plgpu.ACC((bk, br * hi), jnp.float32)] * sb)
                k_scales = [None if not scaled else plgpu.load(
                    ks_smem.at[slot, b], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False) for b in range(sb)]
                release()  # the slot's keys and scales are in registers: it may be refilled
                for b in range(sb):
                    pos = lane + (first + step * sb + b) * bk
                    for j in range(br):
                        out_tile[b, j] = _row_logits(scores[b][:, j * hi:(j + 1) * hi], ws[j], k_scales[b], pos,
                                                     ends[j])

            def store(step, out_tile):
                for b in range(sb):
                    block = step * sb + b
                    for j, row in enumerate(rows):
                        @pl.when((row >= 0) & (block < n_blocks))
                        def _store():
                            plgpu.copy_smem_to_gmem(out_tile.at[b, j], out_ref.at[row, first + block],
                                                    commit_group=False)

            _consume_ring(wg, n_steps, stages, q_bar, k_bar, consumed_bar, o_smem, logits, store, row_weights)

        _warpgroups(memory, compute)

    pl.run_scoped(
        body,
        None if br == 1 else (plgpu.SMEM((_meta_width(br),), jnp.int32), plgpu.Barrier(num_arrivals=1)),
        plgpu.SMEM((chunk,), jnp.int32),
        plgpu.SMEM((br * hi, d), q_ref.dtype, transforms=transforms),
        plgpu.SMEM((br, hi), jnp.float32),
        plgpu.SMEM((stages, sb, bk, d), q_ref.dtype, transforms=transforms),
        plgpu.SMEM((stages, sb, bk), jnp.float32),
        plgpu.SMEM((_COMPUTE_WGS, 2, sb, br, bk), jnp.float32),
        plgpu.SMEM((2 * bk,), jnp.float32),  # -inf; splat stores need a multiple of 128 elements
        plgpu.Barrier(num_arrivals=1),
        plgpu.Barrier(num_arrivals=br + 1),
        plgpu.Barrier(num_arrivals=sb * (2 if scaled else 1), num_barriers=stages),
        plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        collective_axes="wg",
    )


def _mtp_tiles(row_seq, row_end, num_seqs, num_keys, block_rows):
    """Tiles of block_rows rows of one sequence: meta [T, M] int32 (sequence, tile end, row ids
    (-1 = empty), row ends) and row ids [T, BR]."""
    tile_rows, tile_meta = _tile_schedule(row_seq, row_end, num_seqs, num_keys, block_rows)
    ends = jnp.where(tile_rows >= 0, jnp.clip(row_end.astype(jnp.int32)[jnp.maximum(tile_rows, 0)], 0, num_keys), 0)
    meta = jnp.concatenate([tile_meta, tile_rows, ends], axis=1)
    return jnp.pad(meta, ((0, 0), (0, _meta_width(block_rows) - meta.shape[1]))), tile_rows


def _pages_of_64(k_cache, k_scale, block_tables, page_size):
    """The cache as 64-key pages: (k_cache, k_scale, block_tables [S, KB]). Pages of a multiple
    of 64 keys are split (a table op); other page sizes are gathered into contiguous sequences
    first (XLA; the real cache has 64-key pages, a no-op)."""
    num_seqs, width = block_tables.shape
    bk = BLOCK_KEYS
    if page_size % bk == 0:
        per_page = page_size // bk
        if per_page > 1:
            pages = jnp.maximum(block_tables, 0)[:, :, None] * per_page + jnp.arange(per_page, dtype=jnp.int32)
            block_tables = pages.reshape(num_seqs, width * per_page)
        return k_cache, k_scale, block_tables
    num_keys = width * page_size
    key_blocks = pl.cdiv(num_keys, bk)
    pad = ((0, 0), (0, key_blocks * bk - num_keys))
    k_cache = jnp.pad(gather_paged_rows(k_cache, block_tables, page_size), pad + ((0, 0),))
    k_cache = k_cache.reshape(num_seqs * key_blocks * bk, k_cache.shape[-1])
    if k_scale is not None:
        k_scale = jnp.pad(gather_paged_rows(k_scale, block_tables, page_size), pad).reshape(-1)
    block_tables = jnp.arange(num_seqs * key_blocks, dtype=jnp.int32).reshape(num_seqs, key_blocks)
    return k_cache, k_scale, block_tables


def indexer_logits_decode_mgpu(q, weights, k_cache, k_scale, block_tables, row_seq, row_end, *,
                               page_size, interpret=False, **tiling_overrides):
    """Indexer logits for decode-shaped batches (1-2 rows per sequence, long contexts), Pallas
    Mosaic GPU kernel (Hopper). Same contract as `indexer_logits_reference`.

    q: [N, Hi, D] e4m3 or bf16; weights [N, Hi] f32; k_cache [num_slots, D] (same dtype as q);
    k_scale [num_slots] f32 or None; block_tables [S, W] int32; row_seq, row_end [N] int32.
    Returns [N, W * page_size] f32, -inf at positions >= row_end[n].
    tiling_overrides: block_rows, chunk, step_blocks, stages, num_sms (see `choose_decode_tiling`).
    interpret: run in the Mosaic GPU interpreter (CPU tests; eager only, it deadlocks under jit,
    and on a 2-core host once the key ring wraps unless PJRT_NPROC raises XLA's CPU thread count).
    """
    q, weights, k_cache, swizzle = _padded_inputs(q, weights, k_cache)
    n, hi_p, d_p = q.shape
    num_seqs, width = block_tables.shape
    num_keys = width * page_size
    if n == 0 or num_keys == 0:
        return jnp.full((n, num_keys), -jnp.inf, jnp.float32)
    k_cache, k_scale, block_tables = _pages_of_64(k_cache, k_scale, block_tables.astype(jnp.int32), page_size)
    key_blocks = block_tables.shape[1]
    tiling = choose_decode_tiling(n, num_seqs, key_blocks, q.dtype, hi_p, d_p, **tiling_overrides)
    splits = pl.cdiv(key_blocks, tiling.chunk)
    if splits * tiling.chunk != key_blocks:  # every chunk's block-table slice is in bounds
        block_tables = jnp.pad(block_tables, ((0, 0), (0, splits * tiling.chunk - key_blocks)))

    if tiling.block_rows == 1:  # the tile is the row: the kernel reads row_seq, row_end and the table
        args, num_tiles = [row_seq.astype(jnp.int32), row_end.astype(jnp.int32), q, weights[:, None, :],
                           block_tables], n
    else:
        meta, tile_rows = _mtp_tiles(row_seq, row_end, num_seqs, num_keys, tiling.block_rows)
        tile_weights = jnp.where(tile_rows[..., None] >= 0, weights[jnp.maximum(tile_rows, 0)], 0.0)
        # [T, Wp]: each tile's table row, loaded by the kernel without waiting for meta
        args, num_tiles = [meta, q, tile_weights, block_tables[meta[:, 0]]], meta.shape[0]
    args.append(k_cache)
    if k_scale is not None:
        args.append(k_scale.astype(jnp.float32))
    kernel = _ring_kernel(functools.partial(_kernel, tiling=tiling, swizzle=swizzle, num_keys=num_keys,
                                            scaled=k_scale is not None),
                          jax.ShapeDtypeStruct((n, key_blocks, BLOCK_KEYS), jnp.float32), (splits, num_tiles),
                          "indexer_logits_decode_mgpu", interpret)
    out = kernel(*args).reshape(n, key_blocks * BLOCK_KEYS)
    return out if out.shape[1] == num_keys else out[:, :num_keys]
