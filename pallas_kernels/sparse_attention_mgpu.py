"""Sparse MLA attention on Hopper through Pallas Mosaic GPU (wgmma, warp-specialised gathers).

Same semantics as `sparse_attention.sparse_mla_reference`: for each query row n and head h,
over the cache slots idx = slots[n, :] that are >= 0,
    score[j] = scale * (q[n, h, :R] . c[idx_j] + q[n, h, R:] . k_pe[idx_j])
    out[n, h] = softmax(score) @ c[idx],   lse[n, h] = logsumexp(score)
with out = 0, lse = +inf for rows with no valid slot. Caches: bf16, or FlashMLA's fp8 layout
(e4m3 latent + one f32 scale per 128 values + bf16 k_pe, as three arrays).

One CTA = one query row x 64 heads x one split of the slot list, three warpgroups:
  * a producer warpgroup gathers the selected cache rows, 64 per block, straight into
    swizzled shared memory with per-thread 16-byte `cp.async` copies (Hopper's TMA cannot
    gather rows, and one bulk copy per row would need 10 copies per row), zero-filling the rows
    of -1 slots, into a ring of [64, R + P] bf16 tiles (2 at DeepSeek's shapes: q's [64, 576]
    tile and the ring fill the 227 KiB). Eight consecutive lanes take eight rows, so a warp's
    16-byte stores spread over all shared-memory banks (one row per warp: 2-4 way conflicts).
    An fp8 latent is copied the same way, raw: each producer thread copies its 16-byte e4m3
    chunks (and its rows' f32 scales) into the very stage bytes that its own conversion then
    overwrites, in 4 cp.async groups (k_pe's last), and dequantises each group as soon as it has
    landed (e4m3 -> f16 exactly, x the f32 scale, -> bf16, as FlashMLA does). No thread reads
    what another one copied, so a block needs no barrier until it is whole; every copy is in
    flight at once, where loading e4m3 through registers (72 of them) left few loads in flight.
    The block's slot ids arrive by TMA one block ahead;
  * two consumer warpgroups share each tile: warpgroup w scores its 32 slots of the block
    against all 64 heads (S_w = Q . K_w^T, [64, 32], the 576-wide contraction in one wgmma
    chain) and turns them into probabilities against its own running max m_w; it publishes
    (m_w, P_w as f16) in shared memory, both meet at one named barrier (`bar.sync`), and each
    takes the common max m = max(m_0, m_1), rescales its own P and the other's by 2^(m_w - m) in
    registers and accumulates out[:, w-th half of R] += P . V over all 64 slots with P from
    registers (V = the first R columns of the same tile). A second named barrier pair
    (`bar.arrive` after reading, `bar.sync` before the next write) guards the exchange buffers.
    One rendezvous per block instead of two (max, then P) and no P round trip through shared
    memory for the wgmma. The accumulator, 64 x R/2 f32, is what fits in one warpgroup's
    registers; the tile is read from shared memory by both.
128 heads take two CTAs per row: a CTA over all 128 heads would need a 128 x 512 f32 accumulator,
the whole register file. The grid runs heads fastest, so a row's two CTAs run side by side and
the second one's gathers hit L2 (rows first, as before this session, put them ~a wave apart:
beyond L2 at a 128K cache and in decode).

Measured on H200 (FlashMLA's FLOP count, TFLOP/s; `scripts/bench_sparse_attention.py --quick`:
prefill 4096 rows, decode 128 x 2 rows over 32K-slot caches; targets: prefill 400, decode 300).
Session 5's final bench: bf16 prefill 423 at an 8K-slot cache, 383 at 128K, decode 380; fp8
prefill 294 / 290, decode 275. Session 6 probe (same run, median of 3 interleaved rounds, 2048
rows over 8K, decode 128 x 2): the per-thread fp8 layout above 296 vs 290 prefill, 289 vs 276
decode against session 5's in-place one (raw e4m3 in the second half of each 8-row group's tiles,
converted by the whole producer warpgroup 8 rows at a time behind 8 barriers a block).
The Pallas Triton kernel (`sparse_attention.py`) reaches 164 / 134 / 119 (bf16 prefill 8K, bf16
decode, fp8 prefill 8K; session 2's runs of the same bench): Mosaic GPU is the backend here for
wgmma with warp-specialised, barrier-synchronised warpgroups.
Tried and dropped (probes at 1024 x 8K unless said): an L2 bulk prefetch of the next block's rows
(decode 359 -> 299); queueing QK of block i + 1 behind PV of block i in a persistent accumulator
(342 vs 417); a 128-byte swizzle (421, no gain); e4m3 -> f32 by integer bit operations instead of
conversions (231 vs 274); fp8 through registers as FlashMLA does it (each producer thread loads
32-byte e4m3 pieces with ld.global, dequantises in registers and stores bf16 swizzle-tile rows;
4 parts per block with the next 2 parts' loads in flight, across blocks; 88 producer registers):
correct, but 233 vs 278 at 4096 x 8K (likely cause: ~16 KiB of gathers in flight per CTA, where
cp.async puts a whole block's 42 KiB in flight at once; spills at 88 registers not ruled out).
A row's two CTAs as a 2-CTA cluster, each gathering (and for fp8 dequantising) half of every
block and bulk-copying it into the other's stage through distributed shared memory: correct, but
no faster (fp8 prefill 276 vs 289, fp8 decode 257 vs 274, bf16 128K 369 vs 383). Each producer
warp gathering and dequantising its own 8-row groups with warp syncs: 217 vs 285 (2048 x 8K).
Session 6 (2048 x 8K / decode 128 x 2, same runs as above): e4m3 -> bf16 without conversion
instructions (prmt puts each byte's sign and 7 exponent/mantissa bits into a bf16 = value x
2^-120, exact for subnormals; x 2^120 and x the scale as bf16x2 multiplies: 10 SASS a 4 values
against 12 with 4 F2FP) was correct (every e4m3 code within bf16 rounding) and no faster, in this
layout (296 / 286) or the in-place one (297 / 286): the conversion's instruction mix does not
bound fp8, and neither do the in-place layout's barriers. With the conversion skipped altogether
(wrong results, timed) fp8 prefill ran 302 against 301: converting costs nothing measurable.
Asking L2 for block i + 1's rows (prefetch.global.L2 per 128-byte line, slot ids two blocks
ahead) while block i waits for its stage: correct, fp8 decode 254 vs 290 (as with the bulk
prefetch before it, the extra requests cost more than the latency they hide). Two fp8 producer
warpgroups (32 rows of every block each): correct at the odd shapes, but at R = 512 ptxas
rejects the kernel: 512 threads leave 128 registers a thread and the consumer's code needs 158
(it compiles the whole kernel to the launch's register count; setmaxnreg does not raise it).
What bounds it: only two 64-row stages fit beside q's 72 KiB tile, so block i + 1's gather
overlaps block i's math and nothing deeper (its copies can start only when a stage frees), and
QK, softmax and PV of a block run in series; at 128K the gathers leave L2 (151 MB of bf16 cache
against 50 MB; not profiled). fp8 holds at ~300 (8K, 128K and decode alike, so not the memory
behind the gathers) against bf16's ~420, and not because of the conversion (skipping it changes
nothing, above) nor the producer's amount of work (cluster): what is left between the two paths
is their copies (three arrays, 656 bytes a row in 22 cp.async a thread against 36); the register
split was part of it (fp8 at bf16's (224, 56): 310 / 300 against 299 / 292); not profiled.
Between it and FlashMLA (640 prefill, 410 fp8 decode, on H800): the serial phases above (each
consumer warpgroup also re-reads all of q from shared memory per block); an fp8 gather that is
both deep and converted on the way in, which no variant here achieved.

Tests: on a GPU, tests/test_sparse_attention_kernel.py (`gpu` marker) checks it against the
reference; on CPU the kernel can only be lowered (inline PTX has no interpreter), which the
CPU twin checks, and `sparse_attention.sparse_mla_attention` runs the Triton kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, memref, nvvm

from .slot_splits import auto_num_splits, combine_splits

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
HEADS_PER_CTA = 64  # wgmma's M
BLOCK_K = 64  # slots per pipeline stage; each consumer warpgroup scores half of them
_HALF_K = BLOCK_K // 2
_SWIZZLE = 64  # bytes: 32 bf16 columns per smem tile
_COLS = _SWIZZLE // 2  # bf16 columns per swizzle tile
_CHUNK = 8  # bf16 values per 16-byte cp.async
_PRODUCER_THREADS = 128
_LANE_ROWS = 8  # rows per 8 lanes of a producer warp (see _gather_block's units)
_SMEM_BYTES = 227 * 1024  # per block on Hopper
_MAX_STAGES = 4
# setmaxnreg budgets, both cache formats. The kernel launches 384 threads at 168 registers
# (65536 / 384, rounded down to 8): 2 consumers + 1 producer must sum to 3 x 168 = 504, or an
# increase waits forever for registers. Measured (H200, same runs): (232, 40) for bf16 375 vs 417
# TFLOP/s, (216, 72) for bf16 405 vs 420; fp8 at (224, 56) against (216, 72): prefill 310 vs 299,
# decode 300 vs 292, outputs bit-identical (session 6, per-thread fp8 layout).
_CONSUMER_REGS = 224
_PRODUCER_REGS = 56


def _swizzled(dtype, swizzle=None):
    swizzle = swizzle or _SWIZZLE
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


_FP8_TO_BF16 = """{
.reg .b16 lo, hi, a0, a1, a2, a3;
.reg .b32 h0, h1;
.reg .f32 f0, f1, f2, f3;
mov.b32 {lo, hi}, $2;
cvt.rn.f16x2.e4m3x2 h0, lo;
cvt.rn.f16x2.e4m3x2 h1, hi;
mov.b32 {a0, a1}, h0;
mov.b32 {a2, a3}, h1;
cvt.f32.f16 f0, a0;
cvt.f32.f16 f1, a1;
cvt.f32.f16 f2, a2;
cvt.f32.f16 f3, a3;
mul.f32 f0, f0, $3;
mul.f32 f1, f1, $3;
mul.f32 f2, f2, $3;
mul.f32 f3, f3, $3;
cvt.rn.bf16x2.f32 $0, f1, f0;
cvt.rn.bf16x2.f32 $1, f3, f2;
}"""  # 4 e4m3 (one u32, element 0 in the low byte) x f32 scale -> 2 u32 of bf16 pairs (exact e4m3 -> f16)


def _gather_block(ctx, kv_smem, latent, *rest, rank, rope, width, tile):
    """Producer warpgroup: fill `kv_smem[stage]` with one block's gathered cache rows.

    kv_smem: [stages, BLOCK_K, width] bf16, tiled (8, _COLS) with a _SWIZZLE-byte swizzle (physical
    [stages, BLOCK_K / 8, width / _COLS, 8, _COLS]); ids: [BLOCK_K] i32 (shared), the block's slot ids.
    Row j of the block is cache row s = ids[j]: columns [0, rank) the latent (bf16: cp.async; e4m3:
    see `_fp8_per_thread`), [rank, rank + rope) k_pe (bf16, cp.async), the rest zero. A -1 slot gives
    a zero row. bf16: the copies are committed (k_pe's group, then the latent's), the caller waits
    for them and fences; fp8: the latent has landed and been converted on return, k_pe's copies
    (the last group) may still be in flight.
    """
    del ctx
    if tile is None:
        latent_scale = None
        k_pe, ids, stage = rest
    else:
        latent_scale, k_pe, ids, stage = rest
    i32, i64, i8 = (ir.IntegerType.get_signless(b) for b in (32, 64, 8))
    c32 = lambda v: arith.constant(i32, v)
    unwrap = lambda v: v.registers.flat[0] if hasattr(v, "registers") else v
    stage = unwrap(stage)
    tid = arith.remui(mgpu_utils.thread_idx(), c32(_PRODUCER_THREADS))
    gep = lambda base, offset, ty: llvm.getelementptr(base.type, base, [offset], [mgpu_utils.DYNAMIC32], ty,
                                                      llvm.GEPNoWrapFlags.none)
    smem_base = gep(mgpu_utils.memref_ptr(kv_smem), arith.muli(stage, c32(BLOCK_K * width * 2)), i8)
    gptr = lambda ref: llvm.addrspacecast(llvm.PointerType.get(address_space=1), mgpu_utils.memref_ptr(ref))

    def slot_of(j):
        """-> (valid i1, slot clamped to >= 0 as i64) of block row j."""
        idx = memref.load(ids, [arith.index_cast(ir.IndexType.get(), j)])
        valid = arith.cmpi(arith.CmpIPredicate.sge, idx, c32(0))
        return valid, arith.extui(i64, arith.select(valid, idx, c32(0)))

    def dst(j, chunk):
        """Shared address of block row j, bf16 columns [8 chunk, 8 chunk + 8): tile (j / 8, chunk / per),
        row j % 8, 16-byte unit (chunk % per) XOR the row's swizzle bits (per = _SWIZZLE / 16 units
        a tile row; the swizzle XORs address bits 4.. with the bits of the row offset above 7)."""
        r8 = arith.remui(j, c32(8))
        per = _SWIZZLE // 16
        unit = arith.xori(arith.remui(chunk, c32(per)), arith.divui(r8, c32(128 // _SWIZZLE)))
        tile_idx = arith.addi(arith.muli(arith.divui(j, c32(8)), c32(width // _COLS)), arith.divui(chunk, c32(per)))
        offset = arith.addi(arith.addi(arith.muli(tile_idx, c32(8 * _SWIZZLE)), arith.muli(r8, c32(_SWIZZLE))),
                            arith.muli(unit, c32(16)))
        return gep(smem_base, offset, i8)

    def units(per_row):
        """(row j, unit) of this thread over the block's rows, per_row units a row (BLOCK_K x per_row
        is a multiple of the 128 threads at every supported shape). Consecutive lanes take
        _LANE_ROWS consecutive rows, then the next unit: the swizzle then spreads a warp's 16-byte
        shared accesses over all banks (lanes along one row would hit 2 of 8 bank groups)."""
        for g0 in range(0, BLOCK_K * per_row, _PRODUCER_THREADS):
            g = arith.addi(tid, c32(g0))
            rest = arith.divui(g, c32(_LANE_ROWS))
            j = arith.addi(arith.muli(arith.divui(rest, c32(per_row)), c32(_LANE_ROWS)),
                           arith.remui(g, c32(_LANE_ROWS)))
            yield j, arith.remui(rest, c32(per_row))

    def cp_async(j, chunk, src, row_elems, col, col_ok=None):
        """16 bytes of bf16 row slot(j) of src from column col -> dst(j, chunk); zeros if invalid."""
        valid, safe = slot_of(j)
        if col_ok is not None:
            valid = arith.andi(valid, col_ok)
        elem = arith.addi(arith.muli(safe, arith.constant(i64, row_elems)),
                          arith.extui(i64, arith.select(valid, col, c32(0))))
        nvvm.cp_async_shared_global(dst(j, chunk), gep(src, elem, ir.BF16Type.get()), 16,
                                    nvvm.LoadCacheModifierKind.CG, cp_size=arith.select(valid, c32(16), c32(0)))

    def copy_rope():
        for j, chunk in units((width - rank) // _CHUNK):
            col = arith.muli(chunk, c32(_CHUNK))
            in_rope = arith.cmpi(arith.CmpIPredicate.ult, col, c32(rope))
            cp_async(j, arith.addi(chunk, c32(rank // _CHUNK)), gptr(k_pe), rope, col, in_rope)
        nvvm.cp_async_commit_group()

    if latent_scale is None:
        copy_rope()
        for j, chunk in units(rank // _CHUNK):
            cp_async(j, chunk, gptr(latent), rank, arith.muli(chunk, c32(_CHUNK)))
        nvvm.cp_async_commit_group()
    else:
        _fp8_per_thread(gptr(latent), gptr(latent_scale), copy_rope, slot_of, dst, gep, tid, rank=rank, tile=tile)


_FP8_PARTS = 4  # cp.async groups a thread's fp8 copies go out in (each converted as soon as it lands)


def _fp8_per_thread(latent_ptr, scale_ptr, copy_rope, slot_of, dst, gep, tid, *, rank, tile):
    """fp8 latent: each producer thread cp.asyncs raw e4m3 chunks and their rows' f32 scales into the
    stage bytes that its own conversion overwrites, then dequantises them there. No thread reads
    what another one copied, so a block needs no barrier until it is whole (each thread waits for
    its own cp.async groups only).

    Thread t (lane r8 = t % 8, octet o = t / 8 % 4, warp w = t / 32) owns block rows 8 G + r8, G in
    (w, w + 4), and of each the 16-value chunks c = 4 u + o (u < rank / 64). Chunk c becomes bf16
    columns [16 c, 16 c + 16), 16-byte units 2 c and 2 c + 1 of `dst`: the raw chunk lands in unit
    2 c + 1, the row's scales (rank / tile f32) in units 2 c of its first chunks. Eight lanes take
    eight rows of one unit (conflict-free, as `units`); an octet's four lanes of a row read 64
    consecutive bytes of it. The copies go out in _FP8_PARTS groups (then k_pe's, copy_rope), each
    converted as soon as it has landed.
    """
    i32, i64, i8 = (ir.IntegerType.get_signless(b) for b in (32, 64, 8))
    f32 = ir.F32Type.get()
    c32 = lambda v: arith.constant(i32, v)
    vec4 = ir.VectorType.get((4,), i32)
    n_units, n_scales = rank // 64, rank // tile
    chunks_per_scale = tile // 16
    piece = 16 if n_scales % 4 == 0 else 4  # bytes per scale copy
    r8, octet, warp = (arith.remui(tid, c32(8)), arith.remui(arith.divui(tid, c32(8)), c32(4)),
                       arith.divui(tid, c32(32)))
    n_groups = BLOCK_K // 32  # 8-row groups per warp
    rows = [arith.addi(arith.muli(arith.addi(warp, c32(4 * g)), c32(8)), r8) for g in range(n_groups)]
    slots = [slot_of(j) for j in rows]
    # Unit 8 u + 2 o + h of a row sits u * (8 / per) tiles after unit 2 o + h, at the same place in
    # its tile (per = _SWIZZLE / 16 units a tile row): one address a row and h, constant offsets.
    tile_step = (8 // (_SWIZZLE // 16)) * 8 * _SWIZZLE
    bases = [[dst(j, arith.addi(arith.muli(octet, c32(2)), c32(h))) for h in range(2)] for j in rows]
    unit_at = lambda g, u, h, extra=0: gep(bases[g][h], c32(u * tile_step + extra), i8)
    part_units = max(1, n_units * n_groups // _FP8_PARTS)  # a thread's units per cp.async group
    parts = [(g, range(u0, min(u0 + part_units, n_units))) for g in range(n_groups) for u0 in range(0, n_units, part_units)]

    for g, us in parts:
        valid, safe = slots[g]
        size = lambda n: arith.select(valid, c32(n), c32(0))
        if us.start == 0:  # the row's scales, into units 2 c of its first chunks
            first = gep(scale_ptr, arith.muli(safe, arith.constant(i64, n_scales)), f32)
            for k in range(n_scales * 4 // piece):
                nvvm.cp_async_shared_global(
                    unit_at(g, k * piece // 16, 0, k * piece % 16), gep(first, c32(k * piece // 4), f32), piece,
                    nvvm.LoadCacheModifierKind.CG if piece == 16 else nvvm.LoadCacheModifierKind.CA,
                    cp_size=size(piece))
        row_src = gep(latent_ptr, arith.addi(arith.muli(safe, arith.constant(i64, rank)),
                                             arith.extui(i64, arith.muli(octet, c32(16)))), i8)
        for u in us:  # chunk 4 u + o: 64 u bytes after chunk o
            nvvm.cp_async_shared_global(unit_at(g, u, 1), gep(row_src, c32(64 * u), i8), 16,
                                        nvvm.LoadCacheModifierKind.CG, cp_size=size(16))
        nvvm.cp_async_commit_group()
    copy_rope()  # one more group: lands while the parts convert

    scales = {}
    for p, (g, us) in enumerate(parts):
        nvvm.cp_async_wait_group(len(parts) - p)  # this thread's copies of part p have landed
        if us.start == 0:  # every scale of the row into registers before unit 0 overwrites them
            for k in range(n_scales):
                scales[g, k] = llvm.load(f32, unit_at(g, k * 4 // 16, 0, k * 4 % 16), alignment=4)
        for u in us:
            s = scales[g, 4 * u // chunks_per_scale]  # chunks 4 u + o, o < 4: one scale tile (tile % 64 == 0)
            data = llvm.load(vec4, unit_at(g, u, 1), alignment=16)
            words = []
            for k in range(4):
                word = llvm.extractelement(data, arith.constant(i32, k))
                words += mgpu_utils.inline_ptx(_FP8_TO_BF16, word, s, result_types=[i32, i32])
            for h in range(2):
                vec = llvm.mlir_undef(vec4)
                for k in range(4):
                    vec = llvm.insertelement(vec, words[4 * h + k], arith.constant(i32, k))
                llvm.store(vec, unit_at(g, u, h), alignment=16)


# Named barrier ids over the two consumer warpgroups (Mosaic itself uses 0 and 1 + warpgroup).
_EXCHANGED = 15  # both warpgroups have published this block's row maxima and probabilities
_BUFFER_FREE = (13, 14)  # the other warpgroup has read warpgroup w's exchange buffers


def _finite_or_zero(x):
    return jnp.where(x == -jnp.inf, 0.0, x)


def _named_barrier(op, barrier_id):
    """`bar.sync` (wait) or `bar.arrive` (no wait) on a named barrier over the two consumer
    warpgroups (256 threads). Both order this thread's earlier shared-memory accesses."""

    @plgpu.inline_mgpu()
    def barrier(ctx):
        del ctx
        mgpu_utils.inline_ptx(f"bar.{op} {barrier_id}, 256;", has_side_effects=True, convergent=True)

    return barrier()


def _wait_copies(ctx):
    """Producer warpgroup: wait for this thread's cp.async copies."""
    del ctx
    nvvm.cp_async_wait_group(0)


def _kernel(*refs, scoped, rank, rope, width, tile, num_blocks, blocks_per_split, num_stages, qk_scale):
    """refs: q [N, Hp, width] bf16, latent [S, R], (latent_scale [S, R / tile] f32 if fp8,)
    k_pe [S, P] bf16, slots [N, K_pad] i32; out [splits, N, Hp, R] f32, lse [splits, N, Hp] f32."""
    q_gmem, latent_gmem, *cache_gmem, slots_gmem, out_gmem, lse_gmem = refs
    (q_smem, stage_mem, p_smem, x_smem, ids_smem), (q_bar, kv_ready, kv_free, ids_bar) = scoped
    kv_smem, (o_smem, lse_smem) = stage_mem
    head_block, row, split = lax.axis_index("heads"), lax.axis_index("rows"), lax.axis_index("splits")
    wg = lax.axis_index("wg")
    h0 = head_block * HEADS_PER_CTA
    first = split * blocks_per_split
    count = jnp.minimum(blocks_per_split, num_blocks - first)  # >= 1 (the wrapper drops empty splits)
    half_r = rank // 2
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    col_layout = plgpu.Layout.WGMMA.reduce(0)

    def consumer(w):
        plgpu.set_max_registers(_CONSUMER_REGS, action="increase")
        if w == 0:
            plgpu.copy_gmem_to_smem(q_gmem.at[row, pl.ds(h0, HEADS_PER_CTA)], q_smem, q_bar)
        plgpu.barrier_wait(q_bar)

        def softmax(i, s, idx, acc, m, l):
            """Scores of block i -> (P [64, 64] bf16 over both halves, acc rescaled, m, l)."""
            valid = lax.broadcast_in_dim(idx >= 0, s.shape, [1])
            s = jnp.where(valid, s * qk_scale, -jnp.inf)

            # Probabilities against this warpgroup's own new max (no exchange needed first).
            # Until a row has seen a valid slot its max is -inf: shift by 0 then (exp2(-inf) = 0).
            m_own = jnp.maximum(m, jnp.max(s, axis=1))
            p_own = jnp.exp2(s - lax.broadcast_in_dim(_finite_or_zero(m_own), s.shape, [0]))

            @pl.when(i > 0)
            def _():
                _named_barrier("sync", _BUFFER_FREE[w])  # the other read our previous block's

            # Publish (max, P) as f16 (10-bit mantissa: rescaled once more by the reader).
            x_smem[w] = m_own
            p_smem[w] = p_own.astype(jnp.float16)
            _named_barrier("sync", _EXCHANGED)
            m_other = plgpu.load(x_smem.at[1 - w], layout=row_layout)
            p_other = plgpu.load(p_smem.at[1 - w], layout=plgpu.Layout.WGMMA)
            # Both warpgroups derive the same common max, hence the same scale for out and l.
            m_new = jnp.maximum(m_own, m_other)
            shift = _finite_or_zero(m_new)
            alpha = jnp.exp2(m - shift)
            factors = [jnp.exp2(x - shift) for x in (m_own, m_other)]  # <= 1; 0 for rows still -inf
            p_own = p_own * lax.broadcast_in_dim(factors[0], s.shape, [0])
            p_other = p_other.astype(jnp.float32) * lax.broadcast_in_dim(factors[1], s.shape, [0])
            l = l * alpha + jnp.sum(p_own, axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            halves = [p_own.astype(jnp.bfloat16), p_other.astype(jnp.bfloat16)][::1 - 2 * w]
            _named_barrier("arrive", _BUFFER_FREE[1 - w])  # its buffers are read (values in registers)
            return jnp.concatenate(halves, axis=1), acc, m_new, l

        def step(i, carry):
            acc, m, l = carry  # acc [64, R/2] f32 (WGMMA); m, l [64] f32 (log2 units)
            stage = lax.rem(i, num_stages)
            # the slot ids (for the -1 mask) load while the block is still landing
            idx = plgpu.load(slots_gmem.at[row, pl.ds((first + i) * BLOCK_K + w * _HALF_K, _HALF_K)],
                             layout=col_layout, optimized=False)
            plgpu.barrier_wait(kv_ready.at[stage])

            def qk(s_ref):  # S_w = Q . K_w^T, [64, 32]
                plgpu.wgmma(s_ref, q_smem, kv_smem.at[stage, pl.ds(w * _HALF_K, _HALF_K)].T)
                return s_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((HEADS_PER_CTA, _HALF_K), jnp.float32))
            probs, acc, m, l = softmax(i, s, idx, acc, m, l)

            def pv(acc_ref):  # out[:, w-th half of R] += P . V, P [64, 64] from registers
                plgpu.wgmma(acc_ref, probs, kv_smem.at[stage, :, pl.ds(w * half_r, half_r)])

            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(kv_free.at[stage])
            return acc, m, l

        acc = plgpu.layout_cast(jnp.zeros((HEADS_PER_CTA, half_r), jnp.float32), plgpu.Layout.WGMMA)
        m = plgpu.layout_cast(jnp.full((HEADS_PER_CTA,), -jnp.inf, jnp.float32), row_layout)
        l = plgpu.layout_cast(jnp.zeros((HEADS_PER_CTA,), jnp.float32), row_layout)
        acc, m, l = lax.fori_loop(0, count, step, (acc, m, l))

        # Each warpgroup summed p over its own slots: add the two halves of l.
        _named_barrier("sync", _BUFFER_FREE[w])  # matches the other's last arrive
        x_smem[w] = l
        _named_barrier("sync", _EXCHANGED)
        l = plgpu.load(x_smem.at[0], layout=row_layout) + plgpu.load(x_smem.at[1], layout=row_layout)
        empty = l == 0.0
        inv_l = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))
        # o_smem aliases the stage ring: safe once both warpgroups passed the barrier above.
        o_smem[w] = acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])
        if w == 0:
            lse_smem[...] = jnp.where(empty, -jnp.inf, (m + jnp.log2(jnp.where(empty, 1.0, l))) * _LN2)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[w], out_gmem.at[split, row, pl.ds(h0, HEADS_PER_CTA),
                                                          pl.ds(w * half_r, half_r)])
        if w == 0:
            plgpu.copy_smem_to_gmem(lse_smem, lse_gmem.at[split, row, pl.ds(h0, HEADS_PER_CTA)])
        plgpu.wait_smem_to_gmem(0)

    pl.when(wg == 0)(lambda: consumer(0))
    pl.when(wg == 1)(lambda: consumer(1))

    @pl.when(wg == 2)
    def _producer():
        plgpu.set_max_registers(_PRODUCER_REGS, action="decrease")
        scalar = plgpu.Layout.WG_SPLAT(())
        gather = plgpu.inline_mgpu(
            arg_types=(plgpu.RefType(_swizzled(jnp.bfloat16)), plgpu.RefType(),
                       *(plgpu.RefType() for _ in cache_gmem), plgpu.RefType(), scalar))(
            functools.partial(_gather_block, rank=rank, rope=rope, width=width, tile=tile))
        wait_copies = plgpu.inline_mgpu()(_wait_copies)

        def fetch_ids(i):  # block i's slot ids -> ids_smem[stage], one block ahead of its gather
            stage = lax.rem(i, num_stages)
            plgpu.copy_gmem_to_smem(slots_gmem.at[row, pl.ds((first + i) * BLOCK_K, BLOCK_K)],
                                    ids_smem.at[stage], ids_bar.at[stage])

        fetch_ids(0)
        plgpu.barrier_wait(ids_bar.at[0])

        @pl.loop(0, count)
        def _(i):
            stage = lax.rem(i, num_stages)

            @pl.when(i + 1 < count)
            def _():
                fetch_ids(i + 1)  # its buffer's last reader, block i + 1 - stages, is gathered

            @pl.when(i >= num_stages)
            def _():
                plgpu.barrier_wait(kv_free.at[stage])

            gather(kv_smem, latent_gmem, *cache_gmem, ids_smem.at[stage], stage)
            # Signal each block as soon as it has landed: this thread's copies done, then fence
            # them to the async proxy (wgmma) and sync the warpgroup before the single arrive.
            wait_copies()
            plgpu.commit_smem()
            plgpu.barrier_arrive(kv_ready.at[stage])

            @pl.when(i + 1 < count)
            def _():
                plgpu.barrier_wait(ids_bar.at[lax.rem(i + 1, num_stages)])


