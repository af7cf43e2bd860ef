"""Bounded warm-up (jax_sparse_mla.precompile): the enumeration covers every batch within the
limits, and after precompile a serving run compiles nothing; the persistent cache gets entries."""

import dataclasses
import itertools
import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sparse_mla import BucketPolicy, MLAConfig, Request, plan_batch
from jax_sparse_mla.precompile import count_programs, enable_persistent_cache, enumerate_plans, precompile
from tests.support import COMPILE_EVENT, lower_mosaic_kernel, run_python, scored_plan

TINY = MLAConfig.tiny()
LIMITS = dict(num_pages=17, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=32)
# the persistent compilation cache's lookups (jax._src.compiler); a hit also reports COMPILE_EVENT
_CACHE_HIT, _CACHE_MISS = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"


def random_batch(rng, config, *, num_pages, max_num_seqs, max_num_batched_tokens, max_model_len):
    """A random batch within the limits (disjoint pages), biased to the edges: decodes, short and
    long prefills, chunks with context, lengths at index_topk and max_model_len."""
    K, ps, L = config.index_topk, config.page_size, min(max_model_len, config.max_position_embeddings)
    budget, free, reqs = max_num_batched_tokens, list(rng.permutation(num_pages)), []
    for _ in range(int(rng.integers(1, max_num_seqs + 1))):
        if budget < 1:
            break
        kind = rng.integers(4)
        if kind == 0:  # decode
            total = int(rng.choice([2, K, K + 1, L, rng.integers(2, L + 1)]))
            q = 1
        else:
            q = int(rng.choice([1, budget, rng.integers(1, budget + 1)]))
            q = min(q, L)
            total = int(rng.choice([q, K, K + 1, L, rng.integers(q, L + 1)]))
            total = min(max(total, q), L)
            if q == 1 and total > 1 and kind == 1:
                total = 1
        if total - q < 0 or q > budget:
            continue
        pages = -(-total // ps)
        if pages > len(free):
            continue
        reqs.append(Request(total - q, q, [int(free.pop()) for _ in range(pages)]))
        budget -= q
    return reqs or [Request(0, 1, [0])]


@pytest.mark.parametrize("config,options", [
    (TINY, {}),
    (TINY, {"skip_indexer": False}),
    (TINY, {"force_sparse": True}),
    (TINY, {"dispatch": "cond"}),
    (TINY, {"prefill_route": "masked"}),
    (dataclasses.replace(TINY, kv_cache_dtype="fp8"), {}),
], ids=["static", "baseline", "force_sparse", "cond", "masked", "fp8"])
@pytest.mark.parametrize("limits", [LIMITS, dict(num_pages=64, max_num_seqs=5, max_num_batched_tokens=48,
                                                  max_model_len=64)], ids=["small", "wider"])
def test_enumeration_covers_every_random_batch_within_the_limits(config, options, limits):
    buckets = BucketPolicy(min_tokens=8, min_seqs=2, min_pages_per_seq=2, min_dense_keys=8)
    plans = set(enumerate_plans(config, buckets, **limits, **options))
    rng = np.random.default_rng(0)
    hit = set()
    for _ in range(1500):
        reqs = random_batch(rng, config, **limits)
        plan, _ = plan_batch(config, reqs, num_pages=limits["num_pages"], buckets=buckets, **options)
        assert plan in plans, (reqs, plan)
        hit.add(plan)


@pytest.mark.parametrize("options", [{"prefill_route": "sparse"}, {"prefill_route": "masked"}, {"force_sparse": True}],
                         ids=["sparse", "masked", "force_sparse"])
def test_enumeration_is_exactly_the_reachable_set_of_small_limits(options):
    """Every batch of <= 2 requests within the limits, planned: the enumeration is that set (bf16)
    when every long prefill takes one route (prefill_route "auto" enumerates both: a superset)."""
    buckets = BucketPolicy(min_tokens=8, min_seqs=2, min_pages_per_seq=2, min_dense_keys=8)
    limits = dict(num_pages=12, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=20)
    L, B, ps = limits["max_model_len"], limits["max_num_batched_tokens"], TINY.page_size
    shapes = [(c, q) for q in range(1, B + 1) for c in range(L - q + 1)]
    reached = set()
    for n in (1, 2):
        for combo in itertools.combinations_with_replacement(shapes, n):
            if sum(q for _, q in combo) > B:
                continue
            reqs, first = [], 0
            for c, q in combo:
                pages = -(-(c + q) // ps)
                reqs.append(Request(c, q, list(range(first, first + pages))))
                first += pages
            reached.add(plan_batch(TINY, reqs, num_pages=12, buckets=buckets, **options)[0])
    assert set(enumerate_plans(TINY, buckets, **limits, **options)) == reached
    if "prefill_route" in options:
        assert reached <= set(enumerate_plans(TINY, buckets, **limits))  # "auto" holds both routes


def test_count_programs_per_route():
    counts = count_programs(TINY, BucketPolicy(), prefill_route="sparse", **LIMITS)
    assert counts["total"] == counts.get("dense", 0) + counts.get("sparse", 0) and 10 <= counts["total"] <= 40
    plans = {r: set(enumerate_plans(TINY, BucketPolicy(), prefill_route=r, **LIMITS)) for r in ("auto", "masked", "sparse")}
    assert plans["auto"] == plans["masked"] | plans["sparse"]  # "auto": either route for each long prefill
    cond = count_programs(TINY, BucketPolicy(), dispatch="cond", **LIMITS)
    assert set(cond) == {"total", "cond"} and cond["total"] < counts["total"]


def test_after_precompile_a_serving_run_compiles_nothing_and_a_new_engine_loads_every_program(tmp_path):
    """Engine.precompile lowers and compiles the engine's step program for every enumerated plan
    (one backend compile each, written to the executable store): the plans of a run are among
    them and the run compiles nothing. A second engine over the same store (a restarted server)
    loads every program, compiling and lowering none, and its run gives the first run's outputs."""
    from jax_sparse_mla.serving import Engine, Workload

    # one sequence a step: 9 programs instead of LIMITS' 41 (an XLA compile on a CPU costs ~3 s),
    # masked and unmasked steps in the run; two-sequence batches: the Engine.precompile test below
    # and the serving tests
    limits = dict(LIMITS, max_num_seqs=1)

    def engine():
        e = Engine(TINY, num_layers=1, num_pages=limits["num_pages"], max_num_seqs=limits["max_num_seqs"],
                   max_num_batched_tokens=limits["max_num_batched_tokens"], max_model_len=limits["max_model_len"],
                   kernels="xla", dispatch="static")  # static: masked and unmasked programs
        jax.block_until_ready((e.params, e.caches, e.pool))
        return e

    workload = Workload(num_requests=5, input_len=14, output_len=6, input_range_ratio=0.9, output_range_ratio=0.5,
                        seed=3)
    first = engine()
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(kw.get("fun_name")) if event == COMPILE_EVENT else None)
    # kernels "xla": what is checked is that every plan's program is built ahead of the run, whatever
    # its kernels (the interpreted Pallas ones would only make the CPU suite slower)
    report = first.precompile(store=tmp_path / "store", workers=2, progress=False)
    assert report.method == "aot" and report.num_programs == sum(report.per_route.values()) == len(report.plans)
    assert report.loaded == 0 and len(report.executables) == report.num_programs
    kw = first.options.plan_kwargs(TINY, limits["num_pages"])
    assert report.plans == tuple(enumerate_plans(TINY, kw.pop("buckets"), **limits, **kw))
    assert len(compiles) == report.num_programs and all("layer_stack" in f for f in compiles), compiles
    assert len(list((tmp_path / "store").glob("*.executable"))) == report.num_programs
    before = len(compiles)
    result = first.run(workload, progress=False, collect_outputs=True)
    assert len(result.steps) > 5
    assert {s.plan for s in result.steps} <= set(report.plans)
    assert {s.plan.masked for s in result.steps} >= {"none", "all"}  # masked MHA steps among them
    assert len(compiles) == before, compiles[before:]  # no backend compile during the run
    assert all(s.new_programs == 0 for s in result.steps)

    jax.clear_caches()  # nothing of the first engine's programs left in this process but its executables
    second = engine()
    before = len(compiles)
    loaded = second.precompile(store=tmp_path / "store", progress=False)
    assert loaded.loaded == loaded.num_programs == report.num_programs and len(compiles) == before, compiles[before:]
    again = second.run(workload, progress=False, collect_outputs=True)
    assert len(compiles) == before and [s.plan for s in again.steps] == [s.plan for s in result.steps]
    for rid, out in result.outputs.items():
        np.testing.assert_array_equal(again.outputs[rid], out)


def test_executable_store_keys_follow_everything_that_decides_the_program(tmp_path):
    """ExecutableStore.key changes with the function's name, any static argument, any argument's
    shape or dtype, and the library's source (executables.source_digest); an entry that cannot be
    loaded is a miss with a warning naming it, never an error."""
    from jax_sparse_mla import executables
    from jax_sparse_mla.executables import ExecutableStore

    store = ExecutableStore(tmp_path / "store")
    f32 = jax.ShapeDtypeStruct((4, 8), np.float32)
    base = store.key("m.f", dict(plan=1, config="a"), (f32,))
    assert base == store.key("m.f", dict(config="a", plan=1), (f32,))  # keyword order does not matter
    assert len({base, store.key("m.g", dict(plan=1, config="a"), (f32,)),
                store.key("m.f", dict(plan=2, config="a"), (f32,)),
                store.key("m.f", dict(plan=1, config="b"), (f32,)),
                store.key("m.f", dict(plan=1, config="a"), (jax.ShapeDtypeStruct((4, 9), np.float32),)),
                store.key("m.f", dict(plan=1, config="a"), (jax.ShapeDtypeStruct((4, 8), np.int32),)),
                store.key("m.f", dict(plan=1, config="a"), [f32])}) == 7
    original = executables.source_digest()
    executables.source_digest.cache_clear()
    try:
        with mock.patch.object(executables.pathlib.Path, "read_bytes", lambda self: b"other source"):
            assert store.key("m.f", dict(plan=1, config="a"), (f32,)) != base
    finally:
        executables.source_digest.cache_clear()
    assert executables.source_digest() == original
    assert store.load(base) is None  # no entry
    compiled = jax.jit(lambda x: x * 2).lower(f32).compile()
    store.save(base, compiled)
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    np.testing.assert_array_equal(store.load(base)(x), x * 2)
    (tmp_path / "store" / f"{base}.executable").write_bytes(b"truncated")
    with pytest.warns(UserWarning, match=rf"executable store: cannot load {base}.executable"):
        assert store.load(base) is None


@pytest.mark.parametrize("kernels", ["xla", "pallas"])
def test_lowering_a_program_twice_gives_one_program(kernels):
    """Lowering jit_forward twice, jit's caches cleared between, gives the same module with any
    kernels (on a GPU run of the suite "pallas" is the compiled Mosaic GPU kernels): what lets an
    ahead-of-time or another process's program be the one a later call finds."""
    from jax_sparse_mla import init_cache, init_params, jit_forward

    plan, meta = scored_plan(TINY)
    args = (jax.eval_shape(lambda: init_params(TINY, jax.random.key(0))),
            jax.ShapeDtypeStruct((plan.num_tokens, TINY.hidden_size), TINY.jnp_dtype),
            jax.eval_shape(lambda: init_cache(TINY, 8)), meta)
    texts = []
    for _ in range(2):
        jax.clear_caches()
        texts.append(jit_forward.lower(*args, plan=plan, config=TINY, kernels=kernels).as_text())
    assert texts[0] == texts[1]


def _lower_mosaic_kernel_twice() -> list[str]:
    texts = []
    for _ in range(2):
        jax.clear_caches()
        texts.append(lower_mosaic_kernel())
    return texts


def test_mosaic_gpu_kernels_lower_to_the_same_module_every_time(monkeypatch):
    """pallas_kernels.compat drops the process-wide counter jax 0.11 stamps on each Mosaic GPU
    kernel module (`mosaic_gpu.dump_basename = "<kernel>_<n>"`): the same kernel lowered twice is
    the same module (one kernel hash: compiled once a process, whichever programs hold it).
    Without the workaround the two lowerings differ exactly in that counter and the hash; when
    jax stops stamping it, the second half fails and the workaround can go."""
    import re

    from jax._src.pallas.mosaic_gpu import lowering
    from jax.experimental.mosaic.gpu import core

    # each lowering lowers the kernel (not the memo's copy of the first: test_memoized_... below)
    monkeypatch.setattr(lowering, "lower_jaxpr_to_module", lowering.lower_jaxpr_to_module.wrapped)
    texts = _lower_mosaic_kernel_twice()
    assert texts[0] == texts[1] and "mosaic_gpu_v2" in texts[0] and "dump_basename" not in texts[0]
    monkeypatch.setattr(core, "_run_serde_pass", core._run_serde_pass.wrapped)  # jax's own lowering
    texts = _lower_mosaic_kernel_twice()
    names = [re.findall(r"dump_basename\\00(\w+?)_(\d+)\\00", t) for t in texts]
    assert len(names[0]) == len(names[1]) == 1 and int(names[1][0][1]) > int(names[0][0][1]), names
    normal = [re.sub(r'kernel_hash = "(?:[^"\\]|\\.)*"', "", re.sub(r"(dump_basename\\00\w+?_)\d+", r"\1", t))
              for t in texts]
    assert texts[0] != texts[1] and normal[0] == normal[1]


def _lower_indexer_decode(keys: int, outer) -> str:
    """The Mosaic GPU indexer decode kernel (fp8, 2 rows, `keys` keys) inside the program `outer`
    (a function of the kernel's output), lowered for the GPU on any machine: the program's text."""
    import functools

    from pallas_kernels.indexer_logits import indexer_logits
    from tests.support.cases import FP8

    sd = jax.ShapeDtypeStruct
    args = (sd((2, 64, 128), FP8), sd((2, 64), jnp.float32), sd((keys, 128), FP8), sd((keys,), jnp.float32),
            sd((2, keys // 64), jnp.int32), sd((2,), jnp.int32), sd((2,), jnp.int32))
    kernel = functools.partial(indexer_logits, page_size=64, implementation="mosaic", kernel="decode")
    return jax.jit(lambda *a: outer(kernel(*a))).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_memoized_mosaic_gpu_lowering_lowers_each_kernel_once_and_changes_nothing(monkeypatch):
    """pallas_kernels.compat lowers a Mosaic GPU kernel once a process: the same kernel in a second
    program (another program around it, jit's caches cleared) is the memo's copy, and each
    program's text is the text of lowering it without the memo; a kernel of other shapes is a new
    lowering (no false hit)."""
    from jax._src.pallas.mosaic_gpu import lowering

    memo = lowering.lower_jaxpr_to_module
    jax_lower, jax_lowerings = memo.wrapped, []

    def count(*args, **kwargs):
        jax_lowerings.append(args[7])  # the kernel's jaxpr
        return jax_lower(*args, **kwargs)

    monkeypatch.setattr(memo, "wrapped", count)
    memo.cache.clear()
    programs = [(1024, lambda y: y), (1024, lambda y: y * 2.0), (2048, lambda y: y * 2.0)]
    texts = []
    for keys, outer in programs:
        jax.clear_caches()
        texts.append(_lower_indexer_decode(keys, outer))
    assert len(jax_lowerings) == 2 and len(memo.cache) == 2  # 1024 keys once (two programs), 2048 once
    monkeypatch.setattr(lowering, "lower_jaxpr_to_module", jax_lower)  # jax's own lowering, every time
    for (keys, outer), text in zip(programs, texts):
        jax.clear_caches()
        assert _lower_indexer_decode(keys, outer) == text
    assert texts[0] != texts[1] != texts[2]


def _closure_kernel(barrier: int):
    """A Mosaic GPU kernel whose inline PTX comes from a closure over `barrier`: two of them print
    the same jaxpr (the closure is a parameter jax prints as an address it masks)."""
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def body(ctx, x, o):
        mgpu_utils.inline_ptx(f"bar.sync {barrier}, 128;", has_side_effects=True, convergent=True)

    def entry(x_ref, o_ref):
        plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))(body)(x_ref, o_ref)

    kernel = plgpu.kernel(entry, out_type=jax.ShapeDtypeStruct((128,), jnp.float32), grid=(1,), grid_names=("x",))
    return jax.jit(kernel).trace(jax.ShapeDtypeStruct((128,), jnp.float32)).lower(
        lowering_platforms=("cuda",)).as_text()


def test_memoized_lowering_never_shares_a_kernel_its_jaxpr_does_not_tell_apart():
    """Kernels that differ only in what a closure captured lower separately, each to its own PTX."""
    texts = []
    for barrier in (1, 2):
        jax.clear_caches()
        texts.append(_closure_kernel(barrier))
    assert "bar.sync 1, 128" in texts[0] and "bar.sync 2, 128" in texts[1]


def test_aot_precompile_raises_the_first_plan_that_fails_to_lower():
    """A plan whose program fails to trace or lower stops precompile with that error (the plans
    queued behind it are not compiled first)."""
    plan, _ = scored_plan(TINY)
    identity, calls = jax.jit(lambda x: x), []

    def program(p):
        calls.append(p)
        if len(calls) == 2:
            raise ValueError("plan 2 does not lower")
        return identity, (np.zeros(2, np.float32),), {}

    with pytest.raises(ValueError, match="plan 2 does not lower"):
        precompile(TINY, plans=[plan] * 4, num_pages=8, max_num_seqs=2, max_num_batched_tokens=16, method="aot",
                   program=program, workers=1, progress=False)
    assert len(calls) == 2  # nothing traced past the failing plan


def test_precompile_refuses_an_unknown_method_and_aot_options_for_call(tmp_path):
    """Any other method than "call" or "aot", store / workers / program with "call", and a store
    for a program that is not a module-level function of the library are a ValueError before
    anything compiles."""
    plan, _ = scored_plan(TINY)
    kw = dict(plans=[plan], num_pages=8, max_num_seqs=2, max_num_batched_tokens=16, progress=False)
    with pytest.raises(ValueError, match="method must be 'call' or 'aot', got 'auto'"):
        precompile(TINY, **kw, method="auto")
    for option in (dict(store="somewhere"), dict(workers=2), dict(program=lambda p: None)):
        with pytest.raises(ValueError, match="store, workers and program are for method='aot'"):
            precompile(TINY, **kw, **option)
    with pytest.raises(ValueError, match="workers must be"):
        precompile(TINY, **kw, method="aot", workers=0)
    # a store keys a program by its function's name: a lambda's does not tell two programs apart
    program = lambda plan: (jax.jit(lambda x: x + 1.0), (np.zeros(2, np.float32),), {})  # noqa: E731
    with pytest.raises(ValueError, match="store= needs program functions defined at module level"):
        precompile(TINY, **kw, method="aot", store=tmp_path / "store", program=program)
    assert not (tmp_path / "store").exists()  # refused before anything is written


def test_aot_precompile_serves_the_plan_from_the_persistent_cache(tmp_path):
    """method="aot" for one sparse plan (kernels "pallas": interpreted on a CPU, compiled Mosaic GPU
    and Triton kernels on a GPU) writes its program to the persistent cache, and a jit_forward
    call of that plan on real inputs, with jit's in-memory caches cleared, loads it from there."""
    from jax_sparse_mla import init_cache, init_params, jit_forward

    kernels = "pallas"
    plan, meta = scored_plan(TINY)
    events = []
    jax.monitoring.register_event_listener(lambda event, **kw: events.append(event))
    saved = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs,
             jax.config.jax_persistent_cache_min_entry_size_bytes)
    try:
        jax.clear_caches()  # an earlier test of this process may have compiled the same program
        report = precompile(TINY, plans=[plan], num_pages=8, max_num_seqs=2, max_num_batched_tokens=16,
                            kernels=kernels, method="aot", cache_dir=str(tmp_path / "jax_cache"), progress=False)
        assert report.method == "aot" and report.plans == (plan,) and len(report.executables) == 1
        assert events.count(_CACHE_MISS) == 1 and any(os.scandir(tmp_path / "jax_cache"))
        jax.clear_caches()  # the call below can only find the program in the persistent cache
        params, cache = init_params(TINY, jax.random.key(0)), init_cache(TINY, 8)
        x = jax.random.normal(jax.random.key(1), (plan.num_tokens, TINY.hidden_size), TINY.jnp_dtype)
        del events[:]
        out, _ = jit_forward(params, x, cache, meta, plan=plan, config=TINY, kernels=kernels)
        out.block_until_ready()
    finally:  # the persistent cache is process-wide: point it back for the rest of the session
        enable_persistent_cache(saved[0], min_compile_time_s=saved[1], min_entry_size_bytes=saved[2])
    assert events.count(_CACHE_HIT) == 1 and _CACHE_MISS not in events, events  # loaded, not compiled
    assert np.isfinite(np.asarray(out, np.float32)).all()


_RESTART = """
import json, sys
import jax, numpy as np
from jax_sparse_mla import MLAConfig, init_cache, init_params, jit_forward
from jax_sparse_mla.precompile import precompile
from tests.support import lower_mosaic_kernel, scored_plan
if sys.argv[2] == "shifted":  # another Mosaic GPU kernel lowered first: jax's own names would count on
    lower_mosaic_kernel()
config = MLAConfig.tiny()
plan, meta = scored_plan(config)
params, cache = init_params(config, jax.random.key(0)), init_cache(config, 8)
x = jax.random.normal(jax.random.key(1), (plan.num_tokens, config.hidden_size), config.jnp_dtype)
events = []
jax.monitoring.register_event_listener(lambda event, **kw: events.append(event))
report = precompile(config, plans=[plan], num_pages=8, max_num_seqs=2, max_num_batched_tokens=16,
                    kernels="pallas", cache_dir=sys.argv[1], progress=False)
warm = list(events)
out, _ = jit_forward(params, x, cache, meta, plan=plan, config=config, kernels="pallas")
print("RESULT " + json.dumps(dict(method=report.method, warm=warm, call=events[len(warm):],
                                  finite=bool(np.isfinite(np.asarray(out, np.float32)).all()))))
"""


@pytest.mark.gpu
def test_precompile_with_mosaic_kernels_serves_a_restarted_process_from_the_persistent_cache(tmp_path):
    """Compiled Mosaic GPU kernels: after precompile ("call") the call compiles nothing, and a
    second process loads the program from the persistent cache the first one wrote, though it
    lowered another Mosaic GPU kernel first (its kernels lower to the same modules in any order)."""
    # this process may hold most of the GPU: the children allocate as they go
    runs = [run_python(_RESTART, str(tmp_path / "jax_cache"), order, env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
                       timeout=600) for order in ("first", "shifted")]
    for run in runs:
        assert run["method"] == "call" and run["finite"]
        assert _CACHE_HIT not in run["call"] and _CACHE_MISS not in run["call"], run  # nothing to compile
    assert runs[0]["warm"].count(_CACHE_MISS) >= 1  # the first process compiled and wrote the cache
    assert runs[1]["warm"].count(_CACHE_HIT) >= 1 and _CACHE_MISS not in runs[1]["warm"], runs[1]  # loaded


_STORE_RESTART = """
import hashlib, json, sys
import jax, numpy as np
from jax_sparse_mla import MLAConfig, init_cache, init_params
from jax_sparse_mla.precompile import precompile
from tests.support import COMPILE_EVENT, scored_plan
config = MLAConfig.tiny()
plan, meta = scored_plan(config)
params, cache = init_params(config, jax.random.key(0)), init_cache(config, 8)
x = jax.random.normal(jax.random.key(1), (plan.num_tokens, config.hidden_size), config.jnp_dtype)
compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, secs, **kw: compiles.append(event) if event == COMPILE_EVENT else None)
report = precompile(config, plans=[plan], num_pages=8, max_num_seqs=2, max_num_batched_tokens=16,
                    kernels="pallas", method="aot", store=sys.argv[1], progress=False)
out, _ = report.executables[0](params, x, cache, meta)
out = np.asarray(out, np.float32)
print("RESULT " + json.dumps(dict(loaded=report.loaded, compiles=len(compiles), finite=bool(np.isfinite(out).all()),
                                  digest=hashlib.sha256(out.tobytes()).hexdigest())))
"""


@pytest.mark.gpu
def test_a_restarted_process_loads_its_mosaic_kernel_program_from_the_store(tmp_path):
    """Compiled Mosaic GPU and Triton kernels in an executable store: the first process compiles
    the program and writes it, a second loads it (no backend compile, no lowering) and its output
    is the first's, bit for bit."""
    runs = [run_python(_STORE_RESTART, str(tmp_path / "store"), env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
                       timeout=600) for _ in range(2)]
    assert runs[0]["loaded"] == 0 and runs[0]["compiles"] >= 1 and runs[0]["finite"], runs[0]
    assert runs[1]["loaded"] == 1 and runs[1]["compiles"] == 0, runs[1]
    assert runs[1]["digest"] == runs[0]["digest"]


def test_engine_precompile_leaves_nothing_to_compile():
    """Engine.precompile (the engine's cond programs, default kernels): a run then compiles nothing
    at all (no backend compile of any function, and no new dispatch entry of the engine's step:
    every StepRecord.new_programs is 0)."""
    from jax_sparse_mla.serving import Engine, Workload

    engine = Engine(TINY, num_layers=2, num_pages=LIMITS["num_pages"], max_num_seqs=LIMITS["max_num_seqs"],
                    max_num_batched_tokens=LIMITS["max_num_batched_tokens"], max_model_len=LIMITS["max_model_len"])
    report = engine.precompile(progress=False)
    assert report.per_route == {"cond": report.num_programs} and report.method == "aot"
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(kw.get("fun_name")) if event == COMPILE_EVENT else None)
    result = engine.run(Workload(num_requests=4, input_len=12, output_len=5, input_range_ratio=0.9, seed=1),
                        progress=False)
    assert compiles == [] and all(s.new_programs == 0 for s in result.steps)


