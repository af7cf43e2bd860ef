"""Top-k of indexer logits, every implementation against lax.top_k.

Implementations (`pallas_kernels.topk.topk(..., implementation=)`): "xla" (lax.top_k), "triton"
(`pallas_kernels.topk`: thresholds / write / select kernels on Pallas' Triton backend) and
"mosaic" (the same with the Mosaic GPU write sweep where it applies, which also selects the
band of rows on the band path: GPU only; its intermediates bit-identical to the Triton sweep's
and its answers the same index sets, asserted).
Checked per row (check_topk): min(k, #finite) distinct indices then -1, and the multiset of
their values equal to lax.top_k's (the exact index set where there are no ties at the k-th
value). For the Triton kernels, the band path (selection among the keys between two sampled
thresholds) and the whole-row fallback are both exercised, and the tests on their intermediates
(`tests.support.ops.topk_stages`) assert which rows took which path, so a sampling bug cannot
hide behind the (always exact, slower) fallback. On CPU the kernels run in Pallas interpret mode
(small rows, small k, several slices per row); the `gpu` tests compile them for k = 2048 and rows
of 32K / 128K keys.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.indexer_logits import indexer_logits
from pallas_kernels.sparse_mla import sparse_mla
from pallas_kernels.topk import TritonConfig, topk
from tests.support import INTERPRET, OPTIMIZED, ops
from tests.support.cases import make_indexer_case

OP = "topk"
param = functools.partial(ops.implementation_param, OP)
ALL = [param("xla"), param("triton"), param("mosaic")]


def run(implementation, x, k, *, lengths=None, **tuning):
    """topk of a numpy [N, L] array (interpret mode off the GPU); tuning: `TritonConfig`'s fields
    (the kernels' knobs), dropped for "xla", which takes none."""
    config = TritonConfig(**tuning) if tuning and implementation != "xla" else None
    return topk(jnp.asarray(x), k, lengths=lengths, implementation=implementation, config=config,
                interpret=INTERPRET)


def stages(x, k, **kw):
    """All intermediates of the Triton `topk` (see `ops.topk_stages`) for a numpy [N, L] array."""
    return ops.topk_stages(jnp.asarray(x), k, **kw)


def check_topk(out, logits, k):
    """Per row: distinct valid indices, min(k, #(> -inf)) of them, -1 after, and the multiset of
    their values equal to lax.top_k's (any choice among ties is fine)."""
    out, x = np.asarray(out), np.asarray(logits)
    ref = np.asarray(run("xla", x, k))
    assert out.shape == (x.shape[0], k) and out.dtype == np.int32
    for r in range(x.shape[0]):
        n_sel = min(k, int((x[r] > -np.inf).sum()))  # +inf counts as valid, as in lax.top_k
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


def band_path(st, k):
    """[N] bool: the row's answer came from the band (else from the whole-row fallback)."""
    cnt = np.asarray(st["counts"])
    n_def, n_band, n_valid = (cnt[:, :, j].sum(1) for j in range(3))
    n_sel = np.minimum(n_valid, k)
    return (n_def <= n_sel) & (n_def + n_band >= n_sel) & (n_band <= st["capacity"])


def nan_free(x):
    return np.where(np.isnan(x), -np.inf, x)  # lax.top_k treats NaN as the largest


def random_rows(rng, num_rows, num_keys, ends=None):
    """Gaussian rows; row i is -inf from ends[i] on."""
    x = rng.standard_normal((num_rows, num_keys)).astype(np.float32)
    for r, e in enumerate(ends or []):
        x[r, e:] = -np.inf
    return x


def adversarial_rows(rng, num_keys, k):
    """Rows built against a sampled threshold: order, ties, concentration, special values."""
    rows = []
    base = lambda: rng.standard_normal(num_keys).astype(np.float32)  # noqa: E731
    rows.append(np.sort(base()))                                       # ascending
    rows.append(np.sort(base())[::-1].copy())                          # descending
    r = base(); r[np.argsort(r)[-3 * k:]] = 2.5; rows.append(r)         # 3k ties at the top
    r = np.round(base() * 2); rows.append(r)                          # heavy ties at the k-th
    r = np.full(num_keys, 1.0, np.float32); r[rng.permutation(num_keys)[:k // 2]] = 2.0
    rows.append(r)                                                    # k/2 above, ties below
    rows.append(np.full(num_keys, -0.75, np.float32))                  # all equal
    r = base() - 10; r[-(k + k // 2):] += 20; rows.append(r)            # top keys in the last slice
    r = base(); r[1::2] = -np.inf; rows.append(r)                      # every other key invalid
    r = base(); r[rng.random(num_keys) < 0.3] = np.nan; rows.append(r)  # NaN = invalid
    r = base() * 1e30; r[:5] = np.inf; r[5:9] = -np.inf; rows.append(r)  # +inf, huge values
    r = -np.abs(base()) * 1e-38; r[::3] = 0.0; r[1::3] = -0.0; rows.append(r)  # denormals, +-0
    r = np.full(num_keys, -np.inf, np.float32); r[::num_keys // (k // 2)] = 1.0
    rows.append(r)                                                    # < k valid, on a stride
    return np.stack(rows)


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


# ------------------------------------------------------------------------------------------------
# every implementation (CPU: interpret mode)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("implementation", ALL)
@pytest.mark.parametrize("num_keys,k,block", [
    (300, 37, 64),     # L not a multiple of the block
    (150, 200, 64),    # k > L
    (1000, 128, None), # default block (capped at the row length)
])
def test_topk(implementation, num_keys, k, block):
    x = _topk_rows(num_keys, num_keys, k)
    check_topk(run(implementation, x, k, block=block), x, k)


@pytest.mark.parametrize("implementation", ALL)
@pytest.mark.parametrize("num_keys,k", [(1, 1), (1, 4), (2, 1)])
def test_topk_tiny_rows(implementation, num_keys, k):
    x = np.array([[0.5, -1.0][:num_keys], [-np.inf, 2.0][:num_keys], [-np.inf] * num_keys], np.float32)
    check_topk(run(implementation, x, k), x, k)


@pytest.mark.parametrize("implementation", ALL)
def test_topk_on_indexer_logits(implementation):
    """The pipeline: logits of a ragged batch (with -inf tails) -> top-k."""
    args, page = make_indexer_case(2, dtype=jnp.bfloat16, scaled=False, hi=4, d=16, page=4,
                                   lengths=[70, 9], rows_per_seq=[6, 2])
    logits = indexer_logits(*args, page_size=page, implementation="xla")
    check_topk(run(implementation, logits, 16, block=32), logits, 16)


@pytest.mark.parametrize("implementation", ALL)
def test_topk_rows_are_independent(implementation):
    """A row of only -inf, and one with NaN inside its own range, change no other row; NaN counts
    as invalid in every implementation ("xla" once let a NaN take a valid key's place)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 40)).astype(np.float32)
    x[:, 30:] = -np.inf  # past the rows' ends
    x[1, 10:] = -np.inf
    clean = run(implementation, x, 16)
    bad = x.copy()
    bad[4] = -np.inf
    bad[5, [0, 3, 7, 20]] = np.nan
    got = np.asarray(run(implementation, bad, 16))
    np.testing.assert_array_equal(got[:4], np.asarray(clean)[:4])
    np.testing.assert_array_equal(got[4], -1)
    nan_free_row = np.where(np.isnan(bad[5]), -np.inf, bad[5])
    want = np.sort(np.argsort(-nan_free_row, kind="stable")[:16])
    np.testing.assert_array_equal(np.sort(got[5]), want)


def _with_garbage_past(x, lengths, rng):
    """x with every column at or past a row's length replaced by garbage that would win: large
    values, +inf and NaN."""
    g = x.copy()
    for r, n in enumerate(lengths):
        tail = g.shape[1] - min(max(n, 0), g.shape[1])
        if tail:
            g[r, g.shape[1] - tail:] = rng.choice(np.array([1e30, np.inf, np.nan, 50.0], np.float32), tail)
    return g


def _masked(x, lengths):
    return np.where(np.arange(x.shape[1])[None, :] < np.asarray(lengths)[:, None], x, -np.inf)


@pytest.mark.parametrize("implementation", ALL)
@pytest.mark.parametrize("num_keys,k,block,slices", [(300, 37, 64, 1), (1000, 40, 64, 4), (150, 200, 64, None)])
def test_lengths_ignore_the_columns_past_them(implementation, num_keys, k, block, slices):
    """With lengths, a row's keys are its first lengths[n] columns whatever the rest holds: the
    result equals top-k of the row with its tail set to -inf, at lengths 0, 1, below k, around
    the block and slice boundaries, the whole row and past it (clipped), one slice a row and several."""
    rng = np.random.default_rng(num_keys)
    lengths = [0, 1, k - 1, k, k + 1, block, block + 1, num_keys // 2, num_keys - 1, num_keys, num_keys + 7, -3]
    x = rng.standard_normal((len(lengths), num_keys)).astype(np.float32)
    x[3, ::2] = -np.inf  # -inf inside a row's own range still counts as invalid
    garbage = _with_garbage_past(x, lengths, rng)
    tuning = dict(block=block) if slices is None else dict(block=block, slices=slices)
    got = run(implementation, garbage, k, lengths=jnp.asarray(lengths, jnp.int32), **tuning)
    check_topk(got, _masked(x, np.clip(lengths, 0, num_keys)), k)


def test_lengths_keep_the_band_path():
    """Rows shorter than the logits (causal prefill rows) still find their answer on the band
    path: the sample is strided over each row's own keys, with ranks for its own stride."""
    rng = np.random.default_rng(7)
    num_keys, k = 2048, 64
    lengths = np.array([2048, 1536, 1024, 700, 400], np.int32)
    x = _with_garbage_past(rng.standard_normal((5, num_keys)).astype(np.float32), lengths, rng)
    st = stages(x, k, lengths=jnp.asarray(lengths), block=128, sample=256)
    assert band_path(st, k).all()
    check_topk(st["out"], _masked(x, lengths), k)
    cnt = np.asarray(st["counts"])
    np.testing.assert_array_equal(cnt[:, :, 2].sum(1), lengths)  # valid keys counted: the rows' own only


@pytest.mark.parametrize("implementation", ALL)
@pytest.mark.parametrize("slices", [1, 4, None])
def test_lengths_much_shorter_than_the_width(implementation, slices):
    """Rows of 0..300 keys in logits 16 x as wide as the longest (the serving program's fixed
    width): lengths 0, 1, k - 1, k, k + 1, around the sample (64 keys) and the block (64), ties
    and -inf among a row's keys, garbage that would win past them (NaN, +inf, 1e30): each row's
    top-k of its own keys. One slice a row, 4 (a row's slices then follow its own length), and
    the default plan (slices of 4096 columns)."""
    k, block, sample = 40, 64, 64
    lengths = [0, 1, k - 1, k, k + 1, sample - 1, sample, sample + 1, 2 * block - 1, 2 * block + 1, 250, 300]
    rng = np.random.default_rng(16)
    x = rng.standard_normal((len(lengths), 16 * max(lengths))).astype(np.float32)
    x[[3, 4, 9]] = np.round(x[[3, 4, 9]] * 2)  # ties at the k-th key
    x[[7, 10], ::3] = -np.inf  # -inf among a row's own keys
    garbage = _with_garbage_past(x, lengths, rng)
    tuning = dict(block=block, sample=sample) | ({} if slices is None else dict(slices=slices))
    got = run(implementation, garbage, k, lengths=jnp.asarray(lengths, jnp.int32), **tuning)
    check_topk(got, _masked(x, lengths), k)


@pytest.mark.parametrize("length,k,tuning", [
    (1500, 64, dict(block=256)),  # default sample: 1024 of the row's 1500 keys (not 1024 over the width)
    (5000, 64, dict()),  # default plan: sample 1024 (the width's: 4096), 2 slices of 4096 (of 32)
    (600, 64, dict(block=128)),  # the row is its own sample (exact thresholds) in a sampled width
    (700, 40, dict(block=64, sample=64, slices=4)),  # 4 slices of the row's length, not one of the width's
])
def test_short_rows_band_as_in_their_own_width(length, k, tuning):
    """Rows of `length` keys in logits 16 x wider get the plan of their own width: the same
    thresholds, the same definite / band / valid counts slice by slice (the slices past the row
    idle), the same band keys and the same output as the rows in an array of their own width.
    So the band, which the select works through, is as narrow as there: the cost follows the
    row's length, not the width. Rows: random, tied, sorted, a third -inf."""
    rng = np.random.default_rng(length)
    own = np.stack([rng.standard_normal(length), np.round(rng.standard_normal(length) * 2),
                    np.sort(rng.standard_normal(length)),
                    np.where(rng.random(length) < 0.3, -np.inf, rng.standard_normal(length))]).astype(np.float32)
    lengths = np.full(len(own), length, np.int32)
    wide = _with_garbage_past(np.pad(own, ((0, 0), (0, 15 * length))), lengths, rng)
    want = stages(own, k, **tuning)
    got = stages(wide, k, lengths=jnp.asarray(lengths), **tuning)
    np.testing.assert_array_equal(np.asarray(got["thresholds"]), np.asarray(want["thresholds"]))
    cnt, want_cnt = np.asarray(got["counts"]), np.asarray(want["counts"])
    used = want_cnt.shape[1]
    np.testing.assert_array_equal(cnt[:, :used], want_cnt)
    np.testing.assert_array_equal(cnt[:, used:], 0)
    assert band_path(want, k)[[0, 2, 3]].all(), band_path(want, k)
    n_band = want_cnt[:, :, 1].sum(1)
    for r in np.flatnonzero(band_path(want, k)):
        np.testing.assert_array_equal(np.asarray(got["band_keys"])[r, :n_band[r]],
                                      np.asarray(want["band_keys"])[r, :n_band[r]], err_msg=f"row {r}")
    np.testing.assert_array_equal(np.asarray(got["out"]), np.asarray(want["out"]))
    check_topk(got["out"], own, k)


@pytest.mark.parametrize("num_keys,k,sample,plan", [
    (4096, 2048, None, (1024, 639, 410, 5, 2048)),
    (8192, 2048, None, (1024, 350, 187, 4, 4096)),
    (32768, 2048, None, (1024, 119, 34, 2, 8192)),
    (65536, 2048, None, (2048, 119, 34, 2, 8192)),
    (131072, 2048, None, (4096, 119, 34, 2, 8192)),
    (2048, 64, 256, (256, 40, 1, 0, 512)),
])
def test_full_rows_keep_the_static_plan(num_keys, k, sample, plan):
    """A row that fills the width is sampled as before the plan followed each row's length:
    (sample size, ranks of t_lo and t_hi in it, search tolerance, band capacity) as the static
    plan of the width had them."""
    from pallas_kernels.topk.triton import _capacity, _row_plan
    bits, r_lo, r_hi, tol = (int(v) for v in _row_plan(np.int32(num_keys), k, sample, np))
    assert (1 << bits, r_lo, r_hi, tol, _capacity(num_keys, k, sample)) == plan


def test_lengths_are_checked():
    x = jnp.zeros((3, 10), jnp.float32)
    for bad in (jnp.zeros((2,), jnp.int32), jnp.zeros((3,), jnp.float32), [1, 2, 3]):
        with pytest.raises(ValueError, match=r"lengths must be an integer array of shape \[N\] = \(3,\)"):
            run("triton", x, 4, lengths=bad)


# ------------------------------------------------------------------------------------------------
# the Triton kernels (CPU: interpret mode): sampled thresholds, band buffers, fallbacks
# ------------------------------------------------------------------------------------------------

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
    out = run("triton", x, k, block=block, sample=sample, capacity=capacity)
    check_topk(out, nan_free(x), k)


def test_topk_sampled_ragged():
    """Sampled thresholds (sample 256 of 2048 keys), 4 slices per row (published counts, chunks
    loaded 4 at a time): ragged valid lengths around k, random rows; every row with more than
    ~2k valid keys must take the band path."""
    num_keys, k = 2048, 64
    ends = [0, 1, k - 1, k, k + 1, 2 * k, 300, 1000, 1500, num_keys, num_keys]
    x = random_rows(np.random.default_rng(0), len(ends) + 5, num_keys, ends)
    st = stages(x, k, sample=256, block=128, slices=4)
    check_topk(st["out"], x, k)
    assert np.asarray(st["counts"]).shape[1] == 4
    valid = (x > -np.inf).sum(1)
    assert band_path(st, k)[valid > 3 * k].all(), band_path(st, k)


@pytest.mark.parametrize("slices", [1, 4])
def test_topk_adversarial_rows(slices):
    """Sorted, tied, concentrated, special-value rows: exact; the all-equal row overflows the
    band and falls back to the whole row, the ascending/descending rows stay on the band.
    One slice a row (the write kernel counts as it writes) or 4 (each slice publishes its
    counts and takes its offsets from the earlier slices')."""
    num_keys, k = 2048, 64
    x = adversarial_rows(np.random.default_rng(1), num_keys, k)
    st = stages(x, k, sample=256, block=128, slices=slices)
    check_topk(st["out"], nan_free(x), k)
    on_band = band_path(st, k)
    assert on_band[0] and on_band[1], on_band  # sorted rows: the sample sees the quantiles
    assert not on_band[5], on_band  # all equal: band = the whole row > capacity


def test_topk_forced_fallback():
    """Capacity 4: every row whose band holds more than 4 keys is selected from the whole row."""
    num_keys, k = 1024, 48
    rng = np.random.default_rng(2)
    x = np.concatenate([random_rows(rng, 4, num_keys, [num_keys, 500, k + 1, k]),
                        adversarial_rows(rng, num_keys, k)])
    st = stages(x, k, sample=128, block=64, slices=2, capacity=4)
    check_topk(st["out"], nan_free(x), k)
    assert not band_path(st, k)[:2].any()


def test_topk_exact_sample():
    """Sample >= row length: exact thresholds, t_lo <= the k-th key < t_hi with exactly k keys
    >= t_lo when there are no ties (the band holds only keys of the answer)."""
    num_keys, k = 300, 37
    rng = np.random.default_rng(3)
    x = np.concatenate([random_rows(rng, 3, num_keys, [num_keys, k, k + 1]),
                        adversarial_rows(rng, num_keys, k)])
    st = stages(x, k, block=64)
    check_topk(st["out"], nan_free(x), k)
    n_def, n_band = (np.asarray(st["counts"])[:, :, j].sum(1) for j in range(2))
    assert n_def[0] < k and n_def[0] + n_band[0] == k, (n_def, n_band)  # Gaussian row: no ties


def test_topk_deterministic_across_slicings():
    """The output (order included) and the per-row counts do not depend on the slicing nor on
    how many chunks are loaded at a time: definite keys, then the band's selected keys, each in
    column order."""
    num_keys, k = 2048, 64
    rng = np.random.default_rng(4)
    x = np.concatenate([random_rows(rng, 3, num_keys, [num_keys, 900, 70]),
                        adversarial_rows(rng, num_keys, k)[2:5]])
    runs = [stages(x, k, sample=256, block=128, slices=s, group=g)
            for s, g in ((1, 1), (2, 4), (8, 4), (1, 4), (8, 1))]
    check_topk(runs[0]["out"], x, k)
    row_counts = np.asarray(runs[0]["counts"]).sum(1)
    for st in runs[1:]:
        np.testing.assert_array_equal(np.asarray(st["out"]), np.asarray(runs[0]["out"]))
        np.testing.assert_array_equal(np.asarray(st["counts"]).sum(1), row_counts)


def test_topk_grouped_chunks():
    """Chunks loaded `group` at a time: 15 chunks a row (slices of 4, 4, 4, 3 chunks), so
    groups end past a slice; bands of 1-3 chunks. Same output as one chunk at a time."""
    num_keys, k = 1920, 64
    rng = np.random.default_rng(8)
    x = np.concatenate([random_rows(rng, 4, num_keys, [num_keys, 1000, k + 1, 1500]),
                        adversarial_rows(rng, num_keys, k)[[0, 3, 5, 6]]])
    runs = [stages(x, k, sample=512, block=128, slices=4, group=g) for g in (1, 2, 4, 8)]
    check_topk(runs[0]["out"], x, k)
    for st in runs[1:]:
        np.testing.assert_array_equal(np.asarray(st["out"]), np.asarray(runs[0]["out"]))


def test_topk_attention_unchanged():
    """Sparse MLA over our selection equals sparse MLA over lax.top_k's (no ties: same set)."""
    num_keys, k, heads, rank, rope = 512, 32, 4, 32, 8
    keys = jax.random.split(jax.random.key(5), 4)
    ends = jnp.array([num_keys, 300, k, 5, 0, k + 1])
    logits = jax.random.normal(keys[0], (ends.shape[0], num_keys), jnp.float32)
    logits = jnp.where(jnp.arange(num_keys)[None, :] < ends[:, None], logits, -jnp.inf)
    q = jax.random.normal(keys[1], (ends.shape[0], heads, rank + rope), jnp.float32)
    latent = jax.random.normal(keys[2], (num_keys, rank), jnp.float32)
    k_pe = jax.random.normal(keys[3], (num_keys, rope), jnp.float32)
    attend = functools.partial(sparse_mla, q, latent, None, k_pe, scale=0.1, implementation="xla")
    out, lse = attend(run("triton", logits, k, sample=64, block=64))
    ref_out, ref_lse = attend(run("xla", logits, k))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-5)


def test_topk_bad_input():
    with pytest.raises(ValueError, match="2-D"):
        run("triton", jnp.zeros((2, 3, 4)), 2)
    with pytest.raises(ValueError, match="k"):
        run("triton", jnp.zeros((2, 8)), -1)


# ------------------------------------------------------------------------------------------------
# GPU: compiled kernels, k = 2048
# ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_topk_kernel_gpu():
    """32K keys, k = 2048, default plan (8 slices a row at 60 rows: published slice counts,
    chunks loaded 4 at a time): ragged random rows on the band path, adversarial rows exact."""
    num_keys, k = 32768, 2048
    rng = np.random.default_rng(6)
    ends = [0, 1, k - 1, k, k + 1, 3000, 5000, 20000, 32767] + [num_keys] * 39
    x = np.concatenate([random_rows(rng, len(ends), num_keys, ends),
                        adversarial_rows(rng, num_keys, k)])
    st = stages(x, k)
    check_topk(st["out"], nan_free(x), k)
    on_band = band_path(st, k)
    assert on_band[:len(ends)].all(), on_band
    assert not on_band[len(ends) + 5], on_band  # all equal: fallback


@pytest.mark.gpu
def test_topk_kernel_gpu_long_rows():
    """128K keys (32 slices a row at 8 rows), a causal-like batch and ties."""
    num_keys, k = 131072, 2048
    rng = np.random.default_rng(7)
    x = random_rows(rng, 8, num_keys, [num_keys, 70000, 2049, 9000, num_keys])
    x[5] = np.round(x[5] * 8)
    st = stages(x, k)
    check_topk(st["out"], x, k)
    assert band_path(st, k)[[0, 1, 3, 4, 6, 7]].all()


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
    out = jax.jit(functools.partial(run, "triton", k=k))(jnp.asarray(x))
    check_topk(out, np.where(np.isnan(x), -np.inf, x), k)


@pytest.mark.gpu
def test_topk_gpu_long_rows():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((8, 131072)).astype(np.float32)
    x[1, 70000:] = -np.inf
    x[2] = np.round(x[2] * 8)
    out = jax.jit(functools.partial(run, "triton", k=2048))(jnp.asarray(x))
    check_topk(out, x, 2048)


@pytest.mark.parametrize("rows,num_keys,k", [
    (4096, 1024, 64),  # interpreted on CPU: the many-row plan at a small k
    pytest.param(1024, 8192, 2048, marks=pytest.mark.gpu),
    pytest.param(4096, 8192, 2048, marks=pytest.mark.gpu),
])
def test_topk_many_rows(rows, num_keys, k):
    """The many-row plan (>= 1024 rows: one program a row, no slices) on a causal prefill's
    rows: row r reads its first (r + 1) * L // rows keys (lengths), garbage that would win past
    them; the last rows are adversarial and whole."""
    rng = np.random.default_rng(rows + num_keys)
    lengths = (np.arange(rows) + 1) * num_keys // rows
    x = rng.standard_normal((rows, num_keys)).astype(np.float32)
    bad = adversarial_rows(rng, num_keys, k)
    x[-len(bad):] = bad
    lengths[-len(bad):] = num_keys
    out = jax.jit(functools.partial(run, "triton", k=k), compiler_options=OPTIMIZED)(
        jnp.asarray(_with_garbage_past(x, lengths, rng)), lengths=jnp.asarray(lengths, jnp.int32))
    check_topk(out, _masked(nan_free(x), lengths), k)


# ------------------------------------------------------------------------------------------------
# The Mosaic write sweep and band select (pallas_kernels.topk.mosaic): GPU only
# ------------------------------------------------------------------------------------------------

def test_mosaic_write_lowers_for_the_gpu():
    """CPU twin of the hardware run: the write sweep lowers to a Mosaic GPU module at 1024 rows of
    32K keys (the interpreter cannot run its inline PTX)."""
    from pallas_kernels.topk.mosaic import topk_write
    sd = jax.ShapeDtypeStruct
    fn = jax.jit(functools.partial(topk_write, k=2048, cap=8192))
    args = (sd((1024, 32768), jnp.float32), sd((1024,), jnp.int32), sd((1024, 2), jnp.int32))
    assert "mosaic_gpu" in fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_mosaic_refuses_interpret_mode_and_odd_rows():
    from pallas_kernels.topk.mosaic import topk_write
    with pytest.raises(ValueError, match="'mosaic' has no interpret mode"):
        topk(jnp.zeros((4, 64)), 8, implementation="mosaic", interpret=True)
    zeros = jnp.zeros((4,), jnp.int32), jnp.zeros((4, 2), jnp.int32)
    with pytest.raises(ValueError, match="multiples of 4 .16-byte rows., got 66 and 16"):
        topk_write(jnp.zeros((4, 66)), *zeros, k=8, cap=16)
    with pytest.raises(ValueError, match="got 64 and 6"):
        topk_write(jnp.zeros((4, 64)), *zeros, k=8, cap=6)


def _mosaic_rows(rng, rows, num_keys, k):
    """Ragged rows (lengths at and around every 4-key, 1024-key and k boundary, the columns past
    them garbage that would win), then whole adversarial rows -> (x, lengths, number of those)."""
    lengths = rng.integers(0, num_keys + 1, rows)
    edges = [0, 1, 3, 4, 5, 1023, 1024, 1025, k - 1, k, k + 1, num_keys - 1, num_keys - 4, num_keys]
    lengths[:len(edges)] = [min(e, num_keys) for e in edges]
    x = rng.standard_normal((rows, num_keys)).astype(np.float32)
    bad = adversarial_rows(rng, num_keys, k)
    x[-len(bad):] = bad
    lengths[-len(bad):] = num_keys
    return _with_garbage_past(x, lengths, rng), np.asarray(lengths, np.int32), len(bad)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,num_keys,slices,k", [
    (1024, 32768, None, 2048),  # the many-row plan: one slice a row
    (1030, 8196, None, 2048),   # rows not a multiple of 4 warps, L a multiple of 4 but not of 1024
    (64, 131072, 1, 2048),      # few long rows, one slice forced
    (1024, 4098, None, 2048),   # L % 4 != 0: the Triton sweep (the two still agree)
    (1024, 1024, None, 64),     # the sample is the whole row: t_lo = the k-th key, cap = k
    (1024, 2048, None, 3),      # tiny k and band capacity
])
def test_mosaic_write_matches_triton(rows, num_keys, slices, k):
    """The sweep's intermediates (counts, thresholds, the band's keys) are bit-identical to the
    Triton sweep's; the rows it marks done are exactly the band-path rows (where it applies: L
    and the capacity multiples of 4), and their answers hold the same index sets as the Triton
    select's (the band's keys may come in another order) and are the top-k of each row's own
    keys."""
    rng = np.random.default_rng(rows + num_keys)
    x, lengths, n_bad = _mosaic_rows(rng, rows, num_keys, k)
    xj, lj = jnp.asarray(x), jnp.asarray(lengths)
    got = stages(xj, k, lengths=lj, slices=slices, backend="mosaic")
    want = stages(xj, k, lengths=lj, slices=slices)
    cnt = np.asarray(got["counts"])
    np.testing.assert_array_equal(cnt[:, :, :3], np.asarray(want["counts"])[:, :, :3])
    fused = num_keys % 4 == 0 and want["capacity"] % 4 == 0
    np.testing.assert_array_equal(cnt[:, 0, 3], band_path(want, k) if fused else 0)
    np.testing.assert_array_equal(np.asarray(got["thresholds"]), np.asarray(want["thresholds"]))
    np.testing.assert_array_equal(np.sort(np.asarray(got["out"]), 1), np.sort(np.asarray(want["out"]), 1))
    n_band = np.minimum(np.asarray(want["counts"])[:, :, 1].sum(1), want["capacity"])
    gk, wk = np.asarray(got["band_keys"]), np.asarray(want["band_keys"])
    for r in range(rows):
        np.testing.assert_array_equal(gk[r, :n_band[r]], wk[r, :n_band[r]], err_msg=f"row {r}")
    assert band_path(want, k)[:-n_bad].mean() > 0.9  # the band path is the one exercised
    check_topk(got["out"], _masked(nan_free(x), lengths), k)


@pytest.mark.gpu
def test_mosaic_topk_in_a_jit():
    """Implementation "mosaic" through the public op, jitted with XLA's optimisations, on a causal
    prefill's rows (row r sees its first (r + 1) L / rows keys)."""
    rows, num_keys, k = 4096, 8192, 2048
    rng = np.random.default_rng(11)
    lengths = ((np.arange(rows) + 1) * num_keys // rows).astype(np.int32)
    x = rng.standard_normal((rows, num_keys)).astype(np.float32)
    out = jax.jit(functools.partial(run, "mosaic", k=k), compiler_options=OPTIMIZED)(
        jnp.asarray(_with_garbage_past(x, lengths, rng)), lengths=jnp.asarray(lengths))
    check_topk(out, _masked(x, lengths), k)
