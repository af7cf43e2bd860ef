"""Paged caches (layout, write/read) and plan_batch (routing, buckets, validation)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sparse_mla import (BatchMeta, BucketPolicy, MLAConfig, Request, init_cache, plan_batch, read_indexer_keys,
                            read_latent)
from jax_sparse_mla import cache as cache_lib
from jax_sparse_mla import plan as plan_lib
from jax_sparse_mla import policy

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


@pytest.mark.parametrize("read", [read_latent, read_indexer_keys])
@pytest.mark.parametrize("table,length,message", [
    ([4, 1], 10, r"length = 10 rows need 3 pages of 4, but block_table lists 2"),  # (gave 8 rows)
    ([], 1, r"length = 1 rows need 1 pages of 4, but block_table lists 0"),
    ([4, 6, 3], 10, r"block_table\[1\] = 6 is not a page of the cache: page ids are in \[0, 6\)"),  # (clamped)
    ([4, 1, 99], 5, r"block_table\[2\] = 99 is not a page of the cache"),  # an entry past the rows, too
    ([4, -1, 3], 10, r"block_table\[1\] = -1 is not a page of the cache"),  # (read page 0's rows... as zeros)
    ([-1], 0, r"block_table\[0\] = -1 is not a page of the cache"),
    ([4, 1, 3], -1, "length must be >= 0, got -1"),
    ([4, 1, 3], 2.0, "length must be an integer, got 2.0"),
    ([4, 1.0, 3], 10, r"block_table\[1\] must be an integer page id, got 1.0"),
    (np.array([[4, 1, 3]]), 10, r"block_table must be 1-D"),
    (jnp.array([4, 1, 3]), 10, "block_table must be a list, tuple or 1-D numpy integer array"),
    (None, 10, "block_table must be a list, tuple or 1-D numpy integer array .* got NoneType"),
])
def test_reads_refuse_tables_that_do_not_hold_the_rows(read, table, length, message):
    """read_latent / read_indexer_keys return exactly `length` rows from pages of the cache, or
    refuse, naming the argument: never fewer rows, a clamped page or a -1 page's zeros."""
    cache = init_cache(TINY, 6)
    with pytest.raises(ValueError, match=message):
        read(cache, table, length, TINY)


def test_reads_return_the_rows_asked_for_and_check_the_cache():
    cache = init_cache(TINY, 6)
    for table, length in [([4, 1, 3], 10), (np.array([5, 0], np.int64), 8), ((2,), 0), ([4, 1, 3], np.int32(9))]:
        c, k_pe = read_latent(cache, table, length, TINY)
        assert c.shape == (length, TINY.kv_lora_rank) and k_pe.shape == (length, TINY.qk_rope_head_dim)
        assert read_indexer_keys(cache, table, length, TINY).shape == (length, TINY.index_head_dim)
    for bad, message in [({"latent": cache.latent}, "cache must be a PagedCache .*got dict"),
                         (None, "cache must be a PagedCache .*got NoneType"),
                         (init_cache(dataclasses.replace(TINY, kv_cache_dtype="fp8"), 6), "cache.latent")]:
        with pytest.raises(ValueError, match=message):
            read_latent(bad, [4, 1, 3], 10, TINY)
    with pytest.raises(ValueError, match="config must be an MLAConfig, got dict"):
        read_indexer_keys(cache, [4, 1, 3], 10, {})


def test_plan_routes_each_prefill_by_its_length():
    k = TINY.index_topk
    dense, _ = plan_batch(TINY, [Request(0, k, list(range(4))), Request(3, 4, [4, 5])])
    assert dense.use_dense_mha and not dense.has_indexer_scoring and dense.num_sparse_tokens == 0
    both, meta = plan_batch(TINY, [Request(0, k + 1, list(range(5))), Request(0, 3, [5])], prefill_route="sparse")
    assert both.use_dense_mha and both.num_sparse_tokens == 32 and both.num_scored_tokens == 32
    assert list(np.asarray(meta.sparse_rows[:k + 2])) == list(range(k + 1)) + [-1]
    # the dense sequence (request 1) owns rows k+1 .. k+3 and its 3 keys on page 5
    assert list(np.asarray(meta.dense_query_start[:3])) == [0, 0, 3]
    assert list(np.asarray(meta.dense_rows[:4])) == [k + 1, k + 2, k + 3, -1]
    assert list(np.asarray(meta.dense_key_start[:3])) == [0, 0, 3] and both.num_dense_keys == 16
    assert list(np.asarray(meta.dense_key_slots[:4])) == [5 * TINY.page_size + i for i in range(3)] + [-1]
    long_only, _ = plan_batch(TINY, [Request(0, k + 1, list(range(5)))], prefill_route="sparse")
    assert not long_only.use_dense_mha and long_only.num_scored_tokens == long_only.num_tokens
    chunk, _ = plan_batch(TINY, [Request(k - 2, 3, list(range(5)))], prefill_route="sparse")  # context counts
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


