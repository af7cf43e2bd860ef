"""Padding rows: what each op gives for them, and that they never change a real row's result.

Buckets pad every plan size to a power of two (plan.BucketPolicy): padding rows come after the
real rows (row_seq 0, position -1, row_end 0, slot -1, -1 in the row lists), padding sequences
after the real ones (-1 block tables, empty start-location ranges).

(a) Only padding: each op's documented output for a row with no work, through the public api
    (`op(..., implementation=)`) on "xla" and a Pallas kernel (interpret mode on CPU):
    indexer logits with row_end 0 -> all -inf; top-k of all -inf rows or of length 0 -> all -1; sparse MLA
    with every slot -1 -> out 0, lse +inf (FlashMLA's convention: pallas_kernels/sparse_mla/api.py);
    dense MHA with no sequence owning a row -> zeros.
(b) Padding added around real rows (before and after them at the op level; after them at the
    layer level, as plan_batch lays them out) leaves the real rows' results unchanged. Bitwise
    where the kernel computes each row the same way whatever the bucket; where a kernel's
    tiling depends on the row count (`BITWISE` below says which), to float32 round-off.
    The layer: plan_batch with a BucketPolicy that doubles the bucket, forward with
    kernels="xla" and "pallas" on the tiny config: the real rows' outputs and the cache agree.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sparse_mla import BucketPolicy, MLAConfig, Request, init_cache, init_params, plan_batch
from jax_sparse_mla import cache as cache_lib
from jax_sparse_mla.config import FP8_TILE
from jax_sparse_mla.model import forward
from jax_sparse_mla.ops import quantize_tiles
from pallas_kernels.dense_mha import dense_mha
from pallas_kernels.indexer_logits import indexer_logits
from pallas_kernels.sparse_mla import sparse_mla
from pallas_kernels.topk import topk
from tests.support import INTERPRET, ops
from tests.support.cases import FP8, make_indexer_case

# The (op, implementation) pairs whose real rows are bitwise unchanged by padding (measured on
# CPU, interpret mode). The one exception: dense MHA's "xla" (its jnp reference) contracts its P.V
# and score products over every key row, padding keys included (masked to p = 0), so a longer
# key axis changes XLA's dot tiling and moves the real rows by float32 round-off (~5e-7
# absolute at these sizes); it is compared to 1e-6. On a GPU every "xla" is compared to 1e-6
# too: XLA's GPU reductions pick their tiling by shape (measured: sparse MLA's "xla" over an fp8
# cache moves by 4.8e-7 when padding rows are added).
BITWISE = {("indexer_logits", "xla"), ("indexer_logits", "triton"), ("topk", "xla"), ("topk", "triton"),
           ("sparse_mla", "xla"), ("sparse_mla", "triton"), ("dense_mha", "mosaic")}


def same(op, implementation, got, want, msg=""):
    got, want = np.asarray(got), np.asarray(want)
    if (op, implementation) in BITWISE and (INTERPRET or implementation != "xla"):
        np.testing.assert_array_equal(got, want, err_msg=msg)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=msg)


def embed(a, before, after, fill):
    """a [N, ...] with `before` rows of `fill` ahead and `after` rows of it behind."""
    a = jnp.asarray(a)
    pad = lambda n: jnp.full((n,) + a.shape[1:], fill, a.dtype)  # noqa: E731
    return jnp.concatenate([pad(before), a, pad(after)])


AROUND = (3, 4)  # padding rows before and after the real rows in the op-level tests


# ------------------------------------------------------------------------------------------------
# indexer logits
# ------------------------------------------------------------------------------------------------

INDEXER = ("xla", "triton")


def _indexer_case():
    return make_indexer_case(0, dtype=FP8, scaled=True, hi=4, d=32, page=4, lengths=[9, 3, 14],
                             rows_per_seq=[3, 1, 4])


@pytest.mark.parametrize("implementation", INDEXER)
def test_indexer_logits_padding_rows_are_all_neg_inf(implementation):
    (q, w, k, k_scale, tables, row_seq, row_end), page = _indexer_case()
    out = indexer_logits(q, w, k, k_scale, tables, row_seq, jnp.zeros_like(row_end), page_size=page,
                         implementation=implementation, interpret=INTERPRET)
    assert out.shape == (q.shape[0], tables.shape[1] * page)
    np.testing.assert_array_equal(np.asarray(out), -np.inf)


@pytest.mark.parametrize("implementation", INDEXER)
def test_indexer_logits_real_rows_ignore_padding(implementation):
    """Padding rows (row_seq 0, row_end 0, random q) around the real rows and padding sequences
    (-1 block tables) after the real ones."""
    before, after = AROUND
    (q, w, k, k_scale, tables, row_seq, row_end), page = _indexer_case()
    n = q.shape[0]
    want = indexer_logits(q, w, k, k_scale, tables, row_seq, row_end, page_size=page, implementation=implementation,
                          interpret=INTERPRET)
    rng = np.random.default_rng(1)
    q_pad = jnp.asarray(rng.standard_normal((before + n + after,) + q.shape[1:]) * 8, jnp.float32).astype(q.dtype)
    q_pad = q_pad.at[before:before + n].set(q)
    w_pad = embed(w, before, after, 1.0)
    tables_pad = jnp.concatenate([tables, jnp.full((5, tables.shape[1]), -1, jnp.int32)])
    got = indexer_logits(q_pad, w_pad, k, k_scale, tables_pad, embed(row_seq, before, after, 0),
                         embed(row_end, before, after, 0), page_size=page, implementation=implementation,
                         interpret=INTERPRET)
    same("indexer_logits", implementation, got[before:before + n], want)
    np.testing.assert_array_equal(np.asarray(got[:before]), -np.inf)
    np.testing.assert_array_equal(np.asarray(got[before + n:]), -np.inf)


# ------------------------------------------------------------------------------------------------
# top-k
# ------------------------------------------------------------------------------------------------

TOPK = ("xla", "triton")


@pytest.mark.parametrize("implementation", TOPK)
def test_topk_of_neg_inf_rows_is_all_minus_one(implementation):
    out = topk(jnp.full((6, 256), -jnp.inf, jnp.float32), 16, implementation=implementation, interpret=INTERPRET)
    assert out.shape == (6, 16) and out.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(out), -1)


@pytest.mark.parametrize("implementation", TOPK)
def test_topk_of_zero_length_rows_is_all_minus_one(implementation):
    """The layer passes a padding row's row_end 0 as its length: whatever its logits hold."""
    junk = jnp.asarray(np.random.default_rng(4).standard_normal((6, 256)), jnp.float32).at[2].set(jnp.nan)
    out = topk(junk, 16, lengths=jnp.zeros((6,), jnp.int32), implementation=implementation, interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(out), -1)


