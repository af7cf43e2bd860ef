"""Warm-up before serving, at real dimensions: the wall time of `Engine.precompile` (every program
a run under the engine's limits can need) into an empty executable store (cold: each program
traced, lowered and compiled), then in a restarted process over that store (restart: each
program loaded, nothing lowered or compiled).

    python scripts/bench_warmup.py [--kv bf16|fp8] [--dispatch cond|static] [--max-num-seqs 256]
        [--max-num-batched-tokens 8192] [--max-model-len 131072] [--num-pages 65536]
        [--programs START:STOP] [--decode-steps K] [--workers N] [--store DIR] [--out warmup.json]
                                                                                   # GPU, deepseek_v32
    python scripts/bench_warmup.py --smoke                     # CPU: tiny config, small limits

Each phase is a fresh process (this script again, with an internal --phase flag): it builds
Engine(config, num_layers=1, num_pages=..., max_num_seqs=..., max_num_batched_tokens=...,
max_model_len=..., dispatch=...) and times engine.precompile(store=DIR, workers=N). First, in
this process (no device touched), the program set per route for the same options
(enumerate_plans, as count_programs counts it): the program count before anything compiles.
The defaults are a DeepSeek-V3.2 serving engine's limits (65536 pages, 256 sequences, 8192
tokens a step, 131072-token requests) and the engine's default program set (dispatch cond under
BucketPolicy.for_limits: 30 programs; static there would be 105,972). --programs START:STOP:
both phases warm up that slice of the set only (enumerate_plans' order). --decode-steps K > 1:
the engine's decode_steps, and the decode runs' programs (EngineOptions.decode_run_plans, one a
decode row bucket) are warmed up after the slice.

Per phase: precompile_s (the precompile call), process_s (the whole process: imports, engine
init, precompile), the PrecompileReport's program count, routes, how many programs it loaded
from the store, each program's seconds (program_s: its tracing and lowering plus its compile or
load; compiles overlap in the worker threads, so these add up to more than precompile_s; median,
max), and jax's backend-compile events (one per XLA compile) and their seconds: a restart
served by the store has none. The precompile bar goes to stderr (a run cut by a time limit
shows how far it got). Each phase's result is printed, and --out rewritten, as soon as it is
measured. --store must be empty or absent (default: a temporary directory, removed at the end).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jax_sparse_mla import MLAConfig  # noqa: E402

LIMITS = dict(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=131072, num_pages=65536)
SMOKE_LIMITS = dict(max_num_seqs=1, max_num_batched_tokens=32, max_model_len=32, num_pages=17)
KV = {"bf16": "bfloat16", "fp8": "fp8"}
COMPILE = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch.BACKEND_COMPILE_EVENT: compile or load


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help=f"tiny config on CPU, limits {SMOKE_LIMITS}")
    p.add_argument("--kv", choices=list(KV), default="bf16", help="latent cache format")
    p.add_argument("--dispatch", choices=("cond", "static"), default="cond")
    for name in LIMITS:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                       help=f"default {LIMITS[name]} ({SMOKE_LIMITS[name]} with --smoke)")
    p.add_argument("--programs", default=":", help="START:STOP, a slice of the program set (default: all)")
    p.add_argument("--decode-steps", type=int, default=1,
                   help="EngineOptions.decode_steps; > 1: the decode runs' programs are warmed up too")
    p.add_argument("--workers", type=int, default=None, help="compiling threads (default: precompile's)")
    p.add_argument("--store", default=None, help="executable store directory, empty or absent")
    p.add_argument("--out", default=None, help="write the counts and each phase's result as JSON here")
    p.add_argument("--phase", choices=("cold", "restart"), default=None, help=argparse.SUPPRESS)  # a child
    a = p.parse_args(argv)
    try:
        a.slice = slice(*[int(v) if v else None for v in a.programs.split(":")])
    except (TypeError, ValueError):
        p.error(f"--programs must be START:STOP (integers, either may be empty), got {a.programs!r}")
    if a.decode_steps < 1:
        p.error(f"--decode-steps must be at least 1, got {a.decode_steps}")
    for name, default in (SMOKE_LIMITS if a.smoke else LIMITS).items():
        if getattr(a, name) is None:
            setattr(a, name, default)
    return a


def config_of(args) -> MLAConfig:
    base = MLAConfig.tiny() if args.smoke else MLAConfig.deepseek_v32()
    return dataclasses.replace(base, kv_cache_dtype=KV[args.kv])


def options_of(args):
    from jax_sparse_mla.serving.engine import EngineOptions

    return EngineOptions(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                         max_model_len=args.max_model_len, dispatch=args.dispatch, decode_steps=args.decode_steps)


def enumerate_set(args) -> tuple[list, list]:
    """The engine's program set for these options (EngineOptions.program_set; enumerate_plans'
    order) and its decode runs' plans (EngineOptions.decode_run_plans: none with decode_steps 1)."""
    opts, config = options_of(args), config_of(args)
    return opts.program_set(config, args.num_pages), opts.decode_run_plans(config, args.num_pages)


