"""Top-k selection of indexer logits: the k highest finite entries of each row, -1 padded.

Three Pallas kernels (Triton backend): thresholds from a sample of each row, a write sweep over
the row (one program per row, or per row slice when rows are few: each slice publishes its
counts and takes its output offsets from the earlier slices'), then an exact select within the
narrow band of keys between the two thresholds. Each row's sample plan and slices follow its own
length at run time, not the logits' width, so a short row in a wide array costs what it does in
an array of its own width. See `api.topk` for the scheme; measurements: docs/design/topk.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ..device import next_pow2
from .keys import _INVALID, _KEY_ABOVE, _KEY_LOW, _KEY_POS_INF, _LOW31, _SIGN
from .mosaic import topk_write


# ----------------------------------------------------------------------------------------------
# Keys: float32 -> int32 in the float order; count search over key intervals
# ----------------------------------------------------------------------------------------------

_WAYS = 16  # thresholds per counting pass (4 bits of key range per pass)
_Z = 5.0  # safety margin of the sampled thresholds, in standard deviations
_RUN = 8  # sampled keys are runs of 8 adjacent columns: one 32-byte sector each
_SAMPLE_MIN, _SAMPLE_MAX = 1024, 4096  # default sample: a row's length / 32, within these
_MIN_SLICE = 4096  # default: no row slice shorter than this


def _row_keys(x):
    """float32 -> int32 whose signed order is the float order; -inf and NaN -> _INVALID."""
    b = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(x > -jnp.inf, b ^ ((b >> 31) & _LOW31), _INVALID)


def _to_u(s):
    """Signed ordered key -> uint32 with the same (unsigned) order."""
    return jax.lax.bitcast_convert_type(s ^ _SIGN, jnp.uint32)


def _from_u(u):
    return jax.lax.bitcast_convert_type(u, jnp.int32) ^ _SIGN


def _next_pow2_i32(v):
    """The least power of two >= v for int32 v in [1, 2^30] (0 for v = 0), at run time."""
    v = v - 1
    for shift in (1, 2, 4, 8, 16):
        v = v | (v >> shift)
    return v + 1


def _mod_u16(h, d, inv_d):
    """h mod d for int32 h in [0, 2^16) and a run-time d >= 1, inv_d = 1 / d in f32: the float
    quotient is off by at most one (h * inv_d errs by < 2^16 * 2^-22), then corrected. An integer
    division by a run-time divisor would cost ~20 instructions a key."""
    r = h - jnp.floor(h.astype(jnp.float32) * inv_d).astype(jnp.int32) * d
    r = jnp.where(r < 0, r + d, r)
    return jnp.where(r >= d, r - d, r)


def _count_search(count_ge, kk, lo, w, c_lo, c_hi, tol):
    """R searches at once (one count sweep per pass): narrow the interval holding the kk-th
    largest key by 16-way count passes.

    count_ge(th [R, 16] int32) -> [R, 16] int32: #keys >= each threshold (one sweep).
    State, all [R]: the kk-th largest key lies in [lo, lo + w) (uint32 order); c_lo = #keys
    >= lo (>= kk) and c_hi = #keys >= lo + w (< kk). Each pass counts the keys >= lo + j *
    ceil(w / 16), j = 0..15, and keeps the last sub-interval whose count is >= kk. A search
    stops when w == 1 (lo is then the kk-th largest key and c_hi the number of keys above it),
    when c_lo == kk (the kk largest keys are exactly those >= lo) or when its interval holds
    <= tol keys; <= 8 passes whatever the data. Returns (lo, w, c_hi)."""
    jj = jnp.arange(_WAYS, dtype=jnp.int32)[None, :]
    jj_u = jj.astype(jnp.uint32)

    def active(lo, w, c_lo, c_hi):
        del lo
        return (w > 1) & (c_lo - c_hi > tol) & (c_lo > kk)

    def cond(state):
        return jnp.sum(active(*state).astype(jnp.int32)) > 0

    def body(state):
        lo, w, c_lo, c_hi = state
        step = (w >> 4) + ((w & 15) != 0).astype(jnp.uint32)  # ceil(w / 16) >= 1
        cnt = count_ge(_from_u(lo[:, None] + jnp.minimum(jj_u * step[:, None], w[:, None])))
        d = jnp.sum(((cnt >= kk[:, None]) & (jj > 0)).astype(jnp.int32), axis=1)  # cnt[:, 0] = c_lo
        c_lo_next = jnp.sum(jnp.where(jj == d[:, None], cnt, 0), axis=1)
        c_hi_next = jnp.where(d == _WAYS - 1, c_hi,
                              jnp.sum(jnp.where(jj == d[:, None] + 1, cnt, 0), axis=1))
        d_u = d.astype(jnp.uint32)
        w_next = jnp.minimum((d_u + 1) * step, w) - d_u * step  # <= step < w: always shrinks
        go = active(*state)
        return tuple(jnp.where(go, new, old)
                     for new, old in zip((lo + d_u * step, w_next, c_lo_next, c_hi_next), state))

    lo, w, _, c_hi = jax.lax.while_loop(cond, body, (lo, w, c_lo, c_hi))
    return lo, w, c_hi


def _count_ge(chunks, th):
    """[B] key chunks, [R, 16] thresholds -> [R, 16] #keys >= each: per search, [B, 16] compares
    summed over the chunks, then one reduction (a single [B, R, 16] one was no faster)."""
    rows = jnp.arange(th.shape[0])[:, None]
    out = jnp.zeros(th.shape, jnp.int32)
    for r in range(th.shape[0]):
        th_r = jnp.sum(jnp.where(rows == r, th, 0), axis=0)  # row r of th
        ge = sum((keys[:, None] >= th_r[None, :]).astype(jnp.int32) for keys in chunks)
        out = jnp.where(rows == r, jnp.sum(ge, axis=0)[None, :], out)
    return out


def _chunk_loop(n_chunks, group, load, step, init):
    """Loop over chunks 0..n_chunks-1, `group` at a time: a group's loads are issued together
    (one memory latency per group, not per chunk), then step(loaded chunk, carry) runs chunk by
    chunk. load(i) must mask chunks i >= n_chunks out (keys _INVALID)."""
    def body(g, carry):
        for loaded in [load(g * group + u) for u in range(group)]:
            carry = step(loaded, carry)
        return carry
    return jax.lax.fori_loop(0, (n_chunks + group - 1) // group, body, init)


def _count_ge_chunks(load_keys, n_chunks, group):
    """count_ge for _count_search over keys loaded chunk by chunk ([B] int32 each)."""
    def count_ge(th):
        def body(g, cnt):
            return cnt + _count_ge([load_keys(g * group + u) for u in range(group)], th)
        return jax.lax.fori_loop(0, (n_chunks + group - 1) // group, body,
                                 jnp.zeros(th.shape, jnp.int32))
    return count_ge


def _pick(vec, i):
    """vec[i] of a small vector (Triton has no element extraction)."""
    return jnp.sum(jnp.where(jnp.arange(vec.shape[0]) == i, vec, 0))


def _load_thresholds(thr_ref, n):
    t = pltriton.load(thr_ref.at[n, pl.ds(0, 2)])
    return _pick(t, 0), _pick(t, 1)


def _load_counts(cnt_ref, n):
    """Per-slice counts of row n -> ([S] definite, [S] band, [S] valid, [S] done)."""
    c = pltriton.load(cnt_ref.at[n])  # [S, 4]
    col = jnp.arange(4, dtype=jnp.int32)[None, :]
    return tuple(jnp.sum(jnp.where(col == j, c, 0), axis=1) for j in range(4))


def _band_holds_answer(n_def, n_band, n_valid, k, cap):
    """The definite keys are all selected and the band holds the rest of the answer."""
    n_sel = jnp.minimum(n_valid, k)
    return (n_def <= n_sel) & (n_def + n_band >= n_sel) & (n_band <= cap)


# ----------------------------------------------------------------------------------------------
# The four kernels
# ----------------------------------------------------------------------------------------------

def _float_key(v):
    b = int(np.float32(v).view(np.int32))
    return b ^ _LOW31 if b < 0 else b


# First pass of the threshold searches: fixed thresholds at typical logit magnitudes (ascending)
# place both ranks within a sign / magnitude range in one sweep (~1 pass less than 16-way steps
# over the whole key range, and 16 compares per key instead of 2 x 16). The lowest threshold is
# the lowest valid key: the same sweep counts the valid sampled keys.
_COARSE_KEYS = (_KEY_LOW,) + tuple(_float_key(v) for v in (
    -8.0, -1.0, -0.125, 0.0, 2.0 ** -12, 2.0 ** -8, 2.0 ** -5, 0.125, 0.25, 0.5, 1.0, 2.0,
    4.0, 16.0, 256.0))


def _threshold_kernel(x_ref, len_ref, thr_ref, *pub_refs, k, sample, chunk, group, searches):
    """thr[n] = (t_lo, t_hi) of row n from a sample of its own len[n] keys (`_row_plan`): ~r_lo *
    stride row keys are >= t_lo and ~r_hi * stride >= t_hi, stride = len[n] / sample size. The
    sample is strided over the row's keys, not the logits' width: a short row in a wide array
    gets the thresholds (and so the band) it gets in an array of its own width, and as few
    passes' work. The sample is reloaded chunk by chunk (`chunk` keys) each pass (L1/L2 hits):
    holding it in registers (8192 keys) was slower. Chunks go `group` at a time, the last ones
    singly (a row's sample may hold fewer chunks than the width's).
    searches: 1 where every row is its own sample (r_lo = r_hi = k), else 2 (t_lo and t_hi in the
    same passes; a row sampled whole runs both at rank k).
    pub_refs: () or ([N, P] f32 published slice counts, set to -1 here for the "lookback"
    write)."""
    n = pl.program_id(0)
    row_len = len_ref[n]
    for pub_ref in pub_refs:
        pltriton.store(pub_ref.at[n, pl.ds(0, pub_ref.shape[1])],
                       jnp.full(pub_ref.shape[1:], -1.0, jnp.float32))
    lane = jnp.arange(chunk, dtype=jnp.int32)
    bits, r_lo, r_hi, tol = _row_plan(row_len, k, sample)
    size = jnp.int32(1) << bits
    whole_row = size >= row_len  # the row is its own sample: exact thresholds
    n_chunks = jnp.where(whole_row, pl.cdiv(row_len, chunk), size // chunk)
    # R = 2^run_bits runs of _RUN columns, run r at a hashed offset in columns [floor(r L / R),
    # +q) of the row (L = len[n], q = floor(L / R) >= _RUN): spread to the row's end, without an
    # integer division by a run-time value (r * (L mod R) < R^2: samples up to 2^18 keys).
    run_bits = bits - (_RUN.bit_length() - 1)
    q = row_len >> run_bits
    rem = row_len - (q << run_bits)
    spread = jnp.maximum(q // _RUN, 1)  # a run's possible offsets
    inv_spread = 1.0 / spread.astype(jnp.float32)

    def sample_keys(c):
        j = c * chunk + lane
        pos = j
        if searches == 2:
            run = j // _RUN
            h = jax.lax.shift_right_logical(run * -1640531535, 16)  # hash of the run in [0, 65536)
            start = run * q + ((run * rem) >> run_bits)  # runs 8-aligned when L is a multiple of 8 R
            pos = jnp.where(whole_row, j, start + _mod_u16(h, spread, inv_spread) * _RUN + j % _RUN)
        return _row_keys(pltriton.load(x_ref.at[n, pos], mask=pos < row_len, other=-jnp.inf))

    whole = n_chunks // group * group
    count_ge = _count_ge_chunks(sample_keys, whole, group)
    if group > 1:
        in_groups, rest = count_ge, _count_ge_chunks(lambda c: sample_keys(whole + c), n_chunks - whole, 1)
        count_ge = lambda th: in_groups(th) + rest(th)  # noqa: E731
    ranks = jnp.where(jnp.arange(searches) == 0, r_lo, r_hi)  # [R]
    jj = jnp.arange(_WAYS, dtype=jnp.int32)[None, :]
    fixed = jnp.zeros((1, _WAYS), jnp.int32)
    for i, key in enumerate(_COARSE_KEYS):
        fixed = jnp.where(jj == i, key, fixed)
    cnt = count_ge(fixed)  # [1, 16], falls with j
    n_s = jnp.sum(jnp.where(jj == 0, cnt, 0))  # valid sampled keys
    # [R] in 0..15 (0 also when the sample has < rank valid keys: no search then)
    d = jnp.maximum(jnp.sum((cnt >= ranks[:, None]).astype(jnp.int32), axis=1) - 1, 0)
    at = lambda v, i: jnp.sum(jnp.where(jj == i[:, None], v, 0), axis=1)  # noqa: E731  v[0, i]
    lo = _to_u(at(fixed, d))
    hi = jnp.where(d >= _WAYS - 1, _to_u(jnp.int32(_KEY_ABOVE)), _to_u(at(fixed, d + 1)))
    c_lo = at(cnt, d)
    c_hi = jnp.where(d >= _WAYS - 1, 0, at(cnt, d + 1))
    w = jnp.where((n_s >= ranks) & (ranks > 0), hi - lo, jnp.uint32(1))
    lo, w, _ = _count_search(count_ge, ranks, lo, w, c_lo, c_hi, tol)
    t_lo = jnp.where(n_s >= r_lo, _from_u(_pick(lo, 0)), _KEY_LOW)  # <= the r_lo-th sampled key
    last = searches - 1
    t_hi = _from_u(_pick(lo, last) + _pick(w, last))  # > the r_hi-th largest sampled key
    t_hi = jnp.where((r_hi > 0) & (n_s >= r_hi), t_hi, _KEY_ABOVE)
    pltriton.store(thr_ref.at[n, pl.ds(0, 2)], jnp.where(jnp.arange(2) == 0, t_lo, t_hi))


def _row_slice_len(row_len, n_slices, min_slice):
    """Columns of each slice of a row of row_len keys (run time): the row spread over the
    n_slices programs of the row in power-of-two slices of >= min_slice columns, so a short row
    in a wide array is sliced as in an array of its own width (those past its end idle). At
    row_len = L this is `topk_stages`' static slice length."""
    return jnp.maximum(min_slice, _next_pow2_i32(pl.cdiv(row_len, n_slices)))