def test_plan_routes_long_prefills_masked_with_their_keys_in_the_dense_call():
    """prefill_route="masked": a long prefill is scored (in meta.sparse_rows, flagged) and its
    keys join the dense MHA call; a decode beside it attends sparsely ("some"); alone, "all"."""
    k, page = TINY.index_topk, TINY.page_size
    plan, meta = plan_batch(TINY, [Request(0, 3, [0]), Request(4, k, list(range(1, 6))), Request(30, 1, list(range(6, 14)))],
                            prefill_route="masked")
    assert plan.use_dense_mha and plan.masked == "some" and plan.num_sparse_tokens == plan.num_scored_tokens == 32
    assert [g.name for g in plan.groups] == ["sparse"]
    rows = list(range(3, 3 + k)) + [3 + k]  # the masked request's rows, then the decode's
    assert list(np.asarray(meta.sparse_rows[:k + 2])) == rows + [-1]
    assert list(np.asarray(meta.masked_flags[:k + 2])) == [1] * k + [0, 0]
    assert list(np.asarray(meta.dense_rows[:k + 4])) == list(range(k + 3)) + [-1]
    assert list(np.asarray(meta.dense_query_start)) == [0, 3, 3 + k, 3 + k, 3 + k]
    assert list(np.asarray(meta.dense_key_start)) == [0, 3, 3 + 4 + k, 7 + k, 7 + k] and plan.num_dense_keys == 32
    assert list(np.asarray(meta.dense_key_slots[3:7 + k])) == [page + i for i in range(4 + k)]
    alone, meta = plan_batch(TINY, [Request(0, k + 1, list(range(5)))], prefill_route="masked")
    assert alone.masked == "all" and alone.num_sparse_tokens == 32 and list(np.asarray(meta.masked_flags[k:k + 2])) == [1, 0]
    sparse, meta = plan_batch(TINY, [Request(0, k + 1, list(range(5)))], prefill_route="sparse")
    assert sparse.masked == "none" and not sparse.use_dense_mha
    cond, cond_meta = plan_batch(TINY, [Request(0, k + 1, list(range(5)))], prefill_route="masked", dispatch="cond")
    assert cond.masked == "some" and cond.dense_calls[cond_meta.branches[1]] == (32, True)  # the masked dense call
    short, _ = plan_batch(TINY, [Request(0, k, list(range(4)))], prefill_route="masked")
    assert short.masked == "none" and not short.has_indexer_scoring  # <= index_topk: dense, not scored
    forced, _ = plan_batch(TINY, [Request(0, k + 1, list(range(5)))], prefill_route="masked", force_sparse=True)
    assert forced.masked == "none" and not forced.use_dense_mha
    assert [p.program for p in (plan, alone, sparse, cond, short, forced)] == [
        "masked", "masked", "sparse", "cond", "dense", "sparse"]
    for bad in (dict(masked="yes"), dict(masked="all", use_dense_mha=False)):
        with pytest.raises(ValueError, match="BatchPlan.masked must be one of"):
            dataclasses.replace(alone, **bad)


@pytest.mark.parametrize("context_len,query_len", [(0, 2048 + 1), (0, 4096), (0, 8192), (0, 16384), (4096, 4096),
                                                   (28672, 4096), (2040, 9)])
def test_auto_route_follows_the_cost_model(context_len, query_len):
    """prefill_route="auto": a long prefill takes the cheaper route by policy.route_costs, and
    the route flips exactly where the costs cross (the first fresh length where sparse wins)."""
    cfg = MLAConfig.deepseek_v32()
    costs = policy.route_costs(context_len, query_len, cfg.index_topk)
    want = "masked" if costs["masked"] < costs["sparse"] else "sparse"
    assert plan_lib.request_routes(cfg, [Request(context_len, query_len, [0])], False) == [want]
    cross = next(n for n in range(cfg.index_topk + 1, 1 << 16)
                 if policy.prefill_route(0, n, cfg.index_topk) == "sparse")
    assert policy.prefill_route(0, cross - 1, cfg.index_topk) == "masked"
    c = policy.route_costs(0, cross, cfg.index_topk)
    assert c["masked"] >= c["sparse"] and 8192 < cross < 65536