def phase(args) -> dict:
    """One phase in this process: the engine, then its precompile, timed and its compiles counted."""
    import jax

    from jax_sparse_mla.serving import Engine

    events, seconds, lock = Counter(), defaultdict(float), threading.Lock()

    def duration(event, secs, **kw):  # called from precompile's compiling threads
        with lock:
            events[event] += 1
            seconds[event] += secs
    jax.monitoring.register_event_duration_secs_listener(duration)
    t0 = time.perf_counter()
    engine = Engine(config_of(args), num_layers=1, num_pages=args.num_pages, max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                    dispatch=args.dispatch, decode_steps=args.decode_steps)
    jax.block_until_ready((engine.params, engine.caches, engine.pool))
    t1 = time.perf_counter()
    before, before_s = Counter(events), dict(seconds)  # the engine's own programs: outside the store
    plans, decode_plans = enumerate_set(args)
    report = engine.precompile(store=args.store, workers=args.workers, progress=True, plans=plans[args.slice],
                               decode_plans=decode_plans)
    t2 = time.perf_counter()
    events.subtract(before)
    start = args.slice.start or 0
    for i, (plan, secs) in enumerate(zip(report.plans, report.seconds), start):
        stages = "+".join(s for s, n in (("dense", plan.num_dense_keys), ("sparse", plan.num_sparse_tokens)) if n)
        print(f"  {args.phase} program {i}: {plan.num_tokens} rows, {stages or plan.route}: {secs:.1f} s",
              file=sys.stderr, flush=True)
    program_s = list(report.seconds)
    return {"phase": args.phase, "precompile_s": t2 - t1, "engine_init_s": t1 - t0,
            "num_programs": report.num_programs, "per_route": report.per_route, "loaded": report.loaded,
            "program_s": program_s,
            "program_s_median": statistics.median(program_s) if program_s else 0.0,
            "program_s_max": max(program_s, default=0.0),
            "compiles": events[COMPILE], "compiles_s": seconds[COMPILE] - before_s.get(COMPILE, 0.0),
            "device": jax.devices()[0].device_kind, "jax": jax.__version__}


def run_phase(args, name: str, store: str) -> dict:
    """Runs a phase in a fresh process (its stderr, precompile's progress bar, passes through) ->
    its result, with process_s; or {"error": ...}."""
    argv = [os.path.abspath(__file__), "--phase", name, "--store", store, "--kv", args.kv,
            "--dispatch", args.dispatch, f"--programs={args.programs}", f"--decode-steps={args.decode_steps}"] + (
        [] if args.workers is None else ["--workers", str(args.workers)]) + [
        f"--{k.replace('_', '-')}={getattr(args, k)}" for k in LIMITS]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, *argv, *(["--smoke"] if args.smoke else [])], stdout=subprocess.PIPE,
                          text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        return {"error": f"exit status {proc.returncode}", "stdout": proc.stdout[-2000:]}
    return {**json.loads(lines[-1][len("RESULT "):]), "process_s": time.perf_counter() - t0}


def write(path: str | None, result: dict) -> None:
    if path:
        with open(path + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(path + ".tmp", path)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.phase:  # a child: one phase, its result on the last line
        print("RESULT " + json.dumps(phase(args)), flush=True)
        return 0
    if args.store and os.path.isdir(args.store) and os.listdir(args.store):
        sys.exit(f"--store {args.store} is not empty: the cold phase needs an empty executable store")
    plans, decode_plans = enumerate_set(args)
    counts = dict(Counter(p.route for p in plans), total=len(plans), decode_runs=len(decode_plans))
    chosen = len(plans[args.slice]) + len(decode_plans)
    result = {"config": "tiny" if args.smoke else "deepseek_v32", "kv": args.kv, "dispatch": args.dispatch,
              "limits": {k: getattr(args, k) for k in LIMITS}, "count_programs": counts, "programs": args.programs,
              "decode_steps": args.decode_steps, "date": time.strftime("%Y-%m-%d %H:%M"), "phases": {}}
    print(f"{result['config']}, kv {args.kv}, dispatch {args.dispatch}, {result['limits']}: count_programs {counts}; "
          f"warming up {chosen} of them ({args.programs}{', and the decode runs' if decode_plans else ''})",
          flush=True)
    write(args.out, result)
    store = args.store or tempfile.mkdtemp(prefix="bench_warmup_store_")
    try:
        for name in ("cold", "restart"):
            r = result["phases"][name] = run_phase(args, name, store)
            write(args.out, result)
            if "error" in r:
                print(f"{name:<8} failed ({r['error']})", flush=True)
                return 1
            routes = ", ".join(f"{k} {v}" for k, v in r["per_route"].items())
            print(f"{name:<8} {r['num_programs']} programs ({routes}) in {r['precompile_s']:.1f} s, {r['loaded']} "
                  f"loaded from the store (per program median {r['program_s_median']:.2f} s, max "
                  f"{r['program_s_max']:.2f}; process {r['process_s']:.1f} s, engine init {r['engine_init_s']:.1f} s); "
                  f"XLA compiles {r['compiles']} ({r['compiles_s']:.1f} s); {r['device']}", flush=True)
        cold, restart = result["phases"]["cold"], result["phases"]["restart"]
        print(f"restart / cold: {restart['precompile_s'] / cold['precompile_s']:.3f} (precompile), "
              f"{restart['process_s'] / cold['process_s']:.3f} (process)", flush=True)
    finally:
        if args.store is None:
            shutil.rmtree(store, ignore_errors=True)
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
