"""One layer at real dimensions: wall time of a `jit_forward` step (cache donated) per batch kind,
latent cache format and variant, the variants interleaved in one run.

    python scripts/bench_layer.py [--kinds a,b] [--variants static,cond,no_skip,xla,masked,sparse] [--kv bf16,fp8]
                                  [--repeats 7] [--out results.json] [--profile DIR]   # GPU, deepseek_v32
    (each kind's rows are printed, and --out rewritten, as soon as the kind is measured)
    python scripts/bench_layer.py --smoke    # CPU: tiny config, 3 kinds, every variant, 1 repeat

Variants: static (plan_batch's default, kernels="auto": the exact program), cond (dispatch="cond",
the serving program, with an engine's BucketPolicy.for_limits at 256 sequences of up to 128K
tokens: one program per row bucket), no_skip
(skip_indexer=False: every row scored), xla (static plan, kernels="xla"), masked and sparse
(prefill_route forced: every prefill longer than index_topk as masked MHA, or sparse). Hidden states are
random; every cache slot holds random values of the cache's dtypes (contents do not change the
work). Each call takes the cache the previous call returned (it is donated). A round times every
variant once (the order alternates round by round): back-to-back calls, at least ~20 ms of them,
then block_until_ready; the median over rounds is reported, after compilation and a warm-up call.
A variant that fails (out of memory, say: XLA's indexer materialises [rows, heads, keys]) is
reported with its error and the run goes on; a variant whose plan is the static one (no_skip
on the sparse route: nothing to skip; masked or sparse where the plan picks that route) is not
timed again.

Columns: kv (latent cache format), kind (batch), rows (real rows / plan.num_tokens, the bucket),
route (the static plan's: dense | masked | sparse; masked: its dense program has masked rows), variant, ms (median per step), min (fastest round),
vs static (ms / the static variant's ms), first (s: the first call, compile included), rel_err (||out - out_static|| / ||out_static|| over
the real rows, of the last call). --profile DIR also writes a jax.profiler trace per (kv, kind)
under DIR and prints each variant's GPU (or CPU) time by the layer's named scopes (projections,
cache_write, indexer_queries, indexer_logits, indexer_topk, dense_kv_up, dense_mha,
sparse_attention, o_proj; ops outside them are named by the source function that emitted them).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import gzip
import json
import os
import re
import statistics
import sys
import time
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jax_sparse_mla import MLAConfig, Request, init_cache, init_params, jit_forward, plan_batch  # noqa: E402
from jax_sparse_mla.plan import BucketPolicy  # noqa: E402

KINDS = {  # name -> [(context_len, query_len)] per request
    "prefill_8x256": [(0, 256)] * 8, "prefill_4x1024": [(0, 1024)] * 4,
    "prefill_4k": [(0, 4096)], "prefill_8k": [(0, 8192)], "prefill_16k": [(0, 16384)], "prefill_32k": [(0, 32768)],
    "chunk_4k_after_4k": [(4096, 4096)], "chunk_4k_after_28k": [(28672, 4096)],
    "decode_64x4k": [(4096, 1)] * 64, "decode_128x4k": [(4096, 1)] * 128,
    "decode_64x32k": [(32768, 1)] * 64, "decode_128x32k": [(32768, 1)] * 128,
    "mixed_2x1024_64x4k": [(0, 1024)] * 2 + [(4096, 1)] * 64,
    "pad50_4097": [(0, 4097)],  # bucket 8192: ~50% padding rows
}
SMOKE_KINDS = {"decode_4x40": [(40, 1)] * 4, "mixed_12_4x40": [(0, 12)] + [(40, 1)] * 4,  # tiny: sparse, dense,
               "prefill_40": [(0, 40)]}  # masked
VARIANTS = {  # name -> (plan_batch options, kernels)
    "static": ({}, "auto"), "cond": ({"dispatch": "cond"}, "auto"),
    "no_skip": ({"skip_indexer": False}, "auto"), "xla": ({}, "xla"),
    "masked": ({"prefill_route": "masked"}, "auto"), "sparse": ({"prefill_route": "sparse"}, "auto"),
}
KV = {"bf16": "bfloat16", "fp8": "fp8"}
LIBRARY_SCOPES = ("projections", "cache_write", "indexer_queries", "indexer_logits", "indexer_topk",
                  "dense_kv_up", "dense_mha", "sparse_attention", "o_proj")  # jax_sparse_mla.model's scopes


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    csv = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--smoke", action="store_true", help="tiny config on CPU, 3 kinds, 1 repeat")
    p.add_argument("--kinds", type=csv, default=None, help=f"default: all of {','.join(KINDS)}")
    p.add_argument("--variants", type=csv, default=list(VARIANTS))
    p.add_argument("--kv", type=csv, default=list(KV), help="latent cache formats: bf16,fp8")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 7; 1 with --smoke)")
    p.add_argument("--out", default=None, help="write every row as JSON here")
    p.add_argument("--profile", default=None, metavar="DIR", help="trace dir; prints a per-scope breakdown")
    a = p.parse_args(argv)
    kinds = SMOKE_KINDS if a.smoke else KINDS
    a.kinds = a.kinds or list(kinds)
    for name, known in (("kinds", kinds), ("variants", VARIANTS), ("kv", KV)):
        bad = [x for x in getattr(a, name) if x not in known]
        if bad:
            p.error(f"unknown {name} {bad}; one of {list(known)}")
    a.repeats = a.repeats or (1 if a.smoke else 7)
    return a


def random_cache(config: MLAConfig, num_pages: int, key):
    """A cache whose every slot holds random values of its dtypes (scales: powers of two)."""
    shapes = jax.eval_shape(lambda: init_cache(config, num_pages))

    @jax.jit
    def fill(key):
        out = {}
        for i, f in enumerate(dataclasses.fields(shapes)):
            s = getattr(shapes, f.name)
            if s is None:
                out[f.name] = None
            elif f.name.endswith("scale"):
                out[f.name] = 2.0 ** jax.random.randint(jax.random.fold_in(key, i), s.shape, -8, -4).astype(s.dtype)
            else:
                scale = 8.0 if jnp.dtype(s.dtype).itemsize == 1 else 1.0  # e4m3: use its range
                out[f.name] = (scale * jax.random.normal(jax.random.fold_in(key, i), s.shape)).astype(s.dtype)
        return dataclasses.replace(shapes, **out)

    return fill(key)


def batch(config, specs):
    """Requests over pages 1.. in order (page 0 unused) and the page count they need."""
    page, start, requests = config.page_size, 1, []
    for c, q in specs:
        n = -(-(c + q) // page)
        requests.append(Request(c, q, list(range(start, start + n))))
        start += n
    return requests, start


def step_time(step, cache, reps: int):
    """ms per call of `reps` back-to-back calls, each taking the cache the last one returned."""
    t0 = time.perf_counter()
    for _ in range(reps):
        out, cache = step(cache)
    jax.block_until_ready((out, cache))
    return (time.perf_counter() - t0) / reps * 1e3, out, cache


# ------------------------------------------------------------------------------------------------
# --profile: kernel time by named scope
# ------------------------------------------------------------------------------------------------

def _tables(text: str) -> dict[str, dict[int, str]]:
    """The compiled module's stack-frame tables: section -> {id: line body}."""
    tables, section = defaultdict(dict), None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
        elif section and (m := re.match(r"^(\d+) (.*)$", line)):
            tables[section][int(m.group(1))] = m.group(2)
        else:
            section = None
    return tables