def _slice_chunks(s, row_len, slice_len, block):
    """Chunks of `block` columns in slice s (0 past the row's end)."""
    left = row_len - s * slice_len
    return jnp.clip((left + block - 1) // block, 0, slice_len // block)


def _slice_keys(x_ref, n, s, i, n_chunks, *, row_len, slice_len, block):
    """Chunk i of slice s of row n -> ([block] columns, [block] keys); _INVALID past the row's
    end (row_len) and for i >= n_chunks."""
    cols = s * slice_len + i * block + jnp.arange(block, dtype=jnp.int32)
    x = pltriton.load(x_ref.at[n, cols], mask=(cols < row_len) & (i < n_chunks), other=-jnp.inf)
    return cols, _row_keys(x)


def _slice_counts(x_ref, n, s, t_lo, t_hi, *, row_len, slice_len, block, group):
    """(#keys >= t_hi (definite), #keys in [t_lo, t_hi) (band), #valid keys) of slice s of row n."""
    n_chunks = _slice_chunks(s, row_len, slice_len, block)

    def step(loaded, acc):
        key = loaded[1]
        n_def, n_band, n_valid = acc
        return (n_def + (key >= t_hi).astype(jnp.int32),
                n_band + ((key >= t_lo) & (key < t_hi)).astype(jnp.int32),
                n_valid + (key != _INVALID).astype(jnp.int32))

    zeros = jnp.zeros((block,), jnp.int32)
    load = functools.partial(_slice_keys, x_ref, n, s, n_chunks=n_chunks, row_len=row_len,
                             slice_len=slice_len, block=block)
    acc = _chunk_loop(n_chunks, group, load, step, (zeros, zeros, zeros))
    return tuple(jnp.sum(a) for a in acc)


def _store_counts(cnt_ref, n, s, n_def, n_band, n_valid):
    j = jnp.arange(4, dtype=jnp.int32)
    counts = jnp.where(j == 0, n_def, jnp.where(j == 1, n_band, jnp.where(j == 2, n_valid, 0)))
    pltriton.store(cnt_ref.at[n, s, pl.ds(0, 4)], counts)


def _offsets_after_lookback(pub_ref, n, s, n_def, n_band, wait):
    """Publish slice s's (definite, band) counts in pub[n, 2s:2s+2] (f32, set to -1 by the
    threshold kernel), wait until slices 0..s-1 of row n have published theirs, return their
    sums. pub rows hold >= one entry per thread (the atomics' results are read back, and a
    tensor smaller than the thread count has replicated lanes); f32 because Pallas lowers
    vector atomics of int32 as float ones; counts < 2^24 are exact. Slice s' < s of row n has a
    lower block index (grid (N, S), x fastest), so it was dispatched first: the wait ends.
    wait False (a slice past the row's end, which writes nothing): no wait, offsets 0."""
    width = pub_ref.shape[1]
    j = jnp.arange(2)
    pltriton.atomic_max(pub_ref, (n, pl.ds(2 * s, 2)),
                        jnp.where(j == 0, n_def, n_band).astype(jnp.float32))  # -1 -> counts
    j = jnp.arange(width)
    before = j < 2 * s

    def poll(state):
        del state
        c = pltriton.atomic_add(pub_ref, (n, pl.ds(0, width)),
                                jnp.zeros((width,), jnp.float32))  # an L2 read
        return c, jnp.sum((before & (c < 0)).astype(jnp.int32))

    c, _ = jax.lax.while_loop(lambda state: state[1] > 0, poll,
                              (jnp.zeros((width,), jnp.float32), wait.astype(jnp.int32)))
    c = jnp.where(before, c, 0.0).astype(jnp.int32)
    return jnp.sum(jnp.where(j % 2 == 0, c, 0)), jnp.sum(jnp.where(j % 2 == 1, c, 0))


def _write_kernel(x_ref, len_ref, thr_ref, *refs, k, cap, n_slices, min_slice, block, group):
    """Slice s of row n (`_row_slice_len` columns): columns of definite keys -> out[n, offset..],
    band keys and columns -> band[n, offset..], in column order (offsets: the counts of slices
    0..s-1; entries past k or cap are dropped: the select kernel then finds the row off the band
    path); cnt[n, s] = (definite, band, valid, 0) counts of the slice.
    One slice a row (grid (N, 1)): refs = (out, band keys, band columns, cnt); counts as it
    writes. Several (grid (N, S)): refs = (pub [N, P] f32 of -1, out, band keys, band columns,
    cnt, pub aliasing the input): counts its slice, publishes the counts, waits for the earlier
    slices' and writes (a second read of the slice, from L2). One kernel rather than a count
    kernel and a write kernel: one launch fewer (and, one slice a row, one read of it). Only the
    row's first len[n] columns are read: slices past them store zero counts and neither read nor
    wait."""
    sliced = len(refs) == 6
    if sliced:
        _, out_ref, bkey_ref, bcol_ref, cnt_ref, pub_ref = refs
    else:
        out_ref, bkey_ref, bcol_ref, cnt_ref = refs
    n, s = pl.program_id(0), pl.program_id(1)
    lane = jnp.arange(block, dtype=jnp.int32)
    t_lo, t_hi = _load_thresholds(thr_ref, n)
    row_len = len_ref[n]
    slice_len = _row_slice_len(row_len, n_slices, min_slice)
    n_chunks = _slice_chunks(s, row_len, slice_len, block)
    def_off = band_off = jnp.int32(0)
    if sliced:
        counts = _slice_counts(x_ref, n, s, t_lo, t_hi, row_len=row_len, slice_len=slice_len,
                               block=block, group=group)
        _store_counts(cnt_ref, n, s, *counts)
        def_off, band_off = _offsets_after_lookback(pub_ref, n, s, *counts[:2], wait=s * slice_len < row_len)

    def step(loaded, carry):
        c_def, c_band, valid = carry
        cols, key = loaded
        is_def = key >= t_hi
        is_band = (key >= t_lo) & jnp.logical_not(is_def)
        both = is_def.astype(jnp.int32) + (is_band.astype(jnp.int32) << 16)  # one scan for two
        excl = jnp.cumsum(both) - both
        # Masked lanes get spare slots of their own (interpret mode writes them; the GPU doesn't).
        pos = def_off + c_def + (excl & 0xFFFF)
        st = is_def & (pos < k)
        pltriton.store(out_ref.at[n, jnp.where(st, pos, k + lane)], cols, mask=st)
        pos = band_off + c_band + (excl >> 16)
        st = is_band & (pos < cap)
        pos = jnp.where(st, pos, cap + lane)
        pltriton.store(bkey_ref.at[n, pos], key, mask=st)
        pltriton.store(bcol_ref.at[n, pos], cols, mask=st)
        total = jnp.sum(both)
        if not sliced:
            valid = valid + (key != _INVALID).astype(jnp.int32)
        return c_def + (total & 0xFFFF), c_band + (total >> 16), valid

    load = functools.partial(_slice_keys, x_ref, n, s, n_chunks=n_chunks, row_len=row_len,
                             slice_len=slice_len, block=block)
    c_def, c_band, valid = _chunk_loop(n_chunks, group, load, step,
                                       (jnp.int32(0), jnp.int32(0), jnp.zeros((block,), jnp.int32)))
    if not sliced:
        _store_counts(cnt_ref, n, s, c_def, c_band, jnp.sum(valid))


def _select_kernel(x_ref, len_ref, thr_ref, cnt_ref, bkey_ref, bcol_ref, out_in_ref, out_ref, *, k, cap,
                   block, group):
    """Row n: the band's selected keys after the definite ones (out_in_ref aliases out_ref), or
    the whole answer from the row's len[n] columns when the band cannot hold it; -1 padding.
    Nothing for a row the write sweep marked done (cnt[n, 0, 3] = 1: `mosaic.topk_write`
    selected its band itself)."""
    del out_in_ref
    n = pl.program_id(0)
    row_len = len_ref[n]
    lane = jnp.arange(block, dtype=jnp.int32)
    t_lo, t_hi = _load_thresholds(thr_ref, n)
    n_def, n_band, n_valid, done = (jnp.sum(c) for c in _load_counts(cnt_ref, n))
    done = done > 0
    n_sel = jnp.minimum(n_valid, k)
    ok = _band_holds_answer(n_def, n_band, n_valid, k, cap)
    # Source of the selection: the band (keys in [t_lo, t_hi)) or, failing that, the row.
    rank = jnp.where(ok, n_sel - n_def, n_sel)
    n_src = jnp.where(ok, n_band, row_len)
    take_all = jnp.where(ok, rank == n_band, n_valid <= k)  # every valid source key
    base = jnp.where(ok, n_def, 0)

    def src(i):
        j = i * block + lane
        m = j < n_src
        bk = pltriton.load(bkey_ref.at[n, pl.ds(i * block, block)], mask=m & ok, other=_INVALID)
        bc = pltriton.load(bcol_ref.at[n, pl.ds(i * block, block)], mask=m & ok, other=0)
        x = pltriton.load(x_ref.at[n, j], mask=m & jnp.logical_not(ok), other=-jnp.inf)
        return jnp.where(ok, bc, j), jnp.where(ok, bk, _row_keys(x))

    n_src_chunks = jnp.where((rank > 0) & jnp.logical_not(done), (n_src + block - 1) // block, 0)
    lo = _to_u(jnp.where(ok, t_lo, _KEY_LOW))
    w = jnp.where(take_all | (rank == 0) | done, jnp.uint32(1), _to_u(jnp.where(ok, t_hi, _KEY_ABOVE)) - lo)
    one = lambda v: jnp.full((1,), v)  # noqa: E731  (a single search)
    lo, w, n_above = _count_search(_count_ge_chunks(lambda i: src(i)[1], n_src_chunks, group),
                                   one(rank), one(lo), one(w),
                                   one(jnp.where(ok, n_band, n_valid)), one(jnp.int32(0)), 0)
    lo, w, n_above = jnp.sum(lo), jnp.sum(w), jnp.sum(n_above)
    # Keys >= hi are all taken, then the first (rank - n_above) in [lo, hi) in column order: the
    # ties at the rank-th key (w = 1) or all of them (the search stopped at exactly rank keys).
    # take_all: every valid key is >= _KEY_LOW.
    hi = jnp.where(take_all, _KEY_LOW, _from_u(lo + w))
    lo = _from_u(lo)
    take_eq = jnp.where(take_all, 0, rank - n_above)
    n_gt = rank - take_eq

    def compact(loaded, carry):
        c_gt, c_eq = carry
        cols, key = loaded
        gt = key >= hi
        eq = (key >= lo) & jnp.logical_not(gt)
        both = gt.astype(jnp.int32) + (eq.astype(jnp.int32) << 16)
        excl = jnp.cumsum(both) - both
        rank_eq = c_eq + (excl >> 16)
        take = gt | (eq & (rank_eq < take_eq))
        pos = base + jnp.where(gt, c_gt + (excl & 0xFFFF), n_gt + rank_eq)
        pltriton.store(out_ref.at[n, jnp.where(take, pos, k + lane)], cols, mask=take)
        total = jnp.sum(both)
        return c_gt + (total & 0xFFFF), c_eq + (total >> 16)

    _chunk_loop(n_src_chunks, group, src, compact, (jnp.int32(0), jnp.int32(0)))

    def pad(j, carry):
        cols = j * block + lane
        pltriton.store(out_ref.at[n, pl.ds(j * block, block)], jnp.full((block,), -1, jnp.int32),
                       mask=(cols >= n_sel) & (cols < k))
        return carry

    jax.lax.fori_loop(jnp.where(done, pl.cdiv(k, block), n_sel // block), pl.cdiv(k, block), pad, 0)


# ----------------------------------------------------------------------------------------------
# Static plan and entry point
# ----------------------------------------------------------------------------------------------

def _sample_bits(length, sample, xp=jnp):
    """log2 of the keys sampled from a row of `length` keys (int32: a run-time scalar in the
    kernel; xp = np for a host value): `sample` rounded up to a power of two (>= _RUN), or by
    default length / 32 rounded up to a power of two and clamped to [_SAMPLE_MIN, _SAMPLE_MAX]."""
    if sample is not None:
        return xp.int32(max(_RUN, next_pow2(sample)).bit_length() - 1)
    bits = xp.int32(_SAMPLE_MIN.bit_length() - 1)
    for b in range(_SAMPLE_MIN.bit_length(), _SAMPLE_MAX.bit_length()):
        bits = xp.where(length // 32 > 1 << (b - 1), xp.int32(b), bits)
    return bits


def _row_plan(length, k, sample, xp=jnp):
    """Threshold plan of a row of `length` keys (as `_sample_bits`) -> (bits, r_lo, r_hi,
    tol), int32: 2^bits keys sampled, the ranks of t_lo and t_hi in the sample and the sample
    search's tolerance. Keyed on the row's own length, so that a row is sampled as densely
    whatever the logits' width (a row filling the width: the plan that width always had). When
    2^bits >= length the sample is the row itself: exact thresholds, r_lo = r_hi = k, tol 0.
    The r-th largest of `size` keys spread over the row has ~ r * stride row keys above it
    (stride = length / size), std ~ sqrt(r) * stride: r_lo - z sqrt(r_lo) = k / stride (>= k
    keys at z sigma) and r_hi + z sqrt(r_hi) = k / stride (<= k keys); the band holds ~(r_lo -
    r_hi) * stride. In f32 (in the kernel, at run time)."""
    bits = _sample_bits(length, sample, xp)
    size = xp.int32(1) << bits
    m = k * size.astype(xp.float32) / xp.maximum(length, size).astype(xp.float32)  # k / stride
    root = xp.sqrt(_Z * _Z + 4 * m)
    r_lo = xp.ceil((_Z + root) * (_Z + root) / 4).astype(xp.int32)
    r_hi = xp.floor((root - _Z) * (root - _Z) / 4).astype(xp.int32)
    tol = xp.floor(xp.sqrt(m) / 4).astype(xp.int32)  # stop the sample's search at this many keys
    whole_row = size >= length
    return bits, xp.where(whole_row, k, r_lo), xp.where(whole_row, k, r_hi), xp.where(whole_row, 0, tol)


def _capacity(num_keys, k, sample):
    """Default band capacity for rows of <= num_keys keys: 1.5 x the band a row's plan expects
    ((r_lo - r_hi + 2 tol) sampled keys, stride row keys each) rounded up to a power of two, at
    the longest row of each sample size (the band grows with the stride), and >= min(L, k) for a
    row that is its own sample (the band then holds <= k keys, but for ties at the k-th)."""
    lengths, p = [num_keys], _SAMPLE_MIN
    while sample is None and p < _SAMPLE_MAX:  # the longest rows of the default sizes below the width's
        lengths += [32 * p + 31] if 32 * p + 31 < num_keys else []
        p *= 2
    cap = next_pow2(min(num_keys, k))
    for length in lengths:
        bits, r_lo, r_hi, tol = (int(v) for v in _row_plan(np.int32(length), k, sample, np))
        size = 1 << bits
        if size < length:
            cap = max(cap, next_pow2(int(1.5 * (r_lo - r_hi + 2 * tol) * (length / size))))
    return cap


def _kernel_plan(n, sample):
    """Warps of each kernel and the select kernel's chunk for n rows and a threshold sample of
    `sample` keys (a row filling the width's) -> ({"thresholds", "write", "select": warps},
    select chunk or None). thresholds 16 for a sample of 4 chunks, 4 with thousands of rows,
    else 8; the write sweep 4; select 8 below 1024 rows, 4 from there, 2 over 512-key chunks
    from 4096 rows (smaller programs keep more rows in flight). Chosen by each kernel's GPU time
    on an H200 (docs/design/topk.md, "warps a kernel")."""
    thresholds = 16 if sample >= 4096 else 4 if n >= 4096 else 8
    select = 8 if n < 1024 else 4 if n < 4096 else 2
    return dict(thresholds=thresholds, write=4, select=select), (512 if n >= 4096 else None)


def topk_stages(logits, k, *, lengths, interpret, block, num_warps, num_stages, sample, capacity, slices,
                group=None, backend="triton"):
    """`api.topk`'s kernels for N, L, k >= 1 and lengths [N] int or None (row n's keys: its first
    lengths[n] columns, clipped to [0, L]; None: whole rows)
    -> {"out": [N, k], "thresholds": [N, 2] (t_lo, t_hi),
    "counts": [N, S, 4] (definite, band, valid, done per slice; done = 1: the Mosaic sweep selected
    the row's band itself), "band_keys": [N, cap (+block)],
    "capacity": cap}; the intermediates let tests see which path each row took. group: chunks
    whose loads are issued together (default: 4 with several slices a row, else 1). num_warps:
    one count for the three kernels; None: each its own (`_kernel_plan`, which with block None
    also picks the select kernel's chunk). backend "mosaic": the write sweep is `mosaic.topk_write`
    where it applies (one slice a row, L and cap multiples of 4; compiled only), which also
    selects the band-path rows itself (the select kernel then skips them); the rest as "triton"."""
    n, num_keys = logits.shape
    chosen_block = block is None
    block = max(16, min(next_pow2(block or 1024), next_pow2(num_keys)))
    min_slice = block
    if slices is None:  # one slice (a single sweep) once rows alone fill the GPU
        slices = 1 if n >= 1024 else min(pl.cdiv(4096, n), pl.cdiv(num_keys, _MIN_SLICE))
        min_slice = max(block, _MIN_SLICE)
    # Slices of a row filling the width; each row's own: `_row_slice_len` (the same at L).
    slice_len = max(block, next_pow2(pl.cdiv(num_keys, max(1, slices))))
    n_slices = next_pow2(pl.cdiv(num_keys, slice_len))
    sliced = n_slices > 1
    group = group or (4 if sliced else 1)
    # The sample of a row filling the width (each row's own: `_row_plan`), its chunk and the
    # band capacity for rows of any length <= L.
    sample_at_width = 1 << int(_sample_bits(np.int32(num_keys), sample, np))
    whole_rows = sample_at_width >= num_keys  # every row is its own sample
    if whole_rows:
        sample_at_width = next_pow2(num_keys)
    chunk = min(sample_at_width, 1024)
    cap = capacity or _capacity(num_keys, k, sample)
    # Interpret mode carries out a masked-out scatter lane as a write of the old value: give
    # those lanes `block` spare columns of their own. On the GPU masked lanes store nothing.
    spare = block if interpret else 0
    warps, select_chunk = _kernel_plan(n, sample_at_width)
    if num_warps is not None:  # an explicit count applies to all three kernels
        warps, select_chunk = dict.fromkeys(warps, num_warps), None
    select_block = min(block, select_chunk) if select_chunk and chosen_block else block
    x = logits.astype(jnp.float32)
    lengths = (jnp.full((n,), num_keys, jnp.int32) if lengths is None
               else jnp.clip(lengths, 0, num_keys).astype(jnp.int32))
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)

    def call(kernel, name, **kw):
        params = pltriton.CompilerParams(num_warps=warps[name], num_stages=num_stages or 3)
        return pl.pallas_call(kernel, compiler_params=params, interpret=interpret, name=f"topk_{name}", **kw)

    thr_kernel = functools.partial(_threshold_kernel, k=k, sample=sample, chunk=chunk,
                                   group=min(group, sample_at_width // chunk), searches=1 if whole_rows else 2)
    write = functools.partial(_write_kernel, k=k, cap=cap, n_slices=n_slices, min_slice=min_slice, block=block,
                              group=group)
    written = (i32((n, k + spare)), i32((n, cap + spare)), i32((n, cap + spare)),
               i32((n, n_slices, 4)))
    if sliced:  # published slice counts: >= one f32 per thread of the write kernel
        pub = jax.ShapeDtypeStruct((n, next_pow2(max(2 * n_slices, 32 * warps["write"]))), jnp.float32)
        thr, pub = call(thr_kernel, "thresholds", out_shape=(i32((n, 2)), pub), grid=(n,))(x, lengths)
        out, bkey, bcol, cnt, _ = call(write, "write", out_shape=written + (pub,), grid=(n, n_slices),
                                       input_output_aliases={3: 4})(x, lengths, thr, pub)
    else:
        thr = call(thr_kernel, "thresholds", out_shape=i32((n, 2)), grid=(n,))(x, lengths)
        if backend == "mosaic" and num_keys % 4 == 0 and cap % 4 == 0:
            out, bkey, bcol, cnt = topk_write(x, lengths, thr, k=k, cap=cap)
        else:
            out, bkey, bcol, cnt = call(write, "write", out_shape=written, grid=(n, 1))(x, lengths, thr)
    out = call(functools.partial(_select_kernel, k=k, cap=cap, block=select_block, group=group), "select",
               out_shape=i32((n, k + spare)), grid=(n,), input_output_aliases={6: 0})(
                   x, lengths, thr, cnt, bkey, bcol, out)
    return dict(out=out[:, :k], thresholds=thr, counts=cnt, band_keys=bkey, capacity=cap)
