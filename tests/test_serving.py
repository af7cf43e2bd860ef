"""The serving loop: complete runs with sane metrics, outputs equal to the oracle, and a bounded
set of programs (nothing compiles after a warm-up that covers the bucket grid)."""

import itertools
import math

import numpy as np
import pytest

from jax_sparse_mla import BucketPolicy, MLAConfig, Request, plan_batch
from jax_sparse_mla.serving import Engine, PageAllocator, PoolTooSmallError, RequestSpec, Workload
from jax_sparse_mla.serving.engine import jit_layer_stack
from tests.support import oracle_error

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
    # pipelined steps: the host's time of a step (planning within it) and its GPU time
    assert all(0 <= s.plan_s <= s.host_s and 0 < s.launch_s <= s.host_s - s.plan_s
               and 0 < s.device_s <= s.duration_s + 1e-9 for s in steps)
    assert all(b.start_s == pytest.approx(a.start_s + a.duration_s) for a, b in zip(steps, steps[1:]))
    total_in = sum(s.input_len for s in specs.values())
    total_cache = sum(s.input_len + s.output_len - 1 for s in specs.values())
    assert sum(s.prefill_tokens for s in steps) == total_in
    assert sum(s.num_tokens for s in steps) == total_cache
    assert {s.branch for s in steps} == {"dense", "sparse"}  # both kinds of step were exercised
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
    assert {s.route for s in result.steps} == {"cond"} and {s.branch for s in result.steps} == {"dense", "sparse"}
    assert any(s.num_decodes and s.num_prefills for s in result.steps)
    for spec in w.requests():
        assert result.outputs[spec.id].shape == (spec.input_len + spec.output_len - 1, TINY.hidden_size)
    worst, decided = oracle_error(engine, result, w.requests())
    assert decided > 100
    assert worst < 1e-4, worst


def test_pool_too_small_is_a_clear_error():
    engine = Engine(TINY, num_layers=1, num_pages=4)
    with pytest.raises(PoolTooSmallError, match="request 0 .* needs 5 pages of 4 tokens, the cache has 4"):
        engine.run([RequestSpec(0, 18, 2)], progress=False)
    alloc = PageAllocator(3)
    assert alloc.allocate(2) == [0, 1] and alloc.allocate(2) is None
    assert PageAllocator(3, order=[2, 0, 1]).allocate(2) == [2, 0]  # a shuffled free list (synthetic.Harness)
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
                    buckets=POLICY, dispatch="static", seed=7)  # static: the most plans
    compiled = engine.compile_batches(compositions())
    assert compiled <= 24, compiled  # the grid is small
    programs = jit_layer_stack._cache_size()
    # saturated (a queue always waiting) and light, bursty load (Poisson arrivals: often 1-2 running)
    busy = engine.run(Workload(400, concurrency=SEQS + 2, seed=11, **RANDOM), max_steps=500, progress=False)
    light = engine.run(Workload(400, request_rate=150.0, seed=12, **RANDOM), max_steps=500, progress=False)
    steps = busy.steps + light.steps
    assert len(steps) == 1000
    assert jit_layer_stack._cache_size() == programs
    assert sum(s.new_programs for s in steps) == 0
    plans = {s.plan for s in steps}
    assert {p.route for p in plans} == {"dense", "sparse"} and len(plans) >= 6, plans
    assert all(p.num_tokens == BUDGET and p.pages_per_seq == 8 for p in plans)


