"""The benchmark scripts on the CPU (their --smoke runs; nothing here checks a timing): the layer
bench's --profile attribution (a real CPU trace; XLA:GPU trace events, with and without command
buffers, over a small compiled module) and the warm-up bench's cold and restarted phases."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"


def _run(script: str, *args: str, cwd: pathlib.Path) -> str:
    """Runs scripts/<script> with args in a fresh process of this checkout -> its stdout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(SCRIPTS / script), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def bench_layer():
    spec = importlib.util.spec_from_file_location("bench_layer", SCRIPTS / "bench_layer.py")
    module = sys.modules["bench_layer"] = importlib.util.module_from_spec(spec)  # (its dataclass looks itself up)
    spec.loader.exec_module(module)
    return module


def test_layer_profile_attributes_a_cond_step_to_its_scopes(tmp_path):
    """--profile on the CPU: nearly all of the traced op time maps to an instruction and most of
    it to the named scopes, in the static program (also compiled with command buffers off: the
    same output) and in the cond one (whose work runs inside
    the conditional's branches: spread over the scopes, dense_mha among them; also compiled with
    its conditionals in the graphs and with graphs between them: the same output), and the table prints each variant's scopes
    and coverage, and every row its dispatch time."""
    out = _run("bench_layer.py", "--smoke", "--kv", "bf16", "--kinds", "mixed_12_4x40", "--variants",
               "static,static_graphs_off,cond,cond_graphs,cond_graphs_around", "--profile", str(tmp_path / "profile"),
               "--out", str(tmp_path / "rows.json"), cwd=tmp_path)
    rows = {r["variant"]: r for r in json.loads((tmp_path / "rows.json").read_text())["rows"]}
    assert set(rows) == {"static", "static_graphs_off", "cond", "cond_graphs", "cond_graphs_around"}
    # the static and the cond program, each compiled with other options: the same outputs
    assert rows["static_graphs_off"]["rel_err"] == 0
    assert rows["cond_graphs"]["rel_err"] == rows["cond_graphs_around"]["rel_err"] == rows["cond"]["rel_err"]
    for r in rows.values():
        assert r["dispatch_ms"] > 0 and r["temp_mb"] > 0  # (its compiled workspace)
        ms, traced = r["profile_ms_per_step"], r["profile_traced_ms"]
        assert traced > 0 and sum(ms.values()) == pytest.approx(traced)
        assert r["profile_attributed_share"] > 0.95 and r["profile_named_share"] > 0.7, (
            r["variant"], r["profile_attributed_share"], r["profile_named_share"],
            r["profile_ops_ms_per_step"].get("(unattributed)"))  # (the events no instruction claimed)
        # every stage's scope has time (the dense call runs inside a conditional's branch)
        assert {"projections", "cache_write", "indexer_logits", "dense_mha", "o_proj"} <= {s for s, t in ms.items() if t > 0}
        # its largest ops: at most TOP_OPS a scope, by time, together at most the scope's time
        for scope, ops in r["profile_ops_ms_per_step"].items():
            times = [t for _, t in ops]
            assert 0 < len(ops) <= 4 and times == sorted(times, reverse=True)
            assert sum(times) <= ms[scope] * (1 + 1e-9), (scope, ops)
        assert r["profile_ops_ms_per_step"]["projections"][0][1] > 0
    assert out.count("traced op time") == 5 and out.count("% in named scopes") == 5
    assert out.count("(unattributed)") == 5 and out.count("dense_mha") >= 5


# A compiled module as XLA prints it: a cuBLAS GEMM, a scatter, a conditional whose branches run a
# fusion, a Mosaic GPU and a Triton kernel (branch 0) or an unannotated copy and a Triton kernel
# (branch 1), then an op outside the named scopes (_nonfinite_rows, by its stack frame) and o_proj.
_HLO = """HloModule jit_forward, is_scheduled=true

FileNames
1 "/src/jax_sparse_mla/model.py"

FunctionNames
1 "forward"
2 "_nonfinite_rows"
3 "PlanJit.lower"

FileLocations
1 {file_name_id=1 function_name_id=1 line=1 end_line=1 column=1 end_column=2}
2 {file_name_id=1 function_name_id=2 line=2 end_line=2 column=1 end_column=2}
3 {file_name_id=1 function_name_id=3 line=3 end_line=3 column=1 end_column=2}

StackFrames
1 {file_location_id=1 parent_frame_id=4}
2 {file_location_id=2 parent_frame_id=2}
3 {file_location_id=3 parent_frame_id=0}

%fused_neg (p.0: f32[4]) -> f32[4] {
  %p.0 = f32[4]{0} parameter(0)
  ROOT %neg.0 = f32[4]{0} negate(%p.0), metadata={op_name="jit(forward)/projections/neg"}
}

%branch_0 (arg.0: (f32[4])) -> (f32[4]) {
  %arg.0 = (f32[4]{0}) parameter(0)
  %gte.0 = f32[4]{0} get-tuple-element(%arg.0), index=0
  %loop_neg_fusion.2 = f32[4]{0} fusion(%gte.0), kind=kLoop, calls=%fused_neg, metadata={op_name="jit(forward)/cond/branch_0_fun/sparse_attention/neg"}
  %mpmd_map.1 = f32[4]{0} custom-call(%loop_neg_fusion.2), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(forward)/cond/branch_0_fun/sparse_attention/entry/mpmd_map"}
  %pallas_call.5 = f32[4]{0} custom-call(%mpmd_map.1), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(forward)/cond/branch_0_fun/indexer_topk/topk_select/pallas_call"}
  ROOT %tuple.0 = (f32[4]{0}) tuple(%pallas_call.5)
}

%branch_1 (arg.1: (f32[4])) -> (f32[4]) {
  %arg.1 = (f32[4]{0}) parameter(0)
  %gte.1 = f32[4]{0} get-tuple-element(%arg.1), index=0
  %copy.3 = f32[4]{0} copy(%gte.1)
  %pallas_call.2 = f32[4]{0} custom-call(%copy.3), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(forward)/cond/branch_1_fun/dense_mha/flash/pallas_call"}
  ROOT %tuple.1 = (f32[4]{0}) tuple(%pallas_call.2)
}

ENTRY %main.9 (x.1: f32[4], flag.1: s32[]) -> f32[4] {
  %x.1 = f32[4]{0} parameter(0)
  %flag.1 = s32[] parameter(1)
  %loop_neg_fusion = f32[4]{0} fusion(%x.1), kind=kLoop, calls=%fused_neg, metadata={op_name="jit(forward)/projections/neg"}
  %custom-call.1 = (f32[4]{0}, s8[16]{0}) custom-call(%loop_neg_fusion), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(forward)/projections/dot_general"}
  %gte.2 = f32[4]{0} get-tuple-element(%custom-call.1), index=0
  %input_scatter_fusion = f32[4]{0} fusion(%gte.2), kind=kLoop, calls=%fused_neg, metadata={op_name="jit(forward)/cache_write/scatter"}
  %tuple.2 = (f32[4]{0}) tuple(%input_scatter_fusion)
  %cond.1 = (f32[4]{0}) conditional(%flag.1, %tuple.2, %tuple.2), branch_computations={%branch_0, %branch_1}, metadata={op_name="jit(forward)/cond" stack_frame_id=1}
  %gte.3 = f32[4]{0} get-tuple-element(%cond.1), index=0
  %loop_select_fusion = f32[4]{0} fusion(%gte.3), kind=kLoop, calls=%fused_neg, metadata={op_name="jit(forward)/select_n" stack_frame_id=2}
  %custom-call.2 = (f32[4]{0}, s8[16]{0}) custom-call(%loop_select_fusion), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(forward)/o_proj/dot_general"}
  ROOT %gte.4 = f32[4]{0} get-tuple-element(%custom-call.2), index=0
}
"""

