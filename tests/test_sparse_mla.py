"""Sparse MLA attention over selected cache slots, every implementation against the jnp reference.

Implementations (`pallas_kernels.sparse_mla.sparse_mla(..., implementation=)`): "xla"
(`sparse_mla_reference`, jnp: the XLA path and oracle), "triton" (the Pallas Triton kernel;
interpret mode on CPU), "mosaic" (the Mosaic GPU kernel: Hopper only, bf16 q; its gathers are
inline PTX, so it has no interpret mode and its cases are `gpu` tests, with CPU twins that lower
it for the GPU); "auto" (`ops.sparse_mla_auto`) is the public router's choice. Each kernel case
runs on every kernel that takes its operands.

Errors are relative: ||out - ref|| / ||ref|| over the rows that have a valid slot. Tolerances:
  * f32 q and f32 (or fp8 with f32 q) cache: 1e-5. The kernel's products are IEEE f32 there, so
    only summation order differs (online softmax, split merging).
  * bf16 q (bf16 or fp8 cache): 2e-2. The kernel rounds the softmax probabilities to bf16
    before the P.V product, as flash attention does; the
    reference keeps them in f32. Observed errors are ~3e-3.
lse is compared in absolute terms (it is a log): 1e-5 / 1e-2 with the same split, and 3e-2 for
an fp8 cache with bf16 q: the kernels dequantise e4m3 x f32 scale to bf16 (as FlashMLA does),
a <= 2^-9 relative rounding per value (far below e4m3's own 2^-4), which at the real shapes
(576-wide scores of random N(0, 1) data) moves the top scores, hence lse, by up to ~1.6e-2.
The isolation cases plant NaN / inf in every cache slot no row selects (slot 0 included) and run
on every implementation.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sparse_mla.config import FP8_TILE
from jax_sparse_mla.ops import quantize_tiles
from jax_sparse_mla.policy import UPFRONT_MIN_USES
from pallas_kernels.sparse_mla import MosaicConfig, TritonConfig, dequantize_latent, dequantize_pages, sparse_mla
from pallas_kernels.sparse_mla.splits import auto_num_splits, combine_splits, live_blocks
from tests.support import INTERPRET, assert_same_as_clean, ops

OP = "sparse_mla"
param = functools.partial(ops.implementation_param, OP)


def kernels(q_dtype, *values, id=None):
    """The kernels for q of q_dtype (the Mosaic kernel takes bf16 q only), as params."""
    names = ["triton"] + (["mosaic"] if q_dtype == jnp.bfloat16 else [])
    return [param(b, *values, id=f"{b}-{id}" if id else b) for b in names]


def make_inputs(seed, *, rows, heads, rank, rope, topk, num_slots, cache, q_dtype, hole_frac=0.3):
    """Fresh random inputs. cache: "f32" | "bf16" | "fp8". Slots are distinct per row, ~hole_frac -1."""
    keys = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(keys[0], (rows, heads, rank + rope), jnp.float32).astype(q_dtype)
    latent = jax.random.normal(keys[1], (num_slots, rank), jnp.float32)
    k_pe = jax.random.normal(keys[2], (num_slots, rope), jnp.float32)
    if cache == "fp8":
        latent, latent_scale = quantize_tiles(latent, FP8_TILE)
        k_pe = k_pe.astype(jnp.bfloat16)
    else:
        latent_scale = None
        dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16}[cache]
        latent, k_pe = latent.astype(dtype), k_pe.astype(dtype)
    # distinct slots per row (as top-k produces), then random holes
    perm = jax.vmap(lambda k: jax.random.permutation(k, num_slots)[:topk])(jax.random.split(keys[3], rows))
    holes = jax.random.uniform(keys[4], (rows, topk)) < hole_frac
    slots = jnp.where(holes, -1, perm).astype(jnp.int32)
    return q, latent, latent_scale, k_pe, slots


def tuned(implementation, *, num_splits=None, **tiling):
    """`implementation`'s config for a case's tuning: the Triton kernel takes the tiling (block_h,
    block_k, ...) and num_splits, the Mosaic kernel num_splits only."""
    if implementation == "mosaic":
        return MosaicConfig(num_splits=num_splits)
    return TritonConfig(num_splits=num_splits, **tiling)


def run(implementation, q, latent, latent_scale, k_pe, slots, *, dequantize="auto", pages=None, page_size=None,
        **kw):
    """sparse_mla by `implementation` (interpret mode off the GPU); dequantize "auto": the layer's
    route for these rows (`ops.sparse_mla_dequantize`); kw: scale, config."""
    if dequantize == "auto":
        dequantize = ops.sparse_mla_dequantize(q, latent, latent_scale, slots, pages, page_size)
    return sparse_mla(q, latent, latent_scale, k_pe, slots, implementation=implementation, dequantize=dequantize,
                      pages=pages, page_size=page_size, interpret=INTERPRET, **kw)


def check(implementation, inputs, *, scale, out_tol, lse_tol, **kwargs):
    """`run(implementation, ...)` against "xla": skipped where the kernel cannot take the operands."""
    q, latent, latent_scale, k_pe, slots = inputs
    reason = ops.sparse_mla_unsupported(implementation, q, latent, latent_scale, k_pe)
    if reason:
        pytest.skip(f"{implementation}: {reason}")
    out, lse = run(implementation, q, latent, latent_scale, k_pe, slots, scale=scale, **kwargs)
    ref_out, ref_lse = sparse_mla(q, latent, latent_scale, k_pe, slots, scale=scale, implementation="xla")
    out, lse, ref_out, ref_lse = map(np.asarray, (out, lse, ref_out, ref_lse))
    assert out.shape == ref_out.shape and out.dtype == np.float32
    assert lse.shape == ref_lse.shape and lse.dtype == np.float32

    empty = ~(np.asarray(slots) >= 0).any(axis=1)  # rows with no valid slot
    np.testing.assert_array_equal(out[empty], 0.0)
    np.testing.assert_array_equal(lse[empty], np.inf)
    live = ~empty
    if live.any():
        err = np.linalg.norm(out[live] - ref_out[live]) / np.linalg.norm(ref_out[live])
        assert err < out_tol, f"relative error {err:.2e} >= {out_tol}"
        np.testing.assert_allclose(lse[live], ref_lse[live], rtol=0, atol=lse_tol)
    return out, lse


TINY = dict(rank=128, rope=8, num_slots=96)
EXACT = dict(out_tol=1e-5, lse_tol=1e-5)
BF16 = dict(out_tol=2e-2, lse_tol=1e-2)
FP8 = dict(out_tol=2e-2, lse_tol=3e-2)


TINY = dict(rank=128, rope=8, num_slots=96)
EXACT = dict(out_tol=1e-5, lse_tol=1e-5)
BF16 = dict(out_tol=2e-2, lse_tol=1e-2)
FP8 = dict(out_tol=2e-2, lse_tol=3e-2)


# ------------------------------------------------------------------------------------------------
# kernels against the reference (CPU: the Triton kernel in interpret mode)
# ------------------------------------------------------------------------------------------------

_HOLES_CASES = [
    ("f32", jnp.float32, EXACT),
    ("bf16", jnp.bfloat16, BF16),
    ("fp8", jnp.bfloat16, FP8),
    ("fp8", jnp.float32, EXACT),  # dequantised in f32: checks the scales are applied exactly
]


@pytest.mark.parametrize("implementation,cache,q_dtype,tol", [
    p for cache, q_dtype, tol in _HOLES_CASES
    for p in kernels(q_dtype, cache, q_dtype, tol, id=f"{cache}-{jnp.dtype(q_dtype).name}")])
def test_random_slots_with_holes(implementation, cache, q_dtype, tol):
    inputs = make_inputs(0, rows=6, heads=4, topk=16, cache=cache, q_dtype=q_dtype, **TINY)
    check(implementation, inputs, scale=0.1, **tol)


@pytest.mark.parametrize("implementation", kernels(jnp.float32))
@pytest.mark.parametrize("cache", ["f32", "fp8"])
def test_empty_and_sparse_rows(implementation, cache):
    """Rows with no valid slot (out 0, lse +inf) and rows with only a few (index set < topk)."""
    q, latent, latent_scale, k_pe, slots = make_inputs(
        1, rows=6, heads=4, topk=16, cache=cache, q_dtype=jnp.float32, **TINY)
    slots = slots.at[0].set(-1)                                      # no valid slot
    slots = slots.at[1].set(jnp.full((16,), -1).at[3].set(5))        # a single slot
    slots = slots.at[2].set(jnp.full((16,), -1).at[:3].set(jnp.array([7, 8, 9])))  # a short prefix
    slots = slots.at[5].set(-1)
    out, lse = check(implementation, (q, latent, latent_scale, k_pe, slots), scale=0.1, **EXACT)
    # one slot: softmax weight 1, the output is that cache row
    row = latent.astype(jnp.float32)[5] if latent_scale is None else (
        latent.astype(jnp.float32)[5].reshape(-1, FP8_TILE) * latent_scale[5][:, None]).reshape(-1)
    np.testing.assert_allclose(out[1], np.broadcast_to(np.asarray(row), out[1].shape), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("implementation", kernels(jnp.float32))
@pytest.mark.parametrize("heads,topk", [(6, 20), (4, 8), (20, 40)])
def test_odd_heads_and_topk(implementation, heads, topk):
    """H not a power of two (padded, masked), K not a multiple of the block or below it.

    H=20 with block_h=16 gives two head blocks, the second mostly padding.
    """
    inputs = make_inputs(2, rows=3, heads=heads, topk=topk, cache="f32", q_dtype=jnp.float32, **TINY)
    check(implementation, inputs, scale=0.2, config=tuned(implementation, block_h=16, block_k=16), **EXACT)


@pytest.mark.parametrize("implementation", kernels(jnp.bfloat16))
@pytest.mark.parametrize("num_splits", [2, 3])
def test_split_slot_list(implementation, num_splits):
    """Slot lists split over programs and merged by lse, including splits with no valid slot."""
    q, latent, latent_scale, k_pe, slots = make_inputs(
        3, rows=4, heads=4, topk=48, cache="bf16", q_dtype=jnp.bfloat16, **TINY)
    slots = slots.at[0, 16:].set(-1)   # only the first split has work
    slots = slots.at[1, :40].set(-1)   # only the last split has work
    slots = slots.at[2].set(-1)        # nothing at all
    check(implementation, (q, latent, latent_scale, k_pe, slots), scale=0.1,
          config=tuned(implementation, block_k=16, num_splits=num_splits), **BF16)


def test_live_blocks_reach_the_last_valid_slot():
    slots = np.full((5, 70), -1, np.int32)
    slots[1, :3] = [4, 5, 6]        # a short prefix: one block
    slots[2, 69] = 9                # only the very last slot: every block
    slots[3, [0, 40]] = [1, 2]      # an interior run of -1 is walked (blocks up to the last valid)
    slots[4] = np.arange(70)
    np.testing.assert_array_equal(np.asarray(live_blocks(jnp.asarray(slots), 16)), [0, 1, 5, 3, 5])
    np.testing.assert_array_equal(np.asarray(live_blocks(jnp.asarray(slots), 64)), [0, 1, 2, 1, 2])


@pytest.mark.parametrize("splits", [2, 5])
def test_combine_splits_merges_by_log_sum_exp(splits):
    """Against float64 numpy: empty splits (lse -inf, out 0) weigh nothing, a row whose every split is
    empty gives out 0 and lse +inf, and lse far apart (100 nats) merge without overflow."""
    rng = np.random.default_rng(splits)
    out = rng.standard_normal((splits, 6, 4, 8)).astype(np.float32)
    lse = (rng.standard_normal((splits, 6, 4)) * 20).astype(np.float32)
    lse[0, 1] = -np.inf                     # one empty split
    lse[:, 2] = -np.inf                     # a row with every split empty
    lse[1:, 3] = -np.inf                    # only the first split holds the row
    lse[0, 4], lse[-1, 4] = 100.0, 0.0      # far apart: exp(100) overflows f32
    out[lse == -np.inf] = 0.0
    got_out, got_lse = combine_splits(jnp.asarray(out), jnp.asarray(lse))
    lse64 = lse.astype(np.float64)
    top = np.max(lse64, axis=0)
    weight = np.exp(lse64 - np.where(np.isfinite(top), top, 0.0))
    total = weight.sum(axis=0)
    want_out = np.einsum("snh,snhr->nhr", weight, out) / np.where(total > 0, total, 1.0)[..., None]
    want_lse = np.where(total > 0, np.log(np.where(total > 0, total, 1.0)) + np.where(np.isfinite(top), top, 0.0),
                        np.inf)
    np.testing.assert_allclose(np.asarray(got_out), want_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got_lse), want_lse, rtol=1e-6)
    assert np.all(np.asarray(got_out)[2] == 0) and np.all(np.asarray(got_lse)[2] == np.inf)


@pytest.mark.parametrize("wave,min_blocks", [(132, 4), (264, 4), (132, 2)])
def test_auto_splits_fill_one_wave(wave, min_blocks):
    """The split count is the largest that keeps every program in one wave (and each split >=
    min_blocks slot blocks): one more split would start a second wave or starve a split."""
    for rows in [1, 2, 3, 8, 16, 31, 32, 33, 64, 65, 66, 67, 100, 132, 133, 264, 4096]:
        for head_blocks in [1, 2]:
            for num_blocks in [1, 3, 8, 32]:
                s = auto_num_splits(rows, head_blocks, num_blocks, wave=wave, min_blocks_per_split=min_blocks)
                programs = rows * head_blocks
                assert s >= 1
                if s > 1:
                    assert programs * s <= wave and num_blocks // s >= min_blocks
                assert programs * (s + 1) > wave or num_blocks // (s + 1) < min_blocks


@pytest.mark.parametrize("implementation", kernels(jnp.bfloat16))
@pytest.mark.parametrize("num_splits", [1, 3])
def test_work_stops_at_the_last_valid_slot(implementation, num_splits):
    """The kernels walk a row's slots only up to its last valid one (`splits.live_blocks`): rows
    whose valid slots end early, start late, lie in the last block only or are absent, over
    several slot blocks of both kernels (Triton 16, Mosaic 64) and splits that end up with none."""
    q, latent, latent_scale, k_pe, slots = make_inputs(
        11, rows=7, heads=4, topk=300, cache="bf16", q_dtype=jnp.bfloat16, hole_frac=0.0, **dict(TINY, num_slots=400))
    slots = slots.at[0].set(-1)                 # nothing at all
    slots = slots.at[1, 5:].set(-1)             # the first block only
    slots = slots.at[2, :299].set(-1)           # the very last slot only
    slots = slots.at[3, 70:].set(-1)            # two Mosaic blocks, the second barely
    slots = slots.at[4, 20:200].set(-1)         # an interior gap, then more
    slots = slots.at[5, 128:].set(-1)           # ends on a block boundary
    check(implementation, (q, latent, latent_scale, k_pe, slots), scale=0.1,
          config=tuned(implementation, block_k=16, num_splits=num_splits), **BF16)


def test_triton_kernel_walks_only_the_live_blocks(monkeypatch):
    """The Triton kernel stops where `live_blocks` says, whatever the slots hold: told that row 1
    has no live block (and row 2 one), row 1 comes out empty and row 2 attends its first block
    only, while the other rows are unchanged bit for bit."""
    from pallas_kernels.sparse_mla import triton as triton_kernel

    inputs = make_inputs(12, rows=4, heads=4, topk=64, cache="bf16", q_dtype=jnp.bfloat16, hole_frac=0.0, **TINY)
    q, latent, latent_scale, k_pe, slots = inputs
    kw = dict(scale=0.1, config=TritonConfig(block_k=16, num_splits=1))
    want_out, want_lse = map(np.asarray, run("triton", *inputs, **kw))
    real = triton_kernel.live_blocks
    monkeypatch.setattr(triton_kernel, "live_blocks", lambda s, b: real(s, b).at[1].set(0).at[2].set(1))
    out, lse = map(np.asarray, run("triton", *inputs, **kw))
    np.testing.assert_array_equal(out[[0, 3]], want_out[[0, 3]])
    np.testing.assert_array_equal(out[1], 0.0)
    np.testing.assert_array_equal(lse[1], np.inf)
    first_block = np.asarray(run("triton", q, latent, latent_scale, k_pe, slots.at[:, 16:].set(-1), **kw)[0])
    np.testing.assert_array_equal(out[2], first_block[2])


@pytest.mark.parametrize("implementation", kernels(jnp.float32))
def test_large_scores_are_stable(implementation):
    """Scores in the hundreds: the online softmax must rescale, not overflow."""
    q, latent, latent_scale, k_pe, slots = make_inputs(
        4, rows=2, heads=4, topk=32, cache="f32", q_dtype=jnp.float32, **TINY)
    check(implementation, (q * 30.0, latent, latent_scale, k_pe, slots), scale=1.0,
          config=tuned(implementation, block_k=16), out_tol=1e-4, lse_tol=1e-3)


def paged_inputs(seed, *, rows, heads, rank, rope, topk, page_size, cache_pages, seq_pages):
    """An fp8 cache of cache_pages pages; one sequence of seq_pages shuffled pages (its block table,
    -1 padded to a width of seq_pages + 3) whose rows select distinct slots on its pages, ~20% -1."""
    q, latent, latent_scale, k_pe, _ = make_inputs(seed, rows=rows, heads=heads, rank=rank, rope=rope, topk=1,
                                                   num_slots=cache_pages * page_size, cache="fp8", q_dtype=jnp.bfloat16)
    keys = jax.random.split(jax.random.key(seed + 1), 3)
    table = jax.random.permutation(keys[0], cache_pages)[:seq_pages].astype(jnp.int32)
    positions = jax.vmap(lambda k: jax.random.permutation(k, seq_pages * page_size)[:topk])(
        jax.random.split(keys[1], rows))
    slots = table[positions // page_size] * page_size + positions % page_size
    slots = jnp.where(jax.random.uniform(keys[2], (rows, topk)) < 0.2, -1, slots).astype(jnp.int32)
    pages = jnp.concatenate([table, jnp.full((3,), -1, jnp.int32)])
    return q, latent, latent_scale, k_pe, slots, pages


def test_dequantize_pages_renumbers_slots():
    """The copy holds the listed pages dequantised, -1 pages ignored, and each slot names the same
    row there; slots on pages not listed become -1."""
    _, latent, latent_scale, k_pe, slots, pages = paged_inputs(
        7, rows=5, heads=4, rank=128, rope=8, topk=40, page_size=8, cache_pages=30, seq_pages=12)
    stray = int(jnp.setdiff1d(jnp.arange(30), pages)[0]) * 8 + 3  # a slot on a page not listed
    slots = slots.at[4, 0].set(stray)
    copy, copy_pe, renumbered = dequantize_pages(latent, latent_scale, k_pe, slots, pages, page_size=8,
                                                 dtype=jnp.float32)
    assert copy.shape == (15 * 8, 128) and copy_pe.shape == (15 * 8, 8)
    valid = np.asarray(slots) >= 0
    valid[4, 0] = False
    np.testing.assert_array_equal(np.asarray(renumbered) >= 0, valid)
    want = dequantize_latent(latent, latent_scale)
    got_rows, want_rows = np.asarray(renumbered)[valid], np.asarray(slots)[valid]
    np.testing.assert_array_equal(np.asarray(copy)[got_rows], np.asarray(want)[want_rows])
    np.testing.assert_array_equal(np.asarray(copy_pe)[got_rows], np.asarray(k_pe)[want_rows])


@pytest.mark.parametrize("implementation,q_dtype", [p for q_dtype in (jnp.bfloat16, jnp.float32)
                                             for p in kernels(q_dtype, q_dtype, id=jnp.dtype(q_dtype).name)])
def test_fp8_upfront_equals_in_kernel(implementation, q_dtype):
    """Dequantising the sequence's pages upfront gives the in-kernel route's results (both round
    e4m3 x scale to q's dtype, so the products see the same operands), and both match the
    reference. Bit for bit where both routes run the same instructions (interpret mode, the Mosaic
    kernel); compiled Triton feeds a dot from registers (in-kernel) or memory (upfront) and Hopper's
    bf16 MMA sums in a different order then: there, float32 accumulation-order noise only."""
    q, latent, latent_scale, k_pe, slots, pages = paged_inputs(
        8, rows=6, heads=4, rank=128, rope=8, topk=24, page_size=8, cache_pages=20, seq_pages=9)
    q = q.astype(q_dtype)
    tol = EXACT if q_dtype == jnp.float32 else FP8
    kw = dict(pages=pages, page_size=8, **tol)
    in_kernel = check(implementation, (q, latent, latent_scale, k_pe, slots), scale=0.1, dequantize="kernel", **kw)
    upfront = check(implementation, (q, latent, latent_scale, k_pe, slots), scale=0.1, dequantize="upfront", **kw)
    if INTERPRET or implementation != "triton" or q_dtype == jnp.float32:
        np.testing.assert_array_equal(upfront[0], in_kernel[0])
        np.testing.assert_array_equal(upfront[1], in_kernel[1])
    else:
        assert np.linalg.norm(upfront[0] - in_kernel[0]) <= 1e-5 * np.linalg.norm(in_kernel[0])
        np.testing.assert_allclose(upfront[1], in_kernel[1], rtol=1e-5, atol=1e-5)


def _kernel_latent_dtype(rows, *, whole_cache=False):
    """The latent dtype the Pallas kernel receives under dequantize="auto" (traced, not run), for
    `rows` rows of topk 32 and 128 heads over a sequence's 4 pages (+3 -1 entries) of 50."""
    q, latent, latent_scale, k_pe, slots, pages = paged_inputs(
        9, rows=rows, heads=128, rank=128, rope=8, topk=32, page_size=64, cache_pages=50, seq_pages=4)
    fn = functools.partial(run, "triton", scale=0.1, page_size=64)
    jaxpr = jax.make_jaxpr(lambda *a: fn(*a, pages=None if whole_cache else pages))(q, latent, latent_scale, k_pe, slots)
    (call,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]
    return call.invars[1].aval.dtype


def test_auto_dequantizes_upfront_for_prefill_only():
    """"auto": rows x topk x 64-head programs >= UPFRONT_MIN_USES x the copy's rows -> upfront."""
    enough = UPFRONT_MIN_USES * 7 * 64 // (32 * 2)  # rows at exactly the threshold for the 7 listed pages
    assert _kernel_latent_dtype(enough) == jnp.bfloat16
    assert _kernel_latent_dtype(enough - 1) == jnp.float8_e4m3fn
    assert _kernel_latent_dtype(enough, whole_cache=True) == jnp.float8_e4m3fn  # 50 pages to copy


@pytest.mark.parametrize("bad", ["route", "bf16_upfront", "page_size"])
def test_dequantize_rejects_bad_arguments(bad):
    q, latent, latent_scale, k_pe, slots, pages = paged_inputs(
        10, rows=2, heads=4, rank=128, rope=8, topk=8, page_size=8, cache_pages=6, seq_pages=3)
    kw = {"route": dict(dequantize="in_kernel"),
          "bf16_upfront": dict(dequantize="upfront"),
          "page_size": dict(dequantize="upfront", pages=pages, page_size=7)}[bad]
    if bad == "bf16_upfront":
        latent, latent_scale = latent.astype(jnp.bfloat16), None
    with pytest.raises(ValueError, match="dequantize|fp8|page_size"):
        sparse_mla(q, latent, latent_scale, k_pe, slots, scale=0.1,
                   implementation=ops.sparse_mla_auto(q, latent, latent_scale, k_pe), interpret=INTERPRET, **kw)


# ------------------------------------------------------------------------------------------------
# isolation: NaN / inf in cache slots no row selects
# ------------------------------------------------------------------------------------------------

PAGE = 8
SPARSE_SHAPE = dict(rows=6, heads=4, rank=128, rope=8, topk=24, num_slots=96)  # 12 pages of 8


def _sparse_case(cache, seed=0):
    """Clean inputs whose rows select only slots of pages 4..11 (slot 0 never), with holes, a row
    of only -1 and one with a single valid slot; and the same cache with NaN / inf in every slot
    no row selects (pages 0..3 included)."""
    s = SPARSE_SHAPE
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (s["rows"], s["heads"], s["rank"] + s["rope"]), jnp.float32).astype(jnp.bfloat16)
    latent = jax.random.normal(keys[1], (s["num_slots"], s["rank"]), jnp.float32)
    k_pe = jax.random.normal(keys[2], (s["num_slots"], s["rope"]), jnp.float32).astype(jnp.bfloat16)
    if cache == "fp8":
        latent, latent_scale = quantize_tiles(latent, FP8_TILE)
    else:
        latent, latent_scale = latent.astype(jnp.bfloat16), None
    rng = np.random.default_rng(seed)
    slots = np.stack([rng.permutation(np.arange(32, s["num_slots"]))[: s["topk"]] for _ in range(s["rows"])])
    slots = np.where(rng.random(slots.shape) < 0.3, -1, slots).astype(np.int32)
    slots[4] = -1  # no valid slot
    slots[5, 1:] = -1  # one valid slot
    unused = np.setdiff1d(np.arange(s["num_slots"]), slots[slots >= 0])
    assert 0 in unused
    nan_rows = jnp.zeros((s["num_slots"], 1), bool).at[unused].set(True)
    poisoned = (jnp.where(nan_rows, jnp.nan, latent.astype(jnp.float32)).astype(latent.dtype),
                None if latent_scale is None else jnp.where(nan_rows, jnp.inf, latent_scale),
                jnp.where(nan_rows, jnp.inf, k_pe.astype(jnp.float32)).astype(k_pe.dtype))
    return q, (latent, latent_scale, k_pe), poisoned, jnp.asarray(slots)


