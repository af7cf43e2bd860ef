"""Pallas indexer kernels (logits over a paged key cache, top-k) against their jnp references.

On CPU the kernels run in Pallas interpret mode on the tiny config (Hi=4, D=16, page 4; the
Mosaic GPU kernel in its interpreter, which poisons fresh buffers with NaN); the `gpu` tests
compile them for real dimensions (Hi=64, D=128, page 64, k=2048).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sparse_mla.config import MLAConfig
from pallas_kernels.indexer_logits import indexer_logits, indexer_logits_reference
from pallas_kernels.indexer_logits.mosaic_decode import choose_decode_tiling, indexer_logits_mosaic_decode
from pallas_kernels.indexer_logits.mosaic_prefill import indexer_logits_mosaic_prefill
from pallas_kernels.indexer_logits.triton import indexer_logits_triton
from pallas_kernels.topk import topk, topk_reference
from tests.conftest import INTERPRET

FP8 = jnp.float8_e4m3fn


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------

def make_indexer_case(seed, *, dtype, scaled, hi, d, page, lengths, rows_per_seq, extra_pages=3,
                      interleave_rows=True):
    """A ragged batch: sequence s has lengths[s] keys (pages shuffled over a shared pool) and
    rows_per_seq[s] query rows; rows are interleaved across sequences (else in sequence order);
    row ends are a causal run ending at the sequence length plus a few odd ones (0, 1, full)."""
    rng = np.random.default_rng(seed)
    num_seqs = len(lengths)
    width = max(-(-l // page) for l in lengths) + 1  # one spare (unused, -1) page column
    num_pages = num_seqs * width + extra_pages
    pool = rng.permutation(num_pages).astype(np.int32)
    tables = np.full((num_seqs, width), -1, np.int32)
    used = 0
    for s, l in enumerate(lengths):
        n_p = -(-l // page)
        tables[s, :n_p] = pool[used:used + n_p]
        used += n_p
    row_seq, row_end = [], []
    for s, (l, r) in enumerate(zip(lengths, rows_per_seq)):
        ends = list(range(max(1, l - r + 1), l + 1))[-r:]
        ends = ends + [l] * (r - len(ends))
        row_seq += [s] * r
        row_end += ends
    row_seq, row_end = np.array(row_seq, np.int32), np.array(row_end, np.int32)
    n = len(row_seq)
    if n >= 3:  # odd ends: no valid key, exactly one, the whole table width
        row_end[0], row_end[1], row_end[2] = 0, 1, min(lengths[row_seq[2]], width * page)
    if interleave_rows:  # rows of different sequences interleaved
        perm = rng.permutation(n)
        row_seq, row_end = row_seq[perm], row_end[perm]

    q = rng.standard_normal((n, hi, d)).astype(np.float32)
    k = rng.standard_normal((num_pages * page, d)).astype(np.float32)
    w = rng.standard_normal((n, hi)).astype(np.float32)  # negative weights included
    if dtype == FP8:
        q, k = q * 8, k * 8
    q, k = jnp.asarray(q).astype(dtype), jnp.asarray(k).astype(dtype)
    k_scale = None
    if scaled:
        k_scale = jnp.asarray((2.0 ** rng.integers(-6, 2, num_pages * page)).astype(np.float32))
    return (q, jnp.asarray(w), k, k_scale, jnp.asarray(tables), jnp.asarray(row_seq),
            jnp.asarray(row_end)), page


def check_logits(out, ref, tol):
    out, ref = np.asarray(out), np.asarray(ref)
    assert out.shape == ref.shape and out.dtype == np.float32
    fin = np.isfinite(ref)
    np.testing.assert_array_equal(np.isfinite(out), fin)
    np.testing.assert_array_equal(out[~fin], ref[~fin])  # -inf exactly
    if fin.any():
        err = np.linalg.norm(out[fin] - ref[fin]) / max(np.linalg.norm(ref[fin]), 1e-30)
        assert err <= tol, err


# fp8 logits on the GPU. The products q_d * k_d of e4m3 values are exact (4-bit significands), and
# so is the CPU interpreter's f32 sum of them, so there the tight norm tolerance holds. Hopper's fp8
# tensor cores (wgmma with e4m3 operands: the Mosaic GPU kernels; the Triton kernel's fp8 dot with
# max_num_imprecise_acc = 128) do not add them in f32: the accumulator keeps about 14 significant
# bits (DeepSeek-V3 technical report, section 3.3.2: FP8 GEMM accumulation on H800 "limited to
# retaining around 14 bits"; an e8m13 accumulator whose results are truncated, not rounded), so an
# operand aligned to magnitude M loses up to 2^-13 M. One instruction adds K = 32 products to the
# accumulator: D values take S = ceil(D / 32) steps acc_j = acc_(j-1) + g_j, g_j the step's sum of
# products, and counting both operands of each step as truncated at max(|acc_(j-1)|, |g_j|)
# <= sum_(d < 32 j) |p_d| (p_d = q_d k_d),
#     |err(q . k)| <= FP8_ACC_TRUNCATIONS * 2^-13 * sum_j sum_(d < 32 j) |p_d|
#                   = FP8_ACC_TRUNCATIONS * 2^-13 * sum_d (S - d // 32) |p_d|,   FP8_ACC_TRUNCATIONS = 2.
# ReLU is 1-Lipschitz and the rest is f32 (x w, a sum over heads, x k_scale), so per logit
#     |err(I[n, s])| <= 2 * 2^-13 * B[n, s] + (D + 2 Hi + 4) * 2^-24 * B0[n, s],
#     B[n, s] = |k_scale[s]| * sum_h |w[n, h]| * sum_d (S - d // 32) |q[n, h, d] k[s, d]|, B0 the same with
# weights 1 (the 2^-24 term: the f32 sums of kernel and reference). Both are computed in numpy,
# float64, from the same quantised inputs. Measured on the H200 (jax 0.11.2, every fp8 comparison
# of this file, `-m "gpu or not gpu"`): the worst |err| was 0.23 of the bound at the tiny dims
# (D = 16, S = 1) and 0.04 at Hi = 64, D = 128 (norm-relative errors 2.5e-5..5e-5 and 1.0e-4..1.3e-4);
# _hopper_fp8_logits, a numpy model of that accumulator, gives 0.16 and 0.01 (norm-relative 3.1e-5
# and 8.9e-5), while a missing head or one wrong key is 16-2000x past the bound
# (test_fp8_logit_bound_rejects_wrong_logits).
HOPPER_FP8_ACC_ULP = 2.0 ** -13  # 13 fraction bits kept by the fp8 MMA accumulator, truncated
FP8_MMA_K = 32  # e4m3 products per wgmma instruction (k of m64nNk32)
FP8_ACC_TRUNCATIONS = 2  # truncated operands per accumulation step (accumulator, step's products)
F32_ULP = 2.0 ** -24


def fp8_logit_magnitude(args, page_size, depth_weights=None):
    """sum_h |w[n, h]| * sum_d c_d |q[n, h, d] k[s, d]| * |k_scale[s]| over each row's sequence, float64
    [N, W * page_size] (numpy; c_d = depth_weights or 1; sum_h and sum_d commute, all terms >= 0)."""
    q, w, k, k_scale, tables, row_seq, _ = args
    f64 = lambda a: np.abs(np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64))
    qw = np.einsum("nh,nhd->nd", f64(w), f64(q))  # [N, D]
    if depth_weights is not None:
        qw = qw * depth_weights
    tables = np.asarray(tables)
    slots = (np.maximum(tables, 0)[:, :, None] * page_size + np.arange(page_size)).reshape(tables.shape[0], -1)
    listed = np.repeat(tables >= 0, page_size, axis=1)
    k_abs = f64(k)
    ks = np.ones(k_abs.shape[0]) if k_scale is None else f64(k_scale)
    row_seq = np.asarray(row_seq)
    out = np.zeros((len(row_seq), slots.shape[1]))
    for seq in np.unique(row_seq):
        rows = row_seq == seq
        keys = k_abs[slots[seq]] * (ks[slots[seq]] * listed[seq])[:, None]  # [L, D]
        out[rows] = qw[rows] @ keys.T
    return out


def fp8_logit_bound(args, page_size):
    """Elementwise bound on |kernel - reference| for fp8 logits compiled for Hopper (see above)."""
    hi, d = args[0].shape[1], args[0].shape[2]
    steps_left = -(-d // FP8_MMA_K) - np.arange(d) // FP8_MMA_K  # S - d // 32: steps whose operands hold p_d
    return (FP8_ACC_TRUNCATIONS * HOPPER_FP8_ACC_ULP * fp8_logit_magnitude(args, page_size, steps_left)
            + (d + 2 * hi + 4) * F32_ULP * fp8_logit_magnitude(args, page_size))


def check_logits_within(out, ref, bound):
    """As check_logits, with |out - ref| <= bound elementwise where ref is finite."""
    out, ref = np.asarray(out), np.asarray(ref)
    assert out.shape == ref.shape and out.dtype == np.float32
    fin = np.isfinite(ref)
    np.testing.assert_array_equal(np.isfinite(out), fin)
    np.testing.assert_array_equal(out[~fin], ref[~fin])  # -inf exactly
    err = np.abs(out[fin].astype(np.float64) - ref[fin])
    over = err > bound[fin]
    if over.any():
        ratio = err / np.maximum(bound[fin], 1e-300)
        raise AssertionError(f"{over.sum()} of {fin.sum()} logits past the fp8 accumulation bound; "
                             f"worst |err| / bound = {ratio.max():.3g}")


def check_fp8_logits(out, ref, args, page_size, *, on_gpu=not INTERPRET):
    """fp8 logits against the f32 reference, per backend: interpreted on CPU (exact products, f32
    sums) within the tight 1e-5 norm tolerance; compiled for the GPU within fp8_logit_bound."""
    if on_gpu:
        check_logits_within(out, ref, fp8_logit_bound(args, page_size))
    else:
        check_logits(out, ref, 1e-5)


def check_indexer_logits(out, ref, args, page_size, tol):
    """fp8 inputs: check_fp8_logits (per backend); bf16 / f32: norm-relative tol."""
    if args[0].dtype == FP8:
        check_fp8_logits(out, ref, args, page_size)
    else:
        check_logits(out, ref, tol)


def check_topk(out, logits, k):
    """Per row: distinct valid indices, min(k, #(> -inf)) of them, -1 after, and the multiset of
    their values equal to the reference's (any choice among ties is fine)."""
    out, x = np.asarray(out), np.asarray(logits)
    ref = np.asarray(topk_reference(jnp.asarray(x), k))
    assert out.shape == (x.shape[0], k) and out.dtype == np.int32
    for r in range(x.shape[0]):
        n_sel = min(k, int((x[r] > -np.inf).sum()))  # +inf counts as valid, as in the reference
        sel = out[r]
        assert (sel[sel < 0] == -1).all(), r
        idx = np.sort(sel[sel >= 0])
        assert len(idx) == n_sel, (r, len(idx), n_sel)
        assert len(np.unique(idx)) == n_sel and (idx < x.shape[1]).all(), r
        ref_idx = ref[r][ref[r] >= 0]
        np.testing.assert_array_equal(np.sort(x[r][idx]), np.sort(x[r][ref_idx]), err_msg=f"row {r}")
        if not _has_ties(x[r], ref_idx):
            np.testing.assert_array_equal(idx, np.sort(ref_idx), err_msg=f"row {r}")


def _has_ties(row, ref_idx):
    if len(ref_idx) == 0:
        return False
    kth = row[ref_idx].min()
    return (row == kth).sum() > 1


# ------------------------------------------------------------------------------------------------
# indexer logits (CPU: interpret mode, tiny dims)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,scaled,tiling", [
    (jnp.float32, False, dict(block_rows=1, block_keys=16, chunk=32)),   # key axis split, ragged
    (jnp.bfloat16, False, dict(block_rows=4, block_keys=16)),            # multi-row tiles
    (FP8, True, dict()),                                                 # default tiling
    (FP8, True, dict(block_rows=2, block_keys=32, chunk=32)),
])
def test_indexer_logits_ragged(dtype, scaled, tiling):
    args, page = make_indexer_case(0, dtype=dtype, scaled=scaled, hi=4, d=16, page=4,
                                   lengths=[37, 1, 90, 12], rows_per_seq=[5, 1, 7, 3])
    out = indexer_logits(*args, page_size=page, interpret=INTERPRET, **tiling)
    ref = indexer_logits_reference(*args, page_size=page)
    check_indexer_logits(out, ref, args, page, 1e-5)


