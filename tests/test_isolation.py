"""One request's NaN / inf never reaches another request's output: the layer.

Rule: a row's output depends only on its own sequence's keys. Rows gathered for -1 ids (padding
slots, padding rows, pages past a block table) read slot / row / page 0, which may hold another
request's NaN (a finished request whose first token was NaN, say): they are zeroed by select,
never multiplied by a 0 probability (0 * NaN = NaN). Each test plants NaN / inf where no clean
row may look (cache pages no request uses, page 0 included; other requests' and padding rows of
hidden) and checks that the clean rows equal the run without the poison and are finite. A
sequence's own NaN still shows in its own rows (nothing is sanitised with isfinite), on every
route: a non-finite hidden row makes its own row and its request's later rows NaN, as the
oracle and the dense route give it, also where top-k (NaN logits invalid) would select nothing.

The kernel-level isolation cases are part of each op's suite, on every backend
(test_indexer_logits.py, test_topk.py, test_sparse_mla.py, test_dense_mha.py). Here: `forward`
on the tiny config, every route (dense, sparse, force_sparse, mixed, dispatch="cond"), fp8 and
bf16 caches, XLA kernels, and the Pallas kernels (interpret mode) on one sparse batch.
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
from jax_sparse_mla.model import take_rows, forward, positions_to_slots
from tests.support import assert_same_as_clean as _same


def test_positions_to_slots_and_take_rows_never_read_another_page():
    tables = jnp.asarray([[3, -1], [5, 6]], jnp.int32)
    pos = jnp.asarray([[0, 5, -1], [7, 1, -1]], jnp.int32)
    slots = positions_to_slots(pos, tables, jnp.asarray([0, 1], jnp.int32), 4)
    np.testing.assert_array_equal(np.asarray(slots), [[12, -1, -1], [27, 21, -1]])
    a = jnp.full((4, 2), jnp.nan).at[1:].set(2.0)
    np.testing.assert_array_equal(np.asarray(take_rows(a, jnp.asarray([2, -1, 1]))), [[2, 2], [0, 0], [2, 2]])


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
    clean, poisoned, rows, plan = _layer_run(config, SPARSE, nan_hidden=[0], own_nan=[3], prefill_route="sparse")
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
    clean, poisoned, rows, plan = _layer_run(FP8_KV, MIXED, nan_hidden=[0], own_nan=[4], kernels=kernels,
                                             prefill_route="sparse")
    assert plan.route == "dense" and plan.num_sparse_tokens > 4 and plan.num_upfront_rows
    _check_layer(clean, poisoned, rows, victims=[0], own_nan=[4])


@pytest.mark.parametrize("config", [TINY, FP8_KV], ids=["bf16kv-fp8idx", "fp8kv-bf16idx"])
def test_layer_masked_route(config):
    """The mixed batch with its long prefill as masked MHA: its keys join the dense call, its rows
    select their top-k there; the NaN decode, unused pages and padding rows stay out of every
    other row, and a decode's own NaN context shows in its own row."""
    clean, poisoned, rows, plan = _layer_run(config, MIXED, nan_hidden=[0], own_nan=[4], prefill_route="masked")
    assert plan.route == "dense" and plan.masked == "some"
    _check_layer(clean, poisoned, rows, victims=[0], own_nan=[4])


@pytest.mark.parametrize("specs,nan_hidden", [(SPARSE, [0]), (DENSE, [])], ids=["sparse-branch", "dense-branch"])
def test_layer_cond_dispatch(specs, nan_hidden):
    clean, poisoned, rows, plan = _layer_run(TINY, specs, nan_hidden=nan_hidden, dispatch="cond")
    assert plan.route == "cond"
    _check_layer(clean, poisoned, rows, victims=nan_hidden)



LONG = [(6, 1), (0, 20), (10, 1)]  # a decode, a long prefill (scored: masked or sparse), a decode


@pytest.mark.parametrize("route,config,kernels", [
    ("masked", TINY, "xla"), ("masked", FP8_KV, "xla"), ("sparse", TINY, "xla"), ("sparse", FP8_KV, "xla"),
    ("force_sparse", TINY, "xla"), ("cond", FP8_KV, "xla"), ("dense", TINY, "xla"), ("sparse", FP8_KV, "pallas")])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_layer_own_nonfinite_element_shows_on_every_route(route, config, kernels, value):
    """One element of one hidden row of a request is NaN (or inf). Its row and the request's
    later rows are non-finite on every route, as in the float32 oracle and the dense route: the
    scored routes would otherwise give that row exactly 0 (all its indexer logits NaN, nothing
    selected). Its earlier rows and every other request equal the clean run."""
    specs, bad_request, bad_row = (DENSE, 1, 3) if route == "dense" else (LONG, 1, 12)
    kw = {"masked": dict(prefill_route="masked"), "sparse": dict(prefill_route="sparse"),
          "force_sparse": dict(force_sparse=True), "cond": dict(dispatch="cond"), "dense": {}}[route]
    rng = np.random.default_rng(7)
    page = config.page_size
    free = iter(range(1, NUM_PAGES))
    tables = [[next(free) for _ in range(-(-(c + q) // page))] for c, q in specs]
    plan, meta = plan_batch(config, [Request(c, q, t) for (c, q), t in zip(specs, tables)], num_pages=NUM_PAGES, **kw)
    assert plan.program == ("cond" if route == "cond" else "sparse" if route == "force_sparse" else route) or (
        route == "sparse" and plan.route == "dense" and plan.masked == "none")
    ctx = np.asarray([t[p // page] * page + p % page for (c, _), t in zip(specs, tables) for p in range(c)], np.int32)
    cache = cache_lib.write(init_cache(config, NUM_PAGES), jnp.asarray(ctx), {
        **cache_lib.encode_latent(jnp.asarray(rng.standard_normal((len(ctx), config.kv_lora_rank)), jnp.float32),
                                  jnp.asarray(rng.standard_normal((len(ctx), config.qk_rope_head_dim)), jnp.float32),
                                  config),
        **cache_lib.encode_index_keys(jnp.asarray(rng.standard_normal((len(ctx), config.index_head_dim)), jnp.float32),
                                      config)})
    hidden = rng.standard_normal((plan.num_tokens, config.hidden_size)).astype(np.float32)
    starts = np.cumsum([0] + [q for _, q in specs])
    poisoned = hidden.copy()
    poisoned[starts[bad_request] + bad_row, 5] = value
    run = functools.partial(_forward, _params(config), meta=meta, plan=plan, config=config, kernels=kernels)
    clean = np.asarray(run(jnp.asarray(hidden, config.jnp_dtype), cache)[0], np.float32)
    out = np.asarray(run(jnp.asarray(poisoned, config.jnp_dtype), cache)[0], np.float32)
    for i in range(len(specs)):
        rows = np.arange(starts[i], starts[i + 1])
        if i == bad_request:
            before, after = rows[:bad_row], rows[bad_row:]
            assert not np.isfinite(out[after]).all(axis=-1).any(), f"{route}: rows at/after the bad element finite"
            _same(out[before], clean[before], "into the request's earlier rows")
        else:
            _same(out[rows], clean[rows], f"into request {i}")
    assert (out[starts[-1]:] == 0).all()  # padding rows