@pytest.mark.parametrize("block,dtype", [("attention", "float32"), ("decoder", "bfloat16")])
def test_after_warmup_a_serving_run_compiles_nothing(block, dtype):
    """Engine.warmup covers every program a step runs (its one program over the row gather, the
    layers, the residual adds and the decoder block's norms and MoE): a run of mixed prefill /
    decode steps after it compiles nothing, outputs collected included."""
    import jax

    from tests.support import compiled_functions

    jax.clear_caches()  # programs an earlier test compiled would hide one that warm-up misses
    engine = Engine(MLAConfig.tiny(dtype=dtype), num_layers=2, num_pages=48, max_num_batched_tokens=16,
                    max_num_seqs=4, block=block)
    w = Workload(5, input_len=12, output_len=4, input_range_ratio=0.5, concurrency=3, seed=1)
    assert engine.warmup(w) > 0
    with compiled_functions() as compiled:
        result = engine.run(w, progress=False, collect_outputs=True)
    assert compiled == [], compiled
    assert all(r.finished for r in result.requests) and sum(s.new_programs for s in result.steps) == 0
    assert any(s.num_prefills and s.num_decodes for s in result.steps)  # mixed steps
    assert any(s.num_prefills and not s.num_decodes for s in result.steps)
    assert any(s.num_decodes and not s.num_prefills for s in result.steps)


# --- host-side refusal of bad input (before any device work) ------------------------------------

@pytest.mark.parametrize("args,message", [
    ((0, 2.5, 1), "request 0: input_len must be an integer, got 2.5"),
    ((1, 3, 0), "request 1: output_len must be >= 1, got 0"),
    ((2, 3, 1.0), "request 2: output_len must be an integer, got 1.0"),
    ((3, True, 1), "request 3: input_len must be an integer, got True"),
    ((4, "3", 1), "request 4: input_len must be an integer, got '3'"),
    ((5, 2 ** 31, 1), r"request 5: input_len must be >= 1 and < 2\*\*31"),
    ((6, 3, 1, math.nan), "request 6: arrival_s must be finite and >= 0, got nan"),
    ((7, 3, 1, math.inf), "request 7: arrival_s must be finite and >= 0, got inf"),
    ((8, 3, 1, -1.0), "request 8: arrival_s must be finite and >= 0, got -1.0"),
    ((9, 3, 1, "0"), "request 9: arrival_s must be a real number, got '0'"),
    ((10, 3, 1, None), "request 10: arrival_s must be a real number, got None"),
    ((-1, 3, 1), r"request id must be an integer in \[0, 2\*\*31\), got -1"),
    ((1.5, 3, 1), r"request id must be an integer in \[0, 2\*\*31\), got 1.5"),
    ((True, 3, 1), r"request id must be an integer in \[0, 2\*\*31\), got True"),
    (("a", 3, 1), r"request id must be an integer in \[0, 2\*\*31\), got 'a'"),
])
def test_request_spec_fields_are_checked_at_construction(args, message):
    with pytest.raises(ValueError, match=message):
        RequestSpec(*args)


def test_numpy_scalars_are_accepted_as_request_fields():
    spec = RequestSpec(np.int64(3), np.int64(5), np.int32(2), np.float32(0.5))
    assert spec == RequestSpec(3, 5, 2, 0.5) and hash(spec) == hash(RequestSpec(3, 5, 2, 0.5))
    assert [type(v) for v in (spec.id, spec.input_len, spec.output_len, spec.arrival_s)] == [int, int, int, float]
    engine = Engine(TINY, num_layers=1, num_pages=np.int64(8), max_num_batched_tokens=np.int32(16))
    result = engine.run([spec], progress=False)  # (numpy lengths crashed in the bucket arithmetic)
    assert result.requests[0].finished and result.requests[0].output_tokens == 2
    w = Workload(np.int64(3), np.int64(10), np.int32(2), input_range_ratio=np.float64(0.5), concurrency=np.int8(2),
                 seed=np.int64(1))
    assert w == Workload(3, 10, 2, input_range_ratio=0.5, concurrency=2, seed=1)
    assert w.requests() == Workload(3, 10, 2, input_range_ratio=0.5, concurrency=2, seed=1).requests()


def test_duplicate_request_ids_are_refused_before_any_work():
    engine = Engine(TINY, num_layers=1, num_pages=8)
    with pytest.raises(ValueError, match=r"request 7: the id is used twice \(workload entries 0 and 2\)"):
        engine.run([RequestSpec(7, 3, 2), RequestSpec(1, 3, 2), RequestSpec(7, 4, 2)], progress=False)
    with pytest.raises(ValueError, match="workload entry 1: expected a RequestSpec, got tuple"):
        engine.run([RequestSpec(0, 3, 2), (1, 3, 2)], progress=False)
    with pytest.raises(ValueError, match="workload must be a Workload or a sequence of RequestSpecs, got int"):
        engine.run(5, progress=False)


