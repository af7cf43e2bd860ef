"""Top-k selection of indexer logits: the k highest finite entries of each row, -1 padded.

Four Pallas kernels (Triton backend): thresholds from a sample of each row, a counting sweep and
a writing sweep over row slices (several programs per row), then an exact select within the
narrow band of keys between the two thresholds. See `topk` for the scheme and the measurements.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ._shapes import next_pow2


def topk_reference(logits, k: int):
    """logits: [N, L] float32 with -inf for invalid keys -> [N, k] int32 key indices.

    Entries beyond the row's count of finite logits are -1 (also every entry past L when k > L).
    Order within a row is unspecified by contract; here it is descending.
    """
    kk = min(k, logits.shape[1])
    values, index = jax.lax.top_k(logits, kk)
    index = jnp.where(values > -jnp.inf, index, -1).astype(jnp.int32)
    return jnp.pad(index, ((0, 0), (0, k - kk)), constant_values=-1)


# ----------------------------------------------------------------------------------------------
# Keys: float32 -> int32 in the float order; count search over key intervals
# ----------------------------------------------------------------------------------------------

_SIGN = -(1 << 31)  # 0x80000000 as int32
_LOW31 = (1 << 31) - 1
_INVALID = -(1 << 31)  # key given to -inf / NaN / out-of-range lanes: below every valid key
_KEY_NEG_INF = -2139095041  # ordered key of -inf (0x807FFFFF): no valid key equals it
_KEY_LOW = _KEY_NEG_INF + 1  # ordered key of -FLT_MAX, the lowest valid key
_KEY_POS_INF = 2139095040  # ordered key of +inf (0x7F800000), the highest valid key
_KEY_ABOVE = _KEY_POS_INF + 1  # above every valid key
_WAYS = 16  # thresholds per counting pass (4 bits of key range per pass)
_Z = 5.0  # safety margin of the sampled thresholds, in standard deviations
_RUN = 8  # sampled keys are runs of 8 adjacent columns: one 32-byte sector each
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


def _count_search(count_ge, kk, lo, w, c_lo, c_hi, tol):
    """Narrow the interval holding the kk-th largest key by 16-way count passes.

    count_ge(th [16] int32) -> [16] int32: #keys >= each threshold (one sweep over the keys).
    State: the kk-th largest key lies in [lo, lo + w) (uint32 order); c_lo = #keys >= lo (>= kk)
    and c_hi = #keys >= lo + w (< kk). Each pass counts the keys >= lo + j * ceil(w / 16),
    j = 0..15, and keeps the last sub-interval whose count is >= kk. Stops when w == 1 (lo is
    then the kk-th largest key and c_hi the number of keys above it) or when the interval holds
    <= tol keys; <= 8 passes whatever the data. Returns (lo, w, c_hi)."""
    jj = jnp.arange(_WAYS, dtype=jnp.int32)
    jj_u = jj.astype(jnp.uint32)

    def cond(state):
        _, w, c_lo, c_hi = state
        return (w > 1) & (c_lo - c_hi > tol)

    def body(state):
        lo, w, c_lo, c_hi = state
        step = (w >> 4) + ((w & 15) != 0).astype(jnp.uint32)  # ceil(w / 16) >= 1
        cnt = count_ge(_from_u(lo + jnp.minimum(jj_u * step, w)))  # cnt[0] = c_lo
        d = jnp.sum(((cnt >= kk) & (jj > 0)).astype(jnp.int32))  # counts fall with j
        c_lo_next = jnp.sum(jnp.where(jj == d, cnt, 0))
        c_hi_next = jnp.where(d == _WAYS - 1, c_hi, jnp.sum(jnp.where(jj == d + 1, cnt, 0)))
        d_u = d.astype(jnp.uint32)
        w_next = jnp.minimum((d_u + 1) * step, w) - d_u * step  # <= step < w: always shrinks
        return lo + d_u * step, w_next, c_lo_next, c_hi_next

    lo, w, _, c_hi = jax.lax.while_loop(cond, body, (lo, w, c_lo, c_hi))
    return lo, w, c_hi


def _count_ge_chunks(load_keys, n_chunks):
    """count_ge for _count_search over keys loaded chunk by chunk ([B] int32 each)."""
    def count_ge(th):
        def chunk(i, cnt):  # [B, 16] compare, one reduction per chunk
            return cnt + jnp.sum((load_keys(i)[:, None] >= th[None, :]).astype(jnp.int32), axis=0)
        return jax.lax.fori_loop(0, n_chunks, chunk, jnp.zeros((_WAYS,), jnp.int32))
    return count_ge


def _pick(vec, i):
    """vec[i] of a small vector (Triton has no element extraction)."""
    return jnp.sum(jnp.where(jnp.arange(vec.shape[0]) == i, vec, 0))


def _load_thresholds(thr_ref, n):
    t = pltriton.load(thr_ref.at[n, pl.ds(0, 2)])
    return _pick(t, 0), _pick(t, 1)


def _load_counts(cnt_ref, n):
    """Per-slice counts of row n -> ([S] definite, [S] band, [S] valid)."""
    c = pltriton.load(cnt_ref.at[n])  # [S, 4]
    col = jnp.arange(4, dtype=jnp.int32)[None, :]
    return tuple(jnp.sum(jnp.where(col == j, c, 0), axis=1) for j in range(3))


def _band_holds_answer(n_def, n_band, n_valid, k, cap):
    """The definite keys are all selected and the band holds the rest of the answer."""
    n_sel = jnp.minimum(n_valid, k)
    return (n_def <= n_sel) & (n_def + n_band >= n_sel) & (n_band <= cap)


# ----------------------------------------------------------------------------------------------
# The four kernels
# ----------------------------------------------------------------------------------------------

def _threshold_kernel(x_ref, thr_ref, *, num_keys, sample, chunk, r_lo, r_hi, tol):
    """thr[n] = (t_lo, t_hi): ~r_lo * stride row keys are >= t_lo and ~r_hi * stride >= t_hi."""
    n = pl.program_id(0)
    lane = jnp.arange(chunk, dtype=jnp.int32)

    def sample_keys(c):
        j = c * chunk + lane
        if sample >= num_keys:  # the whole row: exact thresholds
            return _row_keys(pltriton.load(x_ref.at[n, j], mask=j < num_keys, other=-jnp.inf))
        n_runs = sample // _RUN
        q = num_keys // n_runs  # >= _RUN
        run = j // _RUN
        h = jax.lax.shift_right_logical(run * -1640531535, 16)  # hash of the run in [0, 65536)
        pos = run * q + (h % (q // _RUN)) * _RUN + j % _RUN  # runs 8-aligned when q is
        return _row_keys(pltriton.load(x_ref.at[n, pos]))

    chunks = [sample_keys(c) for c in range(sample // chunk)]  # the sample stays in registers

    def count_ge(th):
        acc = sum((key[:, None] >= th[None, :]).astype(jnp.int32) for key in chunks)
        return jnp.sum(acc, axis=0)

    n_s = sum(jnp.sum((key != _INVALID).astype(jnp.int32)) for key in chunks)
    lo0 = _to_u(jnp.int32(_KEY_LOW))
    w_all = _to_u(jnp.int32(_KEY_ABOVE)) - lo0

    def search(rank):
        w0 = jnp.where(n_s >= rank, w_all, jnp.uint32(1))
        return _count_search(count_ge, rank, lo0, w0, n_s, jnp.int32(0), tol)

    lo, w, _ = search(r_lo)  # lo <= the r_lo-th largest sampled key
    t_lo = jnp.where(n_s >= r_lo, _from_u(lo), _KEY_LOW)
    if r_hi == 0:
        t_hi = jnp.int32(_KEY_ABOVE)
    else:
        if r_hi != r_lo:
            lo, w, _ = search(r_hi)
        t_hi = jnp.where(n_s >= r_hi, _from_u(lo + w), _KEY_ABOVE)  # > the r_hi-th largest
    pltriton.store(thr_ref.at[n, pl.ds(0, 2)], jnp.where(jnp.arange(2) == 0, t_lo, t_hi))


def _slice_chunks(s, num_keys, slice_len, block):
    """Chunks of `block` columns in slice s (0 past the row's end)."""
    left = num_keys - s * slice_len
    return jnp.clip((left + block - 1) // block, 0, slice_len // block)


def _count_kernel(x_ref, thr_ref, cnt_ref, *, num_keys, slice_len, block):
    """cnt[n, s] = #keys of slice s >= t_hi (definite), in [t_lo, t_hi) (band), valid, 0."""
    n, s = pl.program_id(0), pl.program_id(1)
    lane = jnp.arange(block, dtype=jnp.int32)
    t_lo, t_hi = _load_thresholds(thr_ref, n)

    def body(i, acc):
        cols = s * slice_len + i * block + lane
        key = _row_keys(pltriton.load(x_ref.at[n, cols], mask=cols < num_keys, other=-jnp.inf))
        n_def, n_band, n_valid = acc
        return (n_def + (key >= t_hi).astype(jnp.int32),
                n_band + ((key >= t_lo) & (key < t_hi)).astype(jnp.int32),
                n_valid + (key != _INVALID).astype(jnp.int32))

    zeros = jnp.zeros((block,), jnp.int32)
    acc = jax.lax.fori_loop(0, _slice_chunks(s, num_keys, slice_len, block), body,
                            (zeros, zeros, zeros))
    j = jnp.arange(4, dtype=jnp.int32)
    n_def, n_band, n_valid = (jnp.sum(a) for a in acc)
    pltriton.store(cnt_ref.at[n, s, pl.ds(0, 4)],
                   jnp.where(j == 0, n_def, jnp.where(j == 1, n_band, jnp.where(j == 2, n_valid, 0))))


def _write_kernel(x_ref, thr_ref, cnt_ref, out_ref, bkey_ref, bcol_ref, *, k, cap, num_keys,
                  slice_len, block):
    """Slice s of row n: columns of definite keys -> out[n, offset..], band keys and columns ->
    band[n, offset..], in column order (offsets: the counts of slices 0..s-1). Rows whose band
    cannot hold the answer are skipped (the select kernel searches the whole row)."""
    n, s = pl.program_id(0), pl.program_id(1)
    lane = jnp.arange(block, dtype=jnp.int32)
    t_lo, t_hi = _load_thresholds(thr_ref, n)
    n_def, n_band, n_valid = _load_counts(cnt_ref, n)
    ok = _band_holds_answer(jnp.sum(n_def), jnp.sum(n_band), jnp.sum(n_valid), k, cap)
    before = jnp.arange(n_def.shape[0]) < s
    def_off = jnp.sum(jnp.where(before, n_def, 0))
    band_off = jnp.sum(jnp.where(before, n_band, 0))
    mine = _pick(n_def + n_band, s)
    n_chunks = jnp.where(ok & (mine > 0), _slice_chunks(s, num_keys, slice_len, block), 0)

    def body(i, carry):
        c_def, c_band = carry
        cols = s * slice_len + i * block + lane
        key = _row_keys(pltriton.load(x_ref.at[n, cols], mask=cols < num_keys, other=-jnp.inf))
        is_def = key >= t_hi
        is_band = (key >= t_lo) & jnp.logical_not(is_def)
        both = is_def.astype(jnp.int32) + (is_band.astype(jnp.int32) << 16)  # one scan for two
        excl = jnp.cumsum(both) - both
        # Masked lanes get spare slots of their own (interpret mode writes them; the GPU doesn't).
        pos = jnp.where(is_def, def_off + c_def + (excl & 0xFFFF), k + lane)
        pltriton.store(out_ref.at[n, pos], cols, mask=is_def)
        pos = jnp.where(is_band, band_off + c_band + (excl >> 16), cap + lane)
        pltriton.store(bkey_ref.at[n, pos], key, mask=is_band)
        pltriton.store(bcol_ref.at[n, pos], cols, mask=is_band)
        total = jnp.sum(both)
        return c_def + (total & 0xFFFF), c_band + (total >> 16)

    jax.lax.fori_loop(0, n_chunks, body, (jnp.int32(0), jnp.int32(0)))


def _select_kernel(x_ref, thr_ref, cnt_ref, bkey_ref, bcol_ref, out_in_ref, out_ref, *, k, cap,
                   num_keys, block):
    """Row n: the band's selected keys after the definite ones (out_in_ref aliases out_ref), or
    the whole answer from the whole row when the band cannot hold it; -1 padding."""
    del out_in_ref
    n = pl.program_id(0)
    lane = jnp.arange(block, dtype=jnp.int32)
    t_lo, t_hi = _load_thresholds(thr_ref, n)
    n_def, n_band, n_valid = (jnp.sum(c) for c in _load_counts(cnt_ref, n))
    n_sel = jnp.minimum(n_valid, k)
    ok = _band_holds_answer(n_def, n_band, n_valid, k, cap)
    # Source of the selection: the band (keys in [t_lo, t_hi)) or, failing that, the row.
    rank = jnp.where(ok, n_sel - n_def, n_sel)
    n_src = jnp.where(ok, n_band, num_keys)
    take_all = jnp.where(ok, rank == n_band, n_valid <= k)  # every valid source key
    base = jnp.where(ok, n_def, 0)

    def src(i):
        j = i * block + lane
        m = j < n_src
        bk = pltriton.load(bkey_ref.at[n, pl.ds(i * block, block)], mask=m & ok, other=_INVALID)
        bc = pltriton.load(bcol_ref.at[n, pl.ds(i * block, block)], mask=m & ok, other=0)
        x = pltriton.load(x_ref.at[n, j], mask=m & jnp.logical_not(ok), other=-jnp.inf)
        return jnp.where(ok, bc, j), jnp.where(ok, bk, _row_keys(x))

    n_src_chunks = jnp.where(rank > 0, (n_src + block - 1) // block, 0)
    lo = _to_u(jnp.where(ok, t_lo, _KEY_LOW))
    w = jnp.where(take_all | (rank == 0), jnp.uint32(1), _to_u(jnp.where(ok, t_hi, _KEY_ABOVE)) - lo)
    kth_u, _, n_above = _count_search(_count_ge_chunks(lambda i: src(i)[1], n_src_chunks), rank,
                                      lo, w, jnp.where(ok, n_band, n_valid), jnp.int32(0), 0)
    # take_all: every valid key is > _KEY_NEG_INF; otherwise keys > kth and the first ties.
    threshold = jnp.where(take_all, _KEY_NEG_INF, _from_u(kth_u))
    take_eq = jnp.where(take_all, 0, rank - n_above)
    n_gt = rank - take_eq

    def compact(i, carry):
        c_gt, c_eq = carry
        cols, key = src(i)
        gt = key > threshold
        eq = key == threshold
        both = gt.astype(jnp.int32) + (eq.astype(jnp.int32) << 16)
        excl = jnp.cumsum(both) - both
        rank_eq = c_eq + (excl >> 16)
        take = gt | (eq & (rank_eq < take_eq))
        pos = base + jnp.where(gt, c_gt + (excl & 0xFFFF), n_gt + rank_eq)
        pltriton.store(out_ref.at[n, jnp.where(take, pos, k + lane)], cols, mask=take)
        total = jnp.sum(both)
        return c_gt + (total & 0xFFFF), c_eq + (total >> 16)

    jax.lax.fori_loop(0, n_src_chunks, compact, (jnp.int32(0), jnp.int32(0)))

    def pad(j, carry):
        cols = j * block + lane
        pltriton.store(out_ref.at[n, pl.ds(j * block, block)], jnp.full((block,), -1, jnp.int32),
                       mask=(cols >= n_sel) & (cols < k))
        return carry

    jax.lax.fori_loop(n_sel // block, pl.cdiv(k, block), pad, 0)


# ----------------------------------------------------------------------------------------------
# Static plan and entry point
# ----------------------------------------------------------------------------------------------

def _sample_plan(num_keys, k, sample, capacity):
    """Static sample size, ranks of the two thresholds in it, search tolerance, band capacity."""
    if sample is None:
        sample = min(8192, max(1024, next_pow2(num_keys // 16)))
    sample = max(_RUN, next_pow2(sample))
    if sample >= num_keys:  # the sample is the whole row: t_lo = the k-th largest key exactly
        sample = next_pow2(num_keys)
        return sample, k, k, 0, capacity or next_pow2(min(num_keys, k))
    # The r-th largest of `sample` keys spread over the row has ~ r * stride row keys above
    # it, std ~ sqrt(r) * stride: r_lo - z sqrt(r_lo) = k / stride (>= k keys at z sigma) and
    # r_hi + z sqrt(r_hi) = k / stride (<= k keys); the band holds ~(r_lo - r_hi) * stride.
    stride = num_keys / sample
    m = k / stride
    root = math.sqrt(_Z * _Z + 4 * m)
    r_lo = int(math.ceil(((_Z + root) / 2) ** 2))
    r_hi = int(math.floor(((root - _Z) / 2) ** 2))
    tol = int(math.sqrt(m) / 4)  # stop the sample's search at this many keys per interval
    default_cap = next_pow2(int(1.5 * (r_lo - r_hi + 2 * tol) * stride))
    return sample, r_lo, r_hi, tol, capacity or default_cap


def topk(logits, k: int, *, interpret=False, block=None, num_warps=None, num_stages=None,
         sample=None, capacity=None, slices=None):
    """[N, L] f32 (-inf = invalid) -> [N, k] int32: indices of the k largest finite entries per
    row, -1 padded. Same contract as `topk_reference` (order within a row unspecified; among
    equal values at the threshold any choice is valid; NaN counts as invalid). Deterministic.

    Keys: float32 bits mapped to an int32 whose order is the float order. Exact whatever the
    data; four Pallas kernels (Triton backend):
      1. thresholds (one program per row): a sample of `sample` keys (default L/16 clamped to
         [1024, 8192]; runs of 8 adjacent columns at a jittered stride) held in registers;
         16-way count searches find t_lo, with ~k + 5 sigma row keys expected >= it, and
         t_hi > t, with ~k - 5 sigma expected >= it (searches stop once an interval holds
         ~sqrt(k / stride) / 4 sampled keys: the thresholds need not be exact sample ranks);
      2. count (one program per row slice): per slice, #keys >= t_hi ("definite"), #keys in
         [t_lo, t_hi) (the "band") and #valid keys; pure streaming;
      3. write (one program per row slice): offsets from the counts of the earlier slices;
         definite keys' columns go straight to the output, band keys (key, column) to a
         per-row band buffer of `capacity` entries, both in column order (one block cumsum
         of two packed 16-bit counters per chunk);
      4. select (one program per row): if the definite keys number <= min(k, valid) <=
         definite + band (and the band fits), the exact (min(k, valid) - definite)-th largest
         band key T by 16-way count passes over the band only (~1-2K keys), and the band's
         keys > T and first ties == T are appended; otherwise (unlucky sample, massive ties,
         adversarial order) the exact k-th largest of the whole row and a whole-row
         compaction: correct either way, only slower. -1 padding.
    Rows are split into `slices` slices (default: ~4096 programs, slices >= 4096 keys) so that
    few long rows still fill the GPU; the row is read twice (count, write) by streaming
    kernels, and only ~1-2K band keys per row go through the sequential select.
    """
    if logits.ndim != 2:
        raise ValueError(f"topk: logits must be 2-D [N, L], got shape {logits.shape}")
    if k < 0:
        raise ValueError(f"topk: k must be >= 0, got {k}")
    n, num_keys = logits.shape
    if n == 0 or k == 0:
        return jnp.zeros((n, k), jnp.int32)
    if num_keys == 0:
        return jnp.full((n, k), -1, jnp.int32)
    return _topk_stages(logits, k, interpret=interpret, block=block, num_warps=num_warps,
                        num_stages=num_stages, sample=sample, capacity=capacity,
                        slices=slices)["out"]


def _topk_stages(logits, k, *, interpret, block, num_warps, num_stages, sample, capacity, slices):
    """`topk`'s kernels for N, L, k >= 1 -> {"out": [N, k], "thresholds": [N, 2] (t_lo, t_hi),
    "counts": [N, S, 4] (definite, band, valid, 0 per slice), "band_keys": [N, cap (+block)],
    "capacity": cap}; the intermediates let tests see which path each row took."""
    n, num_keys = logits.shape
    block = max(16, min(next_pow2(block or 1024), next_pow2(num_keys)))
    if slices is None:
        slices = min(pl.cdiv(4096, n), pl.cdiv(num_keys, _MIN_SLICE))
    slice_len = max(block, next_pow2(pl.cdiv(num_keys, max(1, slices))))
    n_slices = next_pow2(pl.cdiv(num_keys, slice_len))
    sample, r_lo, r_hi, tol, cap = _sample_plan(num_keys, k, sample, capacity)
    # Interpret mode carries out a masked-out scatter lane as a write of the old value: give
    # those lanes `block` spare columns of their own. On the GPU masked lanes store nothing.
    spare = block if interpret else 0
    params = pltriton.CompilerParams(num_warps=num_warps or 8, num_stages=num_stages or 3)
    x = logits.astype(jnp.float32)
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    call = functools.partial(pl.pallas_call, compiler_params=params, interpret=interpret)

    thr = call(functools.partial(_threshold_kernel, num_keys=num_keys, sample=sample,
                                 chunk=min(sample, 1024), r_lo=r_lo, r_hi=r_hi, tol=tol),
               out_shape=i32((n, 2)), grid=(n,), name="topk_thresholds")(x)
    sliced = dict(num_keys=num_keys, slice_len=slice_len, block=block)
    cnt = call(functools.partial(_count_kernel, **sliced), out_shape=i32((n, n_slices, 4)),
               grid=(n, n_slices), name="topk_count")(x, thr)
    out, bkey, bcol = call(
        functools.partial(_write_kernel, k=k, cap=cap, **sliced),
        out_shape=(i32((n, k + spare)), i32((n, cap + spare)), i32((n, cap + spare))),
        grid=(n, n_slices), name="topk_write")(x, thr, cnt)
    out = call(functools.partial(_select_kernel, k=k, cap=cap, num_keys=num_keys, block=block),
               out_shape=i32((n, k + spare)), grid=(n,), input_output_aliases={5: 0},
               name="topk_select")(x, thr, cnt, bkey, bcol, out)
    return dict(out=out[:, :k], thresholds=thr, counts=cnt, band_keys=bkey, capacity=cap)