def _frames(tables, frame_id: int) -> list[tuple[str, str]]:
    """(file, function) of a stack frame and its callers, innermost first (parent ids print +1)."""
    out, seen = [], set()
    while frame_id in tables["StackFrames"] and frame_id not in seen:
        seen.add(frame_id)
        loc_id, parent = map(int, re.findall(r"=(\d+)", tables["StackFrames"][frame_id]))
        loc = dict(re.findall(r"(\w+)=(\d+)", tables["FileLocations"].get(loc_id, "")))
        out.append((tables["FileNames"].get(int(loc.get("file_name_id", 0)), "?").strip('"'),
                    tables["FunctionNames"].get(int(loc.get("function_name_id", 0)), "?").strip('"')))
        frame_id = parent - 1
    return out


DISPATCHERS = ("forward", "_dense_program", "_sparse_program", "_attend_sparsely")  # and lax.cond's lambdas


def _scope(op_name: str, frames) -> str:
    """The library's named scope if the op is under one; else the outermost function of the
    layer (jax_sparse_mla/) below forward and the program dispatchers on the op's stack:
    mla_projections, indexer_keys, encode_latent / write (cache writes), _dense_prefill,
    _sparse_attention, ...; "linear" called by forward itself is o_proj."""
    named = [p for p in op_name.split("/") if p in LIBRARY_SCOPES]
    if named:
        return named[-1]
    ours = [fn for f, fn in reversed(frames) if "jax_sparse_mla" in f]  # outermost first
    while ours and (ours[0] in DISPATCHERS + ("<module>",) or ours[0].endswith("<lambda>")):
        ours = ours[1:]
    if not ours:
        return "forward (other)"
    return "o_proj" if ours == ["linear"] else ours[0]