def _check_sparse(run, cache, seed=0):
    q, clean, poisoned, slots = _sparse_case(cache, seed)
    out, lse = run(q, *clean, slots)
    out_p, lse_p = run(q, *poisoned, slots)
    assert_same_as_clean(out_p, out, "into out")
    assert np.isfinite(np.asarray(out_p)).all()
    np.testing.assert_array_equal(np.asarray(lse_p)[4], np.inf)  # the empty row
    np.testing.assert_allclose(np.asarray(lse_p), np.asarray(lse), rtol=1e-6, atol=1e-7)


_TABLES = jnp.asarray([[4, 5, 6, 7, 8, 9], [10, 11, -1, -1, -1, -1]], jnp.int32)  # -1 entries copy nothing
_ISOLATION_ROUTES = [("bf16", "auto"), ("fp8", "kernel"), ("fp8", "upfront")]


@pytest.mark.parametrize("implementation,cache,dequantize,pages", [
    param("xla", "bf16", "auto", None, id="xla-bf16"),
    param("xla", "fp8", "auto", None, id="xla-fp8"),
] + [param("triton", cache, dequantize, _TABLES, id=f"triton-{cache}-{dequantize}")
     for cache, dequantize in _ISOLATION_ROUTES]
  # the Mosaic GPU kernel zero-fills -1 slots in its gathers (cp.async of size 0)
  + [param("mosaic", cache, dequantize, jnp.arange(4, 12, dtype=jnp.int32), id=f"mosaic-{cache}-{dequantize}")
     for cache, dequantize in _ISOLATION_ROUTES])