@pytest.mark.parametrize("implementation", TOPK)
def test_topk_real_rows_ignore_padding(implementation):
    """Real rows (some with fewer than k valid keys) among all -inf padding rows: the same
    positions (compared as sets: the order within a row is unspecified), -1 for the padding."""
    before, after = AROUND
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((5, 256)).astype(np.float32)
    logits[1, 10:] = -np.inf  # 10 valid keys < k
    logits[3, ::2] = -np.inf
    want = np.asarray(topk(jnp.asarray(logits), 16, implementation=implementation, interpret=INTERPRET))
    got = np.asarray(topk(embed(logits, before, after, -np.inf), 16, implementation=implementation,
                          interpret=INTERPRET))
    np.testing.assert_array_equal(np.sort(got[before:before + 5], axis=1), np.sort(want, axis=1))
    np.testing.assert_array_equal(np.delete(got, np.s_[before:before + 5], axis=0), -1)


# ------------------------------------------------------------------------------------------------
# sparse MLA
# ------------------------------------------------------------------------------------------------

SPARSE = [("xla", "bf16", "kernel"), ("triton", "bf16", "kernel"), ("xla", "fp8", "kernel"),
          ("triton", "fp8", "kernel"), ("triton", "fp8", "upfront")]
SPARSE_IDS = ["-".join(p) for p in SPARSE]
SPARSE_PAGE = 8


def _sparse_case(rows=5, heads=4, rank=128, rope=16, topk=16, num_slots=64, cache="bf16", seed=3):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (rows, heads, rank + rope), jnp.float32).astype(jnp.bfloat16)
    latent = jax.random.normal(keys[1], (num_slots, rank), jnp.float32)
    k_pe = jax.random.normal(keys[2], (num_slots, rope), jnp.float32).astype(jnp.bfloat16)
    if cache == "fp8":
        latent, latent_scale = quantize_tiles(latent, FP8_TILE)
    else:
        latent, latent_scale = latent.astype(jnp.bfloat16), None
    slots = jax.vmap(lambda k: jax.random.permutation(k, num_slots)[:topk])(jax.random.split(keys[3], rows))
    slots = slots.astype(jnp.int32).at[2, 5:].set(-1)  # a row with 5 valid slots
    return q, latent, latent_scale, k_pe, slots


