"""pallas_kernels.topk (thresholds / write / select kernels) against lax.top_k.

Checked per row (check_topk): min(k, #finite) distinct indices then -1, and the multiset of
their values equal to lax.top_k's (the exact index set where there are no ties at the k-th
value). The band path (selection among the keys between two sampled thresholds) and the
whole-row fallback are both exercised, and each test asserts which rows took which path, so a
sampling bug cannot hide behind the (always exact, slower) fallback.
On CPU the kernels run in Pallas interpret mode (small rows, small k, several slices per row);
the `gpu` tests compile them for k = 2048 and rows of 32K / 128K keys.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import topk as topk_lib
from pallas_kernels.sparse_mla import sparse_mla_reference
from pallas_kernels.topk.triton import topk_stages
from tests.conftest import INTERPRET
from tests.test_indexer_kernels import check_topk


def stages(x, k, **kw):
    """All intermediates of `topk` (see `topk_stages`) for a numpy [N, L] array."""
    opts = dict(interpret=INTERPRET, block=None, num_warps=None, num_stages=None, sample=None,
                capacity=None, slices=None, group=None)
    opts.update(kw)
    return topk_stages(jnp.asarray(x), k, **opts)


def band_path(st, k):
    """[N] bool: the row's answer came from the band (else from the whole-row fallback)."""
    cnt = np.asarray(st["counts"])
    n_def, n_band, n_valid = (cnt[:, :, j].sum(1) for j in range(3))
    n_sel = np.minimum(n_valid, k)
    return (n_def <= n_sel) & (n_def + n_band >= n_sel) & (n_band <= st["capacity"])


def nan_free(x):
    return np.where(np.isnan(x), -np.inf, x)  # the reference treats NaN as the largest


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


# ------------------------------------------------------------------------------------------------
# CPU (interpret mode) and GPU alike
# ------------------------------------------------------------------------------------------------

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
    attend = functools.partial(sparse_mla_reference, q, latent, None, k_pe, scale=0.1)
    out, lse = attend(topk_lib.topk(logits, k, interpret=INTERPRET, sample=64, block=64))
    ref_out, ref_lse = attend(topk_lib.topk_reference(logits, k))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-5)


def test_topk_bad_input():
    with pytest.raises(ValueError, match="2-D"):
        topk_lib.topk(jnp.zeros((2, 3, 4)), 2, interpret=INTERPRET)
    with pytest.raises(ValueError, match="k"):
        topk_lib.topk(jnp.zeros((2, 8)), -1, interpret=INTERPRET)


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