def test_indexer_logits_prefill_causal_fp8_unscaled():
    # one causal sequence, every position a row (prefill); fp8 without k_scale; 3 heads (padded)
    args, page = make_indexer_case(1, dtype=FP8, scaled=False, hi=3, d=16, page=4,
                                   lengths=[45], rows_per_seq=[45])
    out = indexer_logits(*args, page_size=page, interpret=INTERPRET)
    ref = indexer_logits_reference(*args, page_size=page)
    check_indexer_logits(out, ref, args, page, 1e-5)


_MGPU_PREFILL_CASES = [
    # ragged batch with a 1-key sequence; page 4: keys gathered first; 5 key blocks, 2-slot ring
    (FP8, True, 4, [37, 1, 300, 12], [5, 1, 9, 3], dict(block_rows=4, group=2, stages=2)),
    # the same batch read straight from 64-token pages, bf16
    (jnp.bfloat16, False, 64, [37, 1, 300, 12], [5, 1, 9, 3], dict(block_rows=4, group=4)),
    # decode-like: 1-2 rows per sequence, the key axis split over CTAs (default tiling)
    (FP8, True, 64, [400, 130, 1], [1, 2, 1], dict()),
    # causal prefill of 150 rows (not a multiple of any block), no k_scale, 3 key chunks a tile
    (FP8, False, 64, [150], [150], dict(block_rows=8, splits=3)),
]

