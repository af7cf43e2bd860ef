"""Decode runs (EngineOptions.decode_steps): several decode steps in one dispatch, the batch moved
on the device. Each token equals the one a step-by-step run gives, runs happen only where they
are safe (every request decoding, none waiting, enough tokens left, max_steps), and the program
set and warm-up cover them."""

import dataclasses

import jax
import numpy as np
import pytest

from jax_sparse_mla import MLAConfig
from jax_sparse_mla.model import advance_decodes
from jax_sparse_mla.plan import check_arrays, plan_host
from jax_sparse_mla.serving import Engine, EngineOptions, RequestSpec, Workload
from tests.support import compiled_functions, oracle_error

TINY = MLAConfig.tiny()  # page 4, index_topk 16
KW = dict(num_layers=2, num_pages=40, max_num_batched_tokens=32, max_num_seqs=3, seed=4)


def _runs(result):
    """[(first step index, steps)] of the decode runs of a ServeResult."""
    out, i = [], 0
    while i < len(result.steps):
        k = result.steps[i].dispatch_steps
        out.append((i, k))
        i += k
    return [(i, k) for i, k in out if k > 1]


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8"])
def test_decode_runs_give_every_token_of_the_step_by_step_run(kv_cache_dtype):
    """Runs of 4 over ragged requests (their decodes cross page boundaries inside a run, one
    request finishes at a run's last step) give the step-by-step outputs exactly, and the oracle's;
    every token is one StepRecord."""
    config = dataclasses.replace(TINY, kv_cache_dtype=kv_cache_dtype)
    specs = [RequestSpec(0, 10, 9), RequestSpec(1, 7, 13), RequestSpec(2, 13, 5)]
    results = {k: Engine(config, **KW).run(specs, progress=False, collect_outputs=True, decode_steps=k) for k in (1, 4)}
    runs = _runs(results[4])
    assert runs and all(k == 4 for _, k in runs)
    assert len(results[4].steps) == len(results[1].steps)
    assert sum(len(m.token_times_s) for m in results[4].requests) == sum(s.output_len for s in specs)
    run_ends = [results[4].steps[i + k - 1] for i, k in runs]
    assert any(m.token_times_s[-1] == pytest.approx(s.start_s + s.duration_s, abs=1e-9)
               for m in results[4].requests for s in run_ends)  # a request's last token: a run's last step
    for spec in specs:
        np.testing.assert_array_equal(results[4].outputs[spec.id], results[1].outputs[spec.id])
    engine = Engine(config, **KW)
    worst, decided = oracle_error(engine, results[4], specs)
    assert decided > 50 and worst < 1e-4, worst


def test_decode_runs_wait_for_the_queue_and_respect_max_steps():
    """No run while a request waits for a slot (max_num_seqs 2, four requests at once) or while one
    has fewer tokens left than a run; max_steps counts a run's steps and is met exactly."""
    specs = [RequestSpec(i, 6, 12) for i in range(4)]
    result = Engine(TINY, **{**KW, "max_num_seqs": 2}).run(specs, progress=False, decode_steps=4)
    last_admission = max(i for i, s in enumerate(result.steps) if s.num_prefills)
    runs = _runs(result)
    assert runs and all(i > last_admission for i, _ in runs)  # the first pair decodes step by step
    assert all(s.dispatch_steps == 1 for s in result.steps[-3:])  # (the last 3 tokens: too few for a run)
    for max_steps in (5, 6, 9):
        cut = Engine(TINY, **KW).run(specs[:2], progress=False, decode_steps=4, max_steps=max_steps)
        assert len(cut.steps) == max_steps


def test_a_decode_run_is_timed_as_its_steps():
    """A run's records share its times evenly and tile the run's clock like single steps."""
    result = Engine(TINY, **KW).run([RequestSpec(0, 5, 9)], progress=False, decode_steps=4)
    (first, k), *_ = _runs(result)
    steps = result.steps[first:first + k]
    assert len({(s.duration_s, s.host_s, s.plan_s, s.launch_s, s.device_s) for s in steps}) == 1
    assert [s.index for s in steps] == list(range(first, first + k))
    for a, b in zip(result.steps, result.steps[1:]):
        assert b.start_s == pytest.approx(a.start_s + a.duration_s)


