"""The engine's host share: Engine.run over requests that prefill, then decode together, with the
host time of each step (scheduling, planning, dispatch; StepRecord.host_s) beside its device
time (StepRecord.device_s) and its duration. Steps are pipelined: the host plans step N + 1
while the device runs step N, so host time under the device's is hidden.

    python scripts/bench_engine.py [--seqs 256] [--context 4096] [--decodes 32] [--layers 4]
                                   [--dispatch cond|static] [--max-model-len N] [--out engine.json]  # GPU
    python scripts/bench_engine.py --smoke [--decodes 64]    # CPU: tiny config, 8 x 40 tokens, 2 layers
    python scripts/bench_engine.py --host-only [--seqs 256 --context 4096]    # any machine: the host alone
    python scripts/bench_engine.py --compare-command-buffers [--rounds 3] [--profile DIR]    # GPU
    python scripts/bench_engine.py --decode-steps 1,8 --loop-in-graphs [--rounds 2] [--profile DIR]    # GPU
    python scripts/bench_engine.py --conditionals-in-graphs [--rounds 2]    # GPU, XLA_FLAGS as below

Every request has the same prompt and is sent at once; the scheduler puts decodes first, so the
early requests decode while the later ones still prefill. Each request's output is long enough
(--decodes plus the most steps the prefills can take) that at least --decodes steps have every
sequence decoding; the run stops when the first request has its last token. Prints one line
per kind of step, "decode" (every sequence decodes) and "prefill" (prefill chunks, with the
decodes of the requests that have prefilled): medians of host_s, plan_s, launch_s, device_s and
duration_s, and host / duration. The run is warmed up first (Engine.warmup compiles every program
it will need), so no step compiles. --host-only replaces the step's program call by the packing
of its input (Engine._step_call; nothing compiles or runs on a device): the host's step alone,
scheduling, planning, packing and bookkeeping, at the real dimensions on any machine (its
launch_s is the packing).

--compare-command-buffers times the engine's programs without conditionals (its decode
steps') against the same programs compiled with XLA's command buffers off (as the programs with
conditionals are: model.compiler_options), the two interleaved over --rounds runs of the
workload, rows "decode" and "decode (command buffers off)" (and prefill rows: their programs
differ only where they have no conditional), and traces both under --profile (the second into
DIR_command_buffers_off).

--loop-in-graphs (with --decode-steps K > 1) also times each decode run's program compiled with
WHILE among XLA's command-buffer types (the default types hold none, so the host walks the
run's loop and launches each step's graphs), interleaved with the others: rows "decode (runs of
K, loop in graphs)".

--conditionals-in-graphs times the engine's programs with conditionals (its prefill steps')
against the same programs compiled with CONDITIONAL among XLA's command-buffer types (each
conditional a CUDA conditional node: no host round trip for its branch index), interleaved:
rows "prefill" and "prefill (conditionals in graphs)" (and decode rows: their programs have no
conditional). In the engine's program a layer's output feeds the residual add outside the
conditionals, so a launch should need no branch re-recorded for a moved output, as a layer step
timed alone does (its output comes from o_proj's branches): the hypothesis this run tests, with
the graphs' temps at fixed addresses, XLA_FLAGS=--xla_gpu_command_buffer_update_mode=SKIP_TEMP
(XLA's update mode takes effect only set there, before jax starts). Under --profile, XLA runs
a graph's thunks instead of the graph unless XLA_FLAGS also holds
--xla_enable_command_buffers_during_profiling=true.

--profile DIR runs each variant once more under jax.profiler.trace (into DIR and its row's
suffix: DIR for single steps, DIR_command_buffers_off, DIR_runs_of_8, ...) and prints, for the
dispatches in which every sequence decodes (the variant's single steps, or its decode runs of K),
what the trace shows (`trace_shares`; each dispatch's scheduling, planning and launch is an
engine.STEP_ANNOTATION span, a run's one for its K steps): the wall time, the device's busy time
(the union of its stream events; on a CPU, XLA's thunks) and the share of the window it is busy,
and the host part's time, each a dispatch and a step (a dispatch's / K), then the events that
take the most of the host part (where its planning and launch go), a dispatch and a step. A
device busy well under the wall time is a device that waits on the host. Where the run has three
or more prefill steps, the same for them (their programs have conditionals: a dispatch returns
only near its step's end, so the device idles while the host plans the next step; their busy
share is what that costs).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import re
import statistics
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from jax_sparse_mla import BatchMeta, MLAConfig  # noqa: E402
from jax_sparse_mla.model import COMMAND_BUFFERS_OFF, DEFAULT_COMMAND_TYPES  # noqa: E402
from jax_sparse_mla.serving import Engine, RequestSpec  # noqa: E402
from jax_sparse_mla.serving.engine import STEP_ANNOTATION, jit_layer_stack  # noqa: E402
from traces import load_trace, on_stream  # noqa: E402


def every_decoding(steps, seqs: int) -> list:
    """The StepRecords of `steps` in which every one of the seqs sequences decodes."""
    return [s for s in steps if s.num_prefills == 0 and s.num_decodes == seqs]


def dispatches(steps) -> list:
    """The first StepRecord of each dispatch in a run's `steps` (a decode run's dispatch_steps
    records follow each other): the steps whose index a trace's STEP_ANNOTATION span names."""
    firsts, i = [], 0
    while i < len(steps):
        firsts.append(steps[i])
        i += steps[i].dispatch_steps
    return firsts