def test_cond_dispatch_plan_depends_on_buckets_and_stages_only():
    """A cond plan's sizes are its bucket's; its stages are those the batch needs (a dense call,
    scoring and sparse attention, both); below LADDER_MIN_TOKENS rows a row stage has one size."""
    k = TINY.index_topk
    a, meta_a = plan_batch(TINY, [Request(0, 5, [0, 1])], dispatch="cond")
    assert a.route == "cond" and a.num_scored_tokens == 0 and not a.has_indexer_scoring  # dense only
    assert (a.num_sparse_tokens, a.num_dense_keys, a.masked) == (0, 64, "none") and a.key_sizes == (0, 16, 32, 64)
    assert a.attend_sizes == a.score_sizes == () and a.dense_calls == ((0, False), (16, False), (32, False), (64, False))
    np.testing.assert_array_equal(meta_a.branches, [0, 1, 0, 0])  # 5 dense keys: the 16-key call
    b, meta_b = plan_batch(TINY, [Request(0, k + 1, list(range(5)))], dispatch="cond", buckets=BucketPolicy(min_pages_per_seq=8))
    assert b.num_scored_tokens is None and b.has_indexer_scoring and b.masked == "some"
    assert b.attend_sizes == b.score_sizes == (32,) and b.key_sizes == (0, 16, 32, 64, 128)
    np.testing.assert_array_equal(meta_b.branches, [0, 5, 0, 0])  # k + 1 rows scored, then masked over 32 keys
    # masked calls only past index_topk keys: a masked row's request is longer than that
    assert b.dense_calls[5:] == ((32, True), (64, True), (128, True))
    for rows, masked in ((256, ()), (512, ()), (1024, (4096,)), (8192, (4096, 8192, 16384, 32768))):
        both = plan_lib.cond_plan(MLAConfig.deepseek_v32(), rows, 256, 2048, num_pages=65536, skip_indexer=True, dense=True, sparse=True,
                                  prefill_route="auto")
        assert both.masked == ("some" if masked else "none")  # none where no key size passes index_topk (2048)
        assert tuple(k for k, m in both.dense_calls if m) == masked
    c, meta_c = plan_batch(TINY, [Request(0, k + 1, list(range(5)))], dispatch="cond", prefill_route="sparse",
                           buckets=BucketPolicy(min_pages_per_seq=8))
    assert (c.num_dense_keys, c.key_sizes, c.masked, c.num_sparse_tokens) == (0, (), "none", 32)  # sparse only
    np.testing.assert_array_equal(meta_c.branches, [0, 0, 0, 0])
    s, meta_s = plan_batch(TINY, [Request(0, k + 1, list(range(5)))], dispatch="cond", force_sparse=True,
                           buckets=BucketPolicy(min_pages_per_seq=8))
    assert s == c and meta_s.dense_key_slots.shape == (0,)
    with pytest.raises(ValueError, match="dispatch must be one of"):
        plan_batch(TINY, [Request(0, 5, [0, 1])], dispatch="dynamic")


