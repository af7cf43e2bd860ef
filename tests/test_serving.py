"""The serving loop: complete runs with sane metrics, outputs equal to the oracle, and a bounded
set of programs (nothing compiles after a warm-up that covers the bucket grid)."""

import itertools
import math

import numpy as np
import pytest

from jax_sparse_mla import BucketPolicy, MLAConfig, Request, jit_forward
from jax_sparse_mla.serving import (Engine, PageAllocator, PoolTooSmallError, RequestSpec, Workload,
                                    reference_outputs)

TINY = MLAConfig.tiny()  # index_topk 16, page 4: prefills longer than 16 tokens are sparse


def test_workload_lengths_follow_the_random_dataset():
    w = Workload(200, input_len=100, output_len=10, input_range_ratio=0.25, output_range_ratio=0.5, seed=3)
    specs = w.requests()
    ins = np.array([s.input_len for s in specs])
    outs = np.array([s.output_len for s in specs])
    assert ins.min() >= 75 and ins.max() <= 125 and ins.std() > 5
    assert outs.min() >= 5 and outs.max() <= 15
    assert specs == w.requests()  # seeded
    timed = Workload(50, 10, 2, request_rate=100.0).requests()
    arrivals = [s.arrival_s for s in timed]
    assert arrivals[0] == 0 and all(b >= a for a, b in zip(arrivals, arrivals[1:])) and arrivals[-1] > 0
    with pytest.raises(ValueError, match="input_range_ratio"):
        Workload(1, 10, 1, input_range_ratio=1.5)


def test_short_workload_completes_with_sane_metrics():
    engine = Engine(TINY, num_layers=2, num_pages=48, max_num_batched_tokens=16, max_num_seqs=4)
    w = Workload(10, input_len=12, output_len=5, input_range_ratio=0.6, output_range_ratio=0.6,
                 concurrency=3, seed=1)
    result = engine.run(w, progress=False)
    specs = {s.id: s for s in w.requests()}
    assert len(result.requests) == 10
    for r in result.requests:
        assert r.finished and r.output_tokens == specs[r.id].output_len
        assert 0 <= r.arrival_s and 0 < r.ttft_s and r.arrival_s + r.ttft_s <= r.finish_s <= result.duration_s
        if r.output_len > 1:
            assert r.tpot_s > 0
        else:
            assert math.isnan(r.tpot_s)
    steps = result.steps
    assert all(0 < s.num_tokens <= 16 <= s.padded_tokens for s in steps)
    assert all(s.num_decodes + s.num_prefills <= 4 for s in steps)
    assert math.isclose(sum(s.duration_s for s in steps), result.duration_s)
    total_in = sum(s.input_len for s in specs.values())
    total_cache = sum(s.input_len + s.output_len - 1 for s in specs.values())
    assert sum(s.prefill_tokens for s in steps) == total_in
    assert sum(s.num_tokens for s in steps) == total_cache
    assert {s.route for s in steps} == {"dense", "sparse"}  # both routes were exercised
    summary = result.summary()
    assert summary["completed"] == 10 and summary["total_output_tokens"] == sum(s.output_len for s in specs.values())
    assert summary["request_throughput"] > 0 and summary["median_tpot_ms"] > 0
    assert summary["median_ttft_ms"] <= 1e3 * result.duration_s


def test_decodes_are_scheduled_first_and_the_budget_chunks_prefills():
    engine = Engine(TINY, num_layers=1, num_pages=32, max_num_batched_tokens=6, max_num_seqs=4)
    specs = [RequestSpec(0, 3, 4), RequestSpec(1, 14, 2)]
    steps = engine.run(specs, progress=False).steps
    # step 0: request 0's whole prompt (3) + 3 tokens of request 1; then 1 decode + 5-token chunks
    assert [(s.num_decodes, s.prefill_tokens) for s in steps[:4]] == [(0, 6), (1, 5), (1, 5), (1, 1)]


def test_outputs_match_the_oracle_per_request():
    """Interleaved requests (chunked prefills, decodes, both routes, shuffled pages from a shared
    pool) give each request exactly the two-layer stack of the oracle run on that request alone:
    mixing up pages or rows between requests would break it."""
    engine = Engine(TINY, num_layers=2, num_pages=40, max_num_batched_tokens=12, max_num_seqs=3, seed=4)
    w = Workload(7, input_len=14, output_len=6, input_range_ratio=0.5, output_range_ratio=0.5,
                 concurrency=4, seed=2)
    result = engine.run(w, progress=False, collect_outputs=True)
    assert {s.route for s in result.steps} == {"dense", "sparse"}
    assert any(s.num_decodes and s.num_prefills for s in result.steps)
    worst, decided = 0.0, 0
    for spec in w.requests():
        ref, ambiguous = reference_outputs(engine, spec)
        out = result.outputs[spec.id]
        assert out.shape == ref.shape == (spec.input_len + spec.output_len - 1, TINY.hidden_size)
        keep = ~ambiguous
        decided += int(keep.sum())
        worst = max(worst, float(np.abs(out[keep] - ref[keep]).max() / np.abs(ref).max()))
    assert decided > 100
    assert worst < 1e-4, worst


