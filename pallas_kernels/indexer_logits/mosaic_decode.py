"""Lightning-indexer decode logits: a Pallas Mosaic GPU kernel (Hopper TMA + wgmma), bandwidth-bound.

Same contract as `reference.indexer_logits_reference`:
    logits[n, s] = sum_h weights[n, h] * relu(q[n, h] . k[s]) * k_scale[s]   for s < row_end[n]
and -inf elsewhere, keys addressed by position s of the row's sequence through its block table.
For 1-2 query rows a sequence: rows are grouped by sequence into tiles of block_rows (1, or 2 for
MTP) rows, one CTA per (tile, chunk of 64-key blocks); a memory warpgroup holds the chunk's
block-table slice in SMEM and streams the key blocks and their scales by TMA through a ring of
SMEM slots, and two compute warpgroups take alternate slots. Nothing of size [rows, Hi, keys]
exists outside registers.

Why a kernel of its own: every key byte is read once for ~124 flop (fp8, one row), so the kernel
is a stream over the key cache whose speed is the bytes it keeps in flight: batches of 32+ rows
reach ~90% of a same-size copy, a single sequence ~70% (latency-bound). Layout and measured
variants: docs/design/indexer.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .. import device
from .layout import gather_paged_rows, tile_schedule
from .mosaic_common import (
    BLOCK_KEYS,
    COMPUTE_WGS,
    FILL_BLOCKS,
    MAX_STAGES,
    chunk_blocks,
    chunk_header,
    consume_ring,
    drain_ring,
    fill_tail_and_drain,
    load_ring,
    load_tile_rows,
    meta_width,
    padded_inputs,
    ring_kernel,
    row_logits,
    warpgroups,
)

_KEY_RING_BYTES = 96 * 1024  # SMEM for key blocks in flight per CTA (one CTA per SM)
_SHORT_CHUNK_STEPS, _SHORT_CHUNK_STAGES = 8, 4  # a CTA of <= 8 steps keeps <= 4 in flight
_STEP_BYTES = 16 * 1024  # keys x rows per ring slot: 2 fp8 blocks of 1 row
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


def choose_decode_tiling(num_rows, num_seqs, key_blocks, dtype, hi, d, *, block_rows=None, chunk=None,
                         step_blocks=None, stages=None, num_sms=None) -> DecodeTiling:
    """block_rows: the rows per sequence (rounded up to a power of two, N <= 256). chunk: the
    multiple of 4 that minimises waves * (chunk + per-CTA overhead) over the grid of
    tiles x ceil(key_blocks / chunk) CTAs. step_blocks: _STEP_BYTES of keys per slot and tile row
    (2 blocks at fp8 and one row; 1 at bf16 or two rows, whose wgmmas already hold twice the
    registers and work per block). stages: as many slots as _KEY_RING_BYTES holds (even), at most
    MAX_STAGES (small dims: tiny slots), and at most _SHORT_CHUNK_STAGES for a chunk of at most
    _SHORT_CHUNK_STEPS steps: when every CTA requests its whole ring at once and holds few steps
    (B=1 at 128K), a shallower ring queues less; long chunks (B=32/128) need the deeper one."""
    rows_per_seq = num_rows / max(1, min(num_seqs, num_rows))
    if block_rows is None:
        block_rows = 1 if rows_per_seq < 1.5 else min(1 << (int(rows_per_seq + 0.5) - 1).bit_length(),
                                                      max(1, 256 // hi))
    if block_rows * hi > 256:
        raise ValueError(f"block_rows * heads = {block_rows * hi} > 256 (wgmma N)")
    if chunk is None:
        tiles = -(-num_rows // block_rows)  # busy tiles when rows split evenly (the rest exit at once)
        sms = num_sms or device.num_sms()
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
        stages = max(2, min(MAX_STAGES, _KEY_RING_BYTES // slot_bytes) // 2 * 2)
        if -(-chunk // step_blocks) <= _SHORT_CHUNK_STEPS:
            stages = min(stages, _SHORT_CHUNK_STAGES)
    if stages % COMPUTE_WGS or stages > MAX_STAGES:
        raise ValueError(f"stages={stages} must be a multiple of {COMPUTE_WGS} and at most {MAX_STAGES} "
                         "(mbarriers per group)")
    return DecodeTiling(block_rows, chunk, step_blocks, stages)


def _kernel(*refs, tiling: DecodeTiling, swizzle, num_keys, scaled, clean):
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
        """(tile rows (-1 = none), their ends, `chunk_blocks` of the tile's end)."""
        if br == 1:
            end = row_end()
            return [tile], [end], chunk_blocks(end, first, chunk, sb)
        meta_smem, meta_bar = meta
        blocks = chunk_header(meta_smem, meta_bar, first, chunk, sb)
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
                load_tile_rows(meta_smem, q_ref, w_ref, q_smem, w_smem, q_bar, tile)

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

            load_ring(n_steps, stages, consumed_bar, load_keys)
            fill_tail_and_drain(rows, fill_smem, stop, first, chunk, out_blocks,
                                lambda row, b, n: plgpu.copy_smem_to_gmem(fill_smem.at[:n], out_ref.at[row, pl.ds(b, n)]),
                                clean=clean)
            drain_ring(n_steps, stages, consumed_bar)

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
                        out_tile[b, j] = row_logits(scores[b][:, j * hi:(j + 1) * hi], ws[j], k_scales[b], pos,
                                                     ends[j], chain=False)

            def store(step, out_tile):
                for b in range(sb):
                    block = step * sb + b
                    for j, row in enumerate(rows):
                        @pl.when((row >= 0) & (block < n_blocks))
                        def _store():
                            plgpu.copy_smem_to_gmem(out_tile.at[b, j], out_ref.at[row, first + block],
                                                    commit_group=False)

            consume_ring(wg, n_steps, stages, q_bar, k_bar, consumed_bar, o_smem, logits, store, row_weights)

        warpgroups(memory, compute)

    pl.run_scoped(
        body,
        None if br == 1 else (plgpu.SMEM((meta_width(br),), jnp.int32), plgpu.Barrier(num_arrivals=1)),
        plgpu.SMEM((chunk,), jnp.int32),
        plgpu.SMEM((br * hi, d), q_ref.dtype, transforms=transforms),
        plgpu.SMEM((br, hi), jnp.float32),
        plgpu.SMEM((stages, sb, bk, d), q_ref.dtype, transforms=transforms),
        plgpu.SMEM((stages, sb, bk), jnp.float32),
        plgpu.SMEM((COMPUTE_WGS, 2, sb, br, bk), jnp.float32),
        plgpu.SMEM((FILL_BLOCKS, bk), jnp.float32),  # -inf
        plgpu.Barrier(num_arrivals=1),
        plgpu.Barrier(num_arrivals=br + 1),
        plgpu.Barrier(num_arrivals=sb * (2 if scaled else 1), num_barriers=stages),
        plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        collective_axes="wg",
    )


def _mtp_tiles(row_seq, row_end, num_seqs, num_keys, block_rows):
    """Tiles of block_rows rows of one sequence: meta [T, M] int32 (sequence, tile end, row ids
    (-1 = empty), row ends) and row ids [T, BR]."""
    tile_rows, tile_meta = tile_schedule(row_seq, row_end, num_seqs, num_keys, block_rows)
    ends = jnp.where(tile_rows >= 0, jnp.clip(row_end.astype(jnp.int32)[jnp.maximum(tile_rows, 0)], 0, num_keys), 0)
    meta = jnp.concatenate([tile_meta, tile_rows, ends], axis=1)
    return jnp.pad(meta, ((0, 0), (0, meta_width(block_rows) - meta.shape[1]))), tile_rows


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


def indexer_logits_mosaic_decode(q, weights, k_cache, k_scale, block_tables, row_seq, row_end, *,
                               page_size, clean=True, interpret=False, **tiling_overrides):
    """Indexer logits for decode-shaped batches (1-2 rows per sequence, long contexts), Pallas
    Mosaic GPU kernel (Hopper). Same contract as `indexer_logits_reference`.

    q: [N, Hi, D] e4m3 or bf16; weights [N, Hi] f32; k_cache [num_slots, D] (same dtype as q);
    k_scale [num_slots] f32 or None; block_tables [S, W] int32; row_seq, row_end [N] int32.
    Returns [N, W * page_size] f32, -inf at positions >= row_end[n] (clean=False: past the row's
    tile's last computed key block unwritten, see `api`).
    tiling_overrides: block_rows, chunk, step_blocks, stages, num_sms (see `choose_decode_tiling`).
    interpret: run in the Mosaic GPU interpreter (CPU tests; eager only, it deadlocks under jit,
    and on a 2-core host once the key ring wraps unless PJRT_NPROC raises XLA's CPU thread count).
    """
    q, weights, k_cache, swizzle = padded_inputs(q, weights, k_cache)
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
    kernel = ring_kernel(functools.partial(_kernel, tiling=tiling, swizzle=swizzle, num_keys=num_keys, clean=clean,
                                            scaled=k_scale is not None),
                          jax.ShapeDtypeStruct((n, key_blocks, BLOCK_KEYS), jnp.float32), (splits, num_tiles),
                          "indexer_logits_decode_mgpu", interpret)
    out = kernel(*args).reshape(n, key_blocks * BLOCK_KEYS)
    return out if out.shape[1] == num_keys else out[:, :num_keys]
