"""plan_arrays (planning from host arrays) against plan_batch and the per-request reference:
the same plans, metadata and refusals on random batches. Pure numpy: no compiles."""

import dataclasses

import jax
import numpy as np
import pytest

from jax_sparse_mla import BucketPolicy, MLAConfig, Request, plan_arrays, plan_batch
from jax_sparse_mla import plan as plan_lib
from jax_sparse_mla import policy
from tests.support.plan_reference import first_problem, plan_reference, route

TINY = MLAConfig.tiny()  # page_size 4, index_topk 16
PS, K = TINY.page_size, TINY.index_topk


def arrays_of(requests, width=None, dtype=np.int32):
    """(context_lens, query_lens, block_tables) of Requests, tables -1 padded to `width` columns."""
    width = max(len(r.block_table) for r in requests) if width is None else width
    tables = np.full((len(requests), width), -1, dtype)
    for i, r in enumerate(requests):
        tables[i, :len(r.block_table)] = r.block_table
    return (np.array([r.context_len for r in requests], np.int32), np.array([r.query_len for r in requests], np.int32),
            tables)


def host_plan(config, requests, **options):
    """plan_batch's plan with its host metadata (check_batch + plan_host, its path without the transfer)."""
    opts = dict(num_pages=None, force_sparse=False, skip_indexer=True, buckets=BucketPolicy(), dispatch="static",
                tensor_parallel=1, prefill_route="auto") | options
    batch, num_pages = plan_lib.check_batch(config, requests, opts.pop("num_pages"), opts["force_sparse"],
                                            opts["skip_indexer"], opts["buckets"], opts["dispatch"],
                                            opts["tensor_parallel"], opts["prefill_route"])
    return plan_lib.plan_host(config, batch, num_pages=num_pages, **opts)


def assert_same(got, want, what=""):
    (plan, meta), (want_plan, want_meta) = got, want
    assert plan == want_plan, (what, plan, want_plan)
    for f in dataclasses.fields(want_meta):
        a, b = getattr(meta, f.name), getattr(want_meta, f.name)
        if b is None:
            assert a is None, (what, f.name)
            continue
        a = np.asarray(a)
        assert a.dtype == np.int32 and a.shape == b.shape, (what, f.name, a.dtype, a.shape, b.shape)
        np.testing.assert_array_equal(a, b, err_msg=f"{what} {f.name}")


