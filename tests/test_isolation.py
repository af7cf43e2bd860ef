"""One request's NaN / inf never reaches another request's output.

Rule: a row's output depends only on its own sequence's keys. Rows gathered for -1 ids (padding
slots, padding rows, pages past a block table) read slot / row / page 0, which may hold another
request's NaN (a finished request whose first token was NaN, say): they are zeroed by select,
never multiplied by a 0 probability (0 * NaN = NaN). Each test plants NaN / inf where no clean
row may look (cache slots no row selects, slot 0 and page 0 included; keys past a row's end;
other sequences' pages; other requests' and padding rows of hidden) and checks that the clean
rows equal the run without the poison and are finite. A sequence's own NaN still shows in its
own rows (nothing is sanitised with isfinite).

Kernel level: sparse MLA attention (jnp reference, the Triton kernel in interpret mode, the fp8
cache's upfront dequantisation; the Mosaic GPU kernel on a GPU only: its gathers are inline PTX),
indexer logits (reference, Triton, and the Mosaic GPU prefill and decode kernels in their
interpreter), top-k (reference and Pallas). Layer level: `forward` on the tiny config, every
route (dense, sparse, force_sparse, mixed, dispatch="cond"), fp8 and bf16 caches, XLA kernels,
and the Pallas kernels (interpret mode) on one sparse batch.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sparse_mla import MLAConfig, Request, init_cache, init_params, plan_batch
from jax_sparse_mla import cache as cache_lib
from jax_sparse_mla.config import FP8_TILE
from jax_sparse_mla.model import _take_rows, forward, positions_to_slots
from jax_sparse_mla.ops import quantize_tiles
from pallas_kernels.indexer_logits import gather_paged_rows, indexer_logits_reference
from pallas_kernels.indexer_logits.mosaic_decode import indexer_logits_mosaic_decode
from pallas_kernels.indexer_logits.mosaic_prefill import indexer_logits_mosaic_prefill
from pallas_kernels.indexer_logits.triton import indexer_logits_triton
from pallas_kernels.sparse_mla import dequantize_pages, sparse_mla, sparse_mla_reference
from pallas_kernels.topk import topk, topk_reference
from tests.conftest import INTERPRET

FP8 = jnp.float8_e4m3fn


def _same(got, want, err_msg=""):
    """Equal to the clean run (to float32 round-off) and NaN-free where the clean run is."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert not np.isnan(got).any(), f"NaN leaked {err_msg}"
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=err_msg)


