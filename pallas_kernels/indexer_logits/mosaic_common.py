"""The warpgroup skeleton of the indexer's Mosaic GPU kernels (`mosaic_prefill`, `mosaic_decode`).

Per (row tile, key chunk) item (one a CTA in decode; prefill's persistent CTAs take several, the
ring running on across them): a memory warpgroup streams key blocks of BLOCK_KEYS keys
from the paged cache into a ring of SMEM slots by TMA, and compute_wgs compute warpgroups (2 or
4; COMPUTE_WGS unless the kernel says otherwise) turn each slot's keys into BLOCK_KEYS logits
per row: one warpgroup a slot, whose logits a TMA stores from SMEM (decode), or one or more, each
on its own rows and storing from registers (prefill). Shared here: the inputs padded
for wgmma, the register split, the ring's load and compute loops, the -inf tail and the final
drain, one row's logits epilogue and the kernel call.
The two kernels differ in where page ids come from and in the work per ring slot.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..device import MAX_SWIZZLE, next_pow2
from .layout import FP8_E4M3

BLOCK_KEYS = 64  # wgmma M: one warpgroup's accumulator rows
MAX_STAGES = 32  # Mosaic GPU initialises at most 32 mbarriers per group (the ring's two groups)
COMPUTE_WGS = 2


def padded_inputs(q, weights, k_cache):
    """Checks dtypes and pads for wgmma: N = heads % 8 == 0 and a K row of 32, 64 or a multiple of
    128 bytes (the swizzle); heads get weight 0, D zeros. No-op for the real Hi=64, D=128.

    Returns (q [N, Hi_p, D_p], weights [N, Hi_p] f32, k_cache [num_slots, D_p], swizzle bytes).
    """
    if q.dtype != k_cache.dtype or q.dtype not in (FP8_E4M3, jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"q and k_cache must both be float8_e4m3fn or bfloat16, got {q.dtype}, {k_cache.dtype}")
    _, hi, d = q.shape
    itemsize = q.dtype.itemsize
    row_bytes = d * itemsize
    if row_bytes <= MAX_SWIZZLE:
        row_bytes = max(32, next_pow2(row_bytes))
    else:
        row_bytes = -(-row_bytes // MAX_SWIZZLE) * MAX_SWIZZLE
    hi_p, d_p = -(-hi // 8) * 8, row_bytes // itemsize
    weights = weights.astype(jnp.float32)
    if (hi_p, d_p) != (hi, d):
        q = jnp.pad(q, ((0, 0), (0, hi_p - hi), (0, d_p - d)))
        weights = jnp.pad(weights, ((0, 0), (0, hi_p - hi)))
        k_cache = jnp.pad(k_cache, ((0, 0), (0, d_p - d)))
    return q, weights, k_cache, min(MAX_SWIZZLE, row_bytes)


# setmaxnreg per (compute warpgroups): (memory, compute). A CTA of n warpgroups launches at
# 65536 / (128 n) registers a thread rounded down to 8; the warpgroups' budgets must not
# average above that (2: (40 + 2 x 232) / 3 = 168; 4: (32 + 4 x 112) / 5 = 96).
REGISTERS = {2: (40, 232), 4: (32, 112)}


def warpgroups(memory, compute, compute_wgs=COMPUTE_WGS):
    """Warp specialisation: warpgroup compute_wgs streams keys with few registers (memory()); the
    compute warpgroups take the registers it gives up (compute(wg), wg in [0, compute_wgs))."""
    wg = lax.axis_index("wg")
    memory_regs, compute_regs = REGISTERS[compute_wgs]

    @pl.when(wg == compute_wgs)
    def _memory_wg():
        plgpu.set_max_registers(memory_regs, action="decrease")
        memory()

    @pl.when(wg < compute_wgs)
    def _compute_wg():
        plgpu.set_max_registers(compute_regs, action="increase")
        compute(wg)


def chunk_blocks(tile_end, first, chunk, step_blocks=1):
    """(first key block past the tile's last valid key tile_end, the chunk's key blocks to
    compute, pipeline steps of step_blocks blocks)."""
    stop = pl.cdiv(tile_end, BLOCK_KEYS)
    n_blocks = jnp.clip(stop - first, 0, chunk)
    return stop, n_blocks, n_blocks if step_blocks == 1 else pl.cdiv(n_blocks, step_blocks)


def chunk_header(meta_smem, meta_bar, first, chunk, step_blocks=1):
    """Waits for the tile's metadata, then `chunk_blocks` of its end (meta_smem[1])."""
    plgpu.barrier_wait(meta_bar)
    return chunk_blocks(meta_smem[1], first, chunk, step_blocks)