def test_requests_longer_than_max_model_len_are_refused_before_any_work():
    """max_model_len defaults to the config's max_position_embeddings; a smaller one (an engine
    option, also per run) refuses longer requests, a larger one is refused itself."""
    config = TINY.__class__.tiny(max_position_embeddings=16)
    engine = Engine(config, num_layers=1, num_pages=16)
    with pytest.raises(ValueError, match="request 3: input_len \\+ output_len - 1 = 17 tokens exceeds "
                                         "max_model_len = 16"):
        engine.run([RequestSpec(0, 4, 2), RequestSpec(3, 14, 4)], progress=False)
    with pytest.raises(ValueError, match="request 0: input_len \\+ output_len - 1 = 5 tokens exceeds max_model_len = 4"):
        engine.run([RequestSpec(0, 4, 2)], progress=False, max_model_len=4)
    with pytest.raises(ValueError, match="max_model_len = 17 exceeds the config's max_position_embeddings = 16"):
        engine.run([RequestSpec(0, 4, 2)], progress=False, max_model_len=17)


def test_engine_defaults_to_the_serving_program_at_its_limits():
    """By default an engine plans dispatch="cond" with BucketPolicy.for_limits of its limits: the
    sequence count and table width are fixed (the smaller of the limit and the cache's pages),
    so batches of one row bucket and stage set share one plan, and a run compiles one program for
    each of those it meets."""
    engine = Engine(TINY, num_layers=1, num_pages=40, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)
    assert (engine.options.dispatch, engine.options.buckets) == ("cond", None)
    kw = engine.options.plan_kwargs(TINY, engine.num_pages)
    assert kw["buckets"] == BucketPolicy.for_limits(TINY, max_num_seqs=4, max_model_len=64, num_pages=40)
    assert (kw["buckets"].min_seqs, kw["buckets"].min_pages_per_seq) == (4, 16)  # 64 tokens / 4 a page
    a = plan_batch(TINY, [Request(8, 1, [0, 1, 2]), Request(0, 3, [3])], num_pages=40, **kw)[0]
    b = plan_batch(TINY, [Request(20, 1, list(range(1, 7))), Request(0, 9, [7, 8, 9])], num_pages=40, **kw)[0]
    assert a == b and (a.route, a.num_seqs, a.pages_per_seq) == ("cond", 4, 16)
    result = engine.run([RequestSpec(i, 10 + 7 * i, 3) for i in range(3)], progress=False)
    plans = {s.plan for s in result.steps}
    assert {p.num_tokens for p in plans} == {16} and sum(s.new_programs for s in result.steps) == len(plans) <= 3


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_requests=0), "num_requests must be >= 1, got 0"),
    (dict(num_requests=2.5), "num_requests must be an integer, got 2.5"),
    (dict(num_requests=True), "num_requests must be an integer, got True"),
    (dict(input_len="10"), "input_len must be an integer, got '10'"),
    (dict(output_len=0), "output_len must be >= 1, got 0"),
    (dict(input_range_ratio=math.nan), "input_range_ratio must be in \\[0, 1\\), got nan"),
    (dict(output_range_ratio="0.5"), "output_range_ratio must be a real number, got '0.5'"),
    (dict(concurrency=0), "concurrency \\(or None\\) must be >= 1, got 0"),
    (dict(concurrency=1.5), "concurrency \\(or None\\) must be an integer, got 1.5"),
    (dict(request_rate=math.nan), "request_rate must be > 0"),
    (dict(request_rate=0), "request_rate must be > 0"),
    (dict(request_rate="fast"), "request_rate must be a real number, got 'fast'"),
    (dict(seed=-1), "seed must be a non-negative integer, got -1"),
    (dict(seed=1.5), "seed must be a non-negative integer, got 1.5"),
])
def test_workload_fields_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Workload(**{**dict(num_requests=4, input_len=10, output_len=2), **kwargs})


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be >= 1, got 0"),
    (dict(max_num_batched_tokens=1.5), "max_num_batched_tokens must be an integer, got 1.5"),
    (dict(max_num_seqs=True), "max_num_seqs must be an integer, got True"),
    (dict(skip_indexer="yes"), "skip_indexer must be a bool, got 'yes'"),
    (dict(force_sparse=0), "force_sparse must be a bool, got 0"),
    (dict(dispatch="dynamic"), "dispatch must be one of"),
    (dict(kernels="cuda"), "kernels must be one of"),
    (dict(buckets={}), "buckets must be a BucketPolicy or None, got dict"),
    (dict(max_model_len=0), "max_model_len must be >= 1, got 0"),
    (dict(decode_steps=0), "decode_steps must be >= 1, got 0"),
    (dict(bogus=1), r"unknown engine option\(s\) \['bogus'\]"),
])
def test_engine_options_are_checked_at_construction_and_per_run(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Engine(TINY, num_layers=1, num_pages=8, **kwargs)
    engine = Engine(TINY, num_layers=1, num_pages=8)
    before = [np.asarray(c.latent) for c in engine.caches]
    with pytest.raises(ValueError, match=message):
        engine.run([RequestSpec(0, 3, 2)], progress=False, **kwargs)
    assert all(np.array_equal(a, np.asarray(c.latent)) for a, c in zip(before, engine.caches))


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_layers=0), "num_layers must be >= 1, got 0"),
    (dict(num_pages=0), "num_pages must be >= 1, got 0"),
    (dict(num_pages=2.5), "num_pages must be an integer, got 2.5"),
    (dict(num_pages=2 ** 29 + 1), "slot numbers would overflow int32"),
    (dict(pool_size=0), "pool_size must be >= 1, got 0"),
    (dict(seed=-3), "seed must be a non-negative integer, got -3"),
])
def test_engine_arguments_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Engine(TINY, **{**dict(num_layers=1, num_pages=8), **kwargs})