def test_fp8_plan_splits_prefill_rows_from_decode_rows(monkeypatch):
    """An fp8 latent cache: when dequantising upfront pays (threshold lowered so the tiny config's
    prefill passes it), the sparsely attending prefill rows and their sequences' pages (only the
    pages the sequence fills, not its whole table) are listed apart from the decode rows; not
    with a bf16 cache, under cond dispatch, or when it does not pay."""
    from jax_sparse_mla import policy

    monkeypatch.setattr(policy, "UPFRONT_MIN_USES", 4)
    fp8 = dataclasses.replace(TINY, kv_cache_dtype="fp8")
    k = TINY.index_topk
    requests = [Request(20, 1, [9, 8, 7, 6, 5, 4]),               # decode (row 0)
                Request(0, 3, [3]),                               # short prefill: dense (rows 1-3)
                Request(0, k + 1, [10, 11, 12, 13, 14, 15, 16])]  # long prefill (rows 4 .. k + 4) on 5 pages
    plan, meta = plan_batch(fp8, requests, prefill_route="sparse")
    assert plan.use_dense_mha and (plan.num_upfront_rows, plan.num_kernel_rows, plan.num_upfront_pages) == (32, 1, 8)
    assert [(g.name, g.num_rows, g.indexer_kernel, g.dequantize) for g in plan.groups] == [
        ("upfront", 32, "decode", "upfront"), ("kernel", 1, "decode", "kernel")]  # 32 rows < 16 x 4 sequences
    np.testing.assert_array_equal(meta.upfront_rows, list(range(4, k + 5)) + [-1] * (32 - k - 1))
    np.testing.assert_array_equal(meta.kernel_rows, [0])
    np.testing.assert_array_equal(meta.upfront_pages, [10, 11, 12, 13, 14, -1, -1, -1])
    assert sorted(set(np.asarray(meta.sparse_rows)) - {-1}) == [0] + list(range(4, k + 5))
    for config, kw in [(TINY, {}), (fp8, dict(dispatch="cond"))]:
        other, other_meta = plan_batch(config, requests, **kw)
        assert (other.num_upfront_rows, other.num_kernel_rows, other.num_upfront_pages) == (0, 0, 0)
        assert other_meta.upfront_rows.shape == other_meta.kernel_rows.shape == (0,)
    monkeypatch.setattr(policy, "UPFRONT_MIN_USES", 10 ** 9)
    assert plan_batch(fp8, requests, prefill_route="sparse")[0].num_upfront_rows == 0


def test_plan_meta_slots_positions_and_padding():
    plan, meta = plan_batch(TINY, [Request(2, 3, [7, 2]), Request(0, 2, [5])])
    np.testing.assert_array_equal(meta.positions[:6], [2, 3, 4, 0, 1, -1])
    np.testing.assert_array_equal(meta.slot_mapping[:6], [30, 31, 8, 20, 21, -1])
    np.testing.assert_array_equal(meta.row_seq[:5], [0, 0, 0, 1, 1])
    np.testing.assert_array_equal(meta.block_tables[:2, :2], [[7, 2], [5, -1]])
    assert plan.num_tokens == 16 and np.all(np.asarray(meta.slot_mapping[5:]) == -1)
    assert all(a.dtype == jnp.int32 for a in jax.tree.leaves(meta))
    assert {name: getattr(meta, name).shape for name in BatchMeta.shapes(plan)} == BatchMeta.shapes(plan)
    cond, cond_meta = plan_batch(TINY, [Request(2, 3, [7, 2])], dispatch="cond")
    assert BatchMeta.shapes(cond)["branches"] == (4,) and cond_meta.branches.shape == (4,)
    empty = BatchMeta.empty(plan)  # a batch of padding: what a data shard with no work gets
    assert np.all(empty.positions == -1) and np.all(empty.row_seq == 0) and np.all(empty.dense_key_start == 0)
    assert {f.name for f in dataclasses.fields(BatchMeta)} == set(BatchMeta.shapes(cond))


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
    assert plan_batch(TINY, long_, skip_indexer=False, prefill_route="sparse")[0] == plan_batch(
        TINY, long_, prefill_route="sparse")[0]


# --- host-side refusal of bad input (before anything touches a device) ----------------------------

@pytest.mark.parametrize("requests,message", [
    # a table whose new tokens write over one of its own context pages
    ([Request(4, 4, [3, 3])], r"request 0: page 3 is written by this step \(block_table\[1\]\) and is also its "
                              r"context page block_table\[0\]"),
    # request 1 writes a page request 0 reads as context, and the other way round
    ([Request(4, 1, [0, 1]), Request(0, 3, [0])], r"request 1: page 0 is written by this step \(block_table\[0\]\), "
                                                  r"but request 0 reads it as context"),
    ([Request(0, 3, [0]), Request(4, 1, [0, 1])], r"request 1: page 0 is read as context \(block_table\[0\]\), but "
                                                  r"request 0 writes it in this step"),
    # a partly filled page is written too: its free slots get this step's tokens
    ([Request(2, 1, [5]), Request(4, 1, [5, 6])], "request 1: page 5 is read as context .* request 0 writes it"),
    # two context ranges on one page
    ([Request(8, 1, [0, 0, 1])], r"request 0: page 0 holds two ranges of its context \(block_table\[0\] and "
                                 r"block_table\[1\]\)"),
    ([Request(0, 3, [1]), Request(9, 1, [2, 1, 3])], "request 1: page 1 is read as context .* request 0 writes it"),
])
def test_plan_refuses_pages_read_and_written_in_one_step(requests, message):
    with pytest.raises(ValueError, match=message):
        plan_batch(TINY, requests, num_pages=8)