def _sparse(implementation, dequantize, q, latent, latent_scale, k_pe, slots):
    """sparse_mla over the whole cache as the layer's pages ("xla" ignores dequantize and pages)."""
    return sparse_mla(q, latent, latent_scale, k_pe, slots, scale=0.1, implementation=implementation,
                      dequantize=dequantize, pages=jnp.arange(latent.shape[0] // SPARSE_PAGE, dtype=jnp.int32),
                      page_size=SPARSE_PAGE, interpret=INTERPRET)


@pytest.mark.parametrize("implementation,cache,dequantize", SPARSE, ids=SPARSE_IDS)
def test_sparse_mla_rows_without_slots(implementation, cache, dequantize):
    q, latent, latent_scale, k_pe, slots = _sparse_case(cache=cache)
    out, lse = _sparse(implementation, dequantize, q, latent, latent_scale, k_pe, jnp.full_like(slots, -1))
    np.testing.assert_array_equal(np.asarray(out), 0.0)
    np.testing.assert_array_equal(np.asarray(lse), np.inf)


@pytest.mark.parametrize("implementation,cache,dequantize", SPARSE, ids=SPARSE_IDS)
def test_sparse_mla_real_rows_ignore_padding(implementation, cache, dequantize):
    """Padding rows: -1 slots, q of large values (reading them would show)."""
    before, after = AROUND
    q, latent, latent_scale, k_pe, slots = _sparse_case(cache=cache)
    want_out, want_lse = _sparse(implementation, dequantize, q, latent, latent_scale, k_pe, slots)
    got_out, got_lse = _sparse(implementation, dequantize, embed(q, before, after, 300.0), latent, latent_scale, k_pe,
                               embed(slots, before, after, -1))
    real = slice(before, before + q.shape[0])
    same("sparse_mla", implementation, got_out[real], want_out, "out")
    same("sparse_mla", implementation, got_lse[real], want_lse, "lse")
    pad = np.delete(np.arange(got_out.shape[0]), np.arange(before, before + q.shape[0]))
    np.testing.assert_array_equal(np.asarray(got_out)[pad], 0.0)
    np.testing.assert_array_equal(np.asarray(got_lse)[pad], np.inf)


# ------------------------------------------------------------------------------------------------
# dense MHA
# ------------------------------------------------------------------------------------------------

DENSE = ("xla", "mosaic")


def _dense_run(implementation, q, k, v, q_start, k_start):
    reason = ops.dense_mha_unsupported(implementation, q.dtype, q.shape[-1], v.shape[-1])
    if reason:
        pytest.skip(f"{implementation}: {reason}")
    return dense_mha(q, k, v, jnp.asarray(q_start, jnp.int32), jnp.asarray(k_start, jnp.int32), scale=0.2,
                     implementation=implementation, interpret=INTERPRET)


def _dense_qkv(t, tk, seed=4, heads=2, d=64):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal((n, heads, d)), jnp.bfloat16) for n in (t, tk, tk))
    return q, k, v


@pytest.mark.parametrize("implementation", DENSE)
@pytest.mark.parametrize("keys", ["no_keys", "unowned_keys"])
def test_dense_mha_rows_no_sequence_owns(implementation, keys):
    """q_start_loc all 0: no sequence owns a row (keys: none owned either, or owned by sequences
    with no query rows)."""
    q, k, v = _dense_qkv(24, 16)
    k_start = [0, 0, 0] if keys == "no_keys" else [0, 7, 16]
    out = _dense_run(implementation, q, k, v, [0, 0, 0], k_start)
    assert out.shape == (24, 2, 64)
    np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)


@pytest.mark.parametrize("implementation", DENSE)
def test_dense_mha_real_rows_ignore_padding(implementation):
    """Two sequences (one with context); then padding query and key rows of large values and two
    empty padding sequences, as plan_batch pads dense_rows / dense_key_slots and the sequences.
    (Padding rows come only after the owned rows here: the start locations fix where rows lie.)"""
    q_lens, kv_lens = [9, 5], [9, 12]
    q, k, v = _dense_qkv(sum(q_lens), sum(kv_lens))
    q_start, k_start = np.cumsum([0] + q_lens), np.cumsum([0] + kv_lens)
    want = _dense_run(implementation, q, k, v, q_start, k_start)
    big = [embed(a, 0, 19, 300.0) for a in (q, k, v)]
    got = _dense_run(implementation, *big, np.r_[q_start, q_start[-1], q_start[-1]],
                     np.r_[k_start, k_start[-1], k_start[-1]])
    same("dense_mha", implementation, got[:q.shape[0]], want)
    np.testing.assert_array_equal(np.asarray(got[q.shape[0]:], np.float32), 0.0)


