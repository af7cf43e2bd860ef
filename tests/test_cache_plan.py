"""Paged caches (layout, write/read) and plan_batch (routing, buckets, validation)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sparse_mla import (BucketPolicy, MLAConfig, Request, init_cache, plan_batch, read_indexer_keys,
                            read_latent)
from jax_sparse_mla import cache as cache_lib

TINY = MLAConfig.tiny()


def bytes_per_token(cache):
    return sum(a.dtype.itemsize * int(np.prod(a.shape[2:])) for a in jax.tree.leaves(cache))


def test_real_dimension_cache_layouts():
    real = MLAConfig.deepseek_v32(kv_cache_dtype="fp8")
    c = jax.eval_shape(lambda: init_cache(real, 2))
    latent_bytes = sum(getattr(c, f).dtype.itemsize * int(np.prod(getattr(c, f).shape[2:]))
                       for f in ("latent", "latent_scale", "k_pe"))
    index_bytes = sum(getattr(c, f).dtype.itemsize * int(np.prod(getattr(c, f).shape[2:]))
                      for f in ("index_k", "index_k_scale"))
    assert latent_bytes == 656 and index_bytes == 132  # FlashMLA's and DeepSeek's layouts
    bf16 = jax.eval_shape(lambda: init_cache(MLAConfig.deepseek_v32(indexer_dtype="bfloat16"), 2))
    assert bf16.latent_scale is None and bf16.index_k_scale is None and bytes_per_token(bf16) == 576 * 2 + 128 * 2


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "float32", "fp8"])
@pytest.mark.parametrize("indexer_dtype", ["fp8", "bfloat16", "float32"])
def test_write_then_read_back(kv_cache_dtype, indexer_dtype):
    cfg = dataclasses.replace(TINY, kv_cache_dtype=kv_cache_dtype, indexer_dtype=indexer_dtype)
    rng = np.random.default_rng(0)
    cache = init_cache(cfg, 6)
    table = [4, 1, 3]  # 12 slots, out of order
    n = 10
    c = jnp.asarray(rng.standard_normal((n, cfg.kv_lora_rank)), jnp.float32)
    k_pe = jnp.asarray(rng.standard_normal((n, cfg.qk_rope_head_dim)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((n, cfg.index_head_dim)), jnp.float32)
    pos = np.arange(n)
    slots = np.asarray(table)[pos // cfg.page_size] * cfg.page_size + pos % cfg.page_size
    cache = cache_lib.write(cache, jnp.asarray(slots),
                            {**cache_lib.encode_latent(c, k_pe, cfg), **cache_lib.encode_index_keys(k, cfg)})
    c_back, pe_back = read_latent(cache, table, n, cfg)
    k_back = read_indexer_keys(cache, table, n, cfg)
    tol = {"float32": 1e-7, "bfloat16": 1e-2, "fp8": 0.06}
    for got, want, dt in [(c_back, c, kv_cache_dtype), (pe_back, k_pe, "float32" if kv_cache_dtype == "float32" else "bfloat16"),
                          (k_back, k, indexer_dtype)]:
        err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
        assert err < tol[dt], (dt, err)
    assert not np.any(np.asarray(cache.latent[0]).astype(np.float32))  # page 0 untouched


def test_plan_routes_each_prefill_by_its_length():
    k = TINY.index_topk
    dense, _ = plan_batch(TINY, [Request(0, k, list(range(4))), Request(3, 4, [4, 5])])
    assert dense.use_dense_mha and not dense.has_indexer_scoring and dense.num_sparse_tokens == 0
    both, meta = plan_batch(TINY, [Request(0, k + 1, list(range(5))), Request(0, 3, [5])])
    assert both.use_dense_mha and both.num_sparse_tokens == 32 and both.num_scored_tokens == 32
    assert list(np.asarray(meta.sparse_rows[:k + 2])) == list(range(k + 1)) + [-1]
    # the dense sequence (request 1) owns rows k+1 .. k+3 and its 3 keys on page 5
    assert list(np.asarray(meta.dense_query_start[:3])) == [0, 0, 3]
    assert list(np.asarray(meta.dense_rows[:4])) == [k + 1, k + 2, k + 3, -1]
    assert list(np.asarray(meta.dense_key_start[:3])) == [0, 0, 3] and both.num_dense_keys == 16
    assert list(np.asarray(meta.dense_key_slots[:4])) == [5 * TINY.page_size + i for i in range(3)] + [-1]
    long_only, _ = plan_batch(TINY, [Request(0, k + 1, list(range(5)))])
    assert not long_only.use_dense_mha and long_only.num_scored_tokens == long_only.num_tokens
    chunk, _ = plan_batch(TINY, [Request(k - 2, 3, list(range(5)))])  # context counts toward the length
    assert not chunk.use_dense_mha
    decode_only, _ = plan_batch(TINY, [Request(5, 1, [0, 1])])
    assert not decode_only.use_dense_mha and decode_only.has_indexer_scoring
    mixed, meta = plan_batch(TINY, [Request(0, 4, [0]), Request(30, 1, list(range(1, 9)))])
    assert mixed.use_dense_mha and mixed.num_scored_tokens == mixed.num_sparse_tokens == 1
    assert list(np.asarray(meta.sparse_rows)) == [4] and list(np.asarray(meta.dense_query_start[:3])) == [0, 4, 4]
    forced, _ = plan_batch(TINY, [Request(0, 4, [0])], force_sparse=True)
    assert not forced.use_dense_mha
    baseline, _ = plan_batch(TINY, [Request(0, 4, [0])], skip_indexer=False)
    assert baseline.use_dense_mha and baseline.num_scored_tokens == baseline.num_tokens


def test_cond_dispatch_plan_depends_on_buckets_only():
    k = TINY.index_topk
    a, meta_a = plan_batch(TINY, [Request(0, 5, [0, 1])], dispatch="cond")
    b, meta_b = plan_batch(TINY, [Request(0, k + 1, list(range(5)))], dispatch="cond", buckets=BucketPolicy(min_pages_per_seq=8))
    assert a.route == b.route == "cond" and a.num_scored_tokens is None and a.has_indexer_scoring
    assert (a.num_sparse_tokens, a.num_dense_keys) == (16, 4 * k) and meta_a.dense_flag == 1 and meta_b.dense_flag == 0
    with pytest.raises(ValueError, match="dispatch must be one of"):
        plan_batch(TINY, [Request(0, 5, [0, 1])], dispatch="dynamic")


def test_fp8_plan_splits_prefill_rows_from_decode_rows(monkeypatch):
    """An fp8 latent cache: when dequantising upfront pays (threshold lowered so the tiny config's
    prefill passes it), the sparsely attending prefill rows and their sequences' pages (only the
    pages the sequence fills, not its whole table) are listed apart from the decode rows; not
    with a bf16 cache, under cond dispatch, or when it does not pay."""
    from pallas_kernels import sparse_attention

    monkeypatch.setattr(sparse_attention, "UPFRONT_MIN_USES", 4)
    fp8 = dataclasses.replace(TINY, kv_cache_dtype="fp8")
    k = TINY.index_topk
    requests = [Request(20, 1, [9, 8, 7, 6, 5, 4]),               # decode (row 0)
                Request(0, 3, [3]),                               # short prefill: dense (rows 1-3)
                Request(0, k + 1, [10, 11, 12, 13, 14, 15, 16])]  # long prefill (rows 4 .. k + 4) on 5 pages
    plan, meta = plan_batch(fp8, requests)
    assert plan.use_dense_mha and (plan.num_upfront_rows, plan.num_kernel_rows, plan.num_upfront_pages) == (32, 1, 8)
    np.testing.assert_array_equal(meta.upfront_rows, list(range(4, k + 5)) + [-1] * (32 - k - 1))
    np.testing.assert_array_equal(meta.kernel_rows, [0])
    np.testing.assert_array_equal(meta.upfront_pages, [10, 11, 12, 13, 14, -1, -1, -1])
    assert sorted(set(np.asarray(meta.sparse_rows)) - {-1}) == [0] + list(range(4, k + 5))
    for config, kw in [(TINY, {}), (fp8, dict(dispatch="cond"))]:
        other, other_meta = plan_batch(config, requests, **kw)
        assert (other.num_upfront_rows, other.num_kernel_rows, other.num_upfront_pages) == (0, 0, 0)
        assert other_meta.upfront_rows.shape == other_meta.kernel_rows.shape == (0,)
    monkeypatch.setattr(sparse_attention, "UPFRONT_MIN_USES", 10 ** 9)
    assert plan_batch(fp8, requests)[0].num_upfront_rows == 0


def test_plan_meta_slots_positions_and_padding():
    plan, meta = plan_batch(TINY, [Request(2, 3, [7, 2]), Request(0, 2, [5])])
    np.testing.assert_array_equal(meta.positions[:6], [2, 3, 4, 0, 1, -1])
    np.testing.assert_array_equal(meta.slot_mapping[:6], [30, 31, 8, 20, 21, -1])
    np.testing.assert_array_equal(meta.row_seq[:5], [0, 0, 0, 1, 1])
    np.testing.assert_array_equal(meta.query_start_loc, [0, 3, 5, 5, 5])
    np.testing.assert_array_equal(meta.seq_lens, [5, 2, 0, 0])
    np.testing.assert_array_equal(meta.block_tables[:2, :2], [[7, 2], [5, -1]])
    assert plan.num_tokens == 16 and np.all(np.asarray(meta.slot_mapping[5:]) == -1)
    assert all(a.dtype == jnp.int32 for a in jax.tree.leaves(meta))


def test_bucket_policy_pads_to_powers_of_two():
    policy = BucketPolicy(min_tokens=8, min_seqs=2, min_pages_per_seq=1, min_dense_keys=8)
    plan, _ = plan_batch(TINY, [Request(0, 33, list(range(9)))], buckets=policy, force_sparse=True)
    assert (plan.num_tokens, plan.num_seqs, plan.pages_per_seq) == (64, 2, 16)
    dense, _ = plan_batch(TINY, [Request(2, 3, [0, 1]), Request(0, 4, [2])], buckets=policy)
    assert dense.num_dense_keys == 16  # 5 + 4 keys
    assert [BucketPolicy.round_up(n, 1) for n in (1, 2, 3, 4, 5, 1000)] == [1, 2, 4, 4, 8, 1024]


@pytest.mark.parametrize("requests,num_pages,message", [
    ([], None, "empty batch"),
    ([Request(0, 0, [0])], None, "request 0: query_len must be >= 1, got 0"),
    ([Request(0, 2, [0]), Request(-1, 2, [1])], None, "request 1: context_len must be >= 0"),
    ([Request(3, 3, [0])], None, "request 0: block_table has 1 pages, but context_len \\+ query_len = 6 tokens need 2"),
    ([Request(0, 3, [8])], 8, "request 0: page id 8 is outside \\[0, 8\\)"),
    ([Request(0, 3, [-2])], None, "request 0: page id -2"),
    ([Request(0, 3, [1]), Request(0, 2, [1])], None, "request 1: page 1 is written by this step more than once"),
    ([Request(0, 8, [3, 3])], None, "request 0: page 3 is written"),
])
def test_plan_rejects_bad_requests(requests, num_pages, message):
    with pytest.raises(ValueError, match=message):
        plan_batch(TINY, requests, num_pages=num_pages)


def test_shared_read_only_prefix_pages_are_allowed():
    """Two requests may read one cached prefix page (prefix caching) as long as neither writes it."""
    plan, _ = plan_batch(TINY, [Request(4, 2, [0, 1]), Request(4, 3, [0, 2])], num_pages=4)
    assert plan.num_seqs == 4


def test_forward_refuses_a_cache_of_another_size_than_the_plan_was_validated_for():
    from jax_sparse_mla import init_params
    from jax_sparse_mla.model import forward
    plan, meta = plan_batch(TINY, [Request(0, 5, [0, 1])], num_pages=8)
    x = jnp.ones((plan.num_tokens, TINY.hidden_size))
    with pytest.raises(ValueError, match="validated for 8 pages, the cache has 16"):
        forward(init_params(TINY, jax.random.key(0)), x, init_cache(TINY, 16), meta, plan=plan, config=TINY)


def test_sparse_plans_ignore_skip_indexer():
    """skip_indexer only matters where a dense program exists: no duplicate sparse programs."""
    long_ = [Request(0, 20, list(range(5)))]
    assert plan_batch(TINY, long_, skip_indexer=False)[0] == plan_batch(TINY, long_)[0]