def test_table_entries_past_the_occupied_pages_are_not_aliasing():
    """Only the ceil(total_len / page_size) first entries hold tokens: repeats past them are fine,
    and so are context pages read by several requests."""
    plan, meta = plan_batch(TINY, [Request(0, 3, [0, 0, 0]), Request(4, 1, [1, 2, 0]), Request(4, 2, [1, 3])])
    np.testing.assert_array_equal(meta.block_tables[:3, :2], [[0, -1], [1, 2], [1, 3]])


OTHER_CONFIGS = [("page_size", 8), ("index_topk", 32), ("kv_cache_dtype", "fp8"), ("num_attention_heads", 8),
                 ("max_position_embeddings", 64)]


@pytest.mark.parametrize("field,value", OTHER_CONFIGS)
def test_forward_refuses_a_plan_made_for_another_config(field, value):
    from jax_sparse_mla import init_params
    from jax_sparse_mla.model import forward
    plan, meta = plan_batch(TINY, [Request(0, 5, [0, 1])], num_pages=8)
    assert plan.config.page_size == 4 and plan.config.index_topk == TINY.index_topk
    other = dataclasses.replace(TINY, **{field: value})
    x = jnp.ones((plan.num_tokens, TINY.hidden_size))
    with pytest.raises(ValueError, match=f"the plan was made for a config with {field}={getattr(TINY, field)!r} "
                                         rf"\(the config has {value!r}\)"):
        forward(init_params(other, jax.random.key(0)), x, init_cache(other, 8), meta, plan=plan, config=other)


def test_plans_record_their_config_and_stay_hashable():
    reqs = [Request(0, 5, [0, 1])]
    plan = plan_batch(TINY, reqs)[0]
    assert hash(plan) == hash(plan_batch(TINY, reqs)[0]) and plan == plan_batch(TINY, reqs)[0]
    assert {plan, plan_batch(dataclasses.replace(TINY, page_size=8), reqs)[0]} != {plan}  # another program
    assert plan_batch(dataclasses.replace(TINY, dtype="bfloat16"), reqs)[0] == plan  # not a plan field


def test_sharded_forward_refuses_a_plan_made_for_another_config():
    """sharded_forward checks the plan against the full config (its shards run per-shard configs)."""
    from jax_sparse_mla import init_params
    from jax_sparse_mla.sharding import jit_sharded_forward, make_mesh, plan_data_parallel
    mesh = make_mesh(1, 1)
    plan, meta = plan_data_parallel(TINY, [[Request(0, 5, [0, 1])]], pages_per_shard=8)
    other = dataclasses.replace(TINY, index_topk=32)
    x = jnp.ones((plan.num_tokens, TINY.hidden_size))
    with pytest.raises(ValueError, match=r"made for a config with index_topk=16 \(the config has 32\)"):
        jit_sharded_forward(init_params(other, jax.random.key(0)), x, init_cache(other, 8), meta, mesh=mesh,
                            plan=plan, config=other)
    tp2, meta2 = plan_data_parallel(TINY, [[Request(0, 5, [0, 1])]], pages_per_shard=8, tensor_parallel=2)
    with pytest.raises(ValueError, match="made for a tensor axis of size 2, the mesh's has 1"):
        jit_sharded_forward(init_params(TINY, jax.random.key(0)), x, init_cache(TINY, 8), meta2, mesh=mesh,
                            plan=tp2, config=TINY)
    with pytest.raises(ValueError, match="tensor_parallel=3 does not divide num_attention_heads=4"):
        plan_data_parallel(TINY, [[Request(0, 5, [0, 1])]], pages_per_shard=8, tensor_parallel=3)
    with pytest.raises(ValueError, match="pages_per_shard must be a positive int, got 2.5"):
        plan_data_parallel(TINY, [[Request(0, 5, [0, 1])]], pages_per_shard=2.5)
    with pytest.raises(ValueError, match="data shard 0: expected a sequence of Requests, got Request"):
        plan_data_parallel(TINY, [Request(0, 5, [0, 1])], pages_per_shard=8)