def unsupported_reason(q, latent, latent_scale, k_pe):
    """None if `sparse_mla_attention_mgpu` takes these operands (shapes as there), else why not."""
    rank, rope = latent.shape[-1], k_pe.shape[-1]
    if q.shape[-1] != rank + rope:
        return f"q width {q.shape[-1]} != latent rank {rank} + rope {rope}"
    if q.dtype != jnp.bfloat16 or k_pe.dtype != jnp.bfloat16:
        return f"q and k_pe must be bf16, got {q.dtype}, {k_pe.dtype}"
    if rank % (2 * _COLS) or rank // 2 > 256:
        return f"latent rank must be a multiple of {2 * _COLS} and <= 512, got {rank}"
    if rope % _CHUNK:
        return f"rope width must be a multiple of {_CHUNK}, got {rope}"
    if latent_scale is None:
        if latent.dtype != jnp.bfloat16:
            return f"latent must be bf16 (or e4m3 with latent_scale), got {latent.dtype}"
    else:
        tile = rank // latent_scale.shape[-1]
        if latent.dtype != jnp.float8_e4m3fn or tile * latent_scale.shape[-1] != rank or tile % 64:
            return (f"fp8 cache: an e4m3 latent with scales tiling it by a multiple of 64, got "
                    f"{latent.dtype} {latent.shape}, scales {latent_scale.shape}")
    return None