def random_batch(rng, *, num_pages):
    """A valid random batch: decodes and prefills with lengths around page boundaries and
    index_topk, distinct pages, sometimes a read-only prefix page two requests share, sometimes
    junk table entries past a request's pages."""
    pool = list(rng.permutation(num_pages))
    requests, shared = [], None
    for _ in range(int(rng.integers(1, 7))):
        kind = rng.integers(4)
        if kind == 0:  # decode
            ctx, q = int(rng.integers(1, 3 * K)), 1
        elif kind == 1:  # short prefill, around page boundaries
            ctx, q = int(rng.choice([0, 0, PS - 1, PS, PS + 1])), int(rng.integers(1, K))
        elif kind == 2:  # around index_topk
            q = int(rng.integers(1, 8))
            ctx = max(0, K + int(rng.integers(-3, 3)) - q)
        else:  # long prefill or chunk
            ctx, q = int(rng.choice([0, PS, 2 * K, 3 * K + 1])), int(rng.integers(K - 2, 2 * K + 3))
        needed = -(-(ctx + q) // PS)
        table = [int(pool.pop()) for _ in range(needed)]
        if ctx >= PS and rng.random() < 0.3:  # share a read-only first page
            if shared is None:
                shared = table[0]
            else:
                table[0] = shared
        if rng.random() < 0.3:
            table += [int(v) for v in rng.integers(-5, num_pages + 5, size=int(rng.integers(1, 3)))]
        requests.append(Request(ctx, q, table))
    if shared is not None and not any(r.block_table[0] == shared for r in requests[1:]):
        shared = None
    return requests


@pytest.mark.parametrize("seed", range(4))
def test_plan_arrays_equals_plan_batch_and_the_reference_on_random_batches(seed, monkeypatch):
    rng = np.random.default_rng(seed)
    fp8 = dataclasses.replace(TINY, kv_cache_dtype="fp8")
    if seed % 2:  # make the fp8 split pay on small batches
        monkeypatch.setattr(policy, "UPFRONT_MIN_USES", 1)
    if seed >= 2:  # cond plans' row stages with several sizes at the tiny buckets
        monkeypatch.setattr(plan_lib, "LADDER_MIN_TOKENS", 16)
    for n in range(60):
        config = fp8 if n % 3 == 0 else TINY
        num_pages = int(rng.choice([64, 256]))
        requests = random_batch(rng, num_pages=num_pages)
        options = dict(num_pages=None if n % 5 == 0 else num_pages, force_sparse=bool(rng.random() < 0.1),
                       skip_indexer=bool(rng.random() < 0.8), dispatch=str(rng.choice(["static", "static", "cond"])),
                       tensor_parallel=int(rng.choice([1, 2, 4])),
                       prefill_route=str(rng.choice(["auto", "auto", "masked", "sparse"])),
                       buckets=BucketPolicy(min_tokens=int(rng.choice([1, 16])), min_seqs=int(rng.choice([1, 4])),
                                            min_pages_per_seq=int(rng.choice([1, 4])),
                                            min_dense_keys=int(rng.choice([1, 16]))))
        what = f"batch {n}: {requests} {options}"
        want = plan_reference(config, requests, **options)
        assert_same(host_plan(config, requests, **options), want, what)
        ctx, q, tables = arrays_of(requests, width=max(len(r.block_table) for r in requests) + int(rng.integers(3)))
        batch, num_pages_ = plan_lib.check_arrays(config, ctx, q, tables, options["num_pages"],
                                                  options["force_sparse"], options["skip_indexer"],
                                                  options["buckets"], options["dispatch"],
                                                  options["tensor_parallel"], options["prefill_route"])
        opts = {k: v for k, v in options.items() if k != "num_pages"}
        assert_same(plan_lib.plan_host(config, batch, num_pages=num_pages_, **opts), want, what)
        if n % 20 == 0:  # the public entry points: the same, with the metadata on the device
            assert_same(plan_arrays(config, ctx, q, tables, **options), want, what)
            assert_same(plan_batch(config, requests, **options), want, what)


def test_plan_arrays_takes_any_integer_dtype_and_lists():
    requests = [Request(5, 1, [3, 1]), Request(0, 9, [0, 2, 4])]
    want = host_plan(TINY, requests, num_pages=8)
    ctx, q, tables = arrays_of(requests)
    for dtype in (np.int64, np.uint16, np.int16, np.uint32):
        got = plan_arrays(TINY, ctx.astype(dtype), q.astype(dtype), tables.astype(np.int64), num_pages=8)
        assert_same(got, want, dtype)
    assert_same(plan_arrays(TINY, [5, 0], (1, 9), [[3, 1, -1], [0, 2, 4]], num_pages=np.int64(8)), want)
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(plan_arrays(TINY, ctx, q, tables)[1]))