def _spoil(arrays, name, how):
    """A copy of the dict `arrays` with `name` removed, reshaped, cast to int32 or given a NaN / inf."""
    import jax.numpy as jnp

    arrays = dict(arrays)
    a = arrays[name]
    if how == "missing":
        del arrays[name]
    elif how == "shape":
        arrays[name] = a[..., :-1]
    elif how == "int32":
        arrays[name] = a.astype(jnp.int32)
    else:
        arrays[name] = a.at[(0,) * a.ndim].set(jnp.nan if how == "nan" else jnp.inf)
    return arrays


@pytest.mark.parametrize("name,how,message", [
    ("indexer.wk.weight", "missing", "layer 1: params has no 'indexer.wk.weight'"),
    ("o_proj.weight", "shape", r"layer 1: params\['o_proj.weight'\] has shape \(64, 63\), expected \(64, 64\)"),
    ("kv_a_layernorm.weight", "int32", r"layer 1: params\['kv_a_layernorm.weight'\] has dtype int32"),
    ("q_b_proj.weight", "nan", r"layer 1: params\['q_b_proj.weight'\] has non-finite values"),
])
def test_engine_checks_every_layers_params_at_construction(name, how, message):
    import jax
    from jax_sparse_mla import init_params

    good = init_params(TINY, jax.random.key(0))
    with pytest.raises(ValueError, match=message):
        Engine(TINY, num_layers=2, num_pages=8, params=[good, _spoil(good, name, how)])
    with pytest.raises(ValueError, match="params must be a list of per-layer dicts, got dict"):
        Engine(TINY, num_layers=2, num_pages=8, params=good)