def test_count_programs_signature_names_the_limits_it_needs():
    """count_programs takes enumerate_plans's arguments by name (help() shows them), so a call
    without the limits is a TypeError naming count_programs and the missing ones."""
    import inspect

    assert inspect.signature(count_programs).parameters == inspect.signature(enumerate_plans).parameters
    with pytest.raises(TypeError, match=r"count_programs\(\) missing 3 required keyword-only arguments: "
                                        r"'num_pages', 'max_num_seqs', and 'max_num_batched_tokens'"):
        count_programs(TINY)
    routes = [p.route for p in enumerate_plans(TINY, **LIMITS)]
    assert count_programs(TINY, **LIMITS) == {"total": len(routes), **{r: routes.count(r) for r in set(routes)}}


@pytest.mark.parametrize("options", [
    dict(tensor_parallel=3), dict(tensor_parallel=8), dict(tensor_parallel=0), dict(tensor_parallel=True),
    dict(tensor_parallel=2.0), dict(dispatch="dynamic"), dict(dispatch=None), dict(buckets=None),
    dict(buckets=dict(min_tokens=8)), dict(num_pages=0), dict(num_pages=2.5), dict(num_pages=True),
    dict(num_pages=2 ** 29 + 1), dict(prefill_route="dense"), dict(prefill_route=None), dict(force_sparse=1),
    dict(force_sparse=None), dict(skip_indexer="yes"), dict(skip_indexer=0),
])
def test_enumeration_refuses_the_options_plan_batch_refuses(options):
    """enumerate_plans and count_programs check the options they share with plan_batch as it does
    (tensor_parallel 3 or 8 does not divide the tiny config's 4 heads): the same ValueError."""
    options = {"num_pages": LIMITS["num_pages"], **options}
    buckets = options.pop("buckets", BucketPolicy())
    with pytest.raises(ValueError) as planned:
        plan_batch(TINY, [Request(0, 5, [0, 1])], buckets=buckets, **options)
    limits = {**LIMITS, **options}
    for enumerate_ in (enumerate_plans, count_programs):
        with pytest.raises(ValueError) as enumerated:
            enumerate_(TINY, buckets, **limits)
        assert str(enumerated.value) == str(planned.value)