def test_pool_too_small_is_a_clear_error():
    engine = Engine(TINY, num_layers=1, num_pages=4)
    with pytest.raises(PoolTooSmallError, match="request 0 .* needs 5 pages of 4 tokens, the cache has 4"):
        engine.run([RequestSpec(0, 18, 2)], progress=False)
    alloc = PageAllocator(3)
    assert alloc.allocate(2) == [0, 1] and alloc.allocate(2) is None
    alloc.free([0])
    with pytest.raises(ValueError, match="page 0 is freed but was not allocated"):
        alloc.free([0])


def test_a_small_pool_is_shared_over_time():
    # 6 requests of 4 pages each, 8 pages: at most two run at once, pages are reused
    engine = Engine(TINY, num_layers=1, num_pages=8, max_num_batched_tokens=32)
    result = engine.run(Workload(6, input_len=14, output_len=3), progress=False)
    assert all(r.finished for r in result.requests)
    assert max(s.num_decodes + s.num_prefills for s in result.steps) == 2


# --- nothing compiles after warm-up -------------------------------------------------------------
# Limits that keep every step inside a small, known grid: <= BUDGET tokens -> num_tokens 8;
# <= SEQS requests -> num_seqs {2, 4}; <= 32 cached tokens -> 8 pages (the minimum width); dense
# keys <= SEQS * index_topk -> num_dense_keys {0, 64}; what varies beyond that is the route and how
# many rows attend sparsely, both functions of the batch's composition, which the warm-up enumerates.
BUDGET, SEQS, MAX_LEN = 8, 4, 32
POLICY = BucketPolicy(min_tokens=BUDGET, min_seqs=2, min_pages_per_seq=MAX_LEN // TINY.page_size,
                      min_dense_keys=SEQS * TINY.index_topk)
RANDOM = dict(input_len=12, input_range_ratio=0.8, output_len=5, output_range_ratio=0.8)  # <= 22 + 9 - 1


def compositions():
    """A batch of every composition the scheduler can produce under BUDGET and SEQS: d decodes
    plus a multiset of prefill chunks, each short (context + new <= index_topk: dense) or long
    (sparse), of every query length. Lengths beyond the composition only matter through the page
    width, which the policy pins."""
    topk = TINY.index_topk
    chunks = [(kind, q) for kind in ("short", "long") for q in range(1, BUDGET + 1)]
    for d in range(SEQS + 1):
        for p in range(SEQS - d + 1):
            for prefills in itertools.combinations_with_replacement(chunks, p):
                if d + p == 0 or d + sum(q for _, q in prefills) > BUDGET:
                    continue
                reqs = [Request(5, 1, []) for _ in range(d)]
                reqs += [Request(0 if kind == "short" else topk + 1 - q, q, []) for kind, q in prefills]
                width = MAX_LEN // TINY.page_size  # distinct pages per request
                yield [Request(r.context_len, r.query_len, list(range(i * width, (i + 1) * width)))
                       for i, r in enumerate(reqs)]


def test_no_compilation_after_warmup_over_1000_random_steps():
    engine = Engine(TINY, num_layers=2, num_pages=64, max_num_batched_tokens=BUDGET, max_num_seqs=SEQS,
                    buckets=POLICY, seed=7)
    compiled = engine.compile_batches(compositions())
    assert compiled <= 24, compiled  # the grid is small (fewer when an earlier test compiled some)
    programs = jit_forward._cache_size()
    # saturated (a queue always waiting) and light, bursty load (Poisson arrivals: often 1-2 running)
    busy = engine.run(Workload(400, concurrency=SEQS + 2, seed=11, **RANDOM), max_steps=500, progress=False)
    light = engine.run(Workload(400, request_rate=150.0, seed=12, **RANDOM), max_steps=500, progress=False)
    steps = busy.steps + light.steps
    assert len(steps) == 1000
    assert jit_forward._cache_size() == programs
    assert sum(s.new_programs for s in steps) == 0
    plans = {s.plan for s in steps}
    assert {p.route for p in plans} == {"dense", "sparse"} and len(plans) >= 6, plans
    assert all(p.num_tokens == BUDGET and p.pages_per_seq == 8 for p in plans)