# one step's kernels on the stream: (name, hlo_op or None, us); "command_buffer_1": XLA:GPU's
# command buffers, which launch their kernels under the buffer's name
_PLAIN = [("loop_neg_fusion", "loop_neg_fusion", 2), ("nvjet_sm90_tss_64x8_TNN", "custom-call.1", 10),
          ("input_scatter_fusion", "input_scatter_fusion", 1), ("MemcpyD2H", "cond.1", 0.5),
          ("MemcpyD2D", "copy.3", 1), ("flash", "pallas_call.2", 20), ("loop_select_fusion", "loop_select_fusion", 1),
          ("nvjet_sm90_tss_128x64_TNT", "custom-call.2", 5), ("Memset", None, 0.5)]
_COMMAND_BUFFER = [("loop_neg_fusion", 2), ("nvjet_sm90_tss_64x8_TNN", 10), ("input_scatter_fusion", 1),
                   ("set_case_condition", 0.5), ("loop_neg_fusion_2", 3), ("entry_mosaic_gpu_kernel", 30),
                   ("topk_select__2", 4), ("loop_select_fusion", 1), ("nvjet_sm90_tss_128x64_TNT", 5)]


def _gpu_trace(directory: pathlib.Path, kernels, steps: int = 3) -> None:
    """A trace viewer file as jax.profiler.trace writes it on a GPU: the kernels of `steps` steps
    on the device's stream line, each also on the derived "XLA Ops" line, and a host event."""
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 1, "tid": 14, "name": "thread_name", "args": {"name": "Stream #14(Compute)"}},
            {"ph": "M", "pid": 1, "tid": 2, "name": "thread_name", "args": {"name": "XLA Ops"}},
            {"ph": "M", "pid": 701, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 701, "tid": 1, "name": "thread_name", "args": {"name": "python3"}}]
    events, ts = [{"ph": "X", "pid": 701, "tid": 1, "ts": 0, "dur": 500, "name": "PjitFunction(forward)"}], 0.0
    for _ in range(steps):
        for name, op, dur in kernels:
            args = {"hlo_module": "jit_forward", "correlation_id": "1"} | ({"hlo_op": op} if op else {})
            events.append({"ph": "X", "pid": 1, "tid": 14, "ts": ts, "dur": dur, "name": name, "args": args})
            events.append({"ph": "X", "pid": 1, "tid": 2, "ts": ts, "dur": dur, "name": op or name, "args": args})
            ts += dur + 1
    directory.mkdir(parents=True)
    with gzip.open(directory / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": meta + events}, f)


def test_layer_profile_matches_gpu_kernels_to_instructions(bench_layer, tmp_path):
    """XLA:GPU's events: by their hlo_op where it names the instruction (the conditional's
    predicate copy is control flow; an unannotated copy takes its user's scope), by the kernel's
    name under a command buffer (fusions; Mosaic GPU and Triton kernels by their custom call's
    op_name), and a cuBLAS kernel there by the unmatched instruction scheduled between its
    neighbours; the "XLA Ops" line is not counted twice."""
    scopes = bench_layer.HloScopes(_HLO)
    assert scopes.scope["copy.3"] == "dense_mha" and scopes.scope["cond.1"] == "(control flow)"
    assert scopes.scope["loop_select_fusion"] == "_nonfinite_rows" and scopes.scope["mpmd_map.1"] == "sparse_attention"
    _gpu_trace(tmp_path / "plain", _PLAIN)
    plain = bench_layer.trace_breakdown(str(tmp_path / "plain"), scopes, steps=3)
    assert plain["ms"] == pytest.approx({"projections": 0.012, "cache_write": 0.001, "(control flow)": 0.0005,
                                         "dense_mha": 0.021, "_nonfinite_rows": 0.001, "o_proj": 0.005,
                                         "(unattributed)": 0.0005})
    assert plain["traced_ms"] == pytest.approx(0.041) and plain["named_share"] == pytest.approx(39 / 41)
    # each scope's ops by time, named by instruction, opcode and result type (layouts dropped)
    assert plain["ops"]["projections"] == [("custom-call.1 custom-call (f32[4], s8[16])", pytest.approx(0.010)),
                                           ("loop_neg_fusion fusion f32[4]", pytest.approx(0.002))]
    assert plain["ops"]["dense_mha"] == [("pallas_call.2 custom-call f32[4]", pytest.approx(0.020)),
                                         ("copy.3 copy f32[4]", pytest.approx(0.001))]
    assert plain["attributed_share"] == pytest.approx(40.5 / 41)
    _gpu_trace(tmp_path / "command_buffer", [(name, "command_buffer_1", us) for name, us in _COMMAND_BUFFER])
    buffered = bench_layer.trace_breakdown(str(tmp_path / "command_buffer"), scopes, steps=3)
    assert buffered["ms"] == pytest.approx({"projections": 0.012, "cache_write": 0.001, "(control flow)": 0.0005,
                                            "sparse_attention": 0.033, "indexer_topk": 0.004, "_nonfinite_rows": 0.001,
                                            "o_proj": 0.005})
    assert buffered["attributed_share"] == 1.0
    empty = bench_layer.trace_breakdown(str(tmp_path / "no_trace"), scopes, steps=3)  # a run that wrote no trace
    assert empty["ms"] == empty["ops"] == {} and empty["note"] == "no trace file"
    assert buffered["ops"]["sparse_attention"] == [("mpmd_map.1 custom-call f32[4]", pytest.approx(0.030)),
                                                   ("loop_neg_fusion.2 fusion f32[4]", pytest.approx(0.003))]


def test_layer_slice_fusion_variants_plan_as_their_cond_variant_and_add_the_flag(bench_layer):
    """cond_slices / cond_2x_slices: the plans of cond / cond_2x (the latter's bucket doubled), compiled
    with XLA's dynamic-slice fusion on top of the plan's own options."""
    from jax_sparse_mla import MLAConfig

    config = MLAConfig.tiny()
    for base in ("cond", "cond_2x"):
        assert (bench_layer.variant_options(config, f"{base}_slices", True, 40)
                == bench_layer.variant_options(config, base, True, 40))
        assert bench_layer.ADDED_OPTIONS[f"{base}_slices"] == {"xla_gpu_enable_dynamic_slice_fusion": True}
    doubled = bench_layer.variant_options(config, "cond_2x_slices", True, 40)["buckets"].min_tokens
    own = bench_layer.variant_options(config, "cond", True, 40)["buckets"]
    assert doubled == 2 * own.round_up(40, own.min_tokens)


def test_layer_baked_variants_plan_as_their_cond_variant_and_compile_without_conditionals(bench_layer, monkeypatch):
    """cond_baked / cond_2x_baked: the plans of cond / cond_2x, compiled (compiled_step's baked)
    with the batch's stage sizes as constants and XLA's default options: the lowered program
    holds no conditional (XLA's compile would fold constant-index ones anyway; forward leaves
    none to fold), and a step gives the switching program's output."""
    from jax_sparse_mla import MLAConfig, init_params, jit_forward, plan as plan_lib

    config = MLAConfig.tiny()
    for base in ("cond", "cond_2x"):
        assert (bench_layer.variant_options(config, f"{base}_baked", True, 40)
                == bench_layer.variant_options(config, base, True, 40))
        assert bench_layer.OPTIONS[f"{base}_baked"] == {}
    monkeypatch.setattr(plan_lib, "LADDER_MIN_TOKENS", 16)  # stages of several sizes at a tiny bucket
    requests, num_pages = bench_layer.batch(config, [(0, 20), (9, 1), (0, 5)])
    plan, meta = bench_layer.plan_batch(config, requests, num_pages=num_pages,
                                        **bench_layer.variant_options(config, "cond", True, 26))
    params = init_params(config, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (plan.num_tokens, config.hidden_size))
    cache = bench_layer.random_cache(config, num_pages, jax.random.key(2))
    static = {"plan": plan, "config": config, "kernels": "xla"}
    switching = jit_forward.lower(params, x, cache, meta, **static).as_text()
    baked = bench_layer.baked_forward.lower(params, x, cache, meta, **static,
                                            branches=tuple(int(b) for b in np.asarray(meta.branches))).as_text()
    assert "stablehlo.case" in switching and "stablehlo.case" not in baked
    outs = []
    for baked in (False, True):
        step = bench_layer.compiled_step(params, x, plan, meta, config, "xla", {}, baked)
        out, cache = step(cache)
        outs.append(np.asarray(out))
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-6, atol=1e-6)  # (programs XLA may fuse differently)