def step_medians(runs, suffix: str, a) -> dict:
    """Rows "decode{suffix}" (the steps in which every sequence decodes) and "prefill{suffix}" (the
    steps with a prefill) of `runs`: each field's median in ms, the host share, programs compiled."""
    every = [s for r in runs for s in every_decoding(r.steps, a.seqs)]
    if len(every) < a.decodes * len(runs):
        raise RuntimeError(f"{len(every)} steps in {len(runs)} runs had every sequence decoding, fewer than "
                           f"--decodes {a.decodes} a run (this is a bug)")
    prefills = [s for r in runs for s in r.steps if s.num_prefills > 0]
    rows = {}
    for name, steps in ((f"decode{suffix}", every), (f"prefill{suffix}", prefills)):
        if not steps:
            continue
        med = {f: statistics.median(getattr(s, f) for s in steps) * 1e3
               for f in ("host_s", "plan_s", "launch_s", "device_s", "duration_s")}
        rows[name] = {"steps": len(steps), **{k.replace("_s", "_ms"): v for k, v in med.items()},
                      "host_share": med["host_s"] / med["duration_s"],
                      "new_programs": sum(s.new_programs for s in steps)}
    return rows


def print_rows(rows: dict, prefix: str) -> None:
    for name, r in rows.items():
        print(f"{prefix}{name:<8} steps {r['steps']:>4}  host {r['host_ms']:8.3f} ms (plan {r['plan_ms']:.3f}, launch "
              f"{r['launch_ms']:.3f})  device "
              f"{r['device_ms']:8.3f} ms  step {r['duration_ms']:8.3f} ms  host / step {r['host_share']:.3f}  "
              f"compiled {r['new_programs']}", flush=True)


HOST_EVENTS = 12  # trace_shares' host_events_ms: the names that take the most time


