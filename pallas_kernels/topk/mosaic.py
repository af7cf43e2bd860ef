"""The top-k write sweep on Hopper through Pallas Mosaic GPU (one warp a row, in registers), and
the band's selection by the same warp.

Same contract as the Triton write kernel of `triton.topk_stages` with one slice a row: for row n
(its first lengths[n] columns), the columns of definite keys (>= t_hi) go to out[n, 0..] and band
keys (in [t_lo, t_hi)) with their columns to bkey / bcol[n, 0..], each in column order, entries
past k / cap dropped (bit-identical to the Triton sweep's); cnt[n, 0] = (definite, band, valid,
done). Then, when the band holds the rest of the answer (the select kernel's band path), the warp
appends the band's selected keys and the -1 padding itself and sets done = 1: the select kernel
(still launched, for the other rows) skips the row. The same index sets as the select kernel's
band path; the band's keys may come in another order. Needs L % 4 == 0 and cap % 4 == 0 (16-byte
row starts); `triton.topk_stages` takes this kernel only then.

Why a second kernel: the Triton sweep is bound by its block scans' shared-memory traffic; here a
warp owns a row and ranks and compacts its keys in registers (shuffle scans, ballots). Inline PTX
and MLIR (`plgpu.inline_mgpu`): GPU only, no interpreter. Design and measured variants:
docs/design/topk.md.
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
from jaxlib.mlir.dialects import arith, llvm, scf

from ..mosaic_inline import (Int, c32, first_bin, gep, global_ptr, lane_and_warp, lane_vector, last_float4, load_ptx,
                             scalar, smax, smin, warp_ptx)
from .keys import _INVALID, _KEY_LOW, _KEY_POS_INF, _LOW31, _SIGN

_LOADS = 8  # float4 loads a lane an iteration: 32 keys a lane, 1024 a warp
_WARPS = 4  # rows (warps) a CTA
_BINS = 256  # radix digit of the band select: 8 bits a pass


_SCAN = """{
.reg .b32 t;
.reg .pred p;
mov.b32 $0, $2;
shfl.sync.up.b32 t|p, $0, 1, 0, 0xffffffff;
@p add.u32 $0, $0, t;
shfl.sync.up.b32 t|p, $0, 2, 0, 0xffffffff;
@p add.u32 $0, $0, t;
shfl.sync.up.b32 t|p, $0, 4, 0, 0xffffffff;
@p add.u32 $0, $0, t;
shfl.sync.up.b32 t|p, $0, 8, 0, 0xffffffff;
@p add.u32 $0, $0, t;
shfl.sync.up.b32 t|p, $0, 16, 0, 0xffffffff;
@p add.u32 $0, $0, t;
shfl.sync.idx.b32 $1, $0, 31, 31, 0xffffffff;
}"""  # $2 -> ($0 inclusive warp scan, $1 the warp's total); byte lanes never carry (each <= 128)


def _cmp(pred, a, b):
    """arith.cmpi by predicate name ("slt", "ult", ...)."""
    return arith.cmpi(getattr(arith.CmpIPredicate, pred), a, b)


def _write_rows(ctx, x, lengths, thr, out, bkey, bcol, cnt, hist, block, *, n_rows, num_keys, k, cap):
    """Warp w of CTA `block` sweeps row n = _WARPS * block + w (if n < n_rows)."""
    del ctx
    i32, i64 = (ir.IntegerType.get_signless(b) for b in (32, 64))
    cmp = _cmp
    lane, warp = lane_and_warp(Int(mgpu_utils.thread_idx()))
    n = Int(scalar(block)) * _WARPS + warp
    row_at = lambda ref, width: gep(global_ptr(ref), Int(arith.extui(i64, n.value)) * width, i32)  # noqa: E731
    with mgpu_utils.when(cmp("slt", n.value, c32(n_rows))):
        row_len = llvm.load(i32, gep(global_ptr(lengths), n, i32))
        thr_row = row_at(thr, 2)
        t_lo, t_hi = llvm.load(i32, thr_row), llvm.load(i32, gep(thr_row, 1, i32))
        # [t_lo, t_hi) as key - t_lo < width, unsigned (the width can exceed 2^31); empty if t_lo > t_hi
        band_width = arith.select(cmp("sle", t_lo, t_hi), arith.subi(t_hi, t_lo), c32(0))
        x_row, out_row, bkey_row, bcol_row = (row_at(x, num_keys), row_at(out, k), row_at(bkey, cap),
                                              row_at(bcol, cap))
        lane_col = lane * 4
        last_load = last_float4(Int(row_len))

        per_iter = 32 * 4 * _LOADS

        def load(it):
            """The lane's _LOADS float4s of columns [per_iter it, per_iter (it + 1)) as i32 bits,
            addresses held within the row's float4s (its first if it has none): past the row's
            end they repeat its last float4, which `sweep` masks."""
            vals = []
            for j in range(_LOADS):
                at = smax(smin(lane_vector(Int(it), j, lane_col, vec=4, loads=_LOADS), last_load), 0)
                vals.append(mgpu_utils.inline_ptx("ld.global.nc.L1::no_allocate.v4.b32 {$0, $1, $2, $3}, [$4];",
                                                  gep(x_row, at, i32), result_types=[i32] * 4))
            return vals

        def store(cols, scans, words, run_def, run_band, checked):
            """Each selected key's entries at its offset (checked: those past k / cap dropped)."""
            base = c32(0)  # packed offset of float4 j within the iteration
            for j, (c0, sel) in enumerate(cols):
                incl, total = scans[j // 2]
                field = lambda v: arith.andi(arith.shrui(v, c32(8 * (j % 2))), c32(0x00FF00FF))  # noqa: E731
                own = arith.subi(field(incl), field(words[j // 2]))  # exclusive: the lanes before
                start = arith.addi(base, own)
                for e, (is_def, is_band, key, prefix) in enumerate(sel):
                    at = arith.addi(start, prefix)
                    col = (c0 + e).value
                    pos = arith.addi(run_def, arith.andi(at, c32(0xFFFF)))
                    st = arith.andi(is_def, cmp("ult", pos, c32(k))) if checked else is_def
                    mgpu_utils.inline_ptx("st.global.b32 [$0], $1;", gep(out_row, pos, i32), col, predicate=st)
                    pos = arith.addi(run_band, arith.shrui(at, c32(16)))
                    st = arith.andi(is_band, cmp("ult", pos, c32(cap))) if checked else is_band
                    mgpu_utils.inline_ptx("st.global.b32 [$0], $1;", gep(bkey_row, pos, i32), key, predicate=st)
                    mgpu_utils.inline_ptx("st.global.b32 [$0], $1;", gep(bcol_row, pos, i32), col, predicate=st)
                base = arith.addi(base, field(total))

        def sweep(it, vals, carry, masked):
            """Columns [per_iter it, per_iter (it + 1)) of the row, loaded as vals (masked: the row
            ends among them) -> the new (definite, band, valid) counts."""
            run_def, run_band, valid = carry
            cols, words = [], [c32(0)] * (_LOADS // 2)
            for j in range(_LOADS):
                c0 = lane_vector(Int(it), j, lane_col, vec=4, loads=_LOADS)
                prefix, sel = c32(0), []
                for e, b in enumerate(vals[j]):
                    key = arith.xori(b, arith.andi(arith.shrsi(b, c32(31)), c32(_LOW31)))
                    ok = cmp("ule", arith.subi(key, c32(_KEY_LOW)), c32(_KEY_POS_INF - _KEY_LOW))  # not NaN / -inf
                    if masked:
                        ok = arith.andi(ok, cmp("slt", (c0 + e).value, row_len))
                    valid = arith.addi(valid, arith.extui(i32, ok))
                    key = arith.select(ok, key, c32(_INVALID))
                    is_def = cmp("sge", key, t_hi)
                    is_band = cmp("ult", arith.subi(key, t_lo), band_width)
                    unit = arith.select(is_def, c32(1), arith.select(is_band, c32(1 << 16), c32(0)))
                    sel.append((is_def, is_band, key, prefix))
                    prefix = arith.addi(prefix, unit)
                cols.append((c0, sel))
                # float4 j's (definite | band << 16) count, in byte j % 2 of each half of word j // 2
                words[j // 2] = arith.addi(words[j // 2], arith.shli(prefix, c32(8 * (j % 2))))
            scans = [mgpu_utils.inline_ptx(_SCAN, w, result_types=[i32, i32], convergent=True) for w in words]
            # Offsets past k / cap are checked only in an iteration that reaches them (the rare
            # one: the thresholds expect ~k definite keys a row and the band to fit).
            base = c32(0)
            for j in range(_LOADS):
                base = arith.addi(base, arith.andi(arith.shrui(scans[j // 2][1], c32(8 * (j % 2))), c32(0x00FF00FF)))
            fits = arith.andi(cmp("sle", arith.addi(run_def, arith.andi(base, c32(0xFFFF))), c32(k)),
                              cmp("sle", arith.addi(run_band, arith.shrui(base, c32(16))), c32(cap)))
            if_op = scf.IfOp(fits, [], has_else=True)
            for region, checked in ((if_op.then_block, False), (if_op.else_block, True)):
                with ir.InsertionPoint(region):
                    store(cols, scans, words, run_def, run_band, checked)
                    scf.yield_([])
            return (arith.addi(run_def, arith.andi(base, c32(0xFFFF))),
                    arith.addi(run_band, arith.shrui(base, c32(16))), valid)

        n_full = arith.divui(row_len, c32(per_iter))
        has_tail = arith.extui(i32, cmp("ne", arith.remui(row_len, c32(per_iter)), c32(0)))
        # The next iteration's loads go out before this one's keys are ranked: a warp has a row,
        # and at ~1024 rows an SM holds ~8 warps, too few to hide the loads' latency otherwise.
        def step(it, state):
            carry, vals = state
            ahead = load(arith.addi(it, c32(1)))
            return sweep(it, vals, carry, masked=False), ahead

        carry, vals = mgpu_utils.fori(n_full, ((c32(0),) * 3, load(c32(0))))(step).results
        c_def, c_band, valid = mgpu_utils.fori(has_tail, carry)(
            lambda _, carry: sweep(n_full, vals, carry, masked=True)).results
        valid = mgpu_utils.inline_ptx("redux.sync.add.s32 $0, $1, 0xffffffff;", valid, result_types=i32,
                                      convergent=True)
        done = _select_band(hist, lane, warp, c_def, c_band, valid, t_lo, t_hi, out_row, bkey_row, bcol_row,
                            k=k, cap=cap)
        mgpu_utils.inline_ptx("st.global.v4.b32 [$0], {$1, $2, $3, $4};", row_at(cnt, 4), c_def, c_band, valid,
                              done, predicate=cmp("eq", lane.value, c32(0)))


def _select_band(hist, lane, warp, n_def, n_band, n_valid, t_lo, t_hi, out_row, bkey_row, bcol_row, *, k, cap):
    """After the sweep, in the same warp: when the band holds the rest of the row's answer (as
    `triton._band_holds_answer`), append the band's (min(k, valid) - definite) largest keys'
    columns to out[n] after the definite ones, -1 past them -> 1 (the row is done: the select
    kernel skips it), else 0.

    The rank-th largest band key by radix select, 8 bits a pass from the highest bit where
    t_lo and t_hi - 1 differ (the band's keys share the bits above it; a band within one
    binade: 2-3 passes), each pass a 256-bin histogram in the warp's shared memory over the
    band (L2: the sweep just wrote it); then one pass writes the keys above it and, in band
    (column) order, as many equal to it as the rank leaves, positions from ballots."""
    i1, i32 = (ir.IntegerType.get_signless(b) for b in (1, 32))
    cmp = _cmp
    n_sel = arith.minsi(n_valid, c32(k))
    done = arith.andi(arith.andi(cmp("sle", n_def, n_sel), cmp("sge", arith.addi(n_def, n_band), n_sel)),
                      cmp("sle", n_band, c32(cap)))
    rank = arith.subi(n_sel, n_def)
    take_all = cmp("eq", rank, n_band)
    search = arith.andi(done, arith.andi(cmp("sgt", rank, c32(0)), arith.xori(take_all, arith.constant(i1, 1))))
    u_lo = arith.xori(t_lo, c32(_SIGN))
    differ = arith.xori(u_lo, arith.xori(arith.subi(t_hi, c32(1)), c32(_SIGN)))
    top_byte = arith.shrui(arith.subi(c32(31), warp_ptx("clz.b32 $0, $1;", differ)), c32(3))
    n_passes = arith.select(arith.andi(search, cmp("ne", differ, c32(0))), arith.addi(top_byte, c32(1)), c32(0))
    above_all = arith.select(cmp("eq", n_passes, c32(4)), c32(0), arith.shli(c32(-1), arith.muli(n_passes, c32(8))))
    mgpu_utils.inline_ptx("fence.acq_rel.cta; bar.warp.sync 0xffffffff;", has_side_effects=True, convergent=True)
    hist = gep(mgpu_utils.memref_ptr(hist), warp * _BINS, i32)
    chunks = lambda n, per: arith.divui(arith.addi(n, c32(per - 1)), c32(per))  # noqa: E731

    def radix_pass(p, state):
        prefix, remaining = state
        shift = arith.muli(arith.subi(arith.subi(n_passes, c32(1)), p), c32(8))
        known = arith.select(cmp("eq", shift, c32(24)), c32(0), arith.shli(c32(-1), arith.addi(shift, c32(8))))
        zero = c32(0)
        mgpu_utils.inline_ptx("st.shared.v4.b32 [$0], {$1, $1, $1, $1};", gep(hist, lane * 8, i32), zero,
                              has_side_effects=True)
        mgpu_utils.inline_ptx("st.shared.v4.b32 [$0], {$1, $1, $1, $1};", gep(hist, lane * 8 + 4, i32), zero,
                              has_side_effects=True)
        mgpu_utils.inline_ptx("bar.warp.sync 0xffffffff;", has_side_effects=True, convergent=True)

        def count(c, carry):  # _LOADS float4s of band keys a lane, loaded together
            i0 = [lane_vector(Int(c), j, lane * 4, vec=4, loads=_LOADS) for j in range(_LOADS)]
            keys = [load_ptx("ld.global.cg.v4.b32 {$0, $1, $2, $3}, [$4];", gep(bkey_row, smin(i, cap - 4), i32), n=4)
                    for i in i0]
            for i, four in zip(i0, keys):
                for e, key in enumerate(four):
                    u = arith.xori(key, c32(_SIGN))
                    mine = arith.andi(cmp("slt", (i + e).value, n_band),
                                      cmp("eq", arith.andi(u, known), arith.andi(prefix, known)))
                    digit = arith.andi(arith.shrui(u, shift), c32(_BINS - 1))
                    mgpu_utils.inline_ptx("red.shared.add.u32 [$0], 1;", gep(hist, digit, i32), predicate=mine)
            return carry

        mgpu_utils.fori(chunks(n_band, 128 * _LOADS), c32(0))(count)
        mgpu_utils.inline_ptx("bar.warp.sync 0xffffffff;", has_side_effects=True, convergent=True)
        # lane L holds digits 255 - 8 L - j, j < 8 (descending): the keys above its digits are the
        # lanes before it (an exclusive scan), then its own in order
        first = first_bin(lane, _BINS)
        lo4 = load_ptx("ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", gep(hist, first, i32), n=4)
        hi4 = load_ptx("ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", gep(hist, first + 4, i32), n=4)
        counts = list(hi4[::-1]) + list(lo4[::-1])  # digits first + 7, ..., first
        own = c32(0)
        for h in counts:
            own = arith.addi(own, h)
        incl, _ = mgpu_utils.inline_ptx(_SCAN, own, result_types=[i32, i32], convergent=True)
        cum = arith.subi(incl, own)
        hit_any, digit, before = arith.constant(i1, 0), c32(0), c32(0)
        for j, h in enumerate(counts):
            nxt = arith.addi(cum, h)
            hit = arith.andi(cmp("slt", cum, remaining), cmp("sge", nxt, remaining))
            digit = arith.select(hit, (first + 7 - j).value, digit)
            before = arith.select(hit, cum, before)
            hit_any = arith.ori(hit_any, hit)
            cum = nxt
        who = warp_ptx("bfind.u32 $0, $1;", warp_ptx("vote.sync.ballot.b32 $0, $1, 0xffffffff;", hit_any))
        digit = warp_ptx("shfl.sync.idx.b32 $0, $1, $2, 31, 0xffffffff;", digit, who)
        before = warp_ptx("shfl.sync.idx.b32 $0, $1, $2, 31, 0xffffffff;", before, who)
        mgpu_utils.inline_ptx("bar.warp.sync 0xffffffff;", has_side_effects=True, convergent=True)
        return arith.ori(prefix, arith.shli(digit, shift)), arith.subi(remaining, before)

    prefix, remaining = mgpu_utils.fori(n_passes, (arith.andi(u_lo, above_all), rank))(radix_pass).results
    pivot = arith.select(take_all, c32(0), prefix)  # take_all: every band key is above 0
    n_above = arith.subi(rank, remaining)  # band keys above the pivot, all taken
    lanes_before = warp_ptx("mov.u32 $0, %lanemask_lt;")
    popc = lambda v: warp_ptx("popc.b32 $0, $1;", v)  # noqa: E731

    def compact(c, state):  # _LOADS x 32 band entries, loaded together, ranked by ballots
        run_gt, run_eq = state
        entries = []
        for j in range(_LOADS):
            i = lane_vector(Int(c), j, lane, vec=1, loads=_LOADS)
            at = smin(i, cap - 1)
            entries.append((i, load_ptx("ld.global.cg.b32 $0, [$1];", gep(bkey_row, at, i32)),
                            load_ptx("ld.global.cg.b32 $0, [$1];", gep(bcol_row, at, i32))))
        for i, key, col in entries:
            inside = cmp("slt", i.value, n_band)
            u = arith.xori(key, c32(_SIGN))
            gt = arith.andi(inside, cmp("ugt", u, pivot))
            eq = arith.andi(inside, cmp("eq", u, pivot))
            b_gt = warp_ptx("vote.sync.ballot.b32 $0, $1, 0xffffffff;", gt)
            b_eq = warp_ptx("vote.sync.ballot.b32 $0, $1, 0xffffffff;", eq)
            eq_rank = arith.addi(run_eq, popc(arith.andi(b_eq, lanes_before)))
            pos = arith.select(gt, arith.addi(run_gt, popc(arith.andi(b_gt, lanes_before))),
                               arith.addi(n_above, eq_rank))
            take = arith.ori(gt, arith.andi(eq, cmp("slt", eq_rank, remaining)))
            mgpu_utils.inline_ptx("st.global.b32 [$0], $1;", gep(out_row, Int(n_def) + pos, i32), col, predicate=take)
            run_gt, run_eq = arith.addi(run_gt, popc(b_gt)), arith.addi(run_eq, popc(b_eq))
        return run_gt, run_eq

    n_compact = arith.select(arith.andi(done, cmp("sgt", rank, c32(0))), chunks(n_band, 32 * _LOADS), c32(0))
    mgpu_utils.fori(n_compact, (c32(0), c32(0)))(compact)

    def pad(c, carry):
        i = Int(n_sel) + (Int(c) * 32 + lane)
        mgpu_utils.inline_ptx("st.global.b32 [$0], $1;", gep(out_row, i, i32), c32(-1),
                              predicate=cmp("slt", i.value, c32(k)))
        return carry

    mgpu_utils.fori(arith.select(done, chunks(arith.subi(c32(k), n_sel), 32), c32(0)), c32(0))(pad)
    return arith.extui(i32, done)


def topk_write(x, lengths, thr, *, k, cap):
    """x [N, L] f32 (L % 4 == 0), lengths [N] int32 in [0, L], thr [N, 2] int32 (t_lo, t_hi)
    -> (out [N, k], band keys [N, cap], band columns [N, cap], counts [N, 1, 4]) int32, as
    `triton._write_kernel` with one slice a row (entries it does not write are undefined), plus,
    for the rows it marks done (counts[n, 0, 3] = 1), the whole answer in out[n]."""
    n_rows, num_keys = x.shape
    if num_keys % 4 or cap % 4:
        raise ValueError(f"topk_write: the row length and the band capacity must be multiples of 4 "
                         f"(16-byte rows), got {num_keys} and {cap}")
    int32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    body = functools.partial(_write_rows, n_rows=n_rows, num_keys=num_keys, k=k, cap=cap)

    def entry(*refs):
        plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 8 + (plgpu.Layout.WG_SPLAT(()),))(body)(
            *refs, lax.axis_index("rows"))

    return plgpu.kernel(
        entry,
        out_type=(int32(n_rows, k), int32(n_rows, cap), int32(n_rows, cap), int32(n_rows, 1, 4)),
        scratch_types=(plgpu.SMEM((_WARPS, _BINS), jnp.int32),),
        grid=(pl.cdiv(n_rows, _WARPS),),
        grid_names=("rows",),
        compiler_params=plgpu.CompilerParams(),
        kernel_name="topk_write",
    )(x, lengths, thr)