def random_bad_batch(rng):
    """A random batch that often has problems: negative or zero lengths, totals past
    max_position_embeddings (64 here), short tables, page ids outside [0, 8), pages aliased
    across and within requests, entries past int32."""
    requests = []
    for _ in range(int(rng.integers(1, 5))):
        ctx = int(rng.choice([0, 1, 3, 4, 5, 8, 60, -1])) if rng.random() < 0.9 else int(rng.integers(-3, 70))
        q = int(rng.choice([1, 1, 2, 3, 4, 5, 0]))
        needed = max(1, -(-(ctx + q) // PS))
        size = needed + int(rng.choice([0, 0, 0, 1, -1]))
        table = [int(v) for v in rng.integers(-1, 9, size=max(size, 0))]
        if table and rng.random() < 0.05:
            table[int(rng.integers(len(table)))] = int(rng.choice([2 ** 31, -2 ** 31 - 1, 2 ** 40]))
        requests.append(Request(ctx, q, table))
    return requests


def test_refusals_on_random_batches_name_the_first_problem_as_the_reference_does():
    """The first problem in request order: an earlier request's pages before a later one's
    lengths, then each request's own checks in their order; for plan_batch and plan_arrays."""
    rng = np.random.default_rng(1)
    config = dataclasses.replace(TINY, max_position_embeddings=64)
    counts = {}
    for n in range(400):
        requests = random_bad_batch(rng)
        num_pages = None if n % 4 == 0 else 8
        for arrays in (False, True):
            want = first_problem(config, requests, num_pages, arrays=arrays)
            try:
                if arrays:
                    ctx, q, tables = arrays_of(requests, dtype=np.int64)
                    plan_lib.check_arrays(config, ctx, q, tables, num_pages, False, True,
                                          BucketPolicy(), "static")
                else:
                    plan_lib.check_batch(config, requests, num_pages, False, True, BucketPolicy(), "static")
                got = None
            except ValueError as e:
                got = str(e)
            assert got == want, (requests, num_pages, arrays)
            kind = "ok" if want is None else want.split(": ", 1)[1].split(" ")[0]
            counts[kind] = counts.get(kind, 0) + 1
    assert counts.get("ok", 0) > 20 and len(counts) >= 6, counts  # the mix covers several kinds


def test_type_problems_come_after_earlier_requests_page_problems():
    """plan_batch's type checks (on the Request objects) join the array checks in request order."""
    rng = np.random.default_rng(2)
    bad_fields = [dict(context_len=0.5), dict(query_len="3"), dict(block_table=[1.5]), dict(block_table=None),
                  dict(block_table=[0, 2 ** 70]), dict(context_len=2 ** 70), dict(block_table=np.zeros((1, 1), int))]
    for n in range(150):
        requests = random_bad_batch(rng)
        i = int(rng.integers(len(requests)))
        bad = bad_fields[n % len(bad_fields)]
        requests[i] = dataclasses.replace(requests[i], **bad) if n % 9 else (0, 1, [0])
        want = first_problem(TINY, requests, 8)
        with pytest.raises(ValueError) as e:
            plan_lib.check_batch(TINY, requests, 8, False, True, BucketPolicy(), "static")
        assert str(e.value) == want, requests


@pytest.mark.parametrize("args,message", [
    (([1], [1], [[0]]), "context_lens must be a 1-D numpy integer array \\(on the host\\), got NoneType"),
    ((np.zeros((1, 1), np.int32), [1], [[0]]), r"context_lens must be 1-D, got shape \(1, 1\)"),
    (([4], np.ones(1, np.float32), [[0, 1]]), "query_lens must hold integers, got dtype float32"),
    (([4], [True], [[0, 1]]), "query_lens must hold integers, got dtype bool"),
    (([4], [1], [0, 1]), r"block_tables must be 2-D, got shape \(2,\)"),
    (([4], [1], np.zeros((1, 2), np.float64)), "block_tables must hold integers, got dtype float64"),
    (([4, 0], [1, 1], [[0, 1], [2]]), "block_tables must be a 2-D integer array, got a list numpy cannot convert"),
    (([0], [1], [[2 ** 70]]), "block_tables must hold integers, got dtype object"),
    (([4, 0], [1], [[0, 1]]), r"query_lens has shape \(1,\), context_lens \(2,\)"),
    (([4, 0], [1, 2], [[0, 1]]), "block_tables has 1 rows for 2 requests"),
    ((np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros((0, 4), np.int32)), "empty batch: plan_arrays"),
    (([4, 0], [1, 9], [[0, 1], [2, 3]]), "request 1: block_tables has 2 columns, but context_len \\+ query_len = "
                                         "9 tokens need 3 pages of 4"),
    (([4, 0], [1, 9], [[0, 1, -1], [2, 3, -1]]), r"request 1: page id -1 is outside \[0, 8\) \(block_table\[2\]\)"),
    (([-1], [1], [[0]]), "request 0: context_len must be >= 0, got -1"),
    (([0, 0], [1, 0], [[0], [1]]), "request 1: query_len must be >= 1, got 0"),
    ((np.array([2 ** 31], np.int64), [1], [[0]]), r"request 0: context_len must be >= 0 and < 2\*\*31, got 2147483648"),
    ((np.array([2 ** 63], np.uint64), [1], [[0]]), r"context_len must be >= 0 and < 2\*\*31, got 9223372036854775808"),
    (([0], [1], np.array([[0, 2 ** 40]], np.int64)), r"request 0: block_table\[1\] = 1099511627776 is outside int32"),
    (([0], [3], [[9]]), r"request 0: page id 9 is outside \[0, 8\) \(block_table\[0\]\)"),
    (([4, 0], [1, 3], [[0, 1], [1, -1]]), r"request 1: page 1 is written by this step more than once"),
    (([8], [1], [[0, 0, 1]]), r"request 0: page 0 holds two ranges of its context"),
    (([0, 4], [3, 1], [[0, -1], [0, 2]]), "request 1: page 0 is read as context .* request 0 writes it"),
])
def test_plan_arrays_refuses_bad_arrays_naming_the_argument_or_request(args, message):
    if message.startswith("context_lens must be a 1-D numpy"):
        args = (None,) + args[1:]
    with pytest.raises(ValueError, match=message):
        plan_arrays(TINY, *args, num_pages=8)


def test_plan_arrays_refuses_bad_options_as_plan_batch_does():
    args = ([0], [3], [[0]])
    with pytest.raises(ValueError, match="num_pages must be a positive int or None, got 0"):
        plan_arrays(TINY, *args, num_pages=0)
    with pytest.raises(ValueError, match="dispatch must be one of"):
        plan_arrays(TINY, *args, dispatch="eager")
    with pytest.raises(ValueError, match="config must be an MLAConfig"):
        plan_arrays({}, *args)
    with pytest.raises(ValueError, match="block_tables must be a 2-D numpy integer array \\(on the host\\)"):
        plan_arrays(TINY, [0], [3], jax.numpy.zeros((1, 1), jax.numpy.int32))


def test_shared_prefix_pages_pass_on_both_page_checks():
    """Two requests reading one page is fine; found with the bincount (ids close to the entry
    count) and the sort (sparse ids, no num_pages) alike."""
    for base in (0, 10 ** 6):
        requests = [Request(8, 1, [base, base + 1, base + 2]), Request(8, 2, [base, base + 3, base + 4])]
        plan_batch(TINY, requests)
        plan_arrays(TINY, *arrays_of(requests))
        message = rf"request 1: page {base + 1} is written by this step \(block_table\[1\]\), but request 0 reads it"
        with pytest.raises(ValueError, match=message):
            plan_arrays(TINY, *arrays_of([requests[0], Request(4, 5, [base, base + 1, base + 4])]))


def test_the_route_rule_over_arrays_is_the_scalar_rule():
    """route_codes (the planner's, over arrays) and policy.prefill_route agree with the route
    written out in Python ints, at DeepSeek-V3.2's index_topk, around the masked/sparse crossing."""
    cfg = MLAConfig.deepseek_v32()
    rng = np.random.default_rng(3)
    ctx = np.concatenate([rng.integers(0, 40000, 3000), np.zeros(200, int), rng.integers(0, 5, 200)])
    q = np.concatenate([rng.integers(1, 20000, 3000), np.arange(15200, 15400), np.ones(200, int)])
    for prefill_route in ("auto", "masked", "sparse"):
        names = plan_lib.request_routes(cfg, [Request(int(c), int(n), []) for c, n in zip(ctx, q)], False,
                                        prefill_route)
        assert names == [route(cfg, int(c), int(n), False, prefill_route) for c, n in zip(ctx, q)]
    assert {"masked", "sparse", "dense"} <= set(names if prefill_route == "auto" else plan_lib.request_routes(
        cfg, [Request(int(c), int(n), []) for c, n in zip(ctx, q)], False))
    for c, n in zip(ctx[:300], q[:300]):
        if c + n > cfg.index_topk:
            assert policy.prefill_route(int(c), int(n), cfg.index_topk) == route(cfg, int(c), int(n), False, "auto")
    assert (plan_lib.route_codes(cfg, ctx, q, True) == 0).all()