@pytest.mark.parametrize("request_,message", [
    (Request(0, 3, [1.5]), r"request 0: block_table\[0\] must be an integer page id, got 1.5"),
    (Request(0, 3, [np.float32(2)]), r"request 0: block_table\[0\] must be an integer page id"),
    (Request(0, 3, [True]), r"request 0: block_table\[0\] must be an integer page id, got True"),
    (Request(0, 3, [None]), r"request 0: block_table\[0\] must be an integer page id, got None"),
    (Request(0, 5, [0, "1"]), r"request 0: block_table\[1\] must be an integer page id, got '1'"),
    # slot number 2**30 + 3 pages * 4 overflows int32 (it wrapped onto page 3's slots)
    (Request(0, 3, [2 ** 30 + 3]), r"request 0: page id 1073741827 is outside \[0, 536870912\), the pages of 4 "
                                   r"tokens whose slot numbers fit int32 \(block_table\[0\]\)"),
    (Request(0, 3, [0, 2 ** 40]), r"request 0: block_table\[1\] = 1099511627776 is outside int32"),
    (Request(0, 3, "0"), "request 0: block_table must be a list, tuple or 1-D numpy integer array .* got str"),
    (Request(0, 3, None), "request 0: block_table must be a list, tuple .* got NoneType"),
    (Request(0, 3, 7), "request 0: block_table must be a list, tuple .* got int"),
    (Request(0, 3, np.zeros((1, 1), np.int32)),
     r"request 0: block_table must be 1-D, got a numpy array of shape \(1, 1\)"),
    (Request(0, 3, np.zeros(1, np.float32)),
     "request 0: block_table must hold integer page ids, got a numpy array of dtype float32"),
    (Request(0, 3, jnp.zeros(1, jnp.int32)),
     r"request 0: block_table must be a list, tuple .*on the host\), got ArrayImpl; convert it with np.asarray\(\.\.\.\)"),
    # jax / numpy 0-d arrays are not integers: the message says how to convert them
    (Request(0, 3, [jnp.int32(1)]), r"request 0: block_table\[0\] must be an integer page id, got .*; convert it with int"),
    (Request(jnp.int32(0), 3, [0]),
     r"request 0: context_len must be an integer, got Array\(0, dtype=int32\) \(ArrayImpl\); convert it with int\(\.\.\.\)"),
    (Request(0, np.array(3), [0]), r"request 0: query_len must be an integer, got array\(3\) .*; convert it with int"),
    (Request(0, 3, [[0]]), r"request 0: block_table\[0\] must be an integer page id, got \[0\]"),
    (Request(0.5, 3, [0]), "request 0: context_len must be an integer, got 0.5"),
    (Request(0, 3.0, [0]), "request 0: query_len must be an integer, got 3.0"),
    (Request(0, np.float64(3), [0]), "request 0: query_len must be an integer"),
    (Request(False, 3, [0]), "request 0: context_len must be an integer, got False"),
    (Request(None, 3, [0]), "request 0: context_len must be an integer, got None"),
    (Request(0, "3", [0]), "request 0: query_len must be an integer, got '3'"),
    (Request(2 ** 31, 1, [0]), r"request 0: context_len must be >= 0 and < 2\*\*31"),
    (Request(TINY.max_position_embeddings, 1, list(range(40961))),
     "request 0: context_len \\+ query_len = 163841 tokens exceeds max_position_embeddings = 163840"),
])
def test_plan_refuses_ids_and_lengths_that_are_not_int32_integers(request_, message):
    with pytest.raises(ValueError, match=message):
        plan_batch(TINY, [Request(0, 2, [9]), request_][1:])  # request 0
    with pytest.raises(ValueError, match=message.replace("request 0", "request 1")):
        plan_batch(TINY, [Request(0, 2, [9]), request_])


def test_traced_lengths_are_refused_with_the_fix():
    """plan_batch runs on the host: a traced length gets a message saying so, not int()'s."""
    with pytest.raises(ValueError, match="request 0: query_len must be an integer, .*it is traced: call this on the "
                                         "host, outside jit"):
        jax.jit(lambda n: plan_batch(TINY, [Request(0, n, [0])]))(3)