# ------------------------------------------------------------------------------------------------
# sparse MLA attention
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
    _same(out_p, out, "into out")
    assert np.isfinite(np.asarray(out_p)).all()
    np.testing.assert_array_equal(np.asarray(lse_p)[4], np.inf)  # the empty row
    np.testing.assert_allclose(np.asarray(lse_p), np.asarray(lse), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_sparse_reference_ignores_unselected_slots(cache):
    _check_sparse(functools.partial(sparse_mla_reference, scale=0.1), cache)


@pytest.mark.parametrize("cache,dequantize", [("bf16", "auto"), ("fp8", "kernel"), ("fp8", "upfront")])
def test_sparse_triton_kernel_ignores_unselected_slots(cache, dequantize):
    pages = jnp.asarray([[4, 5, 6, 7, 8, 9], [10, 11, -1, -1, -1, -1]], jnp.int32)  # -1 entries copy nothing
    run = functools.partial(sparse_mla, scale=0.1, interpret=INTERPRET, backend="triton",
                            dequantize=dequantize, pages=pages, page_size=PAGE)
    _check_sparse(run, cache)


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


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_sparse_mosaic_kernel_ignores_unselected_slots_gpu(cache):
    """The Mosaic GPU kernel zero-fills -1 slots in its gathers (cp.async of size 0)."""
    pages = jnp.arange(4, 12, dtype=jnp.int32)
    for dequantize in (["auto"] if cache == "bf16" else ["kernel", "upfront"]):
        run = functools.partial(sparse_mla, scale=0.1, backend="mosaic", dequantize=dequantize,
                                pages=pages, page_size=PAGE)
        _check_sparse(run, cache)


# ------------------------------------------------------------------------------------------------
# indexer logits and top-k
# ------------------------------------------------------------------------------------------------

def _indexer_case(dtype, scaled, page, seed=1):
    """3 sequences on pages 1.. (page 0 and 3 more never used), one spare -1 column in the block
    table; rows: sequence 0 ends 67..70 (length 70), sequence 1 ends 3 and 5 (length 5), sequence
    2 (the poisoned request) ends 128..130. Poison: NaN / inf in the keys (and scales) of every
    unused page, of sequence 2's pages, and of sequences 0 and 1 at positions >= their lengths.
    Returns (clean args, poisoned args, rows that must not change)."""
    rng = np.random.default_rng(seed)
    lengths, hi, d = [70, 5, 130], 4, 16
    width = max(-(-n // page) for n in lengths) + 1
    num_pages = sum(-(-n // page) for n in lengths) + 4
    pool = iter(rng.permutation(np.arange(1, num_pages)))
    tables = np.full((3, width), -1, np.int32)
    for s, n in enumerate(lengths):
        tables[s, : -(-n // page)] = [next(pool) for _ in range(-(-n // page))]
    row_seq = np.array([0, 1, 2, 0, 0, 2, 1, 0, 2], np.int32)
    row_end = np.array([67, 3, 128, 68, 69, 129, 5, 70, 130], np.int32)
    n = len(row_seq)
    q = rng.standard_normal((n, hi, d)).astype(np.float32)
    k = rng.standard_normal((num_pages * page, d)).astype(np.float32)
    w = rng.standard_normal((n, hi)).astype(np.float32)
    if dtype == FP8:
        q, k = q * 8, k * 8
    k_scale = (2.0 ** rng.integers(-4, 2, num_pages * page)).astype(np.float32) if scaled else None

    bad = np.ones(num_pages * page, bool)  # slots a clean row may read: its sequence's keys < length
    for s in (0, 1):
        for pos in range(lengths[s]):
            bad[tables[s, pos // page] * page + pos % page] = False
    assert bad[:page].all()  # page 0 is poisoned
    k_bad = np.where(bad[:, None], np.where(np.arange(len(bad)) % 2 == 0, np.nan, np.inf)[:, None], k)
    clean = [jnp.asarray(q).astype(dtype), jnp.asarray(w), jnp.asarray(k).astype(dtype),
             None if k_scale is None else jnp.asarray(k_scale), jnp.asarray(tables), jnp.asarray(row_seq),
             jnp.asarray(row_end)]
    poisoned = list(clean)
    poisoned[2] = jnp.asarray(k_bad).astype(dtype)
    if scaled:
        poisoned[3] = jnp.asarray(np.where(bad & (np.arange(len(bad)) % 3 == 0), np.nan, k_scale))
    return clean, poisoned, row_seq != 2


def _check_indexer(run, dtype, scaled, page):
    clean, poisoned, keep = _indexer_case(dtype, scaled, page)
    want = np.asarray(run(*clean, page_size=page))[keep]
    got = np.asarray(run(*poisoned, page_size=page))[keep]
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    fin = np.isfinite(want)
    np.testing.assert_array_equal(got[~fin], -np.inf)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype,scaled", [(FP8, True), (jnp.bfloat16, False)])
def test_indexer_reference_and_triton_ignore_other_keys(dtype, scaled):
    _check_indexer(indexer_logits_reference, dtype, scaled, 4)
    _check_indexer(functools.partial(indexer_logits_triton, interpret=INTERPRET), dtype, scaled, 4)


@pytest.mark.parametrize("kernel,dtype,scaled,page,tiling", [
    # keys read straight from 64-key pages: a -1 table entry reads page 0 (NaN)
    (indexer_logits_mosaic_prefill, FP8, True, 64, dict(block_rows=4, group=2, stages=2)),
    (indexer_logits_mosaic_decode, FP8, True, 64, dict(block_rows=1, chunk=4, step_blocks=1, stages=4)),
    # pages of 4: keys gathered into 64-key pages first (gather_paged_rows)
    (indexer_logits_mosaic_decode, jnp.bfloat16, False, 4, dict(block_rows=1, chunk=4, step_blocks=1, stages=4)),
], ids=["prefill-page64", "decode-page64", "decode-page4"])
def test_indexer_mosaic_kernels_ignore_other_keys(kernel, dtype, scaled, page, tiling):
    """The Mosaic GPU kernels (CPU: their interpreter): keys are the wgmma's M rows and the head
    sum a row reduction, so a NaN key reaches only its own logit, which the row-end mask drops."""
    _check_indexer(functools.partial(kernel, interpret=INTERPRET, **tiling), dtype, scaled, page)


def test_gather_paged_rows_zeroes_missing_pages():
    cache = jnp.full((16, 3), jnp.nan).at[4:].set(1.0)  # page 0 NaN
    rows = gather_paged_rows(cache, jnp.asarray([[1, -1], [-1, 2]]), 4)
    want = np.zeros((2, 8, 3), np.float32)
    want[0, :4] = want[1, 4:] = 1.0
    np.testing.assert_array_equal(np.asarray(rows), want)


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_topk_rows_are_independent(impl):
    """A row of only -inf, and one with NaN inside its own range, change no other row; NaN counts
    as invalid in both implementations (the reference once let a NaN take a valid key's place)."""
    run = topk_reference if impl == "reference" else functools.partial(topk, interpret=INTERPRET)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 40)).astype(np.float32)
    x[:, 30:] = -np.inf  # past the rows' ends
    x[1, 10:] = -np.inf
    clean = run(jnp.asarray(x), 16)
    bad = x.copy()
    bad[4] = -np.inf
    bad[5, [0, 3, 7, 20]] = np.nan
    got = np.asarray(run(jnp.asarray(bad), 16))
    np.testing.assert_array_equal(got[:4], np.asarray(clean)[:4])
    np.testing.assert_array_equal(got[4], -1)
    nan_free = np.where(np.isnan(bad[5]), -np.inf, bad[5])
    want = np.sort(np.argsort(-nan_free, kind="stable")[:16])
    np.testing.assert_array_equal(np.sort(got[5]), want)


def test_positions_to_slots_and_take_rows_never_read_another_page():
    tables = jnp.asarray([[3, -1], [5, 6]], jnp.int32)
    pos = jnp.asarray([[0, 5, -1], [7, 1, -1]], jnp.int32)
    slots = positions_to_slots(pos, tables, jnp.asarray([0, 1], jnp.int32), 4)
    np.testing.assert_array_equal(np.asarray(slots), [[12, -1, -1], [27, 21, -1]])
    a = jnp.full((4, 2), jnp.nan).at[1:].set(2.0)
    np.testing.assert_array_equal(np.asarray(_take_rows(a, jnp.asarray([2, -1, 1]))), [[2, 2], [0, 0], [2, 2]])


# ------------------------------------------------------------------------------------------------
# the layer: forward over planned batches
# ------------------------------------------------------------------------------------------------

TINY = MLAConfig.tiny()  # bf16 latent cache, fp8 indexer
FP8_KV = dataclasses.replace(TINY, kv_cache_dtype="fp8", indexer_dtype="bfloat16")
NUM_PAGES = 24
_forward = jax.jit(forward, static_argnames=("plan", "config", "kernels"))

# (context_len, query_len) per request. Request 0 is the one given NaN hidden rows: row 0 is
# what every padded row id (-1) of the plan's row lists reads.
DENSE = [(0, 5), (0, 7), (4, 6)]  # short prefills (one after context): all dense
SPARSE = [(6, 1), (0, 20), (10, 1), (8, 1)]  # decodes and a long prefill
MIXED = [(6, 1), (0, 7), (0, 20), (10, 1), (8, 1)]  # a short prefill beside those


@functools.cache
def _params(config):
    return init_params(config, jax.random.key(0))


def _layer_run(config, specs, *, nan_hidden=(), own_nan=(), kernels="xla", seed=0, **plan_kw):
    """Runs `specs` clean and poisoned; returns (clean out, poisoned out, rows of each request, plan).

    Pages 1.. are allocated in order (page 0 and the pages past the batch are never used) and
    each request's context is written into the cache (random rows). Poisoned run: NaN in every
    cache field of every page no request uses (inf in the scales), NaN in the hidden rows of the
    requests `nan_hidden` and in the padding rows, and NaN in the latent of the context slots of
    the requests `own_nan` (their own keys: their rows must show it).
    """
    page = config.page_size
    rng = np.random.default_rng(seed)
    free = iter(range(1, NUM_PAGES))
    tables = [[next(free) for _ in range(-(-(c + q) // page))] for c, q in specs]
    plan, meta = plan_batch(config, [Request(c, q, t) for (c, q), t in zip(specs, tables)], num_pages=NUM_PAGES,
                            **plan_kw)
    ctx_slots = [[t[p // page] * page + p % page for p in range(c)] for (c, _), t in zip(specs, tables)]
    flat = np.concatenate([np.asarray(s, np.int32) for s in ctx_slots])
    n = len(flat)
    cache = cache_lib.write(init_cache(config, NUM_PAGES), jnp.asarray(flat), {
        **cache_lib.encode_latent(jnp.asarray(rng.standard_normal((n, config.kv_lora_rank)), jnp.float32),
                                  jnp.asarray(rng.standard_normal((n, config.qk_rope_head_dim)), jnp.float32), config),
        **cache_lib.encode_index_keys(jnp.asarray(rng.standard_normal((n, config.index_head_dim)), jnp.float32),
                                      config)})
    starts = np.cumsum([0] + [q for _, q in specs])
    rows = [np.arange(starts[i], starts[i + 1]) for i in range(len(specs))]
    hidden = rng.standard_normal((plan.num_tokens, config.hidden_size)).astype(np.float32)

    used = sorted({p for t in tables for p in t})
    unused = np.setdiff1d(np.arange(NUM_PAGES), used)
    assert 0 in unused
    own = np.concatenate([np.asarray(ctx_slots[i], np.int32) for i in own_nan]) if own_nan else np.zeros(0, np.int32)
    fields = {}
    for f in dataclasses.fields(cache):
        a = getattr(cache, f.name)
        if a is None:
            continue
        bad = jnp.inf if f.name.endswith("scale") else jnp.nan
        a = jnp.where(jnp.isin(jnp.arange(NUM_PAGES), unused).reshape((-1,) + (1,) * (a.ndim - 1)),
                      jnp.asarray(bad, a.dtype), a)
        if f.name in ("latent", "k_pe") and own.size:
            flat_a = a.reshape((-1,) + a.shape[2:])
            a = flat_a.at[own].set(jnp.asarray(jnp.nan, a.dtype)).reshape(a.shape)
        fields[f.name] = a
    poisoned_cache = dataclasses.replace(cache, **fields)
    poisoned_hidden = hidden.copy()
    poisoned_hidden[starts[-1]:] = np.nan  # padding rows
    for i in nan_hidden:
        poisoned_hidden[rows[i]] = np.nan

    run = functools.partial(_forward, _params(config), meta=meta, plan=plan, config=config, kernels=kernels)
    x = lambda h: jnp.asarray(h, config.jnp_dtype)  # noqa: E731
    clean, _ = run(x(hidden), cache)
    poisoned, _ = run(x(poisoned_hidden), poisoned_cache)
    return np.asarray(clean, np.float32), np.asarray(poisoned, np.float32), rows, plan


def _check_layer(clean, poisoned, rows, *, victims=(), own_nan=()):
    for i, r in enumerate(rows):
        if i in own_nan:  # its own NaN key, selected by its own rows, shows
            assert np.isnan(poisoned[r]).all(axis=-1).any(), f"request {i}: own NaN hidden"
        elif i not in victims:
            assert np.isfinite(clean[r]).all()
            _same(poisoned[r], clean[r], f"into request {i}")


@pytest.mark.parametrize("config", [TINY, FP8_KV], ids=["bf16kv", "fp8kv"])
def test_layer_dense_route_ignores_unused_pages_and_padding(config):
    """Dense route: dense_key_slots' -1 padding read slot 0 (NaN: page 0 unused), padding rows NaN."""
    clean, poisoned, rows, plan = _layer_run(config, DENSE)
    assert plan.route == "dense"
    _check_layer(clean, poisoned, rows)


def test_layer_dense_route_nan_batchmate():
    """A NaN prefill beside other short prefills in one dense batch (packed keys). Needs the dense
    attention (pallas_kernels/dense_mha/) to zero masked probabilities by select too."""
    clean, poisoned, rows, plan = _layer_run(TINY, DENSE, nan_hidden=[0])
    assert plan.route == "dense"
    assert np.isnan(poisoned[rows[0]]).all()  # its own NaN shows
    _check_layer(clean, poisoned, rows, victims=[0])


@pytest.mark.parametrize("config", [TINY, FP8_KV], ids=["bf16kv-fp8idx", "fp8kv-bf16idx"])
def test_layer_sparse_route(config):
    """Decodes and a long prefill: a NaN decode row, unused pages NaN, padding rows NaN; another
    decode's own context NaN shows in its own row."""
    clean, poisoned, rows, plan = _layer_run(config, SPARSE, nan_hidden=[0], own_nan=[3])
    assert plan.route == "sparse"
    _check_layer(clean, poisoned, rows, victims=[0], own_nan=[3])


def test_layer_force_sparse_short_prefills():
    clean, poisoned, rows, plan = _layer_run(TINY, DENSE, nan_hidden=[0], force_sparse=True)
    assert plan.route == "sparse"
    _check_layer(clean, poisoned, rows, victims=[0])


@pytest.mark.parametrize("kernels", ["xla", "pallas"])
def test_layer_mixed_batch(kernels):
    """The dense program with sparse rows, fp8 cache: the NaN decode (row 0, which the padded row
    ids of dense_rows, sparse_rows and the fp8 split's upfront / kernel rows read) beside a short
    prefill (dense), a long prefill (sparse, over an upfront-dequantised copy of its pages whose
    -1 entries name page 0) and decodes. kernels="pallas" (CPU: interpret mode) runs the Triton
    indexer, top-k and sparse attention (dense MHA stays on XLA at the tiny config's head dims)."""
    clean, poisoned, rows, plan = _layer_run(FP8_KV, MIXED, nan_hidden=[0], own_nan=[4], kernels=kernels)
    assert plan.route == "dense" and plan.num_sparse_tokens > 4 and plan.num_upfront_rows
    _check_layer(clean, poisoned, rows, victims=[0], own_nan=[4])


@pytest.mark.parametrize("specs,nan_hidden", [(SPARSE, [0]), (DENSE, [])], ids=["sparse-branch", "dense-branch"])
def test_layer_cond_dispatch(specs, nan_hidden):
    clean, poisoned, rows, plan = _layer_run(TINY, specs, nan_hidden=nan_hidden, dispatch="cond")
    assert plan.route == "cond"
    _check_layer(clean, poisoned, rows, victims=nan_hidden)