# Decode rings deep enough that no slot is refilled: the Mosaic GPU interpreter (jax 0.11.2, this
# 2-core CPU) stalls forever once the key ring wraps (every warpgroup blocked in a barrier wait),
# while the same kernel runs on the H200; the GPU tests below cover refilled slots.
_MGPU_DECODE_CASES = [
    # ragged decode batch: lengths not multiples of 64, rows with end 0, 1 and the full table;
    # 3 key chunks per row
    (FP8, True, 64, [520, 1, 77], [1, 1, 1], dict(chunk=4, step_blocks=2, stages=2)),
    # MTP: 2 rows of a sequence share one wgmma (N = 2 x heads); a tile with an empty row slot
    (FP8, True, 64, [300, 1], [2, 1], dict(chunk=8, step_blocks=2, stages=4)),
    # bf16 without scales; page 4: keys gathered into 64-key pages first; 1 chunk per row
    (jnp.bfloat16, False, 4, [37, 1, 90, 12], [1, 1, 1, 1], dict(chunk=4, step_blocks=1, stages=4)),
    # fp8 without scales, page 128 (split into 64-key pages); the block table padded to 4 chunks
    (FP8, False, 128, [700, 5, 300], [1, 1, 1], dict(chunk=4, step_blocks=1, stages=4)),
    # 3 key blocks per ring slot: the last step of a chunk padded with a repeated block (5 blocks)
    (FP8, True, 64, [300, 130], [2, 2], dict(chunk=8, step_blocks=3, stages=4)),
    (jnp.bfloat16, False, 64, [250, 64, 1], [1, 1, 1], dict(chunk=4, step_blocks=2, stages=2)),
]