@pytest.mark.parametrize("name,how,message", [
    ("router.weight", "missing", "layer 1: block_params has no 'router.weight'"),
    ("experts.up", "shape", r"layer 1: block_params\['experts.up'\] has shape \(8, 64, 31\), expected \(8, 64, 32\)"),
    ("ffn_norm.weight", "int32", r"layer 1: block_params\['ffn_norm.weight'\] has dtype int32"),
    ("experts.down", "inf", r"layer 1: block_params\['experts.down'\] has non-finite values"),
    ("attn_norm.weight", "nan", r"layer 1: block_params\['attn_norm.weight'\] has non-finite values"),
])
def test_engine_checks_every_layers_block_params_at_construction(name, how, message):
    import jax
    from jax_sparse_mla.serving.block import MoEConfig, init_block_params

    good = init_block_params(TINY, MoEConfig.tiny(), jax.random.key(0))
    with pytest.raises(ValueError, match=message):
        Engine(TINY, num_layers=2, num_pages=8, block="decoder", block_params=[good, _spoil(good, name, how)])
    with pytest.raises(ValueError, match=r"layer 0: block_params\['router.weight'\] has shape \(64, 8\), "
                                         r"expected \(64, 4\)"):  # the block params of another MoEConfig
        Engine(TINY, num_layers=2, num_pages=8, block="decoder", moe=MoEConfig.tiny(num_experts=4),
               block_params=[good, good])


def test_run_arguments_are_checked():
    engine = Engine(TINY, num_layers=1, num_pages=8)
    for kwargs, message in [(dict(max_steps=-1), "max_steps \\(or None\\) must be >= 0, got -1"),
                            (dict(max_steps=1.5), "max_steps \\(or None\\) must be an integer, got 1.5"),
                            (dict(progress="no"), r"progress must be True, False or None \(None: shown when "
                                                  r"stderr is a terminal\), got 'no'"),
                            (dict(collect_outputs=None), "collect_outputs must be a bool, got None")]:
        with pytest.raises(ValueError, match=message):
            engine.run([RequestSpec(0, 3, 2)], **{"progress": False, **kwargs})
    with pytest.raises(ValueError, match="num_pages must be an integer, got 2.5"):
        PageAllocator(2.5)
    with pytest.raises(ValueError, match=r"order must be a permutation of range\(num_pages\) = range\(3\)"):
        PageAllocator(3, order=[0, 0, 1])


# --- decoder-block mode: x = x + attn(RMSNorm(x)); x = x + moe(RMSNorm(x)) ----------------------

def test_moe_stand_in_equals_the_dense_per_token_loop():
    """grouped_matmul experts (sort by expert, group sizes, unsort, weighted sum) + the shared
    expert equal every token run through its chosen experts one by one, for both scorings."""
    import jax
    from jax_sparse_mla.serving.block import MoEConfig, init_block_params, moe_ffn, reference_moe, route

    assert MoEConfig.for_config(MLAConfig.deepseek_v32()) == MoEConfig(256, 8, 2048, 1)
    assert MoEConfig.for_config(TINY) == MoEConfig(8, 2, 32, 1)
    x = jax.random.normal(jax.random.key(1), (37, TINY.hidden_size))
    for moe in (MoEConfig.tiny(), MoEConfig.tiny(scoring="softmax", num_shared_experts=0, num_experts_per_tok=3)):
        params = init_block_params(TINY, moe, jax.random.key(0))
        assert all(v.dtype == np.float32 for v in params.values())
        ref, margin = reference_moe(params, np.asarray(x), moe)
        assert margin.min() > 1e-6  # no near-tie: the same experts are picked
        out = np.asarray(moe_ffn(params, x, moe))
        assert out.shape == x.shape and np.abs(out - ref).max() < 1e-5 * max(1.0, np.abs(ref).max())
        _, experts = route(params, x, moe)
        assert len(np.unique(np.asarray(experts))) == moe.num_experts  # every expert got tokens


# group sizes: ragged with empty groups, all rows in one group, the last group empty, fewer rows
# than groups, and rows not a multiple of the tile
GROUPINGS = [[5, 0, 17, 3, 0, 11], [36, 0, 0, 0], [9, 4, 20, 0], [1, 0, 2, 0, 0, 0, 0, 0], [3, 3, 3]]