def test_layer_profile_names_an_op_outside_the_scopes_by_the_layer_function_that_made_it(bench_layer):
    """An op outside the named scopes takes the layer's function below its entry, the program
    dispatchers and their branch closures (the jit's caller above them does not count)."""
    model = "/src/jax_sparse_mla/model.py"
    stack = lambda *fns: [(model, fn) for fn in reversed(fns)] + [("/src/scripts/bench_layer.py", "run")]  # noqa: E731
    name = bench_layer._function_scope
    assert name(stack("PlanJit.lower", "forward", "_cond_program", "_switch",
                      "_cond_program.<locals>.dense_call.<locals>.run", "_put_rows")) == "_put_rows"
    assert name(stack("PlanJit.lower", "forward", "_over_rows", "_switch", "forward.<locals>.o_proj", "linear")) == "o_proj"
    assert name(stack("PlanJit.lower", "forward", "_nonfinite_rows")) == "_nonfinite_rows"
    assert name(stack("PlanJit.lower", "forward")) == "forward (other)"


# A loop in a command buffer (XLA:GPU with WHILE among the command types): the graph runs the
# condition's fusion, then its own set_while_condition kernel and predicate copy, then the body.
_LOOP_HLO = """HloModule jit_forward, is_scheduled=true

%fused_lt (p.0: s32[]) -> pred[] {
  %p.0 = s32[] parameter(0)
  %c.0 = s32[] constant(4)
  ROOT %lt.0 = pred[] compare(%p.0, %c.0), direction=LT, metadata={op_name="jit(forward)/indexer_logits/while/cond/lt"}
}

%fused_add (p.1: s32[]) -> s32[] {
  %p.1 = s32[] parameter(0)
  %c.1 = s32[] constant(1)
  ROOT %add.0 = s32[] add(%p.1, %c.1), metadata={op_name="jit(forward)/indexer_logits/while/body/add"}
}

%fused_neg (p.2: f32[4]) -> f32[4] {
  %p.2 = f32[4]{0} parameter(0)
  ROOT %neg.0 = f32[4]{0} negate(%p.2), metadata={op_name="jit(forward)/indexer_logits/while/body/neg"}
}

%condition (s.0: (s32[], f32[4])) -> pred[] {
  %s.0 = (s32[], f32[4]{0}) parameter(0)
  %i.0 = s32[] get-tuple-element(%s.0), index=0
  ROOT %loop_compare_fusion = pred[] fusion(%i.0), kind=kLoop, calls=%fused_lt
}

%body (s.1: (s32[], f32[4])) -> (s32[], f32[4]) {
  %s.1 = (s32[], f32[4]{0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%s.1), index=0
  %v.1 = f32[4]{0} get-tuple-element(%s.1), index=1
  %loop_neg_fusion = f32[4]{0} fusion(%v.1), kind=kLoop, calls=%fused_neg
  %loop_add_fusion = s32[] fusion(%i.1), kind=kLoop, calls=%fused_add
  ROOT %tuple.1 = (s32[], f32[4]{0}) tuple(%loop_add_fusion, %loop_neg_fusion)
}

%command_buffer (s.2: (s32[], f32[4])) -> (s32[], f32[4]) {
  %s.2 = (s32[], f32[4]{0}) parameter(0)
  ROOT %while.1 = (s32[], f32[4]{0}) while(%s.2), condition=%condition, body=%body, metadata={op_name="jit(forward)/indexer_logits/while"}
}

%command_buffer.1 (x.3: f32[4]) -> f32[4] {
  %x.3 = f32[4]{0} parameter(0)
  ROOT %copy.1 = f32[4]{0} copy(%x.3), metadata={op_name="jit(forward)/o_proj/copy"}
}

ENTRY %main.2 (s.3: (s32[], f32[4])) -> f32[4] {
  %s.3 = (s32[], f32[4]{0}) parameter(0)
  %call.1 = (s32[], f32[4]{0}) call(%s.3), to_apply=%command_buffer
  %v.3 = f32[4]{0} get-tuple-element(%call.1), index=1
  ROOT %call.2 = f32[4]{0} call(%v.3), to_apply=%command_buffer.1
}
"""