def load_tile_rows(meta_smem, q_ref, w_ref, q_smem, w_smem, q_bar, tile):
    """The tile's weights [BR, Hi] and the q of its rows (meta_smem[2 + j]; an empty row slot loads
    row 0, never stored: one arrival each) into SMEM, arriving on q_bar (1 + BR arrivals)."""
    plgpu.copy_gmem_to_smem(w_ref.at[tile], w_smem, q_bar)
    hi = q_ref.shape[1]
    for j in range(q_smem.shape[0] // hi):
        plgpu.copy_gmem_to_smem(q_ref.at[jnp.maximum(meta_smem[2 + j], 0)], q_smem.at[pl.ds(j * hi, hi)], q_bar)


def load_ring(n_steps, stages, consumed_bar, load, init_carry=None, base=0):
    """The memory warpgroup's loop: pipeline step s fills ring slot (base + s) % stages, from the
    second lap on (base + s >= stages) once its compute warpgroups released it (consumed_bar).
    base: the ring steps before this loop (a persistent kernel's earlier work items).
    load(step, slot[, carry]) issues the step's TMAs (arriving on the slot's barrier) [and returns
    the next carry]."""
    def body(step, *carry):
        slot = lax.rem(base + step, stages)

        @pl.when(base + step >= stages)
        def _():
            plgpu.barrier_wait(consumed_bar.at[slot])
            plgpu.commit_smem()  # order the consumer's reads (generic proxy) before TMA's writes

        return load(step, slot, *carry)

    pl.loop(0, n_steps, init_carry=init_carry)(body)


def drain_ring(total_steps, stages, consumed_bar):
    """The memory warpgroup's last waits: the releases of the ring's last lap (steps
    [total_steps - stages, total_steps), which no refill waited for), so that the warpgroup has
    seen every phase of consumed_bar complete before the kernel ends."""
    @pl.loop(jnp.maximum(total_steps - stages, 0), total_steps)
    def _(step):
        plgpu.barrier_wait(consumed_bar.at[lax.rem(step, stages)])


# Key blocks of -inf a TMA store of the tail writes: the prefill's 1D box of 256 f32 is TMA's
# largest box dimension (decode's box is [4, 64]); the SMEM splat of -inf needs a multiple of 128
# elements.
FILL_BLOCKS = 4


def fill_tail(rows, stop, first, chunk, out_blocks, store_fill, *, clean):
    """With `clean`, -inf over the chunk's key blocks at or past `stop` (the tile's end) and before
    out_blocks, for each of the tile's rows (row ids, -1 = none): store_fill(row, b, n) stores n key
    blocks of -inf from block b (FILL_BLOCKS at a time, then single blocks; the -inf is already in
    SMEM). Without, those blocks stay unwritten."""
    if not clean:
        return
    start, end = jnp.maximum(stop, first), jnp.minimum(first + chunk, out_blocks)
    wide = jnp.maximum(end - start, 0) // FILL_BLOCKS
    for row in rows:
        @pl.when(row >= 0)
        def _fill_row():
            @pl.loop(0, wide)
            def _fill_wide(i):
                store_fill(row, start + i * FILL_BLOCKS, FILL_BLOCKS)

            @pl.loop(start + wide * FILL_BLOCKS, end)
            def _fill(b):
                store_fill(row, b, 1)


def splat_fill(fill_smem, *, clean):
    """With `clean`, -inf into fill_smem (FILL_BLOCKS key blocks), fenced for the TMA stores that
    read it."""
    if clean:
        fill_smem[...] = jnp.full(fill_smem.shape, -jnp.inf, jnp.float32)
        plgpu.commit_smem()


def fill_tail_and_drain(rows, fill_smem, stop, first, chunk, out_blocks, store_fill, *, clean):
    """The memory warpgroup's end: `splat_fill` and `fill_tail`'s stores from it; then waits until
    the stores have read SMEM (the writes land by kernel end)."""
    splat_fill(fill_smem, clean=clean)
    fill_tail(rows, stop, first, chunk, out_blocks, store_fill, clean=clean)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def consume_ring(wg, n_steps, stages, q_bar, k_bar, consumed_bar, o_smem, compute, store, prologue=lambda: None,
                 compute_wgs=COMPUTE_WGS, owners=1, base=0):
    """Compute warpgroup wg's pipeline steps s < n_steps with (base + s) % stride == wg // owners
    (stride = compute_wgs // owners: `owners` warpgroups take each step, on different rows;
    consumed_bar counts `owners` arrivals; base: the ring steps before these, a persistent
    kernel's earlier work items): once q (q_bar) has landed and state = prologue(), per step
    waits for its ring slot's keys and until the stores of its SMEM output tile
    (o_smem[wg, i % 2]) two steps back have read it, then compute(step, slot, out_tile, lane,
    state, release) fills out_tile (lane: [64] key offsets in the WGMMA row layout; release():
    hands the slot back to the memory warpgroup once its keys are read) and store(step,
    out_tile) issues out_tile's TMA stores (one commit group). With o_smem None, compute stores
    its logits itself (out_tile and store are None) and nothing is awaited at the end."""
    lane = plgpu.broadcasted_iota(jnp.int32, (BLOCK_KEYS,), 0, layout=plgpu.Layout.WGMMA.reduce(1))

    @pl.when(n_steps > 0)
    def _():
        plgpu.barrier_wait(q_bar)
        state = prologue()

        stride = compute_wgs // owners
        first = lax.rem(wg // owners - lax.rem(base, stride) + stride, stride)  # its first step

        @pl.loop(0, (n_steps - first + stride - 1) // stride)
        def _step(i):
            step = first + stride * i
            slot = lax.rem(base + step, stages)
            out_tile = None if o_smem is None else o_smem.at[wg, lax.rem(i, 2)]
            plgpu.barrier_wait(k_bar.at[slot])
            if o_smem is not None:
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # out_tile's stores of step i - 2

            def release():  # every step (the last laps' arrivals wait for no refill: harmless)
                plgpu.barrier_arrive(consumed_bar.at[slot])

            compute(step, slot, out_tile, lane, state, release)
            if o_smem is not None:
                plgpu.commit_smem()
                store(step, out_tile)
                plgpu.commit_smem_to_gmem_group()

    if o_smem is not None:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def row_logits(scores, w, k_scale, pos, row_end, *, chain):
    """One row's logits of a key block: scores [bk, Hi] f32 (WGMMA layout, Hi % 8 == 0), w [Hi]
    f32, k_scale [bk] f32 or None, pos [bk] key positions or None -> [bk] sum_h w_h ReLU(scores_h)
    (x k_scale), -inf at pos >= row_end (pos None: no mask, for a block wholly before row_end).
    chain: the head sum as FMA chains over 8-column slices (a thread's 2 columns of each), then
    one sum of the 8: ~1 FMA an element, where the sum of the products is a tree (~1.44
    instructions an element: multiplies, FMAs and adds); the summation order differs, not the
    precision. The fp8 prefill kernel's choice (`mosaic_prefill._LEAN_EPILOGUE`); the bf16
    prefill and the decode kernel sum the tree (docs/design/indexer.md, 2026-12-03 (later))."""
    bk, hi = scores.shape
    relu, wb = jnp.maximum(scores, 0.0), lax.broadcast_in_dim(w, (bk, hi), [1])
    if chain:
        acc = relu[:, :8] * wb[:, :8]
        for c in range(8, hi, 8):
            acc = acc + relu[:, c:c + 8] * wb[:, c:c + 8]
        logit = jnp.sum(acc, axis=1)
    else:
        logit = jnp.sum(relu * wb, axis=1)
    if k_scale is not None:
        logit = logit * k_scale
    return logit if pos is None else jnp.where(pos < row_end, logit, -jnp.inf)


# TMA's SMEM side: a box lands at a 128-byte aligned address, so buffers indexed along a leading
# axis (the prefill kernel's two items) need a 128-byte multiple per entry (else the second one's
# copy faults with a misaligned address on the GPU; the interpreter does not check it).
TMA_SMEM_ALIGN = 128


def meta_width(block_rows):
    """int32s of a tile's metadata row (sequence, tile end, row ids, row ends), a multiple of
    TMA_SMEM_ALIGN bytes."""
    words = TMA_SMEM_ALIGN // 4
    return -(-(2 + 2 * block_rows) // words) * words


def ring_kernel(kernel, out_type, grid, name, interpret, compute_wgs=COMPUTE_WGS, auto_barriers=True):
    """plgpu.kernel of a ring kernel body: grid ("split", "tile"): (key chunks, row tiles) in
    decode, (1, persistent programs) in prefill; one memory and compute_wgs compute warpgroups
    ("wg"). auto_barriers=False: Pallas inserts none of its automatic warpgroup barriers
    (`unsafe_no_auto_barriers`: around SMEM and register stores, before each TMA load), for a body
    in which no thread reads and writes one region, whose SMEM writes are followed by commit_smem
    (a fence and a warpgroup barrier) before TMA reads them, whose memory warpgroup runs
    commit_smem after a buffer's release (free / consumed barrier) and before reloading it (which
    also orders its own earlier reads of it), and whose warpgroups hand buffers on by mbarriers
    (every thread of a warpgroup arrives)."""
    return plgpu.kernel(
        kernel,
        out_type=out_type,
        grid=grid,
        grid_names=("split", "tile"),
        num_threads=compute_wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=not auto_barriers),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name=name,
    )