def test_ignores_unselected_slots(implementation, cache, dequantize, pages):
    kw = {} if implementation == "xla" else dict(dequantize=dequantize, pages=pages, page_size=PAGE)
    _check_sparse(functools.partial(run, implementation, scale=0.1, **kw), cache)


def test_dequantize_pages_zeroes_unlisted_entries():
    """The upfront copy's rows for -1 page entries are zeros, not page 0's (NaN) rows."""
    _, _, (latent, latent_scale, k_pe), slots = _sparse_case("fp8")
    pages = jnp.asarray([4, 5, 6, 7, 8, 9, 10, 11, -1, -1], jnp.int32)
    copy, copy_pe, renumbered = dequantize_pages(latent, latent_scale, k_pe, slots, pages, page_size=PAGE,
                                                 dtype=jnp.bfloat16)
    tail = slice(8 * PAGE, None)
    np.testing.assert_array_equal(np.asarray(copy[tail], np.float32), 0.0)
    np.testing.assert_array_equal(np.asarray(copy_pe[tail], np.float32), 0.0)
    assert (np.asarray(renumbered) < 8 * PAGE).all()


# ------------------------------------------------------------------------------------------------
# GPU: compiled kernels, real dimensions; the Mosaic kernel's CPU twins
# ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("implementation", kernels(jnp.bfloat16))
@pytest.mark.parametrize("cache,dequantize", [("bf16", "auto"), ("fp8", "kernel"), ("fp8", "upfront")])
def test_real_dimensions_gpu(cache, dequantize, implementation):
    """DeepSeek-V3.2 shapes: H=128, R=512, P=64, topk 2048 over a 32K-token cache, 64 rows."""
    inputs = make_inputs(5, rows=64, heads=128, rank=512, rope=64, topk=2048, num_slots=32768,
                         cache=cache, q_dtype=jnp.bfloat16, hole_frac=0.1)
    scale = (128 + 64) ** -0.5 * (0.1 * np.log(40.0) + 1) ** 2
    check(implementation, inputs, scale=scale, dequantize=dequantize, **(FP8 if cache == "fp8" else BF16))