def test_layer_profile_attributes_a_loop_inside_a_command_buffer(bench_layer, tmp_path):
    """A loop captured in a graph: its fusions by name (also where the event's hlo_op names
    another command buffer's call, whose computations do not hold them), the graph's own
    set_while_condition and predicate copy by the loop between the condition and the body: all
    of it the while's scope, nothing unattributed."""
    scopes = bench_layer.HloScopes(_LOOP_HLO)
    iteration = [("loop_compare_fusion", "call.1", 1), ("set_while_condition", "call.1", 0.5),
                 ("memcpy32_post", "call.1", 0.5), ("loop_neg_fusion", "call.2", 2), ("loop_add_fusion", "call.1", 1)]
    _gpu_trace(tmp_path / "loop", iteration * 4 + iteration[:3] + [("copy_1", "call.2", 3)], steps=1)
    loop = bench_layer.trace_breakdown(str(tmp_path / "loop"), scopes, steps=1)
    assert loop["ms"] == pytest.approx({"indexer_logits": (4 * 5 + 2) / 1e3, "o_proj": 0.003})
    assert loop["attributed_share"] == 1.0
    assert dict(loop["ops"]["indexer_logits"])["loop_neg_fusion fusion f32[4]"] == pytest.approx(0.008)


def _fused(name: str, scope: str) -> str:
    """A fused computation %name of one negate in `scope`."""
    return (f"%{name} (p: s32[]) -> s32[] {{\n  %p = s32[] parameter(0)\n  ROOT %n.{name} = s32[] negate(%p), "
            f'metadata={{op_name="jit(forward)/{scope}/neg"}}\n}}\n')


# a graph holding a loop in indexer_logits and one in dense_mha (as jnp.searchsorted makes them),
# a fusion before and after each; the loops' condition and counter fusions share their kernels
# (deduplicated_name), each body has a fusion of its own
_TWO_LOOPS_HLO = "HloModule jit_forward, is_scheduled=true\n\n" + "\n".join(
    _fused(f"f_{part}_{loop}", scope) for loop, scope in (("a", "indexer_logits"), ("b", "dense_mha"))
    for part in ("lt", "add", "own", "pre", "post")) + """
%condition_a (i.0: s32[]) -> s32[] {
  %i.0 = s32[] parameter(0)
  ROOT %loop_compare_fusion = s32[] fusion(%i.0), kind=kLoop, calls=%f_lt_a
}

%body_a (i.1: s32[]) -> s32[] {
  %i.1 = s32[] parameter(0)
  %loop_neg_fusion.a = s32[] fusion(%i.1), kind=kLoop, calls=%f_own_a
  ROOT %loop_add_fusion = s32[] fusion(%loop_neg_fusion.a), kind=kLoop, calls=%f_add_a
}

%condition_b (i.2: s32[]) -> s32[] {
  %i.2 = s32[] parameter(0)
  ROOT %loop_compare_fusion.1 = s32[] fusion(%i.2), kind=kLoop, calls=%f_lt_b, metadata={deduplicated_name="loop_compare_fusion"}
}

%body_b (i.3: s32[]) -> s32[] {
  %i.3 = s32[] parameter(0)
  %loop_neg_fusion.b = s32[] fusion(%i.3), kind=kLoop, calls=%f_own_b
  ROOT %loop_add_fusion.1 = s32[] fusion(%loop_neg_fusion.b), kind=kLoop, calls=%f_add_b, metadata={deduplicated_name="loop_add_fusion"}
}

%command_buffer (i.4: s32[]) -> s32[] {
  %i.4 = s32[] parameter(0)
  %pre_fusion.a = s32[] fusion(%i.4), kind=kLoop, calls=%f_pre_a
  %while.a = s32[] while(%pre_fusion.a), condition=%condition_a, body=%body_a
  %post_fusion.a = s32[] fusion(%while.a), kind=kLoop, calls=%f_post_a
  %pre_fusion.b = s32[] fusion(%post_fusion.a), kind=kLoop, calls=%f_pre_b
  %while.b = s32[] while(%pre_fusion.b), condition=%condition_b, body=%body_b
  ROOT %post_fusion.b = s32[] fusion(%while.b), kind=kLoop, calls=%f_post_b
}

ENTRY %main.5 (i.5: s32[]) -> s32[] {
  %i.5 = s32[] parameter(0)
  ROOT %call.1 = s32[] call(%i.5), to_apply=%command_buffer
}
"""


