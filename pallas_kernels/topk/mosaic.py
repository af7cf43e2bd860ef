"""Top-k on Hopper through Pallas Mosaic GPU: a row's thresholds, write sweep and band selection
in one kernel, one warp a row.

For row n (its first lengths[n] columns), the warp
  1. loads the row's threshold sample (the runs of 8 columns `triton._threshold_kernel` samples)
     into registers and finds t_lo = its r_lo-th largest key and t_hi = the key just above its
     r_hi-th (exact ranks, where the Triton kernel stops its count search within a tolerance):
     two radix selects at once, 8 bits a pass, in histograms of its own in shared memory;
  2. sweeps the row as the Triton write kernel with one slice a row does: the columns of
     definite keys (>= t_hi) to out[n, 0..], band keys (in [t_lo, t_hi)) with their columns to
     bkey / bcol[n, 0..], each in column order, entries past k / cap dropped; cnt[n, 0] =
     (definite, band, valid, done);
  3. when the band holds the rest of the answer (the select kernel's band path), appends the
     band's selected keys and the -1 padding and sets done = 1: the select kernel (still
     launched, for the other rows) skips the row.

Why: the Triton sweep is bound by its block scans' shared-memory traffic (L1/TEX 71-75% busy,
66-78 instructions a key, docs/design/topk.md), and its threshold and select kernels by the
latency of their dependent count passes. Here the sweep keeps everything in registers: each
iteration a lane loads _LOADS float4s (the warp's loads coalesced, 512 bytes each), ranks its keys
within each float4, and the warp turns the float4s' counts into offsets with shuffle scans of
byte-packed counters (four 32-bit words carry the definite and band counts of the 8 float4s);
predicated scalar stores write the selected entries, checked against k and cap only in an
iteration whose counts reach them. The next iteration's loads are issued before this one's keys
are ranked (a warp a row leaves ~8 warps an SM at 1024 rows: too few to hide the loads
otherwise). Inline PTX and MLIR (`plgpu.inline_mgpu`): GPU only, no interpreter. Measured
variants: docs/design/topk.md.

Needs L % 4 == 0 and cap % 4 == 0 (16-byte row starts) and a sample of <= MAX_SAMPLE keys;
`triton.topk_stages` takes this kernel only then.
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

from .keys import _KEY_ABOVE, _KEY_LOW, _KEY_POS_INF, _LOW31, _RUN, _RUN_HASH, _SIGN  # key ^ _SIGN: unsigned order

_LOADS = 8  # float4 loads a lane an iteration: 32 keys a lane, 1024 a warp
_WARPS = 4  # rows (warps) a CTA
MAX_SAMPLE = 4096  # threshold sample sizes the kernel takes (128 keys a lane)


def _scalar(v):
    """The ir.Value of a scalar inline_mgpu argument (a splat FragmentedArray or a value)."""
    return v.registers.flat[0] if hasattr(v, "registers") else v


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


# MLIR building blocks (called while the kernel is lowered)
def _i32():
    return ir.IntegerType.get_signless(32)


def _c(v):
    return arith.constant(_i32(), v)


def _cmp(pred, a, b):
    return arith.cmpi(getattr(arith.CmpIPredicate, pred), a, b)


def _gep(base, off):
    """&base[off] of an i32 pointer, off i32."""
    return llvm.getelementptr(base.type, base, [off], [mgpu_utils.DYNAMIC32], _i32(), llvm.GEPNoWrapFlags.none)


def _ptx(text, *args, result=True):
    """Warp-level inline PTX: one i32 result, or none (a side effect)."""
    return mgpu_utils.inline_ptx(text, *args, result_types=_i32() if result else None, convergent=True,
                                 has_side_effects=not result)


def _warp_sync():
    _ptx("bar.warp.sync 0xffffffff;", result=False)


def _store(ptr, value, predicate):
    mgpu_utils.inline_ptx("st.global.b32 [$0], $1;", ptr, value, predicate=predicate)


_BINS = 256  # radix digit: 8 bits a pass
_SELECTS = 2  # radix selects a pass can run at once (the sample's two ranks): histograms a warp


def _radix_pass(hist, lane, shift, states, add_keys):
    """One 8-bit pass of up to _SELECTS radix selects over a warp's keys (unsigned order: key ^
    _SIGN). states: [(prefix, remaining)] per select: the keys whose bits above `shift` + 8
    equal the prefix's are its candidates, and the one sought is the remaining-th largest of
    them. add_keys(known) adds each candidate key's digit (bits shift..shift + 7) to select r's
    histogram (hist + r * _BINS, by `red.shared.add`), known = the mask of the bits above.
    -> the new states (the digit appended to the prefix, the candidates above it deducted)."""
    known = arith.select(_cmp("eq", shift, _c(24)), _c(0), arith.shli(_c(-1), arith.addi(shift, _c(8))))
    for r in range(len(states)):
        for half in (0, 4):
            at = _gep(hist, arith.addi(_c(r * _BINS + half), arith.muli(lane, _c(8))))
            _ptx("st.shared.v4.b32 [$0], {$1, $1, $1, $1};", at, _c(0), result=False)
    _warp_sync()
    add_keys(known)
    _warp_sync()
    new = []
    for r, (prefix, remaining) in enumerate(states):
        # lane L holds digits 255 - 8 L - j, j < 8 (descending): the candidates above its digits
        # are the lanes before it (an exclusive scan), then its own in order
        first = arith.subi(_c(_BINS - 8), arith.muli(lane, _c(8)))
        four = lambda at: mgpu_utils.inline_ptx(  # noqa: E731
            "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", _gep(hist, arith.addi(at, _c(r * _BINS))),
            result_types=[_i32()] * 4)
        counts = list(four(arith.addi(first, _c(4))))[::-1] + list(four(first))[::-1]  # digits first + 7 ..
        own = _c(0)
        for h in counts:
            own = arith.addi(own, h)
        incl, _ = mgpu_utils.inline_ptx(_SCAN, own, result_types=[_i32()] * 2, convergent=True)
        cum = arith.subi(incl, own)
        hit_any, digit, before = arith.constant(ir.IntegerType.get_signless(1), 0), _c(0), _c(0)
        for j, h in enumerate(counts):
            nxt = arith.addi(cum, h)
            hit = arith.andi(_cmp("slt", cum, remaining), _cmp("sge", nxt, remaining))
            digit = arith.select(hit, arith.subi(arith.addi(first, _c(7)), _c(j)), digit)
            before = arith.select(hit, cum, before)
            hit_any = arith.ori(hit_any, hit)
            cum = nxt
        who = _ptx("bfind.u32 $0, $1;", _ptx("vote.sync.ballot.b32 $0, $1, 0xffffffff;", hit_any))
        digit = _ptx("shfl.sync.idx.b32 $0, $1, $2, 31, 0xffffffff;", digit, who)
        before = _ptx("shfl.sync.idx.b32 $0, $1, $2, 31, 0xffffffff;", before, who)
        new.append((arith.ori(prefix, arith.shli(digit, shift)), arith.subi(remaining, before)))
    _warp_sync()
    return new


def _add_digits(hist, keys, shift, known, prefixes):
    """add_keys of `_radix_pass` for keys [(key i32, candidate i1)] held in registers."""
    for key, ok in keys:
        u = arith.xori(key, _c(_SIGN))
        digit = arith.andi(arith.shrui(u, shift), _c(_BINS - 1))
        for r, prefix in enumerate(prefixes):
            mine = arith.andi(ok, _cmp("eq", arith.andi(u, known), arith.andi(prefix, known)))
            mgpu_utils.inline_ptx("red.shared.add.u32 [$0], 1;", _gep(hist, arith.addi(digit, _c(r * _BINS))),
                                  predicate=mine)


def _sample_thresholds(x_row, row_len, hist, lane, *, num_keys, sample, r_lo, r_hi):
    """(t_lo, t_hi) of the row from its sample, as the Triton threshold kernel's contract has it
    (`triton._sample_plan`: the sampled runs of 8 columns at the same jittered positions), but
    exact: t_lo = the r_lo-th largest valid sampled key (_KEY_LOW if fewer), t_hi = the key just
    above the r_hi-th (_KEY_ABOVE if r_hi = 0 or fewer). The sample is held in registers (a
    lane's 1/32: <= 128 keys) and both ranks are found in the same four radix passes."""
    exact = sample >= num_keys  # the whole row (sample = next_pow2(L))
    n_runs = sample // _RUN
    q = _RUN if exact else num_keys // n_runs
    keys = []
    for t in range(-(-n_runs // 32)):
        run = arith.addi(lane, _c(32 * t))
        start = arith.muli(run, _c(q))
        if not exact:
            h = arith.shrui(arith.muli(run, _c(_RUN_HASH)), _c(16))  # the run's hash in [0, 65536)
            start = arith.addi(start, arith.muli(arith.remui(h, _c(q // _RUN)), _c(_RUN)))
        for e in range(_RUN):
            pos = arith.addi(start, _c(e))
            b = _ptx("ld.global.nc.b32 $0, [$1];", _gep(x_row, arith.minsi(pos, _c(num_keys - 1))))
            key = arith.xori(b, arith.andi(arith.shrsi(b, _c(31)), _c(_LOW31)))
            ok = arith.andi(_cmp("slt", pos, row_len), _cmp("slt", run, _c(n_runs)))
            ok = arith.andi(ok, _cmp("ule", arith.subi(key, _c(_KEY_LOW)), _c(_KEY_POS_INF - _KEY_LOW)))
            keys.append((key, ok))
    n_valid = _c(0)
    for _, ok in keys:
        n_valid = arith.addi(n_valid, arith.extui(_i32(), ok))
    n_valid = _ptx("redux.sync.add.s32 $0, $1, 0xffffffff;", n_valid)
    ranks = (r_lo,) if r_hi in (r_lo, 0) else (r_lo, r_hi)
    states = [(_c(0), _c(r)) for r in ranks]
    for shift in (24, 16, 8, 0):
        prefixes = [p for p, _ in states]
        states = _radix_pass(hist, lane, _c(shift), states,
                             lambda known: _add_digits(hist, keys, _c(shift), known, prefixes))
    kth = [arith.xori(p, _c(_SIGN)) for p, _ in states]  # the ranks' keys
    t_lo = arith.select(_cmp("sge", n_valid, _c(r_lo)), kth[0], _c(_KEY_LOW))
    if r_hi == 0:
        return t_lo, _c(_KEY_ABOVE)
    t_hi = arith.select(_cmp("sge", n_valid, _c(r_hi)), arith.addi(kth[-1], _c(1)), _c(_KEY_ABOVE))
    return t_lo, t_hi


def _write_rows(ctx, x, lengths, thr, out, bkey, bcol, cnt, hist, block, *, n_rows, num_keys, k, cap, plan):
    """Warp w of CTA `block` takes row n = _WARPS * block + w (if n < n_rows): thresholds from
    its sample, the sweep, the band select."""
    del ctx
    i32, i64 = _i32(), ir.IntegerType.get_signless(64)
    c32, cmp, gep = _c, _cmp, _gep
    gptr = lambda ref: llvm.addrspacecast(llvm.PointerType.get(address_space=1),  # noqa: E731
                                          mgpu_utils.memref_ptr(ref))
    tid = mgpu_utils.thread_idx()
    lane, warp = arith.andi(tid, c32(31)), arith.shrui(tid, c32(5))
    n = arith.addi(arith.muli(_scalar(block), c32(_WARPS)), warp)
    row_at = lambda ref, width: gep(gptr(ref), arith.muli(arith.extui(i64, n), arith.constant(i64, width)))  # noqa: E731
    hist = gep(mgpu_utils.memref_ptr(hist), arith.muli(warp, c32(_SELECTS * _BINS)))
    with mgpu_utils.when(cmp("slt", n, c32(n_rows))):
        row_len = llvm.load(i32, gep(gptr(lengths), n))
        x_row, out_row, bkey_row, bcol_row = (row_at(x, num_keys), row_at(out, k), row_at(bkey, cap),
                                              row_at(bcol, cap))
        t_lo, t_hi = _sample_thresholds(x_row, row_len, hist, lane, num_keys=num_keys, **plan)
        mgpu_utils.inline_ptx("st.global.v2.b32 [$0], {$1, $2};", row_at(thr, 2), t_lo, t_hi,
                              predicate=cmp("eq", lane, c32(0)))
        # [t_lo, t_hi) as key - t_lo < width, unsigned (the width can exceed 2^31); empty if t_lo > t_hi
        band_width = arith.select(cmp("sle", t_lo, t_hi), arith.subi(t_hi, t_lo), c32(0))
        lane_col = arith.muli(lane, c32(4))
        last_load = arith.subi(arith.andi(arith.addi(row_len, c32(3)), c32(-4)), c32(4))

        per_iter = 32 * 4 * _LOADS

        def load(it):
            """The lane's _LOADS float4s of columns [per_iter it, per_iter (it + 1)) as i32 bits,
            addresses held within the row's float4s (its first if it has none): past the row's
            end they repeat its last float4, which `sweep` masks."""
            vals = []
            for j in range(_LOADS):
                c0 = arith.addi(arith.muli(it, c32(per_iter)), arith.addi(c32(128 * j), lane_col))
                at = arith.maxsi(arith.minsi(c0, last_load), c32(0))
                vals.append(mgpu_utils.inline_ptx("ld.global.nc.L1::no_allocate.v4.b32 {$0, $1, $2, $3}, [$4];",
                                                  gep(x_row, at), result_types=[i32] * 4))
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
                    col = arith.addi(c0, c32(e))
                    pos = arith.addi(run_def, arith.andi(at, c32(0xFFFF)))
                    st = arith.andi(is_def, cmp("ult", pos, c32(k))) if checked else is_def
                    mgpu_utils.inline_ptx("st.global.b32 [$0], $1;", gep(out_row, pos), col, predicate=st)
                    pos = arith.addi(run_band, arith.shrui(at, c32(16)))
                    st = arith.andi(is_band, cmp("ult", pos, c32(cap))) if checked else is_band
                    mgpu_utils.inline_ptx("st.global.b32 [$0], $1;", gep(bkey_row, pos), key, predicate=st)
                    mgpu_utils.inline_ptx("st.global.b32 [$0], $1;", gep(bcol_row, pos), col, predicate=st)
                base = arith.addi(base, field(total))

        def sweep(it, vals, carry, masked):
            """Columns [per_iter it, per_iter (it + 1)) of the row, loaded as vals (masked: the row
            ends among them) -> the new (definite, band, valid) counts."""
            run_def, run_band, valid = carry
            cols, words = [], [c32(0)] * (_LOADS // 2)
            for j in range(_LOADS):
                c0 = arith.addi(arith.muli(it, c32(per_iter)), arith.addi(c32(128 * j), lane_col))
                prefix, sel = c32(0), []
                for e, b in enumerate(vals[j]):
                    key = arith.xori(b, arith.andi(arith.shrsi(b, c32(31)), c32(_LOW31)))
                    ok = cmp("ule", arith.subi(key, c32(_KEY_LOW)), c32(_KEY_POS_INF - _KEY_LOW))  # not NaN / -inf
                    if masked:
                        ok = arith.andi(ok, cmp("slt", arith.addi(c0, c32(e)), row_len))
                    valid = arith.addi(valid, arith.extui(i32, ok))
                    key = arith.select(ok, key, c32(-(1 << 31)))
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
        valid = mgpu_utils.inline_ptx("redux.sync.add.s32 $0, $1, 0xffffffff;", valid, result_types=i32, convergent=True)
        done = _select_band(hist, lane, c_def, c_band, valid, t_lo, t_hi, out_row, bkey_row, bcol_row,
                            k=k, cap=cap)
        mgpu_utils.inline_ptx("st.global.v4.b32 [$0], {$1, $2, $3, $4};", row_at(cnt, 4), c_def, c_band, valid,
                              done, predicate=cmp("eq", lane, c32(0)))



def _select_band(hist, lane, n_def, n_band, n_valid, t_lo, t_hi, out_row, bkey_row, bcol_row, *, k, cap):
    """After the sweep, in the same warp: when the band holds the rest of the row's answer (as
    `triton._band_holds_answer`), append the band's (min(k, valid) - definite) largest keys'
    columns to out[n] after the definite ones, -1 past them -> 1 (the row is done: the select
    kernel skips it), else 0.

    The rank-th largest band key by radix select (`_radix_pass`) from the highest byte where
    t_lo and t_hi - 1 differ (the band's keys share the bits above it; a band within one
    binade: 2-3 passes), over the band as the sweep wrote it (L2); then one pass writes the keys
    above it and, in band (column) order, as many equal to it as the rank leaves (positions from
    ballots)."""
    i32 = _i32()
    n_sel = arith.minsi(n_valid, _c(k))
    done = arith.andi(arith.andi(_cmp("sle", n_def, n_sel), _cmp("sge", arith.addi(n_def, n_band), n_sel)),
                      _cmp("sle", n_band, _c(cap)))
    rank = arith.subi(n_sel, n_def)
    take_all = _cmp("eq", rank, n_band)
    search = arith.andi(arith.andi(done, _cmp("sgt", rank, _c(0))), _cmp("ne", rank, n_band))
    u_lo = arith.xori(t_lo, _c(_SIGN))
    differ = arith.xori(u_lo, arith.xori(arith.subi(t_hi, _c(1)), _c(_SIGN)))
    top_byte = arith.shrui(arith.subi(_c(31), _ptx("clz.b32 $0, $1;", differ)), _c(3))
    n_passes = arith.select(arith.andi(search, _cmp("ne", differ, _c(0))), arith.addi(top_byte, _c(1)), _c(0))
    above_all = arith.select(_cmp("eq", n_passes, _c(4)), _c(0), arith.shli(_c(-1), arith.muli(n_passes, _c(8))))
    _ptx("fence.acq_rel.cta;", result=False)  # the sweep's band stores, before the warp reads them
    _warp_sync()
    chunks = lambda n, per: arith.divui(arith.addi(n, _c(per - 1)), _c(per))  # noqa: E731

    def radix_pass(p, state):
        prefix, remaining = state
        shift = arith.muli(arith.subi(arith.subi(n_passes, _c(1)), p), _c(8))

        def add_keys(known):
            def count(c, carry):  # _LOADS float4s of band keys a lane, loaded together
                i0 = [arith.addi(arith.muli(c, _c(128 * _LOADS)), arith.addi(_c(128 * j), arith.muli(lane, _c(4))))
                      for j in range(_LOADS)]
                fours = [mgpu_utils.inline_ptx("ld.global.cg.v4.b32 {$0, $1, $2, $3}, [$4];",
                                               _gep(bkey_row, arith.minsi(i, _c(cap - 4))), result_types=[i32] * 4)
                         for i in i0]
                keys = [(key, _cmp("slt", arith.addi(i, _c(e)), n_band))
                        for i, four in zip(i0, fours) for e, key in enumerate(four)]
                _add_digits(hist, keys, shift, known, [prefix])
                return carry

            mgpu_utils.fori(chunks(n_band, 128 * _LOADS), _c(0))(count)

        [state] = _radix_pass(hist, lane, shift, [(prefix, remaining)], add_keys)
        return state

    prefix, remaining = mgpu_utils.fori(n_passes, (arith.andi(u_lo, above_all), rank))(radix_pass).results
    pivot = arith.select(take_all, _c(0), prefix)  # take_all: every band key is above 0
    n_above = arith.subi(rank, remaining)  # band keys above the pivot, all taken
    lanes_before = _ptx("mov.u32 $0, %lanemask_lt;")
    popc = lambda v: _ptx("popc.b32 $0, $1;", v)  # noqa: E731
    ballot = lambda p: _ptx("vote.sync.ballot.b32 $0, $1, 0xffffffff;", p)  # noqa: E731

    def compact(c, state):  # _LOADS x 32 band entries, loaded together, ranked by ballots
        run_gt, run_eq = state
        entries = []
        for j in range(_LOADS):
            i = arith.addi(arith.muli(c, _c(32 * _LOADS)), arith.addi(_c(32 * j), lane))
            at = arith.minsi(i, _c(cap - 1))
            entries.append((i, _ptx("ld.global.cg.b32 $0, [$1];", _gep(bkey_row, at)),
                            _ptx("ld.global.cg.b32 $0, [$1];", _gep(bcol_row, at))))
        for i, key, col in entries:
            inside = _cmp("slt", i, n_band)
            u = arith.xori(key, _c(_SIGN))
            gt = arith.andi(inside, _cmp("ugt", u, pivot))
            eq = arith.andi(inside, _cmp("eq", u, pivot))
            b_gt, b_eq = ballot(gt), ballot(eq)
            eq_rank = arith.addi(run_eq, popc(arith.andi(b_eq, lanes_before)))
            pos = arith.select(gt, arith.addi(run_gt, popc(arith.andi(b_gt, lanes_before))),
                               arith.addi(n_above, eq_rank))
            _store(_gep(out_row, arith.addi(n_def, pos)), col,
                   arith.ori(gt, arith.andi(eq, _cmp("slt", eq_rank, remaining))))
            run_gt, run_eq = arith.addi(run_gt, popc(b_gt)), arith.addi(run_eq, popc(b_eq))
        return run_gt, run_eq

    n_compact = arith.select(arith.andi(done, _cmp("sgt", rank, _c(0))), chunks(n_band, 32 * _LOADS), _c(0))
    mgpu_utils.fori(n_compact, (_c(0), _c(0)))(compact)

    def pad(c, carry):
        i = arith.addi(n_sel, arith.addi(arith.muli(c, _c(32)), lane))
        _store(_gep(out_row, i), _c(-1), _cmp("slt", i, _c(k)))
        return carry

    mgpu_utils.fori(arith.select(done, chunks(arith.subi(_c(k), n_sel), 32), _c(0)), _c(0))(pad)
    return arith.extui(i32, done)


def topk_write(x, lengths, *, k, cap, sample, r_lo, r_hi):
    """x [N, L] f32 (L % 4 == 0), lengths [N] int32 in [0, L]; the sample plan of
    `triton._sample_plan` (sample size, ranks r_lo >= r_hi of the thresholds in it) ->
    (thresholds [N, 2] (t_lo, t_hi), out [N, k], band keys [N, cap], band columns [N, cap],
    counts [N, 1, 4]) int32: the thresholds of `_sample_thresholds`, then as
    `triton._write_kernel` with one slice a row (entries it does not write are undefined), plus,
    for the rows it marks done (counts[n, 0, 3] = 1), the whole answer in out[n]."""
    n_rows, num_keys = x.shape
    if num_keys % 4 or cap % 4:
        raise ValueError(f"topk_write: the row length and the band capacity must be multiples of 4 "
                         f"(16-byte rows), got {num_keys} and {cap}")
    if not _RUN <= sample <= MAX_SAMPLE:
        raise ValueError(f"topk_write: the sample must hold {_RUN}..{MAX_SAMPLE} keys (a lane holds 1/32 of "
                         f"it in registers), got {sample}")
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    body = functools.partial(_write_rows, n_rows=n_rows, num_keys=num_keys, k=k, cap=cap,
                             plan=dict(sample=sample, r_lo=r_lo, r_hi=r_hi))

    def entry(*refs):
        plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 8 + (plgpu.Layout.WG_SPLAT(()),))(body)(
            *refs, lax.axis_index("rows"))

    return plgpu.kernel(
        entry,
        out_type=(i32(n_rows, 2), i32(n_rows, k), i32(n_rows, cap), i32(n_rows, cap), i32(n_rows, 1, 4)),
        scratch_types=(plgpu.SMEM((_WARPS, _SELECTS * _BINS), jnp.int32),),
        grid=(pl.cdiv(n_rows, _WARPS),),
        grid_names=("rows",),
        compiler_params=plgpu.CompilerParams(),
        kernel_name="topk_write",
    )(x, lengths)