def hlo_scopes(compiled_text: str) -> dict[str, str]:
    """HLO instruction name -> scope, from the compiled module's op metadata and stack frames."""
    tables, out = _tables(compiled_text), {}
    pat = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*metadata=\{([^}]*)\}")
    for line in compiled_text.splitlines():
        if re.search(r"\s(conditional|while|call)\(", line):
            continue  # control flow: its event spans its branches' ops, which are counted themselves
        if m := pat.match(line):
            op_name = re.search(r'op_name="([^"]*)"', m.group(2))
            frame = re.search(r"stack_frame_id=(\d+)", m.group(2))
            out[m.group(1)] = _scope(op_name.group(1) if op_name else "",
                                     _frames(tables, int(frame.group(1))) if frame else [])
    return out


def trace_breakdown(trace_dir: str, scopes: dict[str, str]) -> dict[str, float]:
    """ms per scope over the perfetto trace's events that name an HLO instruction of `scopes`:
    by their hlo_op argument (GPU kernels on the stream lines) where any event has one, else by
    the event's name (one of the two only: the "XLA Ops" line repeats the kernels by name)."""
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True), key=os.path.getmtime)
    if not files:
        return {"(no trace file)": 0.0}
    with gzip.open(files[-1]) as f:
        events = [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X"]
    by_arg = any(e.get("args", {}).get("hlo_op") in scopes for e in events)
    totals = defaultdict(float)
    for e in events:
        name = e.get("args", {}).get("hlo_op") if by_arg else e.get("name")
        if name in scopes:
            totals[scopes[name]] += e.get("dur", 0) / 1e3
    if not totals:
        keys = sorted({k for e in events for k in e.get("args", {})})
        return {f"(no event named an HLO op; event arg keys: {keys[:12]})": 0.0}
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


# ------------------------------------------------------------------------------------------------

ENGINE_LIMITS = dict(max_num_seqs=256, max_model_len=131072)  # the cond variant's BucketPolicy.for_limits
SMOKE_LIMITS = dict(max_num_seqs=8, max_model_len=256)


def variant_options(config, variant: str, smoke: bool) -> dict:
    """plan_batch's options of a variant (cond: an engine's buckets at ENGINE_LIMITS)."""
    options = dict(VARIANTS[variant][0])
    if options.get("dispatch") == "cond":
        options["buckets"] = BucketPolicy.for_limits(config, **(SMOKE_LIMITS if smoke else ENGINE_LIMITS))
    return options


def run_kind(config, kv, params, kind, specs, args, key):
    requests, num_pages = batch(config, specs)
    plans = {v: plan_batch(config, requests, num_pages=num_pages, **variant_options(config, v, args.smoke))
             for v in args.variants}
    T = next(iter(plans.values()))[0].num_tokens
    n = sum(q for _, q in specs)
    static_plan = plan_batch(config, requests, num_pages=num_pages)[0]
    route = static_plan.program
    hidden = jax.random.normal(key, (T, config.hidden_size), jnp.float32).astype(config.jnp_dtype)
    cache = random_cache(config, num_pages, jax.random.fold_in(key, 1))
    steps = {v: functools.partial(lambda c, p, m, k: jit_forward(params, hidden, c, m, plan=p, config=config,
                                                                  kernels=k), p=plans[v][0], m=plans[v][1],
                                  k=VARIANTS[v][1]) for v in args.variants}
    ms, outs, errors, reps, first = defaultdict(list), {}, {}, {}, {}
    same = {v for v in args.variants if v != "static" and "static" in plans and VARIANTS[v][1] == "auto"
            and plans[v][0] == plans["static"][0]}  # e.g. no_skip on the sparse route: the static program
    for v, step in steps.items():  # compile, warm up, size the batches of calls
        if v in same:
            continue
        try:
            t0 = time.perf_counter()
            _, _, cache = step_time(step, cache, 1)
            first[v] = time.perf_counter() - t0
            once, _, cache = step_time(step, cache, 1)
            reps[v] = int(min(50, max(1, 20 / max(once, 1e-3))))
        except Exception as e:  # noqa: BLE001 (an OOM at 32K for XLA, say: report and go on)
            errors[v] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            if cache.latent.is_deleted():
                cache = random_cache(config, num_pages, jax.random.fold_in(key, 1))
    live = [v for v in args.variants if v not in errors and v not in same]
    for r in range(args.repeats):
        for v in (live if r % 2 == 0 else live[::-1]):
            t, outs[v], cache = step_time(steps[v], cache, reps[v])
            ms[v].append(t)
    base = outs.get("static")
    rows = []
    for v in args.variants:
        row = {"kv": kv, "kind": kind, "rows": n, "bucket": T, "route": route, "variant": v}
        if v in errors or v in same:
            row["error" if v in errors else "note"] = errors.get(v, "the static program (not timed again)")
        else:
            row.update(ms=statistics.median(ms[v]), min_ms=min(ms[v]), reps=reps[v], rounds=len(ms[v]),
                       first_s=first[v])
            if base is not None:
                a, b = np.asarray(outs[v][:n], np.float32), np.asarray(base[:n], np.float32)
                row["rel_err"] = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
        rows.append(row)
    if args.profile and live:
        for v in live:
            row = next(r for r in rows if r["variant"] == v)
            trace_dir = os.path.join(args.profile, f"{kind}-{kv}-{v}")
            p, m = plans[v]
            text = jit_forward.lower(params, hidden, cache, m, plan=p, config=config,
                                     kernels=VARIANTS[v][1]).compile().as_text()
            with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
                _, _, cache = step_time(steps[v], cache, 3)
            row["profile_ms_per_step"] = {s: t / 3 for s, t in trace_breakdown(trace_dir, hlo_scopes(text)).items()}
    del cache
    return rows


HEADER = (f"{'kv':<5}{'kind':<22}{'rows':>13} {'route':<7}{'variant':<9}{'ms':>10}{'min':>10}{'vs static':>10}"
          f"{'first':>8}{'rel_err':>10}")


def print_rows(rows):
    """One line per row (rows: one kind's, static first where timed), flushed."""
    static = {(r["kv"], r["kind"]): r.get("ms") for r in rows if r["variant"] == "static"}
    for r in rows:
        head = f"{r['kv']:<5}{r['kind']:<22}{str(r['rows']) + '/' + str(r['bucket']):>13} {r['route']:<7}{r['variant']:<9}"
        if "error" in r or "note" in r:
            print(head + (f"  failed: {r['error']}" if "error" in r else f"  {r['note']}"))
            continue
        s = static.get((r["kv"], r["kind"]))
        ratio = f"{r['ms'] / s:.3f}" if s else "-"
        err = f"{r['rel_err']:.1e}" if "rel_err" in r else "-"
        print(head + f"{r['ms']:>10.3f}{r['min_ms']:>10.3f}{ratio:>10}{r['first_s']:>8.1f}{err:>10}")
        for scope, t in r.get("profile_ms_per_step", {}).items():
            print(f"{'':<16}{scope:<40}{t:>10.3f} ms/step")
    sys.stdout.flush()


def write_rows(path: str, rows, dev) -> None:
    """Every row measured so far as JSON (rewritten after each kind: a run cut short keeps them)."""
    with open(path + ".tmp", "w") as f:
        json.dump({"device": dev.device_kind, "backend": jax.default_backend(), "argv": sys.argv[1:],
                   "date": time.strftime("%Y-%m-%d"), "rows": rows}, f, indent=1)
    os.replace(path + ".tmp", path)


def main(argv=None) -> int:
    args = parse_args(argv)
    base = MLAConfig.tiny() if args.smoke else MLAConfig.deepseek_v32()
    kinds = SMOKE_KINDS if args.smoke else KINDS
    dev = jax.devices()[0]
    print(f"{dev.device_kind} ({jax.default_backend()}), {'tiny' if args.smoke else 'deepseek_v32'}, "
          f"repeats {args.repeats}, jax {jax.__version__}, {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    rows, t0 = [], time.perf_counter()
    print(HEADER, flush=True)
    for kv in args.kv:
        config = dataclasses.replace(base, kv_cache_dtype=KV[kv])
        params = init_params(config, jax.random.key(0))
        for i, kind in enumerate(args.kinds):
            kind_rows = run_kind(config, kv, params, kind, kinds[kind], args, jax.random.key(100 + i))
            print_rows(kind_rows)  # each kind as soon as it is measured
            rows += kind_rows
            if args.out:
                write_rows(args.out, rows, dev)
            print(f"  ({kv} {kind} done at {time.perf_counter() - t0:.0f} s)", flush=True)
        del params
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