def test_layer_profile_attributes_loop_kernels_several_scopes_share(bench_layer, tmp_path):
    """Two loops of two scopes in one graph, the events under a name no instruction has (as XLA's
    command buffers launch them): their condition and counter kernels, one name each for both
    loops, take the scope of their neighbours on the line (the loop's own fusion before them, or
    the fusion before the loop); the graph's own set_while_condition and predicate copy go to the
    loop around them (unmatched_around): every event attributed, each loop's time to its scope."""
    scopes = bench_layer.HloScopes(_TWO_LOOPS_HLO)
    assert scopes.scope["loop_compare_fusion"] == "indexer_logits" and scopes.scope["loop_compare_fusion.1"] == "dense_mha"

    def loop(name, iterations):  # the events of a loop's run: before, each iteration, the last condition, after
        step = [("loop_compare_fusion", 1), ("set_while_condition", 0.5), ("memcpy32_post", 0.5),
                (f"loop_neg_fusion_{name}", 2), ("loop_add_fusion", 1)]
        return [(f"pre_fusion_{name}", 3)] + step * iterations + step[:3] + [(f"post_fusion_{name}", 3)]
    _gpu_trace(tmp_path / "two", [(k, "command_buffer_1", t) for k, t in loop("a", 3) + loop("b", 2)], steps=1)
    two = bench_layer.trace_breakdown(str(tmp_path / "two"), scopes, steps=1)
    assert two["attributed_share"] == 1.0, two["ops"]
    assert two["ms"] == pytest.approx({"indexer_logits": (8 + 5 * 3) / 1e3, "dense_mha": (8 + 5 * 2) / 1e3})


_THREE_FUSIONS_HLO = "HloModule jit_forward, is_scheduled=true\n\n" + "\n".join(
    _fused(name, scope) for name, scope in (("f_1", "projections"), ("f_2", "projections"), ("f_3", "o_proj"))) + """
%command_buffer (i.0: s32[]) -> s32[] {
  %i.0 = s32[] parameter(0)
  %fusion.1 = s32[] fusion(%i.0), kind=kLoop, calls=%f_1
  %fusion.2 = s32[] fusion(%fusion.1), kind=kLoop, calls=%f_2
  ROOT %fusion.3 = s32[] fusion(%fusion.2), kind=kLoop, calls=%f_3
}

ENTRY %main.1 (i.1: s32[]) -> s32[] {
  %i.1 = s32[] parameter(0)
  ROOT %call.1 = s32[] call(%i.1), to_apply=%command_buffer
}
"""


def test_layer_profile_gives_an_unclaimed_event_the_scope_around_it(bench_layer, tmp_path):
    """An event no instruction claims, between events of instructions scheduled next to each other
    (nothing unmatched between them): the scope of the events on both sides where they agree,
    unattributed where they differ."""
    scopes = bench_layer.HloScopes(_THREE_FUSIONS_HLO)
    events = [("fusion_1", 2), ("memcpy32_post", 1), ("fusion_2", 2), ("set_while_condition", 3), ("fusion_3", 4)]
    _gpu_trace(tmp_path / "around", [(k, "command_buffer_1", t) for k, t in events], steps=1)
    around = bench_layer.trace_breakdown(str(tmp_path / "around"), scopes, steps=1)
    assert around["ms"] == pytest.approx({"projections": 0.005, "(unattributed)": 0.003, "o_proj": 0.004})
    assert dict(around["ops"]["projections"]) == pytest.approx(
        {"fusion.1 fusion s32[]": 0.002, "fusion.2 fusion s32[]": 0.002, "memcpy32_post (hlo_op command_buffer_1)": 0.001})


def test_row_matmul_bench_checks_each_kernel_row_against_xla(tmp_path):
    """--smoke --shapes tiny: per row count (M, M / 2 + 1, M / 2) an XLA row and a kernel row,
    the kernel's (interpreted) within bf16's rounding of XLA's over the live rows and 0 past them."""
    _run("bench_row_matmul.py", "--smoke", "--shapes", "tiny", "--configs", "default", "--out", "rows.json",
         cwd=tmp_path)
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert sorted((r["rows"], r["variant"]) for r in rows) == [
        (n, v) for n in (128, 129, 256) for v in ("kernel default", "xla")]
    assert all(r["zero_past_rows"] and r["rel_err"] < 4e-3 and r["ms"] > 0 for r in rows)


def test_sparse_attention_bench_times_a_revision_beside_the_working_tree(tmp_path):
    """--base REV --rounds 2: every kernel variant twice, the working tree's and REV's (module copy),
    both checked against the reference; the working tree's record holds its speedup over REV's."""
    _run("bench_sparse_attention.py", "--smoke", "--base", "HEAD", "--rounds", "2", "--kinds", "decode",
         "--formats", "bf16", "--impls", "triton", "--out", "ab.json", cwd=tmp_path)
    records = {r["impl"]: r for r in json.loads((tmp_path / "ab.json").read_text())["records"]}
    assert sorted(records) == ["triton", "triton@HEAD", "xla"]
    here, base = records["triton"], records["triton@HEAD"]
    assert here["rel_err"] < 2e-2 and base["rel_err"] < 2e-2 and here["spread"] >= 0 and base["spread"] >= 0
    assert here["speedup"] == pytest.approx(base["ms"] / here["ms"]) and "speedup" not in base