def _grouped_inputs(sizes, dtype, seed, k=24, n=20):
    import jax
    import jax.numpy as jnp

    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (sum(sizes), k), jnp.float32).astype(dtype)
    w = jax.random.normal(kw, (len(sizes), k, n), jnp.float32).astype(dtype)
    return x, w, jnp.asarray(sizes, jnp.int32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("sizes", GROUPINGS, ids=lambda s: "-".join(map(str, s)))
def test_grouped_matmul_equals_ragged_dot_and_the_per_row_loop(sizes, dtype):
    """Each row times its group's weights, as jax.lax.ragged_dot (with the same precision and
    float32 accumulation) and a float64 loop over the rows give it: the default tiling, and tiles
    of 4 rows 3 a chunk (several chunks; a group's rows span tiles)."""
    import jax
    import jax.numpy as jnp
    from jax_sparse_mla import ops
    from jax_sparse_mla.serving.block import grouped_matmul

    dt = jnp.dtype(dtype)
    kw = dict(precision=ops.matmul_precision(dt), preferred_element_type=jnp.float32)
    err = lambda a, b: np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b)  # noqa: E731
    group = np.repeat(np.arange(len(sizes)), sizes)
    for seed in range(3):
        x, w, group_sizes = _grouped_inputs(sizes, dt, seed)
        xs, ws = (np.asarray(a.astype(jnp.float32), np.float64) for a in (x, w))
        loop = np.stack([xs[i] @ ws[group[i]] for i in range(len(xs))])
        ragged = np.asarray(jax.lax.ragged_dot(x, w, group_sizes, **kw), np.float64)
        for tiling in ({}, dict(tile=4, chunk=3)):
            out = grouped_matmul(x, w, group_sizes, **tiling, **kw)
            assert out.shape == loop.shape and out.dtype == jnp.float32
            # bf16 inputs: their products are exact in float32, so both tolerances hold too
            assert err(out, ragged) < 1e-6 and err(out, loop) < 1e-6, (seed, tiling)


def test_grouped_matmul_rows_are_independent():
    """A NaN row (first, last, at a group's edge) changes only its own result: a padded position
    or another row never reads it."""
    import jax.numpy as jnp
    from jax_sparse_mla.serving.block import grouped_matmul

    sizes = [5, 0, 17, 3, 0, 11]
    x, w, group_sizes = _grouped_inputs(sizes, jnp.float32, 0)
    base = np.asarray(grouped_matmul(x, w, group_sizes, tile=4, chunk=3))
    assert np.isfinite(base).all()
    for i in (0, 4, 5, 22, 24, 25, len(x) - 1):
        out = np.asarray(grouped_matmul(x.at[i].set(jnp.nan), w, group_sizes, tile=4, chunk=3))
        others = np.arange(len(x)) != i
        assert np.isnan(out[i]).all() and np.array_equal(out[others], base[others]), i
    with pytest.raises(ValueError, match="tile must be >= 1, got 0"):
        grouped_matmul(x, w, group_sizes, tile=0)
    with pytest.raises(ValueError, match="chunk must be an integer"):
        grouped_matmul(x, w, group_sizes, chunk=2.0)
    with pytest.raises(ValueError, match="w must hold at least one group"):
        grouped_matmul(x, w[:0], group_sizes[:0])
    empty = grouped_matmul(x[:0], w, jnp.zeros_like(group_sizes))  # no rows: an empty result, as ragged_dot's
    assert empty.shape == (0, w.shape[-1]) and empty.dtype == x.dtype