def test_advance_decodes_moves_positions_and_slots_over_page_boundaries():
    """The device-side move of a decode batch equals the host plan of the batch at those lengths
    (positions, slot of each row; padding rows stay -1), forwards and backwards."""
    kw = EngineOptions().plan_kwargs(TINY, 64)
    tables = np.array([[5, 9, 2, 7, -1], [11, 3, 8, 0, 6]], np.int32)
    ctx = np.array([6, 13])

    def planned(c):
        return plan_host(TINY, check_arrays(TINY, c, np.ones(2, np.int64), tables, num_pages=64, **kw)[0],
                         num_pages=64, **kw)

    plan, meta = planned(ctx + 3)
    moved = jax.jit(advance_decodes, static_argnums=2)
    for k in range(-3, 1):
        want = planned(ctx + 3 + k)[1]
        got = moved(jax.tree.map(np.asarray, meta), np.int32(k), TINY.page_size)
        np.testing.assert_array_equal(got.positions, want.positions)
        np.testing.assert_array_equal(got.slot_mapping, want.slot_mapping)
        assert (np.asarray(got.positions)[2:] == -1).all()


def test_warmup_and_precompile_cover_the_decode_runs():
    """Engine.warmup with decode_steps compiles the runs' programs too: the run compiles nothing.
    EngineOptions.decode_run_plans is the plan of every decode batch of the set (cond: one a row
    bucket), each a plan of the program set."""
    jax.clear_caches()
    # (one-token prompts: a batch of them has query lengths 1 and is no decode batch)
    for w in (Workload(3, input_len=8, output_len=10, input_range_ratio=0.5, concurrency=3, seed=1),
              [RequestSpec(0, 1, 9), RequestSpec(1, 1, 9)]):
        engine = Engine(TINY, **KW)
        assert engine.warmup(w, decode_steps=4) == len(engine._executables) > 0
        used = set()
        forward = engine._forward

        def recording(plan, meta, rows, kernels, steps=1, forward=forward, used=used):
            used.add((plan, kernels, steps))
            return forward(plan, meta, rows, kernels, steps)

        engine._forward = recording
        with compiled_functions() as compiled:
            result = engine.run(w, progress=False, decode_steps=4)
        assert compiled == [], compiled
        assert _runs(result) and sum(s.new_programs for s in result.steps) == 0
        assert used == set(engine._executables)  # and it compiled only what the run calls

    opts = EngineOptions(max_num_seqs=3, max_num_batched_tokens=32, max_model_len=40, decode_steps=4)
    decode_plans = opts.decode_run_plans(TINY, 40)
    assert decode_plans and set(decode_plans) <= set(opts.program_set(TINY, 40))
    kw = opts.plan_kwargs(TINY, 40)
    rng = np.random.default_rng(0)
    for _ in range(20):  # any decode batch under the limits plans to one of them
        n = int(rng.integers(1, 4))
        ctx = rng.integers(1, 37, n)
        tables = np.arange(n * 10, dtype=np.int32).reshape(n, 10)
        plan, _ = plan_host(TINY, check_arrays(TINY, ctx, np.ones(n, np.int64), tables, num_pages=40, **kw)[0],
                            num_pages=40, **kw)
        assert plan in decode_plans
    assert EngineOptions().decode_run_plans(TINY, 40) == []


def test_a_request_arriving_during_a_run_waits_in_its_ttft():
    """A request's arrival is its spec's time, not the moment the loop gets back to it after the
    run in flight: that wait is in its time to first token."""
    specs = [RequestSpec(0, 5, 30), RequestSpec(1, 5, 3, arrival_s=1e-4), RequestSpec(2, 6, 3, arrival_s=2e-4)]
    result = Engine(TINY, **KW).run(specs, progress=False, decode_steps=8)
    assert [m.arrival_s for m in result.requests] == [s.arrival_s for s in specs]
    assert all(m.ttft_s > 0 for m in result.requests)


def test_decode_run_options_that_could_never_apply_are_refused():
    """decode_steps past what a request of max_model_len can output, and decode-run programs asked
    for with decode_steps 1, are refused before anything compiles."""
    engine = Engine(TINY, **{**KW, "max_model_len": 12})
    with pytest.raises(ValueError, match="decode_steps = 12: a decode run needs .* at most 11"):
        engine.run([RequestSpec(0, 4, 4)], progress=False, decode_steps=12)
    plan = EngineOptions(max_model_len=12, decode_steps=2).decode_run_plans(TINY, 40)[0]
    with pytest.raises(ValueError, match="decode_plans needs decode_steps > 1"):
        engine.precompile(plans=[], decode_plans=[plan])
    with pytest.raises(ValueError, match="decode_runs needs decode_steps > 1"):
        engine.compile_batches([], decode_runs=[[]])
    assert engine._executables == {}