def test_sparse_attention_bench_imports_the_revision_not_the_working_tree(monkeypatch):
    """The base is the revision's pallas_kernels from `git archive`, under another package name."""
    monkeypatch.syspath_prepend(str(SCRIPTS))  # the script's own imports (timing)
    spec = importlib.util.spec_from_file_location("bench_sparse_attention", SCRIPTS / "bench_sparse_attention.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    kernels = bench.import_base("HEAD")
    here = pathlib.Path(kernels.__file__).resolve()
    assert ROOT not in here.parents and kernels.__name__ != "pallas_kernels.sparse_mla"
    committed = subprocess.run(["git", "-C", str(ROOT), "show", "HEAD:pallas_kernels/sparse_mla/api.py"],
                               capture_output=True, text=True, check=True).stdout
    assert (here.parent / "api.py").read_text() == committed


def test_warmup_bench_restart_loads_every_program_from_the_store(tmp_path):
    """--smoke --programs 1: --decode-steps 2 (the set but its first program, and the decode runs'
    programs): the counts come before any compile, and each phase's precompile covered the slice
    and the runs; the cold process compiles every program into the empty store, the restarted one
    loads them all from it (no XLA compile); the JSON holds both phases."""
    out = _run("bench_warmup.py", "--smoke", "--programs", "1:", "--decode-steps", "2", "--workers", "2", "--out",
               str(tmp_path / "warmup.json"), cwd=tmp_path)
    result = json.loads((tmp_path / "warmup.json").read_text())
    counts, cold, restart = result["count_programs"], result["phases"]["cold"], result["phases"]["restart"]
    assert counts["decode_runs"] > 0
    assert counts["total"] - 1 + counts["decode_runs"] == cold["num_programs"] == restart["num_programs"]
    assert cold["per_route"] == restart["per_route"] == {"cond": cold["num_programs"]}
    assert len(cold["program_s"]) == len(restart["program_s"]) == cold["num_programs"]  # a time per program
    assert cold["loaded"] == 0 and cold["compiles"] >= cold["num_programs"]
    assert restart["loaded"] == restart["num_programs"] and restart["compiles"] == 0, restart
    assert out.index("count_programs") < out.index("cold") < out.index("restart ") < out.index("restart / cold")


@pytest.fixture(scope="module")
def bench_engine():
    spec = importlib.util.spec_from_file_location("bench_engine", SCRIPTS / "bench_engine.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _engine_trace(directory: pathlib.Path, events: list) -> None:
    """A trace viewer file of a GPU (pid 1: its stream 14 and the derived "XLA Ops" line 2) and the
    host (pid 701, the engine's thread 1) holding `events`."""
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 1, "tid": 14, "name": "thread_name", "args": {"name": "Stream #14(Compute)"}},
            {"ph": "M", "pid": 1, "tid": 2, "name": "thread_name", "args": {"name": "XLA Ops"}},
            {"ph": "M", "pid": 701, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 701, "tid": 1, "name": "thread_name", "args": {"name": "python3"}}]
    directory.mkdir()
    with gzip.open(directory / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": meta + events}, f)


def _kernel(ts: float, dur: float) -> list:
    """A kernel on _engine_trace's device stream and its copy on the derived line."""
    return [{"ph": "X", "pid": 1, "tid": tid, "ts": ts, "dur": dur, "name": "k", "args": {}} for tid in (14, 2)]


def _host_event(ts: float, dur: float, name: str, tid: int = 1) -> dict:
    """An event on _engine_trace's host (the engine's thread 1, or `tid`)."""
    return {"ph": "X", "pid": 701, "tid": tid, "ts": ts, "dur": dur, "name": name, "args": {}}


def test_engine_bench_times_steps_with_every_sequence_decoding(tmp_path):
    """--smoke --decodes 3 --compare-command-buffers --rounds 2 --profile: in each of the 2 runs
    of each variant at least 3 steps have every sequence decoding (the requests' outputs outlast
    the last prefill), none compiles (warmed up for the run's steps; the variant's executables
    compiled before the runs), each row's host time holds its planning and launch; each variant's
    traced run has its decode steps found by their step spans, with the device busy for part of
    each."""
    out = _run("bench_engine.py", "--smoke", "--seqs", "6", "--decodes", "3", "--compare-command-buffers",
               "--rounds", "2", "--profile", str(tmp_path / "trace"), "--out", str(tmp_path / "engine.json"), cwd=tmp_path)
    result = json.loads((tmp_path / "engine.json").read_text())
    medians, traced = result["medians"], result["traced"]
    off = " (command buffers off)"
    assert set(traced) == {"decode", "decode" + off} and (tmp_path / "trace_command_buffers_off").is_dir()
    for t in traced.values():
        assert t["steps"] >= 2 and 0 < t["busy_share"] <= 1, t
        assert 0 < t["device_busy_ms"] <= t["wall_ms"] and 0 < t["host_ms"], t
    assert out.count("traced") == 2
    assert set(medians) == {"decode", "prefill", "decode" + off, "prefill" + off}, medians
    assert medians["decode"]["steps"] >= 6 and medians["decode" + off]["steps"] >= 6, medians
    for row in medians.values():
        assert row["new_programs"] == 0
        # each step's host time holds its planning and launch, so each median is at most the host's
        assert 0 < row["plan_ms"] <= row["host_ms"] and 0 < row["launch_ms"] <= row["host_ms"], row
        assert row["duration_ms"] > 0, row
    lines = out.splitlines()
    final = [line for line in lines if line.startswith(("decode", "prefill"))]
    assert len(final) == 4 and all("compiled 0" in line for line in final), final
    # each round's rows as it ends (a run cut by a time limit keeps the rounds it finished)
    assert [line.split(":")[0] for line in lines if line.startswith("round ")] == ["round 1"] * 4 + ["round 2"] * 4


def test_engine_bench_times_prefill_steps_with_their_conditionals_in_the_graphs(tmp_path):
    """--smoke --conditionals-in-graphs: the prefill step's program (the dense call's key sizes: a
    conditional) is compiled again with its conditionals in the graphs and timed beside the
    engine's own, no step compiling."""
    out = _run("bench_engine.py", "--smoke", "--decodes", "2", "--conditionals-in-graphs",
               "--rounds", "1", "--out", str(tmp_path / "engine.json"), cwd=tmp_path)
    medians = json.loads((tmp_path / "engine.json").read_text())["medians"]
    assert set(medians) == {"decode", "prefill", "decode (conditionals in graphs)", "prefill (conditionals in graphs)"}
    assert all(row["new_programs"] == 0 and row["steps"] >= 1 for row in medians.values()), medians
    assert "conditionals in graphs: 1 of 2 programs compiled again" in out


def test_engine_bench_profiles_single_steps_and_decode_runs(tmp_path):
    """--smoke --decode-steps 1,2 --profile DIR: each variant is traced into its own directory (DIR,
    DIR_runs_of_2) and prints its traced decode line and host events; the runs' window counts
    dispatches of 2 steps, a step's figures half a dispatch's."""
    out = _run("bench_engine.py", "--smoke", "--seqs", "4", "--decodes", "8", "--decode-steps", "1,2", "--rounds", "1",
               "--profile", str(tmp_path / "trace"), "--out", str(tmp_path / "engine.json"), cwd=tmp_path)
    traced = json.loads((tmp_path / "engine.json").read_text())["traced"]
    assert set(traced) == {"decode", "decode (runs of 2)"}, traced
    assert (tmp_path / "trace").is_dir() and (tmp_path / "trace_runs_of_2").is_dir()
    lines = [line for line in out.splitlines() if line.startswith("traced")]
    assert [line.split("  ")[0] for line in lines] == ["traced decode", "traced (runs of 2) decode"], out
    assert out.count("ms a dispatch") >= 2 + 2 * 2, out  # each variant's line and at least two host events
    for name, k in (("decode", 1), ("decode (runs of 2)", 2)):
        t = traced[name]
        assert t["dispatches"] >= 1 and t["steps"] == k * t["dispatches"], t
        assert 0 < t["wall_ms"] and 0 <= t["device_busy_ms"] <= t["wall_ms"] and 0 < t["host_ms"], t
        assert 0 <= t["busy_share"] <= 1 and t["host_events_ms"], t
        for field in ("wall_ms", "device_busy_ms", "host_ms"):
            assert t[f"step_{field}"] == pytest.approx(t[field] / k), (field, t)


def test_engine_bench_host_only_packs_every_step_and_compiles_nothing(tmp_path):
    """--host-only (the real config's dimensions, a few sequences): no program is compiled or
    called, each step's input is still packed (its launch time is the packing), and every
    sequence decodes in at least --decodes steps."""
    out = _run("bench_engine.py", "--host-only", "--seqs", "4", "--context", "300", "--decodes", "2", "--layers", "1",
               "--out", str(tmp_path / "engine.json"), cwd=tmp_path)
    medians = json.loads((tmp_path / "engine.json").read_text())["medians"]
    assert medians["decode"]["steps"] >= 2 and "warm-up" not in out and "host only" in out
    assert all(r["new_programs"] == 0 and 0 < r["launch_ms"] <= r["host_ms"] for r in medians.values()), medians


def test_engine_bench_times_decode_runs_alone_and_with_their_loop_in_graphs(tmp_path):
    """--smoke --decode-steps 4 --loop-in-graphs (no single-step variant): both variants' decode
    rows are the runs' steps, none compiles, and the JSON is written."""
    _run("bench_engine.py", "--smoke", "--seqs", "4", "--decodes", "4", "--decode-steps", "4", "--loop-in-graphs",
         "--rounds", "1", "--out", str(tmp_path / "engine.json"), cwd=tmp_path)
    result = json.loads((tmp_path / "engine.json").read_text())
    names = {"decode (runs of 4)", "decode (runs of 4, loop in graphs)"}
    assert names <= set(result["medians"]) <= names | {"prefill (runs of 4)", "prefill (runs of 4, loop in graphs)"}
    for name in names:
        runs = result["medians"][name]
        assert runs["steps"] >= 4 and runs["new_programs"] == 0 and 0 < runs["host_share"]
    assert result["summary"]["num_requests"] == 4


def test_engine_trace_shares_counts_the_decode_steps_device_time(tmp_path, bench_engine):
    """trace_shares on a GPU trace written by hand: step k's host span begins when step k - 2 ends
    (the loop dispatches k, then waits for k - 1). Steps 0-2 run 6 us of kernels each (two of 3 us,
    the second overlapping a host-side hlo_op event that must not count), step spans start at
    0, 0, 10, 20, 30 us: the window of steps 2 .. 4 holds the device's busy time of steps 1 and 2,
    12 us of 20, and a kernel past the window (step 3's) adds nothing. Inside the host parts of
    steps 1 and 2 (the window's): a 1.5 us launch with a 0.5 us packing nested in it each step,
    counted inclusive, a wait that outlasts the part (counted to its end), and events on another
    thread, not counted."""
    events = [{"ph": "X", "pid": 701, "tid": 1, "ts": ts, "dur": 2, "name": bench_engine.STEP_ANNOTATION,
               "args": {"step": str(k)}} for k, ts in enumerate((0, 0, 10, 20, 30))]
    for start in (2, 12, 22, 32):  # steps 0, 1, 2, 3 on the device
        for ts in (start, start + 4):  # two kernels of 3 us; each also on the derived line
            events += _kernel(ts, 3)
        events.append({"ph": "X", "pid": 701, "tid": 1, "ts": start, "dur": 9, "name": "h", "args": {"hlo_op": "x"}})
    for ts in (0, 10, 20, 30):  # inside the host parts of steps 1-4: a launch with a packing nested in it
        events += [_host_event(ts, 1.5, "launch"), _host_event(ts + 0.5, 0.5, "pack"),
                   _host_event(ts, 1, "other thread", tid=5), _host_event(ts + 1.5, 4, "wait")]
    _engine_trace(tmp_path / "t", events)
    shares = bench_engine.trace_shares(str(tmp_path / "t"), 2, 4)
    host_events = shares.pop("host_events_ms")
    assert shares == pytest.approx({"dispatches": 2, "steps": 2, "wall_ms": 0.010, "device_busy_ms": 0.006,
                                    "host_ms": 0.002, "step_wall_ms": 0.010, "step_device_busy_ms": 0.006,
                                    "step_host_ms": 0.002, "busy_share": 0.6})
    assert host_events == pytest.approx({"launch": 0.0015, "pack": 0.0005, "wait": 0.0005})
    with pytest.raises(RuntimeError, match="not both in the trace"):
        bench_engine.trace_shares(str(tmp_path / "t"), 2, 7)


def test_engine_trace_shares_counts_a_decode_run_as_one_dispatch_of_its_steps(tmp_path, bench_engine):
    """trace_shares over decode runs of 4 (one span each, named by its first step): dispatches at
    steps 0, 1 (single steps), 2, 6, 10, 14 (runs), their spans at 0, 5, 10, 40, 70, 100 us. The
    window of 6 .. 14 (60 us) holds the device's busy time of the runs at 2 and 6, 8 steps: four 5 us
    kernels each, the first run's first cut off before the window, 15 + 20 us, and 5 us of the run
    at 10 before the window ends: 40 us, 20 a dispatch, 5 a step. Host parts (3 us) and their
    launches (2 us, a 0.5 us packing nested) are those of the runs at 2 and 6, not of those at 10
    and 14. A step inside a run names no span; the trace's first dispatch has none before it."""
    events = [{"ph": "X", "pid": 701, "tid": 1, "ts": ts, "dur": 3, "name": bench_engine.STEP_ANNOTATION,
               "args": {"step": str(k)}} for k, ts in ((0, 0), (1, 5), (2, 10), (6, 40), (10, 70), (14, 100))]
    for start in (35, 65, 95):  # the runs at steps 2, 6 and 10 on the device
        for ts in range(start, start + 24, 6):  # four kernels of 5 us; each also on the derived line
            events += _kernel(ts, 5)
    for ts in (10, 40, 70, 100):  # inside the runs' host parts: a launch with a packing nested in it
        events += [_host_event(ts + 0.5, 2, "launch"), _host_event(ts + 1, 0.5, "pack")]
    _engine_trace(tmp_path / "t", events)
    shares = bench_engine.trace_shares(str(tmp_path / "t"), 6, 14)
    host_events = shares.pop("host_events_ms")
    assert shares == pytest.approx({"dispatches": 2, "steps": 8, "wall_ms": 0.030, "device_busy_ms": 0.020,
                                    "host_ms": 0.003, "step_wall_ms": 0.0075, "step_device_busy_ms": 0.005,
                                    "step_host_ms": 0.00075, "busy_share": 2 / 3})
    assert host_events == pytest.approx({"launch": 0.002, "pack": 0.0005})  # ms a dispatch
    with pytest.raises(RuntimeError, match="not both in the trace"):
        bench_engine.trace_shares(str(tmp_path / "t"), 3, 14)
    with pytest.raises(RuntimeError, match="first = 0 must start a dispatch after the trace's first"):
        bench_engine.trace_shares(str(tmp_path / "t"), 0, 6)


def test_skip_bench_reports_each_comparison_with_its_runs_range_and_host_against_device():
    """bench_skip's repeats: the gain and the TPOT ratio of run i against run i, lowest and highest
    (with two runs the gain of the medians lies between them: a mediant), printed in the tables
    beside each setting's median step host and device busy time."""
    spec = importlib.util.spec_from_file_location("bench_skip", SCRIPTS / "bench_skip.py")
    skip = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(skip)
    rng = np.random.default_rng(0)

    def runs(n):
        return [{"request_throughput": float(rng.uniform(50, 100)), "median_tpot_ms": float(rng.uniform(1, 2)),
                 "median_host_ms": float(rng.uniform(0.1, 1)), "median_device_ms": float(rng.uniform(1, 3))}
                for _ in range(n)]
    on, off = runs(2), runs(2)
    got = skip.spread(on, off)
    gains = [100 * (a["request_throughput"] / b["request_throughput"] - 1) for a, b in zip(on, off)]
    ratios = [a["median_tpot_ms"] / b["median_tpot_ms"] for a, b in zip(on, off)]
    assert got == {"throughput_gain_pct": [min(gains), max(gains)], "tpot_ratio": [min(ratios), max(ratios)]}
    # the medians' gain (of two runs: their means)
    gain = 100 * (sum(r["request_throughput"] for r in on) / sum(r["request_throughput"] for r in off) - 1)
    assert min(gains) <= gain <= max(gains)
    assert skip.spread(on, [dict(r, median_tpot_ms=None) for r in off])["tpot_ratio"] is None
    with pytest.raises(ValueError):
        skip.spread(on, off[:1])  # the settings ran as many times

    meta = {"device": "card", "config": "tiny", "layers": 2, "kernels": "auto", "dispatch": "static",
            "max_num_batched_tokens": 64, "date": "today", "argv": "", "blocks": ["attention"],
            "prefill_input_len": 8, "prefill_range_ratio": 0.125, "decode_output_len": 24, "repeats": 2}
    summary = lambda r: dict(r, median_ttft_ms=5.0, output_throughput=100.0)  # noqa: E731
    results = {"meta": meta, "breakdown": [],
               "prefill": [{"concurrency": 1, "num_requests": 8, "skip": summary(on[0]), "no_skip": summary(off[0]),
                            "throughput_gain_pct": gain, "spread": got}],
               "decode": [{"concurrency": 1, "skip": summary(on[0]), "no_skip": summary(off[0]), "tpot_ratio": 1.0,
                           "regressed": False, "spread": got}]}
    table = skip.markdown(results)
    assert f"{min(gains):+.1f}..{max(gains):+.1f}%" in table and f"{min(ratios):.3f}..{max(ratios):.3f}" in table
    assert (f"{on[0]['median_host_ms']:.2f} / {on[0]['median_device_ms']:.2f} | "
            f"{off[0]['median_host_ms']:.2f} / {off[0]['median_device_ms']:.2f} |") in table


def test_skip_bench_sizes_the_decoder_stack_to_fit_the_device():
    """bench_skip's decoder stand-in at the real dims: 64 routed experts by default (DeepSeek's 8
    active and one shared kept), so 4 layers' weights and caches fit an 80 GB card, where 256
    (the model's, ~92 GB) do not; stack_bytes adds up what Engine allocates (the MoE's experts
    dominate), and a stack past the device's share is refused before anything is built, naming
    the flags."""
    spec = importlib.util.spec_from_file_location("bench_skip", SCRIPTS / "bench_skip.py")
    skip = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(skip)
    from jax_sparse_mla import MLAConfig
    from jax_sparse_mla.serving.block import MoEConfig

    real, tiny = MLAConfig.deepseek_v32(), MLAConfig.tiny()
    moe = skip.decoder_moe(real, None)
    assert moe == MoEConfig.deepseek_v32(num_experts=skip.DECODER_EXPERTS)
    assert skip.decoder_moe(real, 256) == MoEConfig.deepseek_v32()
    assert skip.decoder_moe(tiny, None) == MoEConfig.tiny()
    with pytest.raises(ValueError, match="num_experts_per_tok = 8 exceeds num_experts = 4"):
        skip.decoder_moe(real, 4)

    experts = 3 * 7168 * 2048 * 2  # gate, up, down of one expert, bf16
    attention = skip.stack_bytes(real, 4, 1000, None)
    assert skip.stack_bytes(real, 4, 1000, moe) - attention > 4 * 64 * experts
    assert skip.stack_bytes(real, 4, 1000, MoEConfig.deepseek_v32()) - skip.stack_bytes(real, 4, 1000, moe) == (
        4 * (256 - 64) * (experts + 7168 * 2))  # the experts and the router's columns

    class Device:  # an 80 GB card
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            return self.stats

    card = Device({"bytes_limit": 80 * 10**9})
    skip.check_fits(skip.stack_bytes(real, 4, 1000, moe), card, "4 decoder layers")
    with pytest.raises(SystemExit, match=r"4 decoder layers takes 9\d\.\d GB .* --layers or \(decoder\) --moe-experts"):
        skip.check_fits(skip.stack_bytes(real, 4, 1000, MoEConfig.deepseek_v32()), card, "4 decoder layers")
    skip.check_fits(10**15, Device(None), "a CPU")  # no limit reported: not checked