def test_grouped_matmul_has_no_dense_expansion():
    """Compiled (CPU) at 4096 rows over 64 groups, K 256: ragged_dot's program holds the
    [M, G * K] expansion (268 MB); grouped_matmul's holds no dot over G * K, its scratch is a
    fraction of that and shrinks with the chunk. The default tiling: tiles a power of two in
    [8, 256], at most M / G rows where that is >= 8; a chunk's weights within the bound."""
    import jax
    import jax.numpy as jnp
    from jax_sparse_mla.serving import block

    m, g, k, n = 4096, 64, 256, 128
    args = (jax.ShapeDtypeStruct((m, k), jnp.float32), jax.ShapeDtypeStruct((g, k, n), jnp.float32),
            jax.ShapeDtypeStruct((g,), jnp.int32))
    dense = m * g * k * 4

    def compiled(f):
        c = jax.jit(f).lower(*args).compile()
        return c.memory_analysis().temp_size_in_bytes, [line for line in c.as_text().splitlines() if " dot(" in line]

    temp, dots = compiled(jax.lax.ragged_dot)
    assert temp >= dense  # the measure sees an expansion where there is one
    temp, dots = compiled(block.grouped_matmul)
    assert dots and not any(str(g * k) in line for line in dots) and temp < dense / 8
    small, _ = compiled(lambda *a: block.grouped_matmul(*a, chunk=16))
    assert small < temp / 2
    # a decode's few rows take tiles for the groups that can hold them, not one for every group
    few = jax.make_jaxpr(block.grouped_matmul)(jnp.zeros((8, k)), jnp.zeros((g, k, n)), jnp.zeros((g,), jnp.int32))
    (scan,) = [e for e in few.eqns if e.primitive.name == "scan"]
    positions = int(np.prod(scan.invars[-3].aval.shape))  # the padded layout's rows (its source rows, chunked)
    assert positions <= (1 + 8) * 8  # ceil(8 / tile 8) + 8 non-empty groups at most, 8 rows each
    for m, g, weight_bytes in ((m, g, k * n * 4), (32768, 64, 7168 * 2048 * 2), (8, 64, 7168 * 2048 * 2),
                               (10**6, 8, 4)):
        tile, chunk = block.grouped_tiling(m, g, weight_bytes)
        assert 8 <= tile <= 256 and tile & (tile - 1) == 0 and (tile <= m / g or tile == 8), (m, g)
        assert chunk >= 1 and (chunk == 1 or chunk * weight_bytes <= block.GATHERED_WEIGHT_BYTES), (m, g)


def test_decoder_block_engine_matches_its_oracle_and_differs_from_the_attention_stack():
    kw = dict(num_layers=2, num_pages=40, max_num_batched_tokens=12, max_num_seqs=3, seed=4)
    w = Workload(5, input_len=14, output_len=4, input_range_ratio=0.5, output_range_ratio=0.5, concurrency=3, seed=2)
    decoder = Engine(TINY, block="decoder", **kw)
    assert decoder.block == "decoder" and decoder.moe.num_experts == 8 and len(decoder.block_params) == 2
    result = decoder.run(w, progress=False, collect_outputs=True)
    assert all(r.finished for r in result.requests) and {s.branch for s in result.steps} == {"dense", "sparse"}
    attention = Engine(TINY, **kw).run(w, progress=False, collect_outputs=True)
    for spec in w.requests():
        out = result.outputs[spec.id]
        assert out.shape == (spec.cache_len, TINY.hidden_size) and np.isfinite(out).all()
        assert np.abs(out - attention.outputs[spec.id]).min(axis=1).max() > 0 and \
            np.abs(out - attention.outputs[spec.id]).max() > 0.1
    worst, decided = oracle_error(decoder, result, w.requests())
    assert decided > 50
    assert worst < 3e-4, worst