def test_a_donated_cache_is_refused_with_the_fix():
    """jit_forward donates its input cache: a second call with it, through jit_forward (its check
    before the dispatch, which would raise jax's bare "Array has been deleted") or forward, names
    the cache to pass instead."""
    from jax_sparse_mla import forward, init_params, jit_forward

    params = init_params(TINY, jax.random.key(0))
    plan, meta = plan_batch(TINY, [Request(0, 5, [0, 1])], num_pages=8)
    hidden = jnp.ones((plan.num_tokens, TINY.hidden_size))
    cache = init_cache(TINY, 8)
    _, new_cache = jit_forward(params, hidden, cache, meta, plan=plan, config=TINY)
    assert cache.latent.is_deleted()
    for step in (jit_forward, forward):
        with pytest.raises(ValueError, match=r"cache.latent has been deleted: donated to an earlier call, .* pass "
                                             r"the cache that call returned \(out, cache = jit_forward"):
            step(params, hidden, cache, meta, plan=plan, config=TINY)
    _, newer = jit_forward(params, hidden, new_cache, meta, plan=plan, config=TINY)  # the returned one
    assert new_cache.latent.is_deleted() and not newer.latent.is_deleted()


def test_a_donated_cache_is_refused_by_the_sharded_step_too():
    from jax_sparse_mla import init_params
    from jax_sparse_mla.sharding import jit_sharded_forward, make_mesh, plan_data_parallel

    mesh = make_mesh(1, 1)
    plan, meta = plan_data_parallel(TINY, [[Request(0, 5, [0, 1])]], pages_per_shard=8)
    params, x, cache = init_params(TINY, jax.random.key(0)), jnp.ones((plan.num_tokens, TINY.hidden_size)), init_cache(TINY, 8)
    _, new_cache = jit_sharded_forward(params, x, cache, meta, mesh=mesh, plan=plan, config=TINY)
    assert cache.latent.is_deleted() and not new_cache.latent.is_deleted()
    with pytest.raises(ValueError, match=r"cache.latent has been deleted: donated to an earlier call"):
        jit_sharded_forward(params, x, cache, meta, mesh=mesh, plan=plan, config=TINY)


def test_max_position_embeddings_bounds_a_request():
    short = dataclasses.replace(TINY, max_position_embeddings=8)
    plan_batch(short, [Request(4, 4, [0, 1])])
    with pytest.raises(ValueError, match="request 0: context_len \\+ query_len = 9 tokens exceeds "
                                         "max_position_embeddings = 8"):
        plan_batch(short, [Request(8, 1, [0, 1, 2])])


def test_numpy_integers_plan_like_python_ints():
    plan, meta = plan_batch(TINY, [Request(2, 3, [7, 2]), Request(0, 2, (5,))], num_pages=8)
    np_plan, np_meta = plan_batch(TINY, [Request(np.int64(2), np.int32(3), np.array([7, 2], np.int64)),
                                         Request(np.uint8(0), np.int16(2), [np.int32(5)])], num_pages=np.int64(8))
    assert np_plan == plan and hash(np_plan) == hash(plan) and type(np_plan.num_pages) is int
    for a, b in zip(jax.tree.leaves(meta), jax.tree.leaves(np_meta)):
        np.testing.assert_array_equal(a, b)
    assert plan_batch(TINY, [Request(0, 5, [0, 1])], buckets=BucketPolicy(min_tokens=np.int64(8)))[0].num_tokens == 8


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_pages=0), "num_pages must be a positive int or None, got 0"),
    (dict(num_pages=2.5), "num_pages must be a positive int or None, got 2.5"),
    (dict(num_pages="64"), "num_pages must be a positive int or None, got '64'"),
    (dict(num_pages=True), "num_pages must be a positive int or None, got True"),
    (dict(num_pages=2 ** 29 + 1), r"num_pages = 536870913 pages of 4 tokens: slot numbers would overflow int32"),
    (dict(force_sparse=1), "force_sparse must be a bool, got 1"),
    (dict(skip_indexer=None), "skip_indexer must be a bool, got None"),
    (dict(buckets=None), "buckets must be a BucketPolicy, got NoneType"),
    (dict(buckets=dict(min_tokens=8)), "buckets must be a BucketPolicy, got dict"),
    (dict(dispatch=None), "dispatch must be one of"),
    (dict(dispatch=["static"]), "dispatch must be one of"),
    (dict(prefill_route="dense"), r"prefill_route must be one of \('auto', 'masked', 'sparse'\), got 'dense'"),
    (dict(prefill_route=None), "prefill_route must be one of"),
])
def test_plan_batch_refuses_bad_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_batch(TINY, [Request(0, 5, [0, 1])], **kwargs)