@pytest.mark.gpu
def test_mosaic_fp8_routes_agree_gpu():
    """The Mosaic kernel's in-kernel dequantisation and the upfront copy (both e4m3 x scale in f32,
    rounded to bf16) give the same attention, at the real shapes over a paged cache."""
    q, latent, latent_scale, k_pe, slots, pages = paged_inputs(
        11, rows=256, heads=128, rank=512, rope=64, topk=2048, page_size=64, cache_pages=640, seq_pages=300)
    attend = functools.partial(run, "mosaic", q, latent, latent_scale, k_pe, slots, scale=0.06,
                               pages=pages, page_size=64)
    in_kernel = attend(dequantize="kernel")
    upfront = attend(dequantize="upfront")
    np.testing.assert_allclose(upfront[0], in_kernel[0], rtol=0, atol=1e-5 * float(jnp.abs(in_kernel[0]).max()))
    np.testing.assert_allclose(upfront[1], in_kernel[1], rtol=0, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
@pytest.mark.parametrize("heads,num_splits", [(20, 1), (20, 3), (16, 3), (128, 3)])
def test_mosaic_odd_shapes_gpu(cache, heads, num_splits):
    """Mosaic kernel: H=20 (one head block, padded to 64 heads), 16 (one block of 16 real heads,
    unpadded) or 128 (two head blocks), R=128,
    P=8 (padded to 32 columns), K=200 (padded to whole 64-slot blocks), holes, an empty row, a
    one-slot row, splits with no valid slot."""
    q, latent, latent_scale, k_pe, slots = make_inputs(
        6, rows=5, heads=heads, topk=200, cache=cache, q_dtype=jnp.bfloat16, rank=128, rope=8, num_slots=500)
    slots = slots.at[0].set(-1)
    slots = slots.at[1].set(jnp.full((200,), -1).at[150].set(7))
    slots = slots.at[2, :128].set(-1)
    check("mosaic", (q, latent, latent_scale, k_pe, slots), scale=0.2, config=MosaicConfig(num_splits=num_splits),
          dequantize="kernel" if cache == "fp8" else "auto", **(FP8 if cache == "fp8" else BF16))


@pytest.mark.gpu
def test_mosaic_fp8_dequantisation_gpu():
    """Every finite e4m3 code (subnormals, both zeros, +-448) times scales from 2e-7 to 1e3: a row
    whose only valid slot is cache row n must return that row dequantised and rounded to bf16
    (relative error <= 2^-7 per value: bf16's own rounding is 2^-8; zeros stay exact zeros)."""
    rows, heads, rank, rope = 256, 64, 512, 64
    codes = (np.arange(rank)[None, :] * 7 + np.arange(rows)[:, None] * 13) % 256
    codes = np.where((codes & 0x7F) == 0x7F, 0, codes).astype(np.uint8)  # 0x7F, 0xFF are NaN
    latent = jnp.asarray(codes).view(jnp.float8_e4m3fn)
    rng = np.random.default_rng(7)
    latent_scale = jnp.asarray(np.exp(rng.uniform(np.log(2e-7), np.log(1e3), (rows, rank // FP8_TILE))),
                               jnp.float32)
    k_pe = jnp.asarray(rng.normal(size=(rows, rope)), jnp.bfloat16)
    q = jnp.asarray(rng.normal(size=(rows, heads, rank + rope)), jnp.bfloat16)
    slots = np.full((rows, 64), -1, np.int32)
    slots[:, 37] = np.arange(rows)
    # (scores reach ~1e6 here, so lse is not compared: with one slot its weight is 1 regardless)
    out, _ = run("mosaic", q, latent, latent_scale, k_pe, jnp.asarray(slots), scale=0.1, dequantize="kernel")
    out = np.asarray(out)
    want = (np.asarray(latent.astype(jnp.float32)).reshape(rows, -1, FP8_TILE)
            * np.asarray(latent_scale)[:, :, None]).reshape(rows, 1, rank)
    want = np.broadcast_to(want, out.shape)
    nonzero = want != 0
    np.testing.assert_array_equal(out[~nonzero], 0.0)
    rel = np.abs(out[nonzero] - want[nonzero]) / np.abs(want[nonzero])
    assert rel.max() <= 2.0 ** -7, f"max relative error {rel.max():.2e}"


@pytest.mark.parametrize("cache", ["bf16", "fp8"])
@pytest.mark.parametrize("heads,rank,rope,topk,num_splits", [(128, 512, 64, 2048, None), (20, 128, 8, 200, 3),
                                                            (128, 128, 8, 200, 3), (16, 512, 64, 2048, None),
                                                            (32, 512, 64, 2048, 2)])
def test_mosaic_kernel_lowers(cache, heads, rank, rope, topk, num_splits):
    """CPU twin of the Mosaic GPU tests: the kernel (inline gathers included) lowers to a Mosaic GPU
    module at the real shapes and at the GPU test's odd ones; it cannot run in interpret mode
    (inline_mgpu has no interpreter)."""
    sd = jax.ShapeDtypeStruct
    latent = sd((4096, rank), jnp.bfloat16 if cache == "bf16" else jnp.float8_e4m3fn)
    latent_scale = None if cache == "bf16" else sd((4096, rank // FP8_TILE), jnp.float32)
    args = (sd((3, heads, rank + rope), jnp.bfloat16), latent, latent_scale, sd((4096, rope), jnp.bfloat16),
            sd((3, topk), jnp.int32))
    fn = jax.jit(lambda *a: sparse_mla(*a, scale=0.1, implementation="mosaic",
                                       config=MosaicConfig(num_splits=num_splits), dequantize="kernel"))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("bad", ["rank", "rope", "dtype", "fp8_tile"])
def test_mosaic_rejects_unsupported_shapes(bad):
    rank, rope, dtype = {"rank": (96, 64, jnp.bfloat16), "rope": (128, 12, jnp.bfloat16),
                         "dtype": (128, 64, jnp.float32), "fp8_tile": (128, 64, jnp.float8_e4m3fn)}[bad]
    # fp8: one scale per 8 values, finer than the kernel's 16-value dequantisation units
    latent_scale = jnp.ones((8, rank // 8), jnp.float32) if bad == "fp8_tile" else None
    q = jnp.zeros((2, 4, rank + rope), jnp.bfloat16)
    with pytest.raises(ValueError):
        sparse_mla(q, jnp.zeros((8, rank), dtype), latent_scale, jnp.zeros((8, rope), jnp.bfloat16),
                   jnp.zeros((2, 4), jnp.int32), scale=0.1, implementation="mosaic", dequantize="kernel")