def trace_shares(trace_dir: str, first: int, last: int) -> dict:
    """Over the newest trace under trace_dir (*.trace.json.gz), the window from the host part of
    the dispatch that starts at step `first` (its STEP_ANNOTATION span, arg step: the dispatch's
    first step; a dispatch is one step or a decode run of K, one span for all K) to that of the one
    starting at step `last`. Dispatch d's host part begins once dispatch d - 2 is done (the loop
    dispatches d, then waits for d - 1), while d - 1 runs: from dispatch a's host part to b's, the
    window holds the device's busy time of dispatches a - 1 .. b - 2 (b - a of them; with single
    steps, steps first - 1 .. last - 2), and host_ms is their host parts'. Their steps: from
    dispatch a - 1's first step to b - 1's (K a dispatch for runs of K). Returns {"dispatches",
    "steps", "wall_ms", "device_busy_ms" and "host_ms" a dispatch, "step_wall_ms",
    "step_device_busy_ms" and "step_host_ms" a step (the window's over its steps), "busy_share",
    "host_events_ms"}. host_events_ms: the HOST_EVENTS event names that take the most time inside
    those host parts (on their thread, starting within them, cut at their end), ms a dispatch
    each, inclusive of the events nested in them (where the launch goes). Device busy time: the
    union of the events on a device's "Stream" lines; on a trace without devices (XLA:CPU), of
    the events with an hlo_op arg."""
    loaded = load_trace(trace_dir)
    if loaded is None:
        raise RuntimeError(f"no trace under {trace_dir}")
    events, lines, devices = loaded
    spans = {int(e["args"]["step"]): e for e in events
             if e.get("name") == STEP_ANNOTATION and "step" in e.get("args", {})}
    if first not in spans or last not in spans:
        raise RuntimeError(f"steps {first} and {last} are not both in the trace (it has {len(spans)} dispatch spans)")
    order = sorted(spans)  # each dispatch's first step, in dispatch order
    i, j = order.index(first), order.index(last)
    if not 0 < i < j:
        raise RuntimeError(f"first = {first} must start a dispatch after the trace's first and before last = {last}'s "
                           "(the window holds the device's busy time of the dispatches before them)")
    lo, hi = spans[first]["ts"], spans[last]["ts"]
    on_device = [e for e in events if (on_stream(e, lines, devices) if devices else "hlo_op" in e.get("args", {}))]
    clipped = sorted((max(e["ts"], lo), min(e["ts"] + e.get("dur", 0), hi)) for e in on_device)
    busy, end = 0.0, lo
    for a, b in clipped:  # the union of the spans clipped to the window (those outside it are empty)
        if a < b and b > end:
            busy += b - max(a, end)
            end = b
    parts = [spans[k] for k in order[i - 1:j - 1]]  # the host parts of the dispatches whose device busy time it holds
    starts = [p["ts"] for p in parts]  # ascending, and the parts do not overlap (one loop)
    inside = collections.Counter()  # what the host parts hold: event name -> its time, inclusive
    for e in events:
        k = bisect.bisect_right(starts, e["ts"]) - 1  # the last part to start at or before e
        if k < 0 or e.get("pid") in devices or e.get("name") == STEP_ANNOTATION:
            continue
        p = parts[k]
        if (p["pid"], p["tid"]) == (e.get("pid"), e.get("tid")) and e["ts"] < p["ts"] + p["dur"]:
            inside[e.get("name", "")[:80]] += min(e["ts"] + e.get("dur", 0), p["ts"] + p["dur"]) - e["ts"]
    n, steps = j - i, order[j - 1] - order[i - 1]
    us = {"wall_ms": hi - lo, "device_busy_ms": busy, "host_ms": sum(p["dur"] for p in parts)}  # the window's
    return {"dispatches": n, "steps": steps, **{name: t / 1e3 / n for name, t in us.items()},
            **{f"step_{name}": t / 1e3 / steps for name, t in us.items()},
            "busy_share": busy / (hi - lo) if hi > lo else 0.0,
            "host_events_ms": {name: t / 1e3 / n for name, t in inside.most_common(HOST_EVENTS)}}


# XLA's default command-buffer types and WHILE: a decode run's loop inside the graphs; and
# CONDITIONAL: a step's conditionals inside them
LOOP_IN_GRAPHS = {"xla_gpu_enable_command_buffer": DEFAULT_COMMAND_TYPES + ",WHILE"}
CONDITIONALS_IN_GRAPHS = {"xla_gpu_enable_command_buffer": DEFAULT_COMMAND_TYPES + ",CONDITIONAL"}


def recompiled(engine: Engine, options: dict, which) -> dict:
    """The engine's executables, those whose key (plan, kernels, steps) `which` takes compiled
    again with the XLA compiler options `options`."""
    executables = dict(engine._executables)
    for plan, kernels, steps in [key for key in executables if which(*key)]:
        args, static = engine._step_call(plan, BatchMeta.empty(plan), np.zeros((steps, 0), np.int32), kernels, steps)
        lowered = jit_layer_stack.lower(*args, **static)
        executables[plan, kernels, steps] = lowered.compile(compiler_options=options)
    return executables