def test_block_arguments_are_checked():
    from jax_sparse_mla.serving.block import MoEConfig

    with pytest.raises(ValueError, match=r"block must be one of \('attention', 'decoder'\), got 'moe'"):
        Engine(TINY, num_layers=1, num_pages=8, block="moe")
    with pytest.raises(ValueError, match='moe and block_params are for block="decoder"'):
        Engine(TINY, num_layers=1, num_pages=8, moe=MoEConfig.tiny())
    with pytest.raises(ValueError, match="moe must be a MoEConfig or None, got dict"):
        Engine(TINY, num_layers=1, num_pages=8, block="decoder", moe={})
    with pytest.raises(ValueError, match="got 1 layers of block_params for num_layers=2"):
        Engine(TINY, num_layers=2, num_pages=8, block="decoder", block_params=[{}])
    with pytest.raises(ValueError, match="num_experts_per_tok = 9 exceeds num_experts = 8"):
        MoEConfig.tiny(num_experts_per_tok=9)
    with pytest.raises(ValueError, match="MoEConfig.scoring must be one of"):
        MoEConfig(scoring="relu")
    assert Engine(TINY, num_layers=1, num_pages=8).block == "attention"


def test_engine_and_block_params_of_other_types_are_refused_by_name():
    """Engine checks the per-layer params and block params it is given (not at the first step),
    and the decoder block's functions their params and input: a ValueError naming the argument."""
    import jax
    from jax_sparse_mla import init_params
    from jax_sparse_mla.serving import block
    from jax_sparse_mla.serving.block import MoEConfig, init_block_params

    params = init_params(TINY, jax.random.key(0))
    moe = MoEConfig.tiny()
    bp = init_block_params(TINY, moe, jax.random.key(1))
    kw = dict(num_layers=2, num_pages=8)
    for kwargs, message in [
        (dict(params=params), "params must be a list of per-layer dicts, got dict"),
        (dict(params=3), "params must be a list .*got int"),
        (dict(params=[params, None]), r"layer 1: params must be a dict of arrays, got NoneType"),
        (dict(params=[params, {**params, "o_proj.weight": None}]), r"layer 1: params\['o_proj.weight'\] is a NoneType"),
        (dict(params=[params, {}]), r"layer 1: params has no 'q_a_proj.weight'"),
        (dict(block="decoder", block_params=bp), "block_params must be a list .*got dict"),
        (dict(block="decoder", block_params=[bp, ()]), r"layer 1: block_params must be a dict of arrays, got tuple"),
        (dict(block="decoder", block_params=[bp, {**bp, "router.weight": bp["router.weight"][:, :3]}]),
         r"layer 1: block_params\['router.weight'\] has shape \(64, 3\), expected \(64, 8\)"),
    ]:
        with pytest.raises(ValueError, match=message):
            Engine(TINY, **kw, **kwargs)
    x = jax.numpy.ones((4, TINY.hidden_size))
    for call, message in [(lambda: block.attn_input(None, x, config=TINY), "params must be a dict of arrays"),
                          (lambda: block.attn_input({}, x, config=TINY), "params has no 'attn_norm.weight'"),
                          (lambda: block.attn_input(bp, None, config=TINY), "x must be a floating-point array"),
                          (lambda: block.ffn_residual([], x, config=TINY, moe=moe), "params must be a dict of arrays"),
                          (lambda: block.ffn_residual(bp, x, config=TINY, moe=None), "moe must be a MoEConfig"),
                          (lambda: block.ffn_residual(bp, [[1.0]], config=TINY, moe=moe), "x must be a floating-point")]:
        with pytest.raises(ValueError, match=message):
            call()
    assert block.ffn_residual(bp, x, config=TINY, moe=moe).shape == x.shape


def test_decoder_block_precompile_covers_the_moe_programs():
    """The decoder block's norms and MoE run inside the step's one program: Engine.precompile
    compiles them with it, and a run after it compiles nothing."""
    from tests.support import compiled_functions

    engine = Engine(TINY, block="decoder", num_layers=1, num_pages=16, max_num_batched_tokens=8, max_num_seqs=2,
                    max_model_len=16, buckets=BucketPolicy(min_tokens=8, min_seqs=2, min_pages_per_seq=4, min_dense_keys=32))
    engine.precompile(progress=False)
    with compiled_functions() as compiled:
        result = engine.run(Workload(6, input_len=6, output_len=3, seed=1), progress=False)
    assert all(r.finished for r in result.requests) and sum(s.new_programs for s in result.steps) == 0
    assert compiled == [], compiled