@pytest.mark.parametrize("kernel,dtype,scaled,page,lengths,rows,tiling",
                         [pytest.param(indexer_logits_mosaic_prefill, *c, id=f"prefill{i}")
                          for i, c in enumerate(_MGPU_PREFILL_CASES)]
                         + [pytest.param(indexer_logits_mosaic_decode, *c, id=f"decode{i}")
                            for i, c in enumerate(_MGPU_DECODE_CASES)])
def test_indexer_logits_mosaic_kernels(kernel, dtype, scaled, page, lengths, rows, tiling):
    """The Mosaic GPU prefill and decode kernels (CPU: their interpreter, whose fresh buffers are
    NaN, so every unwritten logit fails; heads 4 -> 8 and D 16 -> 32 padded)."""
    args, page = make_indexer_case(7, dtype=dtype, scaled=scaled, hi=4, d=16, page=page,
                                   lengths=lengths, rows_per_seq=rows)
    out = kernel(*args, page_size=page, interpret=INTERPRET, **tiling)
    ref = indexer_logits_reference(*args, page_size=page)
    check_indexer_logits(out, ref, args, page, 1e-5)


def _hopper_fp8_logits(args, page_size):
    """numpy model of the fp8 kernels on Hopper: per (row, head, key), 32-product steps added to the
    accumulator with both operands truncated to 13 fraction bits at their common alignment and the
    result to 14 significant bits; then f32 ReLU, x w, head sum, x k_scale (as the kernels)."""
    q, w, k, k_scale, tables, row_seq, row_end = (np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)
                                                  if a is not None else None for a in args)
    tables, row_seq, row_end = tables.astype(int), row_seq.astype(int), row_end.astype(int)
    slots = (np.maximum(tables, 0)[:, :, None] * page_size + np.arange(page_size)).reshape(tables.shape[0], -1)
    listed = np.repeat(tables >= 0, page_size, axis=1)

    def trunc(x, exp, bits):  # x toward zero to a multiple of 2^(exp - bits)
        step = np.ldexp(1.0, exp - bits)
        return np.trunc(x / step) * step

    def exponent(x):  # floor(log2 |x|), 0 for 0
        return np.frexp(x)[1] - 1

    out = np.full((len(row_seq), slots.shape[1]), -np.inf, np.float32)
    for n in range(len(row_seq)):
        keys = k[slots[row_seq[n]]] * listed[row_seq[n]][:, None]  # [L, D]
        acc = np.zeros((q.shape[1], keys.shape[0]))
        for j in range(0, q.shape[2], FP8_MMA_K):
            g = q[n, :, j:j + FP8_MMA_K] @ keys[:, j:j + FP8_MMA_K].T  # exact: e4m3 products, f64 sum
            e = exponent(np.maximum(np.abs(acc), np.abs(g)))
            acc = trunc(trunc(acc, e, 13) + trunc(g, e, 13), exponent(acc + g), 13)
        scores = np.maximum(acc.astype(np.float32), np.float32(0))
        logit = np.sum(scores * w[n].astype(np.float32)[:, None], axis=0, dtype=np.float32)
        if k_scale is not None:
            logit = logit * k_scale[slots[row_seq[n]]].astype(np.float32)
        valid = np.arange(len(logit)) < row_end[n]
        out[n, valid] = logit[valid]
    return out