def step_counts(value: str) -> list[int]:
    """--decode-steps: comma-separated integers."""
    try:
        return [int(x) for x in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated integers expected (e.g. 1,8), got {value!r}") from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true",
                   help="tiny config on CPU; defaults 8 sequences of 40 tokens, 4 decode steps, 2 layers")
    p.add_argument("--seqs", type=int, default=None, help="sequences (default 256)")
    p.add_argument("--context", type=int, default=None, help="prompt tokens of each sequence (default 4096)")
    p.add_argument("--decodes", type=int, default=None,
                   help="steps in which every sequence decodes (default 32)")
    p.add_argument("--layers", type=int, default=None, help="default 4")
    p.add_argument("--dispatch", default="cond", choices=("static", "cond"), help="default: the engine's (cond)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the engine's max_model_len (default: the workload's, context + output length): under the "
                        "default buckets it sets the block-table width every step transfers")
    p.add_argument("--host-only", action="store_true", help="no program runs: the host's step alone")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="run each variant once more under a profiler trace (into DIR and its row's suffix: DIR, "
                        "DIR_runs_of_8, ...); print its decode dispatches' device busy share, "
                        "a dispatch and a step")
    p.add_argument("--compare-command-buffers", action="store_true",
                   help="also time the programs without conditionals compiled with XLA's command buffers off")
    p.add_argument("--decode-steps", type=step_counts, default=[1],
                   help="EngineOptions.decode_steps, one variant each (e.g. 1,8: rows 'decode' and 'decode (runs "
                        "of 8)', interleaved over --rounds)")
    p.add_argument("--loop-in-graphs", action="store_true",
                   help="also time each decode run (--decode-steps K > 1) with its loop inside XLA's command "
                        "buffers (WHILE among their types): rows 'decode (runs of K, loop in graphs)'")
    p.add_argument("--conditionals-in-graphs", action="store_true",
                   help="also time the programs with conditionals (prefill steps) with CONDITIONAL among XLA's "
                        "command-buffer types: rows '... (conditionals in graphs)'")
    p.add_argument("--rounds", type=int, default=3,
                   help="runs of each variant with --compare-command-buffers, --conditionals-in-graphs or several "
                        "--decode-steps")
    p.add_argument("--out", default=None, help="write the step records and the medians as JSON here")
    a = p.parse_args(argv)
    if a.host_only and (a.compare_command_buffers or a.conditionals_in_graphs):
        p.error("--host-only runs no program: nothing to compare")
    if a.compare_command_buffers and a.conditionals_in_graphs:
        p.error("--compare-command-buffers and --conditionals-in-graphs: one comparison a run")
    if a.conditionals_in_graphs and a.decode_steps != [1]:
        p.error("--conditionals-in-graphs times single steps: leave --decode-steps out")
    if any(k < 1 for k in a.decode_steps) or len(set(a.decode_steps)) != len(a.decode_steps):
        p.error(f"--decode-steps must be distinct positive integers, got {a.decode_steps}")
    if a.compare_command_buffers and a.decode_steps != [1]:
        p.error("--compare-command-buffers times single steps: leave --decode-steps out")
    if a.loop_in_graphs and max(a.decode_steps) == 1:
        p.error("--loop-in-graphs times decode runs: give --decode-steps with a K > 1")
    if a.loop_in_graphs and a.host_only:
        p.error("--host-only runs no program: nothing to compare")
    if a.rounds < 1:
        p.error(f"--rounds must be at least 1, got {a.rounds}")
    defaults = dict(seqs=8, context=40, decodes=4, layers=2) if a.smoke else dict(seqs=256, context=4096, decodes=32,
                                                                                 layers=4)
    for name, value in defaults.items():  # a size given on the command line wins
        if getattr(a, name) is None:
            setattr(a, name, value)
    config = MLAConfig.tiny() if a.smoke else MLAConfig.deepseek_v32()
    budget = max(8192, 2 * a.seqs)
    # the prefills' steps at most: every step's budget less one token per sequence decoding
    prefill_steps = -(-a.seqs * a.context // (budget - a.seqs))
    output_len = a.decodes + prefill_steps + 1  # the first request still decodes when the last has prefilled
    pages = a.seqs * -(-(a.context + output_len) // config.page_size)
    engine = Engine(config, num_layers=a.layers, num_pages=pages, dispatch=a.dispatch,
                    max_num_seqs=a.seqs, max_num_batched_tokens=budget,
                    max_model_len=a.max_model_len or a.context + output_len)
    specs = [RequestSpec(i, a.context, output_len) for i in range(a.seqs)]
    print(f"{jax.devices()[0].device_kind} ({jax.default_backend()}), {'tiny' if a.smoke else 'deepseek_v32'}, "
          f"{a.layers} layers, {a.seqs} x {a.context} tokens, {output_len} out each, dispatch {a.dispatch}"
          f"{', host only' if a.host_only else ''}, "
          f"jax {jax.__version__}, {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    if a.host_only:
        done = jax.numpy.zeros(())

        def pack_only(plan, meta, rows, kernels, steps=1):  # the step's input packed, no program called
            engine._step_call(plan, meta, rows, kernels, steps)
            return done
        engine._forward = pack_only
    else:
        t0 = time.perf_counter()
        compiled = sum(engine.warmup(specs, max_steps=output_len, decode_steps=k) for k in a.decode_steps)
        print(f"warm-up: {compiled} programs in {time.perf_counter() - t0:.1f} s", flush=True)
    # a row name's suffix -> (the executables the runs use (None: the engine's own), decode_steps)
    variants = {("" if k == 1 else f" (runs of {k})"): (None, k) for k in a.decode_steps}
    if a.loop_in_graphs:
        variants.update({f" (runs of {k}, loop in graphs)": (
            recompiled(engine, LOOP_IN_GRAPHS, lambda plan, kernels, steps, k=k: steps == k), k)
            for k in a.decode_steps if k > 1})
    if a.compare_command_buffers:
        variants = {"": (None, 1), " (command buffers off)": (
            recompiled(engine, COMMAND_BUFFERS_OFF, lambda plan, kernels, steps: not plan.has_conditionals), 1)}
    if a.conditionals_in_graphs:
        with_conditionals = sum(plan.has_conditionals for plan, _, _ in engine._executables)
        print(f"conditionals in graphs: {with_conditionals} of {len(engine._executables)} programs compiled again",
              flush=True)
        variants = {"": (None, 1), " (conditionals in graphs)": (
            recompiled(engine, CONDITIONALS_IN_GRAPHS, lambda plan, kernels, steps: plan.has_conditionals), 1)}
    own = dict(engine._executables)  # the variants' None
    results = {suffix: [] for suffix in variants}
    rounds = a.rounds if len(variants) > 1 else 1
    for r in range(rounds):  # the variants interleaved; each round's medians printed as it ends
        for suffix, (executables, k) in variants.items():
            engine._executables = own if executables is None else executables
            results[suffix].append(engine.run(specs, max_steps=output_len, progress=False, decode_steps=k))
            if rounds > 1:
                print_rows(step_medians(results[suffix][-1:], suffix, a), f"round {r + 1}: ")
    rows = {}
    for suffix, runs in results.items():
        rows.update(step_medians(runs, suffix, a))
    print_rows(rows, "")
    traced = {}
    for suffix, (executables, k) in variants.items() if a.profile else ():
        engine._executables = own if executables is None else executables
        trace_dir = "_".join([a.profile, *re.findall(r"\w+", suffix)])  # " (runs of 8)" into DIR_runs_of_8
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            again = engine.run(specs, max_steps=output_len, progress=False, decode_steps=k)
        firsts = dispatches(again.steps)
        decoding = [s.index for s in every_decoding(firsts, a.seqs) if s.dispatch_steps == k]  # single steps or runs
        if len(decoding) < 3:
            raise SystemExit(f"--profile needs more --decodes (the traced run had {len(decoding)} dispatches of {k} "
                             "steps with every sequence decoding, fewer than 3; the window starts at the second)")

        def window(name: str, first: int, last: int) -> dict:  # trace_shares of dispatches first .. last, printed
            t = traced[f"{name}{suffix}"] = trace_shares(trace_dir, first, last)
            print(f"traced{suffix} {name}  dispatches {t['dispatches']:>4} ({t['steps']} steps)  wall "
                  f"{t['wall_ms']:.3f} ms a dispatch ({t['step_wall_ms']:.3f} a step), device busy "
                  f"{t['device_busy_ms']:.3f} ms ({t['step_device_busy_ms']:.3f} a step, {t['busy_share']:.1%}), "
                  f"host part {t['host_ms']:.3f} ms ({t['step_host_ms']:.3f} a step)", flush=True)
            return t

        t = window("decode", decoding[1], decoding[-1])  # dispatches [0] .. [-1] - 2
        for name, ms in t["host_events_ms"].items():
            print(f"    {ms:8.3f} ms a dispatch {ms * t['dispatches'] / t['steps']:8.3f} ms a step  {name}", flush=True)
        prefilling = [s.index for s in firsts if s.num_prefills > 0]  # the run's first dispatches, single steps
        if len(prefilling) >= 3:  # the device's idle between prefill steps (their programs have conditionals)
            window("prefill", prefilling[1], prefilling[-1])
    if a.out:
        first = next(iter(results.values()))[0]  # the first variant's first run
        result = {"device": jax.devices()[0].device_kind, "argv": sys.argv[1:], "date": time.strftime("%Y-%m-%d"),
                  "medians": rows, "traced": traced, "summary": first.summary()}
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