def sparse_mla_attention_mgpu(q, latent, latent_scale, k_pe, slots, *, scale, num_splits=None):
    """Sparse MLA attention as a Mosaic GPU kernel (Hopper). Same contract as
    `sparse_attention.sparse_mla_attention`: q [N, H, R + P] bf16; latent [S, R] bf16, or
    float8_e4m3fn with latent_scale [S, R / tile] f32; k_pe [S, P] bf16; slots [N, K] i32 (-1 skip).
    Returns (out [N, H, R] f32, lse [N, H] f32; empty rows give 0, +inf).
    """
    if reason := unsupported_reason(q, latent, latent_scale, k_pe):
        raise ValueError(reason)
    n_rows, heads, _ = q.shape
    rank, rope, topk = latent.shape[-1], k_pe.shape[-1], slots.shape[-1]
    tile = None if latent_scale is None else rank // latent_scale.shape[-1]
    cache = (latent,) if latent_scale is None else (latent, latent_scale.astype(jnp.float32))
    if n_rows == 0 or topk == 0:  # nothing to attend: every row is empty
        return jnp.zeros((n_rows, heads, rank), jnp.float32), jnp.full((n_rows, heads), jnp.inf, jnp.float32)
    width = rank + pl.cdiv(rope, _COLS) * _COLS
    padded_heads = pl.cdiv(heads, HEADS_PER_CTA) * HEADS_PER_CTA
    num_blocks = pl.cdiv(topk, BLOCK_K)
    q = jnp.pad(q, ((0, 0), (0, padded_heads - heads), (0, width - rank - rope)))
    slots = jnp.pad(slots.astype(jnp.int32), ((0, 0), (0, num_blocks * BLOCK_K - topk)), constant_values=-1)
    head_blocks = padded_heads // HEADS_PER_CTA
    if num_splits is None:
        num_splits = auto_num_splits(n_rows, head_blocks, num_blocks, target_programs=132,
                                      min_blocks_per_split=2)
    num_splits = max(1, min(num_splits, num_blocks))
    blocks_per_split = pl.cdiv(num_blocks, num_splits)
    num_splits = pl.cdiv(num_blocks, blocks_per_split)

    # As many [64, width] stages as shared memory holds next to q, P and the small buffers (2 at
    # DeepSeek's shapes); the ring must also hold the f32 output tile that aliases it at the end.
    stage_bytes = BLOCK_K * width * 2
    fixed_bytes = HEADS_PER_CTA * width * 2 + 2 * HEADS_PER_CTA * _HALF_K * 2 + 3 * 1024
    num_stages = min(_MAX_STAGES, (_SMEM_BYTES - fixed_bytes) // stage_bytes)
    num_stages = max(num_stages, pl.cdiv(HEADS_PER_CTA * rank * 4, stage_bytes))
    kernel = functools.partial(_kernel, rank=rank, rope=rope, width=width, tile=tile, num_blocks=num_blocks,
                               blocks_per_split=blocks_per_split, num_stages=num_stages,
                               qk_scale=float(scale) * _LOG2E)

    def entry(*refs):
        pl.run_scoped(
            lambda *scoped: kernel(*refs, scoped=(scoped[:5], scoped[5:])),
            plgpu.SMEM((HEADS_PER_CTA, width), jnp.bfloat16, transforms=_swizzled(jnp.bfloat16)),
            plgpu.RefUnion(
                plgpu.SMEM((num_stages, BLOCK_K, width), jnp.bfloat16, transforms=_swizzled(jnp.bfloat16)),
                (plgpu.SMEM((2, HEADS_PER_CTA, rank // 2), jnp.float32, transforms=_swizzled(jnp.float32, 128)),
                 plgpu.SMEM((HEADS_PER_CTA,), jnp.float32)),
            ),
            plgpu.SMEM((2, HEADS_PER_CTA, _HALF_K), jnp.float16, transforms=_swizzled(jnp.float16, 64)),
            plgpu.SMEM((2, HEADS_PER_CTA), jnp.float32),
            plgpu.SMEM((num_stages, BLOCK_K), jnp.int32),
            plgpu.Barrier(),
            plgpu.Barrier(num_barriers=num_stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=num_stages),
            plgpu.Barrier(num_barriers=num_stages),
            collective_axes="wg",
        )

    out, lse = plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct((num_splits, n_rows, padded_heads, rank), jnp.float32),
                  jax.ShapeDtypeStruct((num_splits, n_rows, padded_heads), jnp.float32)),
        grid=(n_rows, num_splits, head_blocks),  # heads fastest: a row's CTAs run together (L2 hits)
        grid_names=("rows", "splits", "heads"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
    )(q, *cache, k_pe, slots)
    out, lse = combine_splits(out, lse)
    return out[:, :heads], lse[:, :heads]
