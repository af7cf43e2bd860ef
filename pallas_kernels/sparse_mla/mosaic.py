"""Sparse MLA attention on Hopper through Pallas Mosaic GPU (wgmma, warp-specialised gathers).

Same semantics as `reference.sparse_mla_reference`: for each query row n and head h,
over the cache slots idx = slots[n, :] that are >= 0,
    score[j] = scale * (q[n, h, :R] . c[idx_j] + q[n, h, R:] . k_pe[idx_j])
    out[n, h] = softmax(score) @ c[idx],   lse[n, h] = logsumexp(score)
with out = 0, lse = +inf for rows with no valid slot. Caches: bf16, or FlashMLA's fp8 layout
(e4m3 latent + one f32 scale per 128 values + bf16 k_pe, as three arrays; the cache writes
power-of-two scales, jax_sparse_mla.ops.quantize_tiles, but any finite f32 scale dequantises as
value * scale).
P is rounded once to bf16 against the block's max; e4m3 x scale is rounded to bf16 (within 2^-8).
An fp8 prefill normally takes the upfront bf16 route instead (jax_sparse_mla.policy.dequantize_route).

One CTA = one query row x 64 heads x one split of the slot list: a producer warpgroup gathers the
selected cache rows, a scorer and an accumulator warpgroup run the products and the softmax.
Why Mosaic GPU: TMA cannot gather rows, so the gathers are per-thread `cp.async` behind
warp-specialised wgmma, which the Triton backend does not pipeline. Layout, what bounds it and the
measured variants: docs/design/sparse_mla.md.

GPU only: inline PTX has no interpreter, so on CPU the kernel can only be lowered (its CPU twin in
tests/test_sparse_mla.py checks that) and `api.sparse_mla` runs the Triton kernel; on a GPU the
`gpu`-marked tests check it against the reference.
"""


from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, memref, nvvm

from ..device import HOPPER_SMS, LN2, LOG2E, MAX_SWIZZLE, SMEM_BYTES
from ..mosaic_inline import (Int, c32, fp8_lane, fp8_row, fp8_scale_byte, fp8_scale_copy_bytes, fp8_scale_piece,
                             fp8_scale_unit, gather_unit, gep, global_ptr, scalar, swizzled_offset, unit_stride, warp_sync)
from .splits import auto_num_splits, combine_splits, live_blocks