@pytest.mark.parametrize("hi,d,page,lengths,rows", [
    (4, 16, 4, [37, 1, 90, 12], [5, 1, 7, 3]),   # the CPU tests' tiny dims (one 32-product step)
    (64, 128, 64, [300, 130, 1], [4, 2, 1]),     # DeepSeek-V3.2's dims (four steps)
])
def test_fp8_logit_bound_rejects_wrong_logits(hi, d, page, lengths, rows):
    """The GPU tolerance for fp8 logits (fp8_logit_bound), checked on CPU: the exact reference and a
    numpy model of Hopper's truncating accumulator pass, the model within a quarter of the bound;
    a missing head, one wrong key or a missing k_scale fail."""
    args, page = make_indexer_case(11, dtype=FP8, scaled=True, hi=hi, d=d, page=page, lengths=lengths,
                                   rows_per_seq=rows)
    ref = np.asarray(indexer_logits_reference(*args, page_size=page))
    check = functools.partial(check_fp8_logits, ref=ref, args=args, page_size=page, on_gpu=True)
    check(ref)
    modelled = _hopper_fp8_logits(args, page)
    check(modelled)
    fin = np.isfinite(ref)
    worst = (np.abs(modelled[fin] - ref[fin].astype(np.float64)) / fp8_logit_bound(args, page)[fin]).max()
    assert 0 < worst < 0.25, worst

    q, w, k, k_scale, tables, row_seq, row_end = args
    missing_head = indexer_logits_reference(q, w.at[:, hi // 2].set(0.0), *args[2:], page_size=page)
    key_0, key_1 = np.asarray(tables)[0, 0] * page + 1, np.asarray(tables)[0, 0] * page + 2  # sequence 0's
    wrong_key = indexer_logits_reference(q, w, k.at[key_0].set(k[key_1]), *args[3:], page_size=page)
    no_scale = indexer_logits_reference(q, w, k, None, *args[4:], page_size=page)
    for wrong in (missing_head, wrong_key, no_scale):
        assert not np.array_equal(np.asarray(wrong), ref)
        with pytest.raises(AssertionError, match="past the fp8 accumulation bound"):
            check(wrong)


@pytest.mark.parametrize("num_rows,num_seqs,key_blocks,want", [
    (32, 32, 512, (1, 128)),     # B=32, 32K keys: 4 chunks a row, 128 CTAs (one wave of 132 SMs)
    (1, 1, 2048, (1, 16)),       # B=1, 128K keys: 128 chunks of 16 blocks
    (128, 128, 2048, (1, 256)),  # B=128: chunks of 256 blocks (one TMA of the block table)
    (64, 32, 512, (2, 128)),     # MTP: 2 rows per tile
])
def test_choose_decode_tiling(num_rows, num_seqs, key_blocks, want):
    t = choose_decode_tiling(num_rows, num_seqs, key_blocks, FP8, 64, 128, num_sms=132)
    step_blocks = 2 // want[0]  # 16 KiB of fp8 keys per slot and row
    stages = 4 if want[1] // step_blocks <= 8 else 12 // step_blocks  # a short chunk: at most 4 in flight
    assert (t.block_rows, t.chunk, t.step_blocks, t.stages) == want + (step_blocks, stages)
    t = choose_decode_tiling(num_rows, num_seqs, key_blocks, jnp.bfloat16, 64, 128, num_sms=132)
    assert (t.block_rows, t.chunk, t.step_blocks, t.stages) == want + (1, 4 if want[1] <= 8 else 6)
    for chunk in (6, 260):
        with pytest.raises(ValueError, match="multiple of 4"):
            choose_decode_tiling(num_rows, num_seqs, key_blocks, FP8, 64, 128, chunk=chunk)
    with pytest.raises(ValueError, match="at most 32"):
        choose_decode_tiling(num_rows, num_seqs, key_blocks, FP8, 64, 128, stages=34)
    with pytest.raises(ValueError, match="wgmma N"):
        choose_decode_tiling(num_rows, num_seqs, key_blocks, FP8, 64, 128, block_rows=8)


def test_indexer_logits_decode_mgpu_rows_in_sequence_order():
    """One row per sequence, row n of sequence n (the usual decode batch): every CTA's guessed
    block-table row is the right one (the interleaved batches above reload most of them)."""
    args, page = make_indexer_case(8, dtype=FP8, scaled=True, hi=4, d=16, page=64, lengths=[300, 1, 190],
                                   rows_per_seq=[1, 1, 1], interleave_rows=False)
    assert np.array_equal(np.asarray(args[5]), np.arange(3))
    out = indexer_logits_mosaic_decode(*args, page_size=page, interpret=INTERPRET, chunk=4, stages=2)
    check_indexer_logits(out, indexer_logits_reference(*args, page_size=page), args, page, 1e-5)


def test_indexer_logits_decode_mgpu_rejects_mixed_dtypes():
    args, page = make_indexer_case(9, dtype=FP8, scaled=True, hi=4, d=16, page=64,
                                   lengths=[70], rows_per_seq=[1])
    q, w, k, *rest = args
    with pytest.raises(ValueError, match="float8_e4m3fn or bfloat16"):
        indexer_logits_mosaic_decode(q, w, k.astype(jnp.bfloat16), *rest, page_size=page, interpret=INTERPRET)


# ------------------------------------------------------------------------------------------------
# top-k (CPU: interpret mode)
# ------------------------------------------------------------------------------------------------

def _topk_rows(seed, num_keys, k):
    rng = np.random.default_rng(seed)
    rows = []
    def add(r):
        rows.append(np.asarray(r, np.float32))
    base = lambda: rng.standard_normal(num_keys).astype(np.float32)
    add(base())                                              # all valid
    r = base(); r[k:] = -np.inf; add(r)                      # exactly k valid
    r = base(); r[k + 1:] = -np.inf; add(r)                  # k + 1 valid
    add(np.full(num_keys, -np.inf))                          # nothing valid
    r = np.full(num_keys, -np.inf); r[num_keys // 2] = 3.0; add(r)  # one valid entry
    r = base(); r[rng.random(num_keys) < 0.5] = -np.inf; add(r)     # scattered -inf
    add(np.round(base() * 2))                                # heavy ties across the threshold
    add(np.full(num_keys, 0.25))                             # all equal
    add(-np.abs(base()) * 1e-30)                             # tiny negatives (denormal range)
    r = base() * 1e30; r[:7] = np.inf; add(r)                # huge values and +inf
    return np.stack(rows)


@pytest.mark.parametrize("num_keys,k,block", [
    (300, 37, 64),     # L not a multiple of the block
    (150, 200, 64),    # k > L
    (1000, 128, None), # default block (capped at the row length)
])
def test_topk(num_keys, k, block):
    x = _topk_rows(num_keys, num_keys, k)
    out = topk(jnp.asarray(x), k, interpret=INTERPRET, block=block)
    check_topk(out, x, k)


@pytest.mark.parametrize("num_keys,k,block,sample,capacity", [
    (1000, 40, 64, 64, None),    # strided (jittered) sample of 64, default capacity: fast path
    (1000, 40, 64, 64, 48),      # capacity barely above k: ties and unlucky samples overflow
    (1000, 40, 64, 64, 40),      # capacity == k
    (1000, 40, 64, 64, 8),       # capacity < k: every row with > 8 candidates falls back
    (333, 100, 32, 16, 128),     # L not a multiple of the block or of the sample
    (70, 90, 16, 16, 32),        # k > L, sample of 16 (stride 4)
])
def test_topk_filter_fallbacks(num_keys, k, block, sample, capacity):
    """Small samples and band buffers: band overflow and unlucky-threshold fallbacks (whole-row
    selection) must stay exact, next to rows that take the band path (capacity None)."""
    x = _topk_rows(num_keys + 1, num_keys, k)
    rng = np.random.default_rng(num_keys)
    extra = []
    r = np.round(rng.standard_normal(num_keys) * 0.5).astype(np.float32)  # ~40% tied at the k-th
    extra.append(r)
    r = np.full(num_keys, 1.0, np.float32); r[rng.permutation(num_keys)[:k // 2]] = 2.0  # ties below the top
    extra.append(r)
    r = np.sort(rng.standard_normal(num_keys)).astype(np.float32)  # sorted: top keys at the end
    extra.append(r)
    r = np.full(num_keys, -np.inf, np.float32); r[::max(1, num_keys // 8)] = 1.0  # few valid, on a stride
    extra.append(r)
    r = rng.standard_normal(num_keys).astype(np.float32); r[rng.random(num_keys) < 0.2] = np.nan  # NaN = invalid
    extra.append(r)
    x = np.concatenate([x, np.stack(extra)])
    out = topk(jnp.asarray(x), k, interpret=INTERPRET, block=block, sample=sample,
               capacity=capacity)
    nan_free = np.where(np.isnan(x), -np.inf, x)  # the reference treats NaN as the largest
    check_topk(out, nan_free, k)


@pytest.mark.parametrize("num_keys,k", [(1, 1), (1, 4), (2, 1)])
def test_topk_tiny_rows(num_keys, k):
    x = np.array([[0.5, -1.0][:num_keys], [-np.inf, 2.0][:num_keys], [-np.inf] * num_keys], np.float32)
    out = topk(jnp.asarray(x), k, interpret=INTERPRET)
    check_topk(out, x, k)


def test_topk_on_indexer_logits():
    """The pipeline: logits of a ragged batch (with -inf tails) -> top-k."""
    args, page = make_indexer_case(2, dtype=jnp.bfloat16, scaled=False, hi=4, d=16, page=4,
                                   lengths=[70, 9], rows_per_seq=[6, 2])
    logits = indexer_logits_reference(*args, page_size=page)
    out = topk(logits, 16, interpret=INTERPRET, block=32)
    check_topk(out, logits, 16)


# ------------------------------------------------------------------------------------------------
# GPU: compiled kernels, real dimensions
# ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype,scaled", [(FP8, True), (jnp.bfloat16, False)])
@pytest.mark.parametrize("layout", ["prefill", "decode"])
def test_indexer_logits_gpu(dtype, scaled, layout):
    if layout == "prefill":  # two causal sequences (one with context), many rows each
        lengths, rows = [3000, 1100], [1200, 1100]
    else:  # decode: 1-2 rows per sequence, longer contexts
        lengths, rows = [4100, 700, 6000, 1, 2500] * 4, [2, 1, 2, 1, 2] * 4
    args, page = make_indexer_case(3, dtype=dtype, scaled=scaled, hi=64, d=128, page=64,
                                   lengths=lengths, rows_per_seq=rows)
    out = jax.jit(functools.partial(indexer_logits, page_size=page))(*args)
    ref = jax.jit(functools.partial(indexer_logits_reference, page_size=page))(*args)
    check_indexer_logits(out, ref, args, page, 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,scaled", [(FP8, True), (jnp.bfloat16, False)])
@pytest.mark.parametrize("kernel", [indexer_logits_mosaic_prefill, indexer_logits_triton])
def test_indexer_logits_prefill_kernels_gpu(kernel, dtype, scaled):
    """Both prefill kernels at real dimensions: two causal sequences (one with context, neither a
    multiple of 64 long), rows of both interleaved, plus a short third sequence."""
    args, page = make_indexer_case(6, dtype=dtype, scaled=scaled, hi=64, d=128, page=64,
                                   lengths=[3001, 1100, 70], rows_per_seq=[1203, 1100, 33])
    out = jax.jit(functools.partial(kernel, page_size=page))(*args)
    ref = jax.jit(functools.partial(indexer_logits_reference, page_size=page))(*args)
    check_indexer_logits(out, ref, args, page, 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,scaled", [(FP8, True), (jnp.bfloat16, False)])
@pytest.mark.parametrize("kernel,rows", [
    (indexer_logits_mosaic_decode, [1, 1, 1, 1, 1, 1]),  # one row per tile
    (indexer_logits_mosaic_decode, [2, 2, 1, 2, 2, 1]),  # MTP: 2 rows per tile, some slots empty
    (indexer_logits_triton, [1, 2, 1, 2, 1, 1]),
])
def test_indexer_logits_decode_kernels_gpu(kernel, rows, dtype, scaled):
    """Both decode kernels at real dimensions: long ragged contexts (key rings refilled many
    times), 1 and 2 (MTP) rows per sequence, a 1-key sequence, rows with no valid key."""
    args, page = make_indexer_case(10, dtype=dtype, scaled=scaled, hi=64, d=128, page=64,
                                   lengths=[33001, 700, 1, 20000, 4097, 64], rows_per_seq=rows)
    out = jax.jit(functools.partial(kernel, page_size=page))(*args)
    ref = jax.jit(functools.partial(indexer_logits_reference, page_size=page))(*args)
    check_indexer_logits(out, ref, args, page, 1e-4)


@pytest.mark.gpu
def test_topk_gpu():
    rng = np.random.default_rng(4)
    num_keys, k = 32768, 2048
    x = rng.standard_normal((32, num_keys)).astype(np.float32)
    ends = [0, 1, 2047, 2048, 2049, 5000, 32768, 20000] * 3
    for r, e in enumerate(ends):
        x[r, e:] = -np.inf
    x[8:12] = np.round(x[8:12] * 4)  # ties
    x[12] = 1.0  # all equal: candidate overflow -> whole-row selection
    x[24] = np.sort(x[24])  # sorted row
    x[25, rng.random(num_keys) < 0.3] = np.nan  # NaN counts as invalid
    x[26] = np.round(x[26] * 0.5)  # ~40% of the row tied at the threshold
    x[27] *= 1e30
    x[27, :5] = np.inf
    out = jax.jit(functools.partial(topk, k=k))(jnp.asarray(x))
    check_topk(out, np.where(np.isnan(x), -np.inf, x), k)


@pytest.mark.gpu
def test_topk_gpu_long_rows():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((8, 131072)).astype(np.float32)
    x[1, 70000:] = -np.inf
    x[2] = np.round(x[2] * 8)
    out = jax.jit(functools.partial(topk, k=2048))(jnp.asarray(x))
    check_topk(out, x, 2048)


@pytest.mark.parametrize("dtype,scaled", [(FP8, True), (jnp.bfloat16, False)])
def test_indexer_logits_mgpu_lowers_for_the_gpu(dtype, scaled):
    """CPU twin of the hardware run: the Mosaic kernel lowers to a Mosaic GPU module at real
    dimensions (64 heads x 128, pages of 64; the interpreter does not check layouts)."""
    sd = jax.ShapeDtypeStruct
    args = (sd((4096, 64, 128), dtype), sd((4096, 64), jnp.float32), sd((64 * 256, 128), dtype),
            sd((64 * 256,), jnp.float32) if scaled else None, sd((2, 128), jnp.int32),
            sd((4096,), jnp.int32), sd((4096,), jnp.int32))
    fn = jax.jit(functools.partial(indexer_logits_mosaic_prefill, page_size=64))
    assert "mosaic_gpu" in fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("dtype,scaled,rows", [(FP8, True, 1), (jnp.bfloat16, False, 1), (FP8, True, 2)])
def test_indexer_logits_decode_mgpu_lowers_for_the_gpu(dtype, scaled, rows):
    """CPU twin of the hardware run: the decode kernel lowers to a Mosaic GPU module at real
    dimensions (B=32 sequences of 32K keys, 64 heads x 128, pages of 64; 1 or 2 rows each)."""
    sd = jax.ShapeDtypeStruct
    n, slots = 32 * rows, 32 * 32768
    args = (sd((n, 64, 128), dtype), sd((n, 64), jnp.float32), sd((slots, 128), dtype),
            sd((slots,), jnp.float32) if scaled else None, sd((32, 512), jnp.int32),
            sd((n,), jnp.int32), sd((n,), jnp.int32))
    fn = jax.jit(functools.partial(indexer_logits_mosaic_decode, page_size=64))
    assert "mosaic_gpu" in fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("rows_per_seq", [1, 6, 13])
def test_indexer_logits_decode_mgpu_lowers_at_tiny_dims(rows_per_seq):
    """CPU twin of the hardware failure in test_forward's bf16 TINY config (one decode row beside
    prefill chunks of < 16 rows per sequence): tiny key blocks made a ring of 48 slots, more
    mbarriers than Mosaic GPU initialises in one group (32)."""
    cfg = MLAConfig.tiny(dtype="bfloat16")
    hi, d, page = cfg.index_n_heads, cfg.index_head_dim, cfg.page_size
    n, num_seqs, width = 3 * rows_per_seq, 3, 8
    sd = jax.ShapeDtypeStruct
    args = (sd((n, hi, d), jnp.bfloat16), sd((n, hi), jnp.float32), sd((page * num_seqs * width, d), jnp.bfloat16),
            None, sd((num_seqs, width), jnp.int32), sd((n,), jnp.int32), sd((n,), jnp.int32))
    fn = jax.jit(functools.partial(indexer_logits_mosaic_decode, page_size=page))
    assert "mosaic_gpu" in fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