def test_enumeration_needs_num_pages_and_an_mla_config():
    with pytest.raises(ValueError, match="num_pages must be a positive int .* got None"):
        enumerate_plans(TINY, **{**LIMITS, "num_pages": None})
    with pytest.raises(ValueError, match="config must be an MLAConfig, got dict"):
        count_programs({}, **LIMITS)
    assert count_programs(TINY, **LIMITS, tensor_parallel=2)["total"] > 0  # 2 divides 4 heads


@pytest.mark.parametrize("options,stage_sets", [
    ({}, [(False, True), (True, False), (True, True)]), ({"prefill_route": "sparse"}, [(False, True), (True, False), (True, True)]),
    ({"force_sparse": True}, [(False, True)]),
], ids=["auto", "sparse", "force_sparse"])
def test_serving_program_set_is_the_stage_sets_of_each_row_bucket(options, stage_sets):
    """dispatch="cond" under BucketPolicy.for_limits: every batch within the limits plans one of
    the enumerated plans, which are one per row bucket (sequence count and table width fixed at
    the limits) and stage set a batch of it may need (the dense call, the sparse stages, both),
    and every one is reached by some batch: the count is exact."""
    limits = dict(num_pages=64, max_num_seqs=5, max_num_batched_tokens=48, max_model_len=64)
    buckets = BucketPolicy.for_limits(TINY, max_num_seqs=5, max_model_len=64, num_pages=64)
    plans = enumerate_plans(TINY, buckets, dispatch="cond", **limits, **options)
    assert sorted((p.num_tokens, bool(p.num_dense_keys), bool(p.num_sparse_tokens)) for p in plans) == sorted(
        (T, *stages) for T in (16, 32, 64) for stages in stage_sets)
    assert {(p.num_seqs, p.pages_per_seq) for p in plans} == {(8, 16)}  # (powers of two)
    assert count_programs(TINY, buckets, dispatch="cond", **limits, **options) == {"total": len(plans), "cond": len(plans)}
    rng = np.random.default_rng(1)
    short_prefills = [[Request(0, 16, [4 * i + j for j in range(4)]) for i in range(n)] for n in (2, 3)]
    hit = set()
    for reqs in [random_batch(rng, TINY, **limits) for _ in range(300)] + short_prefills:
        plan, _ = plan_batch(TINY, reqs, num_pages=64, buckets=buckets, dispatch="cond", **options)
        assert plan in plans, (reqs, plan)
        hit.add(plan)
    assert hit == set(plans)


def test_serving_program_set_at_deepseek_limits():
    """The set an engine serving DeepSeek-V3.2 compiles: 65536 pages, 256 sequences, 8192 tokens a
    step, 131072-token requests: 30 cond programs, one per row bucket (16 .. 8192) and stage set,
    against 105,972 static plans under the default buckets."""
    config = MLAConfig.deepseek_v32()
    limits = dict(num_pages=65536, max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=131072)
    buckets = BucketPolicy.for_limits(config, max_num_seqs=256, max_model_len=131072, num_pages=65536)
    plans = enumerate_plans(config, buckets, dispatch="cond", **limits)
    assert sorted((p.num_tokens, bool(p.num_dense_keys), bool(p.num_sparse_tokens)) for p in plans) == sorted(
        (16 << i, *stages) for i in range(10) for stages in [(False, True), (True, False), (True, True)])
    assert {(p.num_seqs, p.pages_per_seq) for p in plans} == {(256, 2048)}
    assert all(p.key_sizes[-1] == p.num_dense_keys == 4 * p.num_tokens for p in plans if p.num_dense_keys)