HEADS_PER_CTA = 64  # wgmma's M
BLOCK_K = 64  # slots per pipeline stage
_SWIZZLE = 64  # bytes: 32 bf16 columns per smem tile
_COLS = _SWIZZLE // 2  # bf16 columns per swizzle tile
_CHUNK = 8  # bf16 values per 16-byte cp.async
_PRODUCER_THREADS = 128
_MAX_STAGES = 4
# setmaxnreg budgets. The kernel launches 384 threads at 168 registers (65536 / 384, rounded down
# to 8): the three must sum to 3 x 168 = 504, or an increase waits forever for registers.
_SCORER_REGS = 232  # warpgroup 0: its accumulator, S [64, 64] f32 and P
_ACCUMULATOR_REGS = 216  # warpgroup 1: its accumulator
_PRODUCER_REGS = 56
_END = 15  # named barrier over the two consumer warpgroups (Mosaic itself uses 0 and 1 + warpgroup)
_START = 14  # named barrier over the whole CTA, once: the landing barriers are initialised


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
    i64, i8 = (ir.IntegerType.get_signless(b) for b in (64, 8))
    stage = Int(scalar(stage))
    tid = Int(mgpu_utils.thread_idx()) % _PRODUCER_THREADS
    smem_base = gep(mgpu_utils.memref_ptr(kv_smem), stage * (BLOCK_K * width * 2), i8)

    def slot_of(j):
        """-> (valid i1, slot clamped to >= 0 as i64) of block row j (an Int)."""
        idx = memref.load(ids, [arith.index_cast(ir.IndexType.get(), j.value)])
        valid = arith.cmpi(arith.CmpIPredicate.sge, idx, c32(0))
        return valid, arith.extui(i64, arith.select(valid, idx, c32(0)))

    def dst(j, unit):
        """Shared address of block row j, bf16 columns [8 unit, 8 unit + 8) (16-byte unit `unit`)."""
        return gep(smem_base, swizzled_offset(j, unit, row_bytes=width * 2, swizzle=_SWIZZLE), i8)

    def units(per_row):
        """(row j, unit) of this thread over the block's rows, per_row units a row (BLOCK_K x per_row
        is a multiple of the 128 threads at every supported shape), as `gather_unit` spreads them."""
        for g0 in range(0, BLOCK_K * per_row, _PRODUCER_THREADS):
            yield gather_unit(tid + g0, per_row)

    def cp_async(j, chunk, src, row_elems, col, col_ok=None):
        """16 bytes of bf16 row slot(j) of src from column col -> dst(j, chunk); zeros if invalid."""
        valid, safe = slot_of(j)
        if col_ok is not None:
            valid = arith.andi(valid, col_ok)
        elem = Int(safe) * row_elems + arith.extui(i64, arith.select(valid, col.value, c32(0)))
        nvvm.cp_async_shared_global(dst(j, chunk), gep(src, elem, ir.BF16Type.get()), 16,
                                    nvvm.LoadCacheModifierKind.CG, cp_size=arith.select(valid, c32(16), c32(0)))

    def copy_rope():
        for j, chunk in units((width - rank) // _CHUNK):
            col = chunk * _CHUNK
            in_rope = arith.cmpi(arith.CmpIPredicate.ult, col.value, c32(rope))
            cp_async(j, chunk + rank // _CHUNK, global_ptr(k_pe), rope, col, in_rope)
        nvvm.cp_async_commit_group()

    if latent_scale is None:
        copy_rope()
        for j, chunk in units(rank // _CHUNK):
            cp_async(j, chunk, global_ptr(latent), rank, chunk * _CHUNK)
        nvvm.cp_async_commit_group()
    else:
        _fp8_per_thread(global_ptr(latent), global_ptr(latent_scale), copy_rope, slot_of, dst, tid,
                        rank=rank, tile=tile)


_FP8_PARTS = 4  # cp.async groups a thread's fp8 copies go out in (each converted as soon as it lands)


def _fp8_per_thread(latent_ptr, scale_ptr, copy_rope, slot_of, dst, tid, *, rank, tile):
    """fp8 latent: each producer thread cp.asyncs raw e4m3 chunks into the stage bytes that its own
    conversion overwrites, then dequantises them there. A warp's rows' f32 scales come in one copy
    a lane; past that, no thread reads what another one copied, so a block needs no barrier until
    it is whole (each thread waits for its own cp.async groups and its warp's).

    Thread t (lane r8 = t % 8, octet o = t / 8 % 4, warp w = t / 32: `fp8_lane`) owns block rows
    8 G + r8, G in (w, w + 4) (`fp8_row`), and of each the 16-value chunks c = 4 u + o
    (u < rank / 64). Chunk c becomes bf16 columns [16 c, 16 c + 16), 16-byte units 2 c and 2 c + 1
    of `dst`: the raw chunk lands in unit 2 c + 1. Eight lanes take eight rows of one unit
    (conflict-free, as `units`); an octet's four lanes of a row read 64 consecutive bytes of it.
    A row's scales (rank / tile f32; scale k at bytes 4 (k % 4) of unit 8 (k / 4), octet 0's:
    `fp8_scale_unit`, `fp8_scale_byte`) are copied by the lanes of octets 2 G' and 2 G' + 1 of its
    row group G' (half each, `fp8_scale_piece`), in the first group; each thread reads its rows'
    scales once that group has landed and its warp has synced, and the warp syncs again before any
    unit is overwritten. The copies go out in _FP8_PARTS groups (then k_pe's, copy_rope), each
    converted as soon as it has landed.
    """
    i32, i64, i8 = (ir.IntegerType.get_signless(b) for b in (32, 64, 8))
    f32 = ir.F32Type.get()
    vec4 = ir.VectorType.get((4,), i32)
    n_units, n_scales = rank // 64, rank // tile
    chunks_per_scale = tile // 16
    r8, octet, warp = fp8_lane(tid)
    n_groups = BLOCK_K // 32  # 8-row groups per warp
    rows = [fp8_row(warp, r8, g) for g in range(n_groups)]
    slots = [slot_of(j) for j in rows]
    # Unit 8 u + 2 o + h of a row sits `unit_stride(8 u)` bytes after unit 2 o + h: one address a
    # row and h, constant offsets.
    bases = [[dst(j, octet * 2 + h) for h in range(2)] for j in rows]
    unit_at = lambda g, u, h: gep(bases[g][h], unit_stride(8 * u, swizzle=_SWIZZLE), i8)
    part_units = max(1, n_units * n_groups // _FP8_PARTS)  # a thread's units per cp.async group
    parts = [(g, range(u0, min(u0 + part_units, n_units))) for g in range(n_groups) for u0 in range(0, n_units, part_units)]
    def scale_at(j, k):  # scale k (an Int or int) of row j
        return gep(dst(j, fp8_scale_unit(k)), fp8_scale_byte(k), i8)

    # The scales of row group o / 2's row, pieces half, half + 2, ... (o = 2 G' + half): the same
    # bytes twice where a row has one piece.
    half, group = octet % 2, octet // 2
    is_second = arith.cmpi(arith.CmpIPredicate.eq, group.value, c32(1))
    valid = arith.select(is_second, slots[1][0], slots[0][0])
    row_scales = gep(scale_ptr, Int(arith.select(is_second, slots[1][1], slots[0][1])) * n_scales, f32)
    row = Int(arith.select(is_second, rows[1].value, rows[0].value))
    piece = fp8_scale_copy_bytes(n_scales)
    n_pieces = n_scales * 4 // piece
    for i in range(-(-n_pieces // 2)):
        k = fp8_scale_piece(half, i, n_pieces=n_pieces, scales_per_piece=piece // 4)
        nvvm.cp_async_shared_global(scale_at(row, k), gep(row_scales, k, f32), piece,
                                    nvvm.LoadCacheModifierKind.CG if piece == 16 else nvvm.LoadCacheModifierKind.CA,
                                    cp_size=arith.select(valid, c32(piece), c32(0)))

    for g, us in parts:
        valid, safe = slots[g]
        size = lambda n: arith.select(valid, c32(n), c32(0))
        row_src = gep(latent_ptr, Int(safe) * rank + arith.extui(i64, (octet * 16).value), i8)
        for u in us:  # chunk 4 u + o: 64 u bytes after chunk o
            nvvm.cp_async_shared_global(unit_at(g, u, 1), gep(row_src, 64 * u, i8), 16,
                                        nvvm.LoadCacheModifierKind.CG, cp_size=size(16))
        nvvm.cp_async_commit_group()
    copy_rope()  # one more group: lands while the parts convert

    scales = {}
    for p, (g, us) in enumerate(parts):
        nvvm.cp_async_wait_group(len(parts) - p)  # this thread's copies of part p have landed
        if p == 0:  # the warp's scale copies (group 0) have landed: every scale into registers
            warp_sync()
            for g2, j in enumerate(rows):
                for k in range(n_scales):
                    scales[g2, k] = llvm.load(f32, scale_at(j, k), alignment=4)
            warp_sync()  # before any unit holding scales is overwritten
        for u in us:
            s = scales[g, 4 * u // chunks_per_scale]  # chunks 4 u + o, o < 4: one scale tile (tile % 64 == 0)
            data = llvm.load(vec4, unit_at(g, u, 1), alignment=16)
            words = []
            for k in range(4):
                word = llvm.extractelement(data, c32(k))
                words += mgpu_utils.inline_ptx(_FP8_TO_BF16, word, s, result_types=[i32, i32])
            for h in range(2):
                vec = llvm.mlir_undef(vec4)
                for k in range(4):
                    vec = llvm.insertelement(vec, words[4 * h + k], c32(k))
                llvm.store(vec, unit_at(g, u, h), alignment=16)


def _finite_or_zero(x):
    return jnp.where(x == -jnp.inf, 0.0, x)


def _opaque_zero():
    """An int32 0 the compiler cannot see through (inline PTX with side effects), made anew at each
    call. Indexing q's tile with it inside the block loop keeps the Q.K^T chain's 36 shared-memory
    descriptors of q there: loop-invariant, LLVM hoists them out of the loop, and 36 live 64-bit
    values next to the scorer's accumulator and S spill (208 bytes, reloaded every block); made in
    the loop they cost one 64-bit add each and nothing spills (docs/design/sparse_mla.md)."""

    @plgpu.inline_mgpu(return_type=plgpu.ShapeDtypeStruct((), jnp.int32, layout=plgpu.Layout.WG_SPLAT(())))
    def zero(ctx):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        value = mgpu_utils.inline_ptx("mov.u32 $0, 0;", result_types=i32, has_side_effects=True)
        return mgpu.FragmentedArray.splat(value, (), layout=mgpu.WGSplatFragLayout(()), is_signed=True)

    return zero()


def _sync_consumers():
    """`bar.sync` on named barrier _END over the two consumer warpgroups (256 threads): waits for
    both and orders this thread's earlier shared-memory accesses."""

    @plgpu.inline_mgpu()
    def barrier(ctx):
        del ctx
        mgpu_utils.inline_ptx(f"bar.sync {_END}, 256;", has_side_effects=True, convergent=True)

    return barrier()


# The landing barriers (one mbarrier a stage: its block's rows are in shared memory) are the
# kernel's own, in the slot-id buffer's last row: a bf16 producer thread arrives on one by
# cp.async.mbarrier.arrive.noinc, which needs its address, and Pallas barriers cannot be handed to
# inline_mgpu code.
def _landed_ptr(words, stage):
    """Shared address of stage `stage`'s landing mbarrier (8 bytes each in `words`, i32)."""
    return gep(mgpu_utils.memref_ptr(words), scalar(stage), ir.IntegerType.get_signless(64))


def _init_landed(ctx, words, *, stages):
    """Whole CTA, once: one thread initialises each stage's landing mbarrier for _PRODUCER_THREADS
    arrivals, then every thread passes named barrier _START."""
    del ctx
    first = mgpu_utils.single_thread_predicate(mgpu_utils.ThreadSubset.BLOCK)
    for k in range(stages):
        nvvm.mbarrier_init(_landed_ptr(words, c32(k)), c32(_PRODUCER_THREADS), predicate=first)
    mgpu_utils.inline_ptx(f"fence.mbarrier_init.release.cluster; bar.sync {_START}, {3 * 128};",
                          has_side_effects=True, convergent=True)


def _signal_landed(ctx, words, stage, *, converted):
    """Producer thread, after issuing its copies of a block: arrive on the stage's landing barrier
    once they have landed. bf16 (converted False): the arrival is the copies' own completion
    (cp.async.mbarrier.arrive.noinc), so the producer goes on to the next block at once; fp8: the
    thread has converted its copies in place, so it waits for the rest (k_pe), fences its shared
    stores to the async proxy and arrives."""
    del ctx
    ptr = _landed_ptr(words, stage)
    if converted:
        nvvm.cp_async_wait_group(0)
        mgpu_utils.inline_ptx("fence.proxy.async.shared::cta;", has_side_effects=True)
        mgpu_utils.inline_ptx("mbarrier.arrive.release.cta.shared::cta.b64 _, [$0];", ptr, has_side_effects=True)
    else:
        nvvm.cp_async_mbarrier_arrive(ptr, noinc=True)


def _wait_landed(ctx, words, stage, parity):
    """Consumer warpgroup: wait for phase `parity` of the stage's landing barrier, then fence so that
    this warpgroup's wgmma (async proxy) sees the producer's copies."""
    del ctx
    nvvm.mbarrier_try_wait_parity(_landed_ptr(words, stage), scalar(parity), c32(10_000_000))
    mgpu_utils.inline_ptx("fence.proxy.async.shared::cta;", has_side_effects=True)


def _kernel(*refs, scoped, rank, rope, width, tile, blocks_per_split, num_stages, qk_scale, block_heads):
    """refs: q [N, Hp, width] bf16, latent [S, R], (latent_scale [S, R / tile] f32 if fp8,)
    k_pe [S, P] bf16, slots [N, K_pad] i32, live [N] i32 (the row's blocks up to its last valid
    slot); out [splits, N, Hp, R] f32, lse [splits, N, Hp] f32. A CTA walks only its split's live
    blocks; one with none loads nothing and writes zeros and lse -inf."""
    q_gmem, latent_gmem, *cache_gmem, slots_gmem, live_gmem, out_gmem, lse_gmem = refs
    (q_smem, stage_mem, p_smem, x_smem, ids_smem), (q_bar, kv_free, ids_bar, p_ready, p_free) = scoped
    kv_smem, (o_smem, lse_smem) = stage_mem
    a_smem, l_smem = x_smem.at[0], x_smem.at[1]  # block i's rescale factor; 1 / l at the end
    head_block, row, split = lax.axis_index("heads"), lax.axis_index("rows"), lax.axis_index("splits")
    wg = lax.axis_index("wg")
    h0 = head_block * block_heads
    heads = pl.ds(0, block_heads)  # the CTA's real heads among its 64 q / out rows (the rest unused)
    first = split * blocks_per_split
    count = jnp.maximum(jnp.minimum(blocks_per_split, live_gmem[row] - first), 0)
    half_r = rank // 2
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    scalar = plgpu.Layout.WG_SPLAT(())
    landed = ids_smem.at[num_stages]  # the stages' landing mbarriers (8 bytes each, see _landed_ptr)
    plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))(functools.partial(_init_landed, stages=num_stages))(landed)
    wait_landed = plgpu.inline_mgpu(arg_types=(plgpu.RefType(), scalar, scalar))(_wait_landed)
    col_layout = plgpu.Layout.WGMMA.reduce(0)

    def store_out(w, acc, inv_l):
        # o_smem aliases the stage ring: safe once both warpgroups passed _END (every PV waited)
        o_smem[w] = acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[w, heads], out_gmem.at[split, row, pl.ds(h0, block_heads),
                                                                 pl.ds(w * half_r, half_r)])

    @pl.when(wg == 0)
    def _scorer():
        plgpu.set_max_registers(_SCORER_REGS, action="increase")

        @pl.when(count > 0)
        def _():
            plgpu.copy_gmem_to_smem(q_gmem.at[row, pl.ds(h0, block_heads)], q_smem.at[0, heads], q_bar)
            plgpu.barrier_wait(q_bar)

        def step(i, carry):
            acc, m, l = carry  # acc [64, R/2] f32 (WGMMA); m, l [64] f32 (log2 units)
            stage = lax.rem(i, num_stages)
            # the slot ids (for the -1 mask) load while the block is still landing
            idx = plgpu.load(slots_gmem.at[row, pl.ds((first + i) * BLOCK_K, BLOCK_K)],
                             layout=col_layout, optimized=False)
            wait_landed(landed, stage, lax.rem(lax.div(i, num_stages), 2))

            def qk(s_ref):  # S = Q . K^T, [64, 64]
                plgpu.wgmma(s_ref, q_smem.at[_opaque_zero()], kv_smem.at[stage].T)
                return s_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((HEADS_PER_CTA, BLOCK_K), jnp.float32))
            valid = lax.broadcast_in_dim(idx >= 0, s.shape, [1])
            s = jnp.where(valid, s * qk_scale, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            shift = _finite_or_zero(m_new)  # rows with no valid slot yet: exp2(-inf) = 0
            p = jnp.exp2(s - lax.broadcast_in_dim(shift, s.shape, [0]))
            alpha = jnp.exp2(m - shift)
            l = l * alpha + jnp.sum(p, axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            probs = p.astype(jnp.bfloat16)

            @pl.when(i > 0)
            def _():
                plgpu.barrier_wait(p_free)  # warpgroup 1 is done with block i - 1's P and alpha

            p_smem[...] = probs
            a_smem[...] = alpha
            plgpu.commit_smem()
            plgpu.barrier_arrive(p_ready)

            def pv(acc_ref):  # out[:, :R/2] += P . V, P from registers
                plgpu.wgmma(acc_ref, probs, kv_smem.at[stage, :, pl.ds(0, half_r)])

            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(kv_free.at[stage])
            return acc, m_new, l

        acc = plgpu.layout_cast(jnp.zeros((HEADS_PER_CTA, half_r), jnp.float32), plgpu.Layout.WGMMA)
        m = plgpu.layout_cast(jnp.full((HEADS_PER_CTA,), -jnp.inf, jnp.float32), row_layout)
        l = plgpu.layout_cast(jnp.zeros((HEADS_PER_CTA,), jnp.float32), row_layout)
        acc, m, l = lax.fori_loop(0, count, step, (acc, m, l))
        empty = l == 0.0
        inv_l = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))
        l_smem[...] = inv_l
        _sync_consumers()  # both past their last PV: the ring is free for o_smem
        store_out(0, acc, inv_l)
        lse_smem[...] = jnp.where(empty, -jnp.inf, (m + jnp.log2(jnp.where(empty, 1.0, l))) * LN2)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(lse_smem.at[heads], lse_gmem.at[split, row, pl.ds(h0, block_heads)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _accumulator():
        plgpu.set_max_registers(_ACCUMULATOR_REGS, action="increase")

        def step(i, acc):
            stage = lax.rem(i, num_stages)
            wait_landed(landed, stage, lax.rem(lax.div(i, num_stages), 2))
            plgpu.barrier_wait(p_ready)
            alpha = plgpu.load(a_smem, layout=row_layout)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

            def pv(acc_ref):  # out[:, R/2:] += P . V, P from shared memory
                plgpu.wgmma(acc_ref, p_smem, kv_smem.at[stage, :, pl.ds(half_r, half_r)])

            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(p_free)
            plgpu.barrier_arrive(kv_free.at[stage])
            return acc

        acc = plgpu.layout_cast(jnp.zeros((HEADS_PER_CTA, half_r), jnp.float32), plgpu.Layout.WGMMA)
        acc = lax.fori_loop(0, count, step, acc)
        _sync_consumers()
        store_out(1, acc, plgpu.load(l_smem, layout=row_layout))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _producer():
        plgpu.set_max_registers(_PRODUCER_REGS, action="decrease")
        gather = plgpu.inline_mgpu(
            arg_types=(plgpu.RefType(_swizzled(jnp.bfloat16)), plgpu.RefType(),
                       *(plgpu.RefType() for _ in cache_gmem), plgpu.RefType(), scalar))(
            functools.partial(_gather_block, rank=rank, rope=rope, width=width, tile=tile))
        signal_landed = plgpu.inline_mgpu(arg_types=(plgpu.RefType(), scalar))(
            functools.partial(_signal_landed, converted=tile is not None))

        def fetch_ids(i):  # block i's slot ids -> ids_smem[stage], one block ahead of its gather
            stage = lax.rem(i, num_stages)
            plgpu.copy_gmem_to_smem(slots_gmem.at[row, pl.ds((first + i) * BLOCK_K, BLOCK_K)],
                                    ids_smem.at[stage], ids_bar.at[stage])

        @pl.when(count > 0)
        def _():
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
            signal_landed(landed, stage)

            @pl.when(i + 1 < count)
            def _():
                plgpu.barrier_wait(ids_bar.at[lax.rem(i + 1, num_stages)])


def unsupported_reason(q, latent, latent_scale, k_pe):
    """None if `sparse_mla_mosaic` takes these operands (shapes as there), else why not."""
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


def sparse_mla_mosaic(q, latent, latent_scale, k_pe, slots, *, scale, num_splits=None):
    """Sparse MLA attention as a Mosaic GPU kernel (Hopper). Same contract as
    `api.sparse_mla`: q [N, H, R + P] bf16; latent [S, R] bf16, or
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
    # A CTA computes 64 heads (wgmma's M); fewer real ones (16 / 32 a tensor shard) are read and
    # written as they are, the tile's other rows left unused, so q and out need no padding copy.
    # Head counts of neither kind (not a multiple of 8 below 64, or of 64 above) are padded.
    block_heads = heads if heads < HEADS_PER_CTA and heads % 8 == 0 else HEADS_PER_CTA
    padded_heads = pl.cdiv(heads, block_heads) * block_heads
    num_blocks = pl.cdiv(topk, BLOCK_K)
    q = jnp.pad(q, ((0, 0), (0, padded_heads - heads), (0, width - rank - rope)))  # a no-op pad is elided
    slots = jnp.pad(slots.astype(jnp.int32), ((0, 0), (0, num_blocks * BLOCK_K - topk)), constant_values=-1)
    live = live_blocks(slots, BLOCK_K)
    head_blocks = padded_heads // block_heads
    if num_splits is None:
        num_splits = auto_num_splits(n_rows, head_blocks, num_blocks, wave=HOPPER_SMS)  # a CTA an SM
    num_splits = max(1, min(num_splits, num_blocks))
    blocks_per_split = pl.cdiv(num_blocks, num_splits)
    num_splits = pl.cdiv(num_blocks, blocks_per_split)

    # As many [64, width] stages as shared memory holds next to q, P and the small buffers (2 at
    # DeepSeek's shapes); the ring must also hold the f32 output tile that aliases it at the end.
    stage_bytes = BLOCK_K * width * 2
    fixed_bytes = HEADS_PER_CTA * width * 2 + HEADS_PER_CTA * BLOCK_K * 2 + 3 * 1024
    num_stages = min(_MAX_STAGES, (SMEM_BYTES - fixed_bytes) // stage_bytes)
    num_stages = max(num_stages, pl.cdiv(HEADS_PER_CTA * rank * 4, stage_bytes))
    kernel = functools.partial(_kernel, rank=rank, rope=rope, width=width, tile=tile,
                               blocks_per_split=blocks_per_split, num_stages=num_stages,
                               qk_scale=float(scale) * LOG2E, block_heads=block_heads)

    def entry(*refs):
        pl.run_scoped(
            lambda *scoped: kernel(*refs, scoped=(scoped[:5], scoped[5:])),
            plgpu.SMEM((1, HEADS_PER_CTA, width), jnp.bfloat16, transforms=_swizzled(jnp.bfloat16)),
            plgpu.RefUnion(
                plgpu.SMEM((num_stages, BLOCK_K, width), jnp.bfloat16, transforms=_swizzled(jnp.bfloat16)),
                (plgpu.SMEM((2, HEADS_PER_CTA, rank // 2), jnp.float32, transforms=_swizzled(jnp.float32, MAX_SWIZZLE)),
                 plgpu.SMEM((HEADS_PER_CTA,), jnp.float32)),
            ),
            plgpu.SMEM((HEADS_PER_CTA, BLOCK_K), jnp.bfloat16, transforms=_swizzled(jnp.bfloat16)),
            plgpu.SMEM((2, HEADS_PER_CTA), jnp.float32),
            plgpu.SMEM((num_stages + 1, BLOCK_K), jnp.int32),  # slot ids a stage; the landing barriers
            plgpu.Barrier(),
            plgpu.Barrier(num_arrivals=2, num_barriers=num_stages),
            plgpu.Barrier(num_barriers=num_stages),
            plgpu.Barrier(),
            plgpu.Barrier(),
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
    )(q, *cache, k_pe, slots, live)
    out, lse = combine_splits(out, lse)
    return out[:, :heads], lse[:, :heads]
