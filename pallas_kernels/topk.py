"""Top-k selection of indexer logits: the k highest finite entries of each row, -1 padded.

One Pallas kernel (Triton backend), one program per row: sample a threshold, filter the row to
the candidates above it in one sweep, exact count-based select among them (the whole row when
the candidates cannot hold the answer), then compaction. A radix select with tensor-core
(one-hot MMA) histograms and an unrolled variant of the counting passes were measured slower
on the H200 and removed (see docs/benchmarks.md, 2026-11-29).
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
# Pallas kernel (Triton backend): sample threshold -> filter candidates -> count-based select
# ----------------------------------------------------------------------------------------------

_SIGN = -(1 << 31)  # 0x80000000 as int32
_LOW31 = (1 << 31) - 1


def _ordered_key(x):
    """float32 -> int32 whose signed order is the float order (-0 < +0; NaN ignored by callers)."""
    b = jax.lax.bitcast_convert_type(x, jnp.int32)
    return b ^ ((b >> 31) & _LOW31)


_INVALID = -(1 << 31)  # key given to -inf / NaN / out-of-range lanes: below every valid key
_KEY_NEG_INF = -2139095041  # _ordered_key(-inf) (0x807FFFFF): no valid key equals it
_KEY_LOW = _KEY_NEG_INF + 1  # _ordered_key(-FLT_MAX), the lowest valid key
_KEY_POS_INF = 2139095040  # _ordered_key(+inf) (0x7F800000), the highest valid key
_WAYS = 16  # thresholds per counting pass (4 bits of key range per pass)
_Z = 5.0  # safety margin of the sampled threshold, in standard deviations


def _to_u(s):
    """Signed ordered key -> uint32 with the same (unsigned) order."""
    return jax.lax.bitcast_convert_type(s ^ _SIGN, jnp.uint32)


def _from_u(u):
    return jax.lax.bitcast_convert_type(u, jnp.int32) ^ _SIGN


def _count_select(load_keys, n_chunks, kk, lo, w, c_hi):
    """Exact kk-th largest key by a 16-way count search over a key interval.

    load_keys(i) -> [B] int32 ordered keys of chunk i (_INVALID for lanes to ignore).
    State: the kk-th largest key lies in [lo, lo + w) (uint32 order), c_hi = #keys >= lo + w
    (< kk), and #keys >= lo >= kk. Each pass counts the keys >= lo + j * ceil(w / 16) for the
    16 thresholds j = 0..15 in one sweep over the chunks and keeps the last sub-interval whose
    count is >= kk; it stops when w == 1. Returns (lo, c_hi): the key and #keys > it.
    Terminates after <= 8 passes whatever the data (w shrinks to ceil(w / 16) each pass)."""
    jj = jnp.arange(_WAYS, dtype=jnp.int32)
    jj_u = jj.astype(jnp.uint32)

    def cond(state):
        return state[1] > 1

    def body(state):
        lo, w, c_hi = state
        step = (w >> 4) + ((w & 15) != 0).astype(jnp.uint32)  # ceil(w / 16) >= 1
        th = _from_u(lo + jnp.minimum(jj_u * step, w))  # [16]; th[0] = lo

        def chunk(i, cnt):  # [block, 16] compare, one reduction per chunk
            key = load_keys(i)
            return cnt + jnp.sum((key[:, None] >= th[None, :]).astype(jnp.int32), axis=0)

        cnt = jax.lax.fori_loop(0, n_chunks, chunk, jnp.zeros((_WAYS,), jnp.int32))
        d = jnp.sum(((cnt >= kk) & (jj > 0)).astype(jnp.int32))
        c_next = jnp.sum(jnp.where(jj == d + 1, cnt, 0))
        c_next = jnp.where(d == _WAYS - 1, c_hi, c_next)
        d_u = d.astype(jnp.uint32)
        new_w = jnp.minimum((d_u + 1) * step, w) - d_u * step  # <= step < w: always shrinks
        return lo + d_u * step, new_w, c_next

    lo, _, c_hi = jax.lax.while_loop(cond, body, (lo, w, c_hi))
    return lo, c_hi


def _sample_params(num_keys, k, sample, cap):
    """Static sample size, target rank in the sample and candidate capacity."""
    if sample is None:
        sample = min(4096, max(1024, next_pow2(num_keys // 32)))
    sample = next_pow2(sample)
    if sample >= num_keys:  # the sample is the whole row: its k-th largest is the answer
        sample = next_pow2(num_keys)
        rank, default_cap = k, next_pow2(num_keys)
    else:
        # The r-th largest of `sample` evenly spread keys has ~ r * stride keys above it, std
        # ~ sqrt(r) * stride: pick r with r - z sqrt(r) = k / stride (>= k keys at z sigma) and
        # room for r + z sqrt(r) samples' worth of candidates.
        stride = num_keys / sample
        m = k / stride
        sr = (_Z + math.sqrt(_Z * _Z + 4 * m)) / 2
        rank = int(math.ceil(sr * sr))
        default_cap = next_pow2(max(k, int((rank + _Z * math.sqrt(rank)) * stride * 1.1)))
    return sample, rank, (cap or default_cap)


def _filter_kernel(x_ref, out_ref, ckey_ref, cidx_ref, *, k, num_keys, block, sample, rank, cap,
                   interpret):
    n = pl.program_id(0)
    lane = jnp.arange(block, dtype=jnp.int32)
    n_row_blocks = pl.cdiv(num_keys, block)

    def row_keys(i, enabled=None):
        cols = i * block + lane
        mask = cols < num_keys
        if enabled is not None:
            mask = mask & enabled
        x = pltriton.load(x_ref.at[n, pl.ds(i * block, block)], mask=mask, other=-jnp.inf)
        return cols, jnp.where(x > -jnp.inf, _ordered_key(x), _INVALID)  # NaN, -inf: invalid

    # 1. Sample: `sample` keys spread over the row (jittered stride) -> threshold t, the
    #    rank-th largest sampled key: ~ rank * stride (>= k with margin) keys are >= t.
    s_block = min(sample, block)
    s_lane = jnp.arange(s_block, dtype=jnp.int32)
    n_s_chunks = sample // s_block

    def sample_keys(c):
        j = c * s_block + s_lane
        if sample >= num_keys:
            pos, mask = j, j < num_keys
        else:
            q, r = divmod(num_keys, sample)
            h = jax.lax.shift_right_logical(j * -1640531535, 16)  # hash of j in [0, 65536)
            pos = j * q + (j * r) // sample + h % q
            mask = pos < num_keys
        pos = jnp.minimum(pos, num_keys - 1)
        x = pltriton.load(x_ref.at[n, pos], mask=mask, other=-jnp.inf)
        return jnp.where(x > -jnp.inf, _ordered_key(x), _INVALID)

    n_s = jax.lax.fori_loop(
        0, n_s_chunks, lambda c, a: a + jnp.sum((sample_keys(c) != _INVALID).astype(jnp.int32)),
        jnp.int32(0))
    few = n_s < rank  # too few valid samples: every valid key is a candidate
    lo0 = _to_u(jnp.int32(_KEY_LOW))
    w0 = jnp.where(few, jnp.uint32(1), _to_u(jnp.int32(_KEY_POS_INF)) + 1 - lo0)
    t_u, _ = _count_select(sample_keys, n_s_chunks, rank, lo0, w0, jnp.int32(0))
    t_key = jnp.where(few, _KEY_LOW, _from_u(t_u))

    # 2. Filter: one sweep of the row; keys >= t go (in column order) to the candidate
    #    buffer; also the valid count and the max key.
    def filter_body(i, carry):
        c_ge, nv, mx = carry
        cols, key = row_keys(i)
        ge = key >= t_key
        ge_i = ge.astype(jnp.int32)
        pos = c_ge + jnp.cumsum(ge_i) - ge_i
        st = ge & (pos < cap)
        pos = jnp.where(st, pos, cap + lane)  # masked lanes: spare slots of their own
        pltriton.store(ckey_ref.at[n, pos], key, mask=st)
        pltriton.store(cidx_ref.at[n, pos], cols, mask=st)
        return c_ge + jnp.sum(ge_i), nv + (key != _INVALID).astype(jnp.int32), jnp.maximum(mx, key)

    c_ge, nv, mx = jax.lax.fori_loop(
        0, n_row_blocks, filter_body,
        (jnp.int32(0), jnp.zeros((block,), jnp.int32), jnp.full((block,), _INVALID, jnp.int32)))
    n_valid = jnp.sum(nv)
    k_max = jnp.max(mx)
    if not interpret:
        # The candidates were written by other threads of this program: bar.sync orders those
        # global stores before the loads below (CUDA's __syncthreads visibility guarantee).
        pltriton.debug_barrier()

    # 3. Source of the exact selection: the candidates when they hold every key >= the answer
    #    (else: sample unlucky, overflow from ties, ...: the whole row, slower but exact).
    take_all = n_valid <= k
    ok = (c_ge >= jnp.minimum(n_valid, k)) & (c_ge <= cap)
    n_src = jnp.where(ok, c_ge, num_keys)
    n_src_chunks = (n_src + block - 1) // block

    def src(i):
        cols = i * block + lane
        m = (cols < n_src) & ok
        ck = pltriton.load(ckey_ref.at[n, pl.ds(i * block, block)], mask=m, other=_INVALID)
        ci = pltriton.load(cidx_ref.at[n, pl.ds(i * block, block)], mask=m, other=0)
        rcols, rk = row_keys(i, enabled=jnp.logical_not(ok))
        return jnp.where(ok, ci, rcols), jnp.where(ok, ck, rk)

    lo = jnp.where(ok, _to_u(t_key), _to_u(jnp.int32(_KEY_LOW)))
    w = jnp.where(take_all, jnp.uint32(1), _to_u(k_max) + 1 - lo)
    kth_u, n_above = _count_select(lambda i: src(i)[1], n_src_chunks, k, lo, w, jnp.int32(0))
    threshold = jnp.where(take_all, _KEY_NEG_INF, _from_u(kth_u))  # take_all: every valid key
    n_sel = jnp.minimum(n_valid, k)
    take_eq = jnp.where(take_all, 0, k - n_above)
    n_gt = n_sel - take_eq
    spare = k

    # 4. Compaction of the source: keys > threshold, then the first take_eq ties.
    def compact(i, carry):
        c_gt, c_eq = carry
        cols, key = src(i)
        gt = key > threshold
        eq = key == threshold
        gt_i, eq_i = gt.astype(jnp.int32), eq.astype(jnp.int32)
        pos_gt = c_gt + jnp.cumsum(gt_i) - gt_i
        rank_eq = c_eq + jnp.cumsum(eq_i) - eq_i
        take = gt | (eq & (rank_eq < take_eq))
        pos = jnp.where(gt, pos_gt, n_gt + rank_eq)
        pos = jnp.where(take, pos, spare + lane)
        pltriton.store(out_ref.at[n, pos], cols, mask=take)
        return c_gt + jnp.sum(gt_i), c_eq + jnp.sum(eq_i)

    jax.lax.fori_loop(0, n_src_chunks, compact, (jnp.int32(0), jnp.int32(0)))

    def pad(j, carry):
        cols = j * block + lane
        pltriton.store(out_ref.at[n, pl.ds(j * block, block)], jnp.full((block,), -1, jnp.int32),
                       mask=(cols >= n_sel) & (cols < k))
        return carry

    jax.lax.fori_loop(n_sel // block, pl.cdiv(k, block), pad, 0)


def topk(logits, k: int, *, interpret=False, block=None, num_warps=None, num_stages=None,
         sample=None, capacity=None):
    """[N, L] f32 (-inf = invalid) -> [N, k] int32: indices of the k largest finite entries per
    row, -1 padded. Same contract as `topk_reference` (order within a row unspecified; among
    equal values at the threshold any choice is valid; NaN counts as invalid).

    Keys: float32 bits mapped to an int32 whose order is the float order. Exact; one Pallas
    program (Triton backend) per row: sample, filter, count-select, compaction.
      1. sample `sample` (default L/32, clamped to [1024, 4096]) keys spread over the row
         (jittered stride); their rank-th largest key t, with rank chosen so that the
         expected number of row keys >= t is k + ~5 sigma (~1.85 k at L=32K, k=2048), is
         found exactly by the count search below (8 passes over 1024 keys);
      2. filter: ONE sweep of the row: keys >= t are appended (key, column) to a per-row
         candidate buffer of `capacity` entries (default ~2.5 k..4 k rounded up to a power of
         two: 8192 at L=32K/128K) in column order (block cumsum + running count); it also
         counts valid keys and takes the max key;
      3. if the candidates hold every key that can be selected (#candidates >= min(k, valid)
         and no overflow) the exact k-th largest key is searched among the ~2 k-4 k
         candidates only; otherwise (unlucky sample, overflow from massive ties, ...) among
         the whole row: correct either way, only slower;
      4. exact k-th largest key T by a 16-way count search on the key interval
         [t, max]: each pass counts the keys >= 16 thresholds spread over the interval in
         one sweep ([block, 16] compare, one reduction per chunk) and keeps the sub-interval
         holding the k-th; ~6 passes for the ~2^24 keys between t and the max of a Gaussian
         row (<= 8 always);
      5. compaction of the candidates: keys > T and the first k - #(> T) keys == T go to
         the output (block cumsums + running counters); -1 padding.
      Per element of the row: 1 load + ~20 integer ops (key, compare, position, valid count,
      max, predicated scatter) + its share of one block cumsum and sum (filter). The
      candidate work (~6 count passes x 16 compares + compaction over ~4K keys, ~1.2 M ops a
      row of 32K) and the sample (~8 x 16 x 1024 compares) are each about as much as the
      filter sweep itself; nothing per element goes through shared memory or tensor cores.
    A radix select (4 passes of 8-bit histograms by one-hot tensor-core MMA) and a variant
    counting with 15 unrolled scalar thresholds were both measured slower on the H200 (radix
    0.6-0.9x of lax.top_k) and removed; see docs/benchmarks.md, 2026-11-29.
    """
    n, num_keys = logits.shape
    if n == 0 or k == 0:
        return jnp.zeros((n, k), jnp.int32)
    if num_keys == 0:
        return jnp.full((n, k), -1, jnp.int32)
    if block is None:
        block = 1024
    block = max(16, min(next_pow2(block), next_pow2(num_keys)))
    # Interpret mode carries out a masked-out scatter lane as a write of the old value: give
    # those lanes `block` spare columns of their own. On the GPU masked lanes store nothing.
    out_cols = k + block if interpret else k
    params = pltriton.CompilerParams(num_warps=num_warps or 8, num_stages=num_stages or 3)
    x = logits.astype(jnp.float32)
    sample, rank, cap = _sample_params(num_keys, k, sample, capacity)
    kernel = functools.partial(_filter_kernel, k=k, num_keys=num_keys, block=block,
                               sample=sample, rank=rank, cap=cap, interpret=interpret)
    scratch = jax.ShapeDtypeStruct((n, cap + block), jnp.int32)
    out, _, _ = pl.pallas_call(
        kernel, out_shape=(jax.ShapeDtypeStruct((n, out_cols), jnp.int32), scratch, scratch),
        grid=(n,), compiler_params=params, interpret=interpret, name="indexer_topk_filter",
    )(x)
    return out if out_cols == k else out[:, :k]