# ------------------------------------------------------------------------------------------------
# the layer
# ------------------------------------------------------------------------------------------------

TINY = MLAConfig.tiny()
FP8_KV = dataclasses.replace(TINY, kv_cache_dtype="fp8", indexer_dtype="bfloat16")
NUM_PAGES = 32
_forward = jax.jit(forward, static_argnames=("plan", "config", "kernels"))
# (context_len, query_len): a decode, a short prefill (dense MHA), a long prefill (sparse), a decode
MIXED = [(6, 1), (0, 7), (0, 20), (10, 1)]


@functools.cache
def _params(config):
    return init_params(config, jax.random.key(0))


def _filled_cache(config, tables, specs, rng):
    page = config.page_size
    slots = np.asarray([t[p // page] * page + p % page for (c, _), t in zip(specs, tables) for p in range(c)], np.int32)
    n = len(slots)
    rows = lambda d: jnp.asarray(rng.standard_normal((n, d)), jnp.float32)  # noqa: E731
    return cache_lib.write(init_cache(config, NUM_PAGES), jnp.asarray(slots), {
        **cache_lib.encode_latent(rows(config.kv_lora_rank), rows(config.qk_rope_head_dim), config),
        **cache_lib.encode_index_keys(rows(config.index_head_dim), config)})


# each kernels choice, cache format and dispatch once or twice (the full product of the three
# passes too, but costs ~2 minutes on 2 CPU cores; pallas + cond alone ~25 s)
LAYER_CASES = [("xla", TINY, "static"), ("xla", FP8_KV, "cond"), ("pallas", FP8_KV, "static")]


@pytest.mark.parametrize("kernels,config,dispatch", LAYER_CASES,
                         ids=[f"{k}-{'fp8kv' if c.kv_cache_dtype == 'fp8' else 'bf16kv'}-{d}" for k, c, d in LAYER_CASES])
def test_layer_real_rows_ignore_a_bigger_bucket(kernels, config, dispatch):
    """The same mixed batch planned with the default buckets and with every bucket doubled
    (tokens, sequences, pages per sequence): real rows' outputs and the written caches agree;
    padding rows give 0. Compared to float32 round-off (the programs' shapes differ, so XLA may
    fuse and tile them differently); bitwise equality is reported in the assertion message."""
    page = config.page_size
    free = iter(range(1, NUM_PAGES))
    tables = [[next(free) for _ in range(-(-(c + q) // page))] for c, q in MIXED]
    requests = [Request(c, q, t) for (c, q), t in zip(MIXED, tables)]
    rng = np.random.default_rng(5)
    cache = _filled_cache(config, tables, MIXED, rng)
    n = sum(q for _, q in MIXED)
    small_plan, small_meta = plan_batch(config, requests, num_pages=NUM_PAGES, dispatch=dispatch)
    big = BucketPolicy(min_tokens=2 * small_plan.num_tokens, min_seqs=2 * small_plan.num_seqs,
                       min_pages_per_seq=2 * small_plan.pages_per_seq)
    big_plan, big_meta = plan_batch(config, requests, num_pages=NUM_PAGES, dispatch=dispatch, buckets=big)
    assert big_plan.num_tokens == 2 * small_plan.num_tokens and big_plan.route == small_plan.route
    hidden = rng.standard_normal((big_plan.num_tokens, config.hidden_size)).astype(np.float32)
    hidden[n:] = 1e3  # padding rows: large values that would show if read
    run = functools.partial(_forward, _params(config), config=config, kernels=kernels)
    want, want_cache = run(jnp.asarray(hidden[:small_plan.num_tokens]), cache, small_meta, plan=small_plan)
    got, got_cache = run(jnp.asarray(hidden), cache, big_meta, plan=big_plan)
    want, got = np.asarray(want, np.float32), np.asarray(got, np.float32)
    assert np.isfinite(want[:n]).all()
    bitwise = np.array_equal(got[:n], want[:n])
    np.testing.assert_allclose(got[:n], want[:n], rtol=1e-5, atol=1e-6, err_msg=f"bitwise equal: {bitwise}")
    np.testing.assert_array_equal(got[n:], 0.0)
    for f in dataclasses.fields(cache):
        a, b = getattr(got_cache, f.name), getattr(want_cache, f.name)
        if a is not None:
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=f.name)
