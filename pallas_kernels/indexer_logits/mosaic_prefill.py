"""Lightning-indexer logits: a Pallas Mosaic GPU kernel (Hopper wgmma, TMA, warp specialisation).

Same contract as `reference.indexer_logits_reference`:
    logits[n, s] = sum_h weights[n, h] * relu(q[n, h] . k[s]) * k_scale[s]   for s < row_end[n]
and -inf elsewhere, keys addressed by position s of the row's sequence through its block table.
For batches of many rows a sequence (prefill); decode-shaped batches go to `mosaic_decode`.

A persistent grid of one CTA an SM takes (row tile, key chunk) items, heaviest tile first; a
memory warpgroup streams 64-key blocks from the paged cache into an SMEM ring by TMA (page_size %
64 == 0; other page sizes are first gathered into contiguous keys by XLA), and `compute_wgs`
compute warpgroups (4 for fp8, 2 for bf16) each run one wgmma [64 keys, D] x [D, group * Hi] per
row group and block, then the ReLU, head-weighted sum, key scales and causal mask in registers,
and store the logits from registers. The warpgroup skeleton is `mosaic_common`'s, shared with
the decode kernel. Nothing of size [rows, Hi, keys] exists outside registers.

Why Mosaic GPU: fp8 wgmma with warp-specialised TMA pipelining (~2.4x the Triton kernel at 8K
prefill). Layout, tilings and measurements: docs/design/indexer.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..device import HOPPER_SMS, SMEM_BYTES, next_pow2, num_sms
from .layout import gather_paged_rows, max_tiles, ranks_within, tile_schedule
from .mosaic_common import (
    BLOCK_KEYS,
    FILL_BLOCKS,
    MAX_STAGES,
    REGISTERS,
    TMA_SMEM_ALIGN,
    chunk_blocks,
    chunk_header,
    consume_ring,
    drain_ring,
    fill_tail,
    load_ring,
    load_tile_rows,
    meta_width,
    padded_inputs,
    ring_kernel,
    row_logits,
    splat_fill,
    warpgroups,
)

_SMEM_SLACK = 4 * 1024  # of device.SMEM_BYTES: barriers and the allocations' alignment
_TARGET_ITEMS = 2 * HOPPER_SMS  # (tile, chunk) work items for short prefills: two a CTA
# compute warpgroups by key itemsize (docs/design/indexer.md): fp8 1.10-1.13x faster with 4 than
# with 2 at T = S = 2K..32K, bf16 0.97x, so bf16 keeps 2
_COMPUTE_WGS = {1: 4, 2: 2}
# the lean epilogue by key itemsize (docs/design/indexer.md, 2026-12-03 (later)): the head sum as
# FMA chains, the causal mask only in blocks that reach past a row's end, no automatic warpgroup
# barriers. Measured at each dtype's default tiling: fp8 (four compute warpgroups) 1.05-1.06x at
# T = S = 8K and 32K; bf16 (two) 0.99x / 0.95x, so bf16 keeps the tree sum, the mask in every
# block and the barriers (fp8 with compute_wgs=2 was not measured)
_LEAN_EPILOGUE = {1: True, 2: False}


@dataclasses.dataclass(frozen=True)
class PrefillTiling:
    """block_rows: rows of one sequence per tile (their q stays in SMEM); group: rows whose q
    share one wgmma (N = group * Hi <= 256; accumulator: group * Hi / 2 registers per thread);
    stages: key blocks in flight (a multiple of compute_wgs // owners); splits: key chunks per
    tile; compute_wgs: compute warpgroups (2 or 4), of which `owners` compute each key block,
    each on its own row groups, and the others the next blocks; programs: CTAs of the
    persistent grid, which take the (tile, chunk) items in rounds of `programs`, heaviest first,
    in snake order (round r in reverse when r is odd)."""
    block_rows: int
    group: int
    stages: int
    splits: int
    compute_wgs: int
    programs: int

    @property
    def owners(self) -> int:
        """Compute warpgroups per key block: as many as divide both the warpgroups and the row
        groups, so that a warpgroup owns few rows (one group at the defaults: its head weights
        then stay in registers) and computes every (compute_wgs // owners)-th block."""
        return math.gcd(self.compute_wgs, self.block_rows // self.group)


def _weight_rows(block_rows, hi):
    """Rows of a tile's weights [rows, Hi] f32 in GMEM and SMEM: block_rows, padded (zeros, never
    read) to a TMA_SMEM_ALIGN-byte multiple, since the kernel keeps two tiles' weights."""
    step = TMA_SMEM_ALIGN // math.gcd(TMA_SMEM_ALIGN, hi * 4)
    return -(-block_rows // step) * step


def _smem_bytes(block_rows, stages, hi, d, itemsize):
    """SMEM of the kernel's buffers: two items' metadata, q and weights; the key ring and its
    scales; the -inf tile."""
    per_item = meta_width(block_rows) * 4 + block_rows * hi * d * itemsize + _weight_rows(block_rows, hi) * hi * 4
    return 2 * per_item + stages * BLOCK_KEYS * (d * itemsize + 4) + FILL_BLOCKS * BLOCK_KEYS * 4


def choose_prefill_tiling(num_rows, num_seqs, key_blocks, dtype, hi, d, *, block_rows=None, group=None,
                       stages=None, splits=None, compute_wgs=None, programs=None) -> PrefillTiling:
    """Prefill (many rows per sequence): as many rows per tile (a power of two, at most 16) as
    SMEM holds next to the ring, two tiles' q at a time (8 fp8 rows, 4 bf16 rows at the real
    dims), one chunk. Decode (1-2 rows per sequence): tiles of those rows and the key axis split
    into chunks until about _TARGET_ITEMS (tile, chunk) items exist. One CTA an SM (`programs`)."""
    rows_per_seq = num_rows / max(1, min(num_seqs, num_rows))
    itemsize = jnp.dtype(dtype).itemsize
    compute_wgs = compute_wgs or _COMPUTE_WGS[itemsize]
    if compute_wgs not in REGISTERS:
        raise ValueError(f"compute_wgs={compute_wgs} must be one of {sorted(REGISTERS)}")
    stages = stages or (8 if compute_wgs == 4 else 4)
    budget = SMEM_BYTES - _SMEM_SLACK
    if block_rows is None:
        # the persistent kernel loads the next item's q during the current one: two tiles' q
        fit = max([r for r in (1, 2, 4, 8, 16) if _smem_bytes(r, stages, hi, d, itemsize) <= budget], default=1)
        block_rows = min(next_pow2(int(rows_per_seq + 0.5)), fit)
    if _smem_bytes(block_rows, stages, hi, d, itemsize) > budget:
        raise ValueError(f"block_rows={block_rows} and stages={stages} need "
                         f"{_smem_bytes(block_rows, stages, hi, d, itemsize)} bytes of shared memory "
                         f"(two tiles' q and weights, the key ring), more than the {budget} available")
    # wgmma's N = group * Hi: its f32 accumulator (N / 2 registers a thread) within the compute
    # warpgroups' register budget: N <= 256 with 2 of them (232 registers), <= 128 with 4 (112:
    # N = 256 would need 128 for the accumulator alone)
    max_n = 256 if compute_wgs == 2 else 128
    if group is None:
        group = max([g for g in range(1, block_rows + 1) if block_rows % g == 0 and g * hi <= max_n], default=1)
    if block_rows % group or group * hi > max_n:
        raise ValueError(f"block_rows={block_rows} must be a multiple of group={group}, and group * heads = "
                         f"{group * hi} (wgmma N) at most {max_n} with compute_wgs={compute_wgs}")
    if splits is None:
        splits = max(1, min(key_blocks, pl.cdiv(_TARGET_ITEMS, max_tiles(num_rows, num_seqs, block_rows))))
    items = max_tiles(num_rows, num_seqs, block_rows) * splits
    if programs is not None and programs < 1:
        raise ValueError(f"programs={programs} must be at least 1")
    tiling = PrefillTiling(block_rows, group, stages, splits, compute_wgs, min(programs or num_sms(), items))
    key_phases = compute_wgs // tiling.owners
    if tiling.stages % key_phases or tiling.stages > MAX_STAGES:
        # Block i uses slot i % stages and the warpgroups of phase i % key_phases: a ring of a
        # multiple of key_phases gives each slot the same warpgroups, which then wait on every
        # phase of its barrier (a hang otherwise).
        raise ValueError(f"stages={tiling.stages} must be a multiple of compute_wgs={compute_wgs} // "
                         f"gcd(compute_wgs, block_rows // group) = {key_phases} and at most {MAX_STAGES}")
    return tiling


def _kernel(meta_ref, q_ref, w_ref, bt_ref, k_ref, *rest, tiling: PrefillTiling, page_size, chunk,
            swizzle, clean, lean):
    """meta [T, M] int32 (sequence, tile end, row ids, row ends); q [N, Hi, D]; w [T, _weight_rows(BR), Hi] f32;
    bt [S, W] int32; k [slots, D]; k_scale [slots] f32 (if present); out [N, Lp] f32.

    Persistent: program c of tiling.programs does the work items c, c + programs, ... of the T x
    splits (tile, key chunk) items, heaviest tile first. The tile's metadata, q and weights sit
    in one of two SMEM buffers (item j in buffer j % 2), so the memory warpgroup loads item j +
    1's while the compute warpgroups work on item j; the key ring runs on across items.
    lean: `_LEAN_EPILOGUE`'s choice for the key dtype."""
    *ks_ref, out_ref = rest
    ks_ref = ks_ref[0] if ks_ref else None
    br, group, stages, splits, programs = (tiling.block_rows, tiling.group, tiling.stages, tiling.splits,
                                           tiling.programs)
    _, hi, d = q_ref.shape
    bk = BLOCK_KEYS
    out_blocks = out_ref.shape[1] // bk
    program = lax.axis_index("tile")
    total_items = meta_ref.shape[0] * splits
    rounds, last = divmod(total_items, programs)
    # snake order: the program's place in round r is program (r even) or programs - 1 - program
    # (r odd), so that the heaviest-first items even out over the programs
    in_last = jnp.where(rounds % 2 == 0, program < last, programs - 1 - program < last)
    n_items = rounds + in_last.astype(jnp.int32)
    owners, owned = tiling.owners, tiling.block_rows // tiling.group // tiling.owners
    transforms = (plgpu.TilingTransform((8, swizzle // q_ref.dtype.itemsize)), plgpu.SwizzleTransform(swizzle))

    def item_of(j):
        """(tile, first key block of its chunk, buffer) of the program's j-th work item."""
        i = j * programs + jnp.where(lax.rem(j, 2) == 0, program, programs - 1 - program)
        return i // splits, lax.rem(i, splits) * chunk, lax.rem(j, 2)

    def body(meta_smem, q_smem, w_smem, k_smem, ks_smem, fill_smem,
             meta_bar, q_bar, k_bar, consumed_bar, free_bar):

        def memory():
            splat_fill(fill_smem, clean=clean)

            def tail(j):
                """Item j's -inf tail (its metadata still in its buffer: j + 2 reuses it)."""
                _, first, buf = item_of(j)
                meta = meta_smem.at[buf]
                stop, _, _ = chunk_blocks(meta[1], first, chunk)
                fill_tail([meta[2 + r] for r in range(br)], stop, first, chunk, out_blocks,
                          lambda row, b, n: plgpu.copy_smem_to_gmem(
                              fill_smem.at[:n * bk], out_ref.at[row, pl.ds(b * bk, n * bk)]),
                          clean=clean)

            def item(j, base):
                tile, first, buf = item_of(j)
                meta = meta_smem.at[buf]

                @pl.when(j >= 2)
                def _():  # the compute warpgroups are done with item j - 2's buffers
                    plgpu.barrier_wait(free_bar.at[buf])
                    plgpu.commit_smem()

                plgpu.copy_gmem_to_smem(meta_ref.at[tile], meta, meta_bar.at[buf])
                _, _, n_steps = chunk_header(meta, meta_bar.at[buf], first, chunk)
                seq = meta[0]

                @pl.when(n_steps > 0)
                def _():
                    load_tile_rows(meta, q_ref, w_ref, q_smem.at[buf], w_smem.at[buf], q_bar.at[buf], tile)

                if clean:  # the previous item's tail: its stores issue while the compute
                    @pl.when(j >= 1)  # warpgroups drain the ring, after this item's q is on its way
                    def _():
                        tail(j - 1)

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

                load_ring(n_steps, stages, consumed_bar, load_keys, init_carry=block_slot(0), base=base)
                return base + n_steps

            total_steps = pl.loop(0, n_items, init_carry=jnp.int32(0))(item)
            if clean:
                @pl.when(n_items >= 1)
                def _():
                    tail(n_items - 1)

            drain_ring(total_steps, stages, consumed_bar)

            @pl.loop(jnp.maximum(n_items - 2, 0), n_items)
            def _(j):  # the last two items' releases of their buffers, likewise
                plgpu.barrier_wait(free_bar.at[lax.rem(j, 2)])

            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        def compute(wg):
            # the warpgroup's row groups (owned of them: wg % owners, + owners, ...)
            groups = [wg % owners + owners * k for k in range(owned)]

            def item(j, base):
                _, first, buf = item_of(j)
                meta, w_rows = meta_smem.at[buf], w_smem.at[buf]
                _, _, n_steps = chunk_header(meta, meta_bar.at[buf], first, chunk)

                def row_weights(j):
                    """Tile row j's head weights [Hi] from SMEM, in the layout of a row's scores."""
                    return plgpu.load(w_rows.at[j], layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)

                def held_weights():
                    """The owned rows' head weights, in registers for the whole item when the
                    warpgroup owns one row group (else re-read from SMEM at each block)."""
                    return None if owned > 1 else [row_weights(groups[0] * group + r) for r in range(group)]

                def logits(step, slot, out_tile, lane, w_held, release):
                    del out_tile
                    k_scale = None if ks_ref is None else plgpu.load(
                        ks_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
                    pos = lane + (first + step) * bk
                    for g in groups:
                        row0 = g * group

                        def mma(acc, row0=row0):  # the group's q rows side by side: N = group * Hi
                            q_rows = q_smem.at[buf, pl.ds(pl.multiple_of(row0 * hi, hi), group * hi)]
                            plgpu.wgmma(acc, k_smem.at[slot], q_rows.T)
                            plgpu.wgmma_wait(0)
                            return acc[...]

                        scores = pl.run_scoped(mma, plgpu.ACC((bk, group * hi), jnp.float32))
                        rows = [meta[2 + row0 + r] for r in range(group)]
                        ends = [meta[2 + br + row0 + r] for r in range(group)]

                        def store_rows(masked):
                            for r in range(group):
                                w = w_held[r] if w_held is not None else row_weights(row0 + r)
                                logit = row_logits(scores[:, r * hi:(r + 1) * hi], w, k_scale,
                                                   pos if masked else None, ends[r], chain=lean)

                                @pl.when(rows[r] >= 0)
                                def _store():  # from registers (no SMEM staging, no TMA)
                                    out_ref[rows[r], pl.ds((first + step) * bk, bk)] = logit

                        if lean:
                            # the causal mask only where the block reaches past a (real) row's
                            # end: the diagonal blocks of a prefill; the interior ones skip the
                            # compare and select
                            block_end = (first + step + 1) * bk
                            interior = functools.reduce(jnp.minimum, [jnp.where(row >= 0, end, block_end)
                                                                      for row, end in zip(rows, ends)]) >= block_end
                            pl.when(interior)(lambda: store_rows(False))
                            pl.when(jnp.logical_not(interior))(lambda: store_rows(True))
                        else:
                            store_rows(True)
                    release()

                consume_ring(wg, n_steps, stages, q_bar.at[buf], k_bar, consumed_bar, None, logits, None,
                             prologue=held_weights, compute_wgs=tiling.compute_wgs, owners=owners, base=base)
                plgpu.barrier_arrive(free_bar.at[buf])  # item j's metadata, q and weights are read
                return base + n_steps

            pl.loop(0, n_items, init_carry=jnp.int32(0))(item)

        warpgroups(memory, compute, tiling.compute_wgs)

    pl.run_scoped(
        body,
        plgpu.SMEM((2, meta_ref.shape[1]), jnp.int32),
        plgpu.SMEM((2, br * hi, d), q_ref.dtype, transforms=transforms),
        plgpu.SMEM((2, _weight_rows(br, hi), hi), jnp.float32),
        plgpu.SMEM((stages, bk, d), q_ref.dtype, transforms=transforms),
        plgpu.SMEM((stages, bk), jnp.float32),
        plgpu.SMEM((FILL_BLOCKS * bk,), jnp.float32),  # -inf
        plgpu.Barrier(num_arrivals=1, num_barriers=2),
        plgpu.Barrier(num_arrivals=br + 1, num_barriers=2),
        plgpu.Barrier(num_arrivals=1 if ks_ref is None else 2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=owners, num_barriers=stages),
        plgpu.Barrier(num_arrivals=tiling.compute_wgs, num_barriers=2),
        collective_axes="wg",
    )


# Tiles are dealt heaviest first by their cost in this many classes of key blocks (a counting
# sort; the order only balances the persistent grid, any order gives the same logits).
_COST_CLASSES = 128


def _tiles(row_seq, row_end, num_seqs, num_keys, block_rows):
    """Row tiles of one sequence each, heaviest first: by key blocks to compute (the tile's largest
    row_end), in _COST_CLASSES classes of equal width, in tile order within a class.

    Returns meta [T, M] int32 (sequence, tile end, row ids (-1 = empty), row ends), and the row
    ids [T, BR] (to gather the weights)."""
    tile_rows, tile_meta = tile_schedule(row_seq, row_end, num_seqs, num_keys, block_rows)
    key_blocks = pl.cdiv(num_keys, BLOCK_KEYS)
    classes = min(_COST_CLASSES, key_blocks + 1)
    light = (key_blocks - pl.cdiv(tile_meta[:, 1], BLOCK_KEYS)) * classes // (key_blocks + 1)  # 0: heaviest
    rank, counts = ranks_within(light, classes)
    place = (jnp.cumsum(counts) - counts)[light] + rank
    order = jnp.zeros_like(place).at[place].set(jnp.arange(place.shape[0], dtype=jnp.int32), unique_indices=True)
    tile_rows, tile_meta = tile_rows[order], tile_meta[order]
    ends = jnp.where(tile_rows >= 0, jnp.clip(row_end.astype(jnp.int32)[jnp.maximum(tile_rows, 0)], 0, num_keys), 0)
    meta = jnp.concatenate([tile_meta, tile_rows, ends], axis=1)
    return jnp.pad(meta, ((0, 0), (0, meta_width(block_rows) - meta.shape[1]))), tile_rows


def indexer_logits_mosaic_prefill(q, weights, k_cache, k_scale, block_tables, row_seq, row_end, *, page_size,
                        clean=True, interpret=False, **tiling_overrides):
    """Indexer logits, Pallas Mosaic GPU kernel (Hopper). Same contract as
    `indexer_logits_reference`.

    q: [N, Hi, D] e4m3 or bf16; weights [N, Hi] f32; k_cache [num_slots, D] (same dtype as q);
    k_scale [num_slots] f32 or None; block_tables [S, W] int32; row_seq, row_end [N] int32.
    Returns [N, W * page_size] f32, -inf at positions >= row_end[n] (clean=False: -inf only up to
    the end of the row's tile's last computed key block; past it unwritten, see `api`).
    tiling_overrides: block_rows, group, stages, splits, compute_wgs, programs (see `PrefillTiling`). interpret: run in
    the Mosaic GPU interpreter (CPU tests).
    """
    q, weights, k_cache, swizzle = padded_inputs(q, weights, k_cache)
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
    tiling = choose_prefill_tiling(n, num_seqs, key_blocks, q.dtype, hi_p, d_p, **tiling_overrides)
    chunk = pl.cdiv(key_blocks, tiling.splits)

    meta, tile_rows = _tiles(row_seq, row_end, num_seqs, num_keys, tiling.block_rows)
    tile_weights = jnp.where(tile_rows[..., None] >= 0, weights[jnp.maximum(tile_rows, 0)], 0.0)
    pad_rows = _weight_rows(tiling.block_rows, hi_p) - tiling.block_rows
    tile_weights = jnp.pad(tile_weights, ((0, 0), (0, pad_rows), (0, 0)))
    args = [meta, q, tile_weights, block_tables, k_cache]
    if k_scale is not None:
        args.append(k_scale.astype(jnp.float32))
    lean = _LEAN_EPILOGUE[q.dtype.itemsize]
    kernel = ring_kernel(
        functools.partial(_kernel, tiling=tiling, page_size=page_size, chunk=chunk, swizzle=swizzle, clean=clean,
                          lean=lean),
        jax.ShapeDtypeStruct((n, key_blocks * BLOCK_KEYS), jnp.float32), (1, tiling.programs),
        "indexer_logits_mgpu", interpret, compute_wgs=tiling.compute_wgs, auto_barriers=not lean)
    out = kernel(*args)
    return out if out.shape[1] == num_keys else out[:, :num_keys]