def test_plan_batch_refuses_what_is_not_a_list_of_requests():
    for requests, message in [(None, "requests must be a sequence of Requests, got NoneType"),
                              (Request(0, 5, [0, 1]), "requests must be a sequence of Requests, got Request"),
                              ([(0, 5, [0, 1])], "request 0: expected a Request, got tuple")]:
        with pytest.raises(ValueError, match=message):
            plan_batch(TINY, requests)
    with pytest.raises(ValueError, match="config must be an MLAConfig, got dict"):
        plan_batch({}, [Request(0, 5, [0, 1])])
    assert plan_batch(TINY, (r for r in [Request(0, 5, [0, 1])]))[0] == plan_batch(TINY, [Request(0, 5, [0, 1])])[0]


@pytest.mark.parametrize("field,value", [("min_tokens", 0), ("min_seqs", -4), ("min_pages_per_seq", 2.0),
                                         ("min_dense_keys", True), ("min_tokens", "16"), ("min_seqs", 2 ** 31),
                                         ("min_tokens", None)])
def test_bucket_policy_fields_must_be_positive_ints(field, value):
    with pytest.raises(ValueError, match=f"invalid BucketPolicy: {field} must be a positive int"):
        BucketPolicy(**{field: value})


def _pages_allowed(reqs, num_pages, page_size):
    """The page rule, written out independently of plan.py: a request's pages (the first
    ceil(total / page_size) table entries) lie in [0, num_pages) and are distinct; the pages it
    writes this step (from the one holding position context_len on) belong to no other request."""
    occupied, written = [], []
    for r in reqs:
        table = list(r.block_table)[: -(-(r.context_len + r.query_len) // page_size)]
        if any(not 0 <= p < num_pages for p in table) or len(set(table)) != len(table):
            return False
        occupied.append(set(table))
        written.append(set(table[r.context_len // page_size:]))
    return not any(i != j and written[i] & occupied[j] for i in range(len(reqs)) for j in range(len(reqs)))


def test_page_checks_agree_with_the_rule_on_random_batches():
    """plan_batch accepts exactly the random batches the rule allows, and reports the first
    problem in request order."""
    rng = np.random.default_rng(0)
    accepted = 0
    for _ in range(400):
        reqs = []
        for _ in range(rng.integers(1, 4)):
            ctx, q = int(rng.integers(0, 9)), int(rng.integers(1, 6))
            reqs.append(Request(ctx, q, [int(p) for p in rng.integers(-1, 7, size=-(-(ctx + q) // 4))]))
        try:
            plan_batch(TINY, reqs, num_pages=6)
            ok = True
        except ValueError:
            ok = False
        assert ok == _pages_allowed(reqs, 6, TINY.page_size), reqs
        accepted += ok
    assert 20 < accepted < 380
    with pytest.raises(ValueError, match="request 0: page id 9"):
        plan_batch(TINY, [Request(0, 3, [9]), Request(0, 3, [1.5])], num_pages=8)
    with pytest.raises(ValueError, match="request 1: page 0 is written"):
        plan_batch(TINY, [Request(0, 3, [0]), Request(0, 3, [0]), Request(0, 3, [1.5])], num_pages=8)


def test_cond_scoring_kernel_shape_follows_the_steps_rows_per_sequence():
    """A cond plan's sequence count is the engine's limit (256), so the Mosaic indexer kernel's
    shape is picked at run time with the scoring size (plan.score_calls, meta.branches[0]) from
    the step's real rows and sequences, as a static plan's is from its own: a 2048-row chunk of
    one sequence is prefill-shaped, 64 decodes decode-shaped (host planning only)."""
    config = MLAConfig.deepseek_v32()
    buckets = BucketPolicy.for_limits(config, max_num_seqs=256, max_model_len=131072, num_pages=65536)
    chunk = [Request(6144, 2048, list(range(128)))]
    decodes = [Request(4096, 1, list(range(65 * i, 65 * (i + 1)))) for i in range(64)] + [
        Request(0, 1024, list(range(4160, 4176))), Request(0, 1024, list(range(4176, 4192)))]
    for requests, want in [(chunk, (2048, "prefill")), (decodes, (256, "decode"))]:
        static, _ = plan_batch(config, requests, num_pages=65536)
        cond, meta = plan_batch(config, requests, num_pages=65536, dispatch="cond", buckets=buckets)
        assert cond.num_seqs == 256 and cond.score_calls[int(meta.branches[0])] == want
        assert cond.group("sparse", *want).indexer_kernel == want[1]
        assert {g.indexer_kernel for g in static.groups if g.name in ("all", "sparse")} == {want[1]}
