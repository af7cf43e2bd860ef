"""The short-prefill skip, end to end: vLLM PR #48407's evaluation with skip_indexer on and off
side by side in one run, through the serving loop (jax_sparse_mla.serving) over N layers.

    python scripts/bench_skip.py [--layers 4] [--quick] [--out-dir docs/skip]   # GPU, real dims
    python scripts/bench_skip.py --smoke                                          # CPU, tiny config

(a) short prefills: input 1024 tokens (random range ratio 0.125), output 1, concurrency
    1..32: request throughput and TTFT, skip on vs off (vLLM reported +2.54% request throughput).
(b) decode-heavy: input 1, output 1024, concurrency 1/8/32: median TPOT must not regress with the
    skip (ratio on/off printed; > 1.03 is flagged, and only judged with two or more timed runs a
    setting: one run's order and spread move it by several percent).
(c) per-step breakdown on fixed batches: one step through all layers with the skip and without,
    and the indexer scoring alone (logits + top-k through jax_sparse_mla.kernels, per layer) on
    the same rows: the indexer's share of a step.
--block attention,decoder runs each phase for each layer stack in turn: "attention" (x = x +
attn(x), the default) and "decoder" (DeepSeek-V3.2 decoder blocks, x = x + attn(RMSNorm(x));
x = x + moe(RMSNorm(x)) with serving.block's MoE stand-in: DeepSeek-V3.2's 8 active experts of
intermediate 2048 and one shared, but --moe-experts routed experts, default 64 of its 256 at the
real dims: 256 take 22.5 GB of bf16 a layer, 4 layers ~92 GB, more than an 80 GB card holds;
each token's experts and FLOPs are the model's, only the weights it picks from are fewer), so
the skip's gain is read off a model's step as well as the attention stack's; every row and
table line names its block, and --time-limit applies to each block. Before a block's engine is
built, its weights and caches are checked to fit the device (stack_bytes against what jax may
allocate there, leaving room for XLA's scratch): a stack that does not fit is refused, naming the
flags that shrink it, before any block runs.
Every workload is warmed up first (a dry run of the scheduler collects its plans; each is
compiled and run once), then timed; skip on/off runs alternate. Writes results.json, table.md
and PNG plots to --out-dir and prints the markdown table. Sizes are flags; --quick trims;
--time-limit stops starting concurrency levels of (a) after half of it and of (b) after 85% (the
default aims to keep a full H200 run under 8 minutes, compilation included; --compilation-cache
makes reruns cheaper).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (also when a test loads it by path)

from jax_sparse_mla import BucketPolicy, MLAConfig, Request  # noqa: E402
from jax_sparse_mla import kernels as kernel_ops  # noqa: E402
from jax_sparse_mla.serving import Engine, Workload  # noqa: E402
from jax_sparse_mla.cache import page_bytes  # noqa: E402
from jax_sparse_mla.params import param_shapes  # noqa: E402
from jax_sparse_mla.serving.block import BLOCKS, MoEConfig, block_param_shapes  # noqa: E402
from timing import median_ms  # noqa: E402

SETTINGS = {"skip": True, "no_skip": False}  # name -> skip_indexer
DECODER_EXPERTS = 64  # the MoE stand-in's routed experts at the real dims: 4 layers in ~23 GB, not ~92 GB
FIT_SHARE = 0.7  # of the device's memory a stack's weights and caches may take (the rest: activations, scratch)


def decoder_moe(config: MLAConfig, experts: int | None) -> MoEConfig:
    """The decoder blocks' MoE stand-in: MoEConfig.for_config(config) with `experts` routed
    experts (None: DECODER_EXPERTS at the real dims, the tiny MoE's own otherwise)."""
    moe = MoEConfig.for_config(config)
    if experts is None:
        experts = DECODER_EXPERTS if moe.num_experts > DECODER_EXPERTS else moe.num_experts
    return dataclasses.replace(moe, num_experts=experts)


def stack_bytes(config: MLAConfig, layers: int, num_pages: int, moe: MoEConfig | None) -> int:
    """Bytes of an Engine's layers: attention params, decoder block params (moe None: attention
    layers, none) and one cache of num_pages pages each, in config.dtype."""
    item = jnp.dtype(config.jnp_dtype).itemsize
    shapes = list(param_shapes(config).values()) + (list(block_param_shapes(config, moe).values()) if moe else [])
    return layers * (sum(int(np.prod(s)) for s in shapes) * item + num_pages * page_bytes(config))


def check_fits(need: int, device, what: str) -> None:
    """SystemExit naming what shrinks the stack when `need` bytes exceed FIT_SHARE of what jax
    may allocate on the device (its memory_stats' bytes_limit; not checked where the device
    reports none, e.g. a CPU)."""
    limit = (device.memory_stats() or {}).get("bytes_limit")
    if limit and need > FIT_SHARE * limit:
        raise SystemExit(f"{what} takes {need / 1e9:.1f} GB of weights and caches, more than {FIT_SHARE:.0%} of the "
                         f"{limit / 1e9:.1f} GB jax may allocate on the device: pass fewer --layers or (decoder) "
                         "--moe-experts")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _blocks(text: str) -> list[str]:
    blocks = [b for b in text.split(",") if b]
    bad = [b for b in blocks if b not in BLOCKS]
    if bad or not blocks or len(set(blocks)) != len(blocks):
        raise argparse.ArgumentTypeError(f"expected distinct blocks from {BLOCKS}, comma-separated, got {text!r}")
    return blocks


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny config, tiny sizes (CPU, ~1 minute)")
    p.add_argument("--quick", action="store_true", help="fewer requests, shorter decodes, one repeat")
    p.add_argument("--config", choices=("tiny", "deepseek_v32"), default=None,
                   help="default: deepseek_v32 on a GPU, tiny otherwise (always tiny with --smoke)")
    p.add_argument("--layers", type=int, default=None, help="layers in the stack (default 4; 2 with --smoke)")
    p.add_argument("--block", type=_blocks, default=["attention"],
                   help="layer stacks to run, comma-separated from attention,decoder (default attention)")
    p.add_argument("--moe-experts", type=int, default=None,
                   help=f"decoder: routed experts of the MoE stand-in (default {DECODER_EXPERTS} at the real dims, "
                   "DeepSeek-V3.2 has 256; the tiny MoE's 8 otherwise)")
    p.add_argument("--kernels", default="auto", choices=("auto", "xla", "pallas"))
    p.add_argument("--dispatch", default="static", choices=("static", "cond"))
    p.add_argument("--out-dir", default="docs/skip")
    p.add_argument("--prefill-concurrency", type=_ints, default=None, help="default 1,2,4,8,16,32")
    p.add_argument("--prefill-input-len", type=int, default=None, help="default index_topk // 2 (1024)")
    p.add_argument("--prefill-range-ratio", type=float, default=0.125)
    p.add_argument("--prefill-requests-per-concurrency", type=int, default=None,
                   help="requests per run = this x concurrency (at least 8); default 8, 4 with --quick")
    p.add_argument("--decode-concurrency", type=_ints, default=None, help="default 1,8,32")
    p.add_argument("--decode-output-len", type=int, default=None, help="default 1024 (256 with --quick)")
    p.add_argument("--decode-waves", type=int, default=1, help="requests per decode run = waves x concurrency")
    p.add_argument("--breakdown-prefills", type=_ints, default=None,
                   help="prefills of prefill-input-len tokens in each breakdown batch (default 1,8)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="default 8192 (64 with --smoke)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--min-pages-per-seq", type=int, default=4, help="BucketPolicy minimum width")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per setting (default 2, 1 with --quick)")
    p.add_argument("--time-limit", type=float, default=420.0,
                   help="after its first level, no (a) level starts past 50%% of this many seconds, "
                   "no (b) level past 85%%")
    p.add_argument("--compilation-cache", default=None, help="persistent XLA compilation cache directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    if a.smoke:
        a.config = "tiny"
    elif a.config is None:
        a.config = "deepseek_v32" if on_gpu else "tiny"
    small = a.config == "tiny"
    a.layers = a.layers or (2 if a.smoke else 4)
    a.prefill_concurrency = a.prefill_concurrency or ([1, 2, 4] if a.smoke else [1, 2, 4, 8, 16, 32])
    a.decode_concurrency = a.decode_concurrency or ([1, 4] if a.smoke else [1, 8, 32])
    a.prefill_requests_per_concurrency = a.prefill_requests_per_concurrency or (4 if a.quick or a.smoke else 8)
    a.decode_output_len = a.decode_output_len or (24 if a.smoke else 256 if a.quick else 1024)
    a.max_num_batched_tokens = a.max_num_batched_tokens or (64 if small else 8192)
    a.breakdown_prefills = a.breakdown_prefills or [1, 8]
    a.repeats = a.repeats or (1 if a.quick or a.smoke else 2)
    return a


# ------------------------------------------------------------------------------------------------

def run_pair(engine: Engine, workload: Workload, args, label: str, level: int) -> dict:
    """Warm up both settings, then `repeats` timed runs of each, alternating; which setting runs
    first also alternates with the sweep's `level` (with one repeat, not always the same one).
    -> {setting: its runs' medians, "spread": the lowest and highest over the repeats (run i of each
    setting against run i of the other) of the request-throughput gain (%) and the TPOT ratio,
    "warmup_s"}."""
    t0 = time.perf_counter()
    compiled = {name: engine.warmup(workload, skip_indexer=skip) for name, skip in SETTINGS.items()}
    warm_s = time.perf_counter() - t0
    runs = {name: [] for name in SETTINGS}
    for rep in range(args.repeats):
        order = list(SETTINGS.items())
        if (rep + level) % 2:
            order.reverse()
        for name, skip in order:
            gc.collect()
            gc.disable()  # no collector pauses inside a timed run
            try:
                result = engine.run(workload, skip_indexer=skip, progress=False if args.no_progress else None,
                                    desc=f"{label} {name}")
            finally:
                gc.enable()
            s = result.summary()
            if s["new_programs"]:
                print(f"  warning: {label} {name} compiled {s['new_programs']} programs while timed", flush=True)
            runs[name].append(s)
    out = {}
    for name, summaries in runs.items():
        keys = [k for k, v in summaries[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
        merged = {k: float(statistics.median([s[k] for s in summaries if s[k] is not None]))
                  if all(s[k] is not None for s in summaries) else None for k in keys}
        merged["steps_by_route"] = summaries[0]["steps_by_route"]
        merged["steps_with_scoring"] = summaries[0]["steps_with_scoring"]
        merged["programs_compiled_in_warmup"] = compiled[name]
        out[name] = merged
    out["spread"] = spread(runs["skip"], runs["no_skip"])
    out["warmup_s"] = warm_s
    return out


def throughput_gain_pct(on: dict, off: dict) -> float:
    """The skip's request-throughput gain (%) of run summary `on` over `off`."""
    return 100 * (on["request_throughput"] / off["request_throughput"] - 1)


def spread(skip: list[dict], no_skip: list[dict]) -> dict:
    """The range over the repeats of the two settings' run summaries (run i against run i):
    {"throughput_gain_pct": [lowest, highest] of the skip's request-throughput gain (%),
    "tpot_ratio": [lowest, highest] of skip / no-skip median TPOT (None: no run decoded)}."""
    pairs = list(zip(skip, no_skip, strict=True))
    gains = [throughput_gain_pct(on, off) for on, off in pairs]
    ratios = [on["median_tpot_ms"] / off["median_tpot_ms"] for on, off in pairs
              if on["median_tpot_ms"] and off["median_tpot_ms"]]
    return {"throughput_gain_pct": [min(gains), max(gains)], "tpot_ratio": [min(ratios), max(ratios)] if ratios else None}


def phase_prefill(engine, args, t_start) -> list[dict]:
    rows = []
    for level, c in enumerate(args.prefill_concurrency):
        if rows and time.perf_counter() - t_start > 0.5 * args.time_limit:  # leave time to (b), (c)
            print(f"  (a) concurrency {c}: skipped, past --time-limit", flush=True)
            continue
        w = Workload(num_requests=max(8, args.prefill_requests_per_concurrency * c), input_len=args.prefill_input_len,
                     input_range_ratio=args.prefill_range_ratio, output_len=1, concurrency=c, seed=args.seed)
        r = run_pair(engine, w, args, f"(a) c={c}", level)
        on, off = r["skip"], r["no_skip"]
        row = {"concurrency": c, "num_requests": w.num_requests, **r,
               "throughput_gain_pct": throughput_gain_pct(on, off)}
        rows.append(row)
        lo, hi = r["spread"]["throughput_gain_pct"]
        print(f"  (a) c={c:>3}: req/s {on['request_throughput']:.2f} vs {off['request_throughput']:.2f} "
              f"({row['throughput_gain_pct']:+.2f}%, runs {lo:+.1f}..{hi:+.1f}%), median TTFT ms "
              f"{on['median_ttft_ms']:.1f} vs {off['median_ttft_ms']:.1f}, host / device ms a step "
              f"{on['median_host_ms']:.2f} / {on['median_device_ms']:.2f} vs {off['median_host_ms']:.2f} / "
              f"{off['median_device_ms']:.2f}  [warm-up {r['warmup_s']:.0f}s]", flush=True)
    return rows


def _regression_note(regressed) -> str:
    return {True: ", REGRESSED", False: "", None: ", one run: not judged"}[regressed]


def phase_decode(engine, args, t_start) -> list[dict]:
    rows = []
    for level, c in enumerate(args.decode_concurrency):
        if rows and time.perf_counter() - t_start > 0.85 * args.time_limit:
            print(f"  (b) concurrency {c}: skipped, past --time-limit", flush=True)
            continue
        w = Workload(num_requests=c * args.decode_waves, input_len=1, output_len=args.decode_output_len,
                     concurrency=c, seed=args.seed + 1)
        r = run_pair(engine, w, args, f"(b) c={c}", level)
        on, off = r["skip"], r["no_skip"]
        ratio = on["median_tpot_ms"] / off["median_tpot_ms"]
        row = {"concurrency": c, "num_requests": w.num_requests, **r, "tpot_ratio": ratio,
               "regressed": ratio > 1.03 if args.repeats > 1 else None}
        rows.append(row)
        lo, hi = r["spread"]["tpot_ratio"] or (float("nan"), float("nan"))
        print(f"  (b) c={c:>3}: median TPOT ms {on['median_tpot_ms']:.3f} vs {off['median_tpot_ms']:.3f} "
              f"(ratio {ratio:.3f}{_regression_note(row['regressed'])}, runs {lo:.3f}..{hi:.3f})  "
              f"[warm-up {r['warmup_s']:.0f}s]", flush=True)
    return rows


def _scoring_fn(engine: Engine, requests, args):
    """The indexer's work on a batch's rows, alone: logits over the paged key cache + top-k."""
    from jax_sparse_mla import plan_batch, policy

    cfg = engine.config
    plan, meta = plan_batch(cfg, requests, num_pages=engine.num_pages, force_sparse=True,
                            buckets=engine.options.buckets)
    impl = kernel_ops.resolve(args.kernels, cfg)
    T, key = plan.num_tokens, jax.random.key(1)
    q = jax.random.normal(key, (T, cfg.index_n_heads, cfg.index_head_dim), jnp.float32)
    q = q.astype(jnp.float8_e4m3fn if cfg.indexer_dtype == "fp8" else jnp.dtype(cfg.indexer_dtype))
    w = jax.random.normal(jax.random.fold_in(key, 1), (T, cfg.index_n_heads), jnp.float32)
    row_end = jnp.where(meta.positions >= 0, meta.positions + 1, 0)
    cache = engine.caches[0]

    @jax.jit
    def score(q, w, k, k_scale, block_tables, row_seq, row_end):
        logits = kernel_ops.indexer_logits(q, w, k, k_scale, block_tables, row_seq, row_end,
                                           page_size=cfg.page_size, kernel=policy.indexer_kernel(T, plan.num_seqs),
                                           clean=False, **impl.indexer_logits.kwargs)
        return kernel_ops.topk(logits, cfg.index_topk, lengths=row_end, **impl.topk.kwargs)

    return lambda: score(q, w, cache.flat("index_k"), cache.flat("index_k_scale"), meta.block_tables,
                         meta.row_seq, row_end)


def phase_breakdown(engine, args) -> list[dict]:
    rows = []
    page = engine.config.page_size
    for n in args.breakdown_prefills:
        length = args.prefill_input_len
        if n * length > args.max_num_batched_tokens:
            print(f"  (c) {n} x {length}: skipped, over --max-num-batched-tokens", flush=True)
            continue
        per = -(-length // page)
        requests = [Request(0, length, list(range(i * per, (i + 1) * per))) for i in range(n)]
        times, plans = {}, {}
        for name, skip in SETTINGS.items():
            _, plans[name] = engine.forward_batch(requests, skip_indexer=skip)
            times[name] = median_ms(lambda: engine.forward_batch(requests, skip_indexer=skip)[0])
        scoring = median_ms(_scoring_fn(engine, requests, args))
        row = {"batch": f"{n} x {length}", "tokens": n * length, "padded_tokens": plans["skip"].num_tokens,
               "step_ms_skip": times["skip"], "step_ms_no_skip": times["no_skip"],
               "saved_ms": times["no_skip"] - times["skip"],
               "saved_share_pct": 100 * (times["no_skip"] - times["skip"]) / times["no_skip"],
               "scoring_ms_per_layer": scoring, "scoring_ms_all_layers": scoring * engine.num_layers,
               "scoring_share_pct": 100 * scoring * engine.num_layers / times["no_skip"],
               "route_skip": plans["skip"].route, "route_no_skip": plans["no_skip"].route}
        rows.append(row)
        print(f"  (c) {row['batch']}: step ms {times['skip']:.2f} (skip) vs {times['no_skip']:.2f} (no skip), "
              f"saved {row['saved_share_pct']:.1f}%; scoring alone {scoring:.2f} ms/layer = "
              f"{row['scoring_share_pct']:.1f}% of the no-skip step", flush=True)
    return rows


# ------------------------------------------------------------------------------------------------

def markdown(results) -> str:
    m = results["meta"]
    blocks = m.get("blocks", ["attention"])
    many = len(blocks) > 1  # then every table gets a leading block column
    col, sep = ("| block ", "|---") if many else ("", "")
    cell = (lambda r: f"| {r.get('block', 'attention')} ") if many else (lambda r: "")
    stack = "" if blocks == ["attention"] else f" ({' and '.join(blocks)} blocks)"
    lines = [f"### Short-prefill skip, end to end (`scripts/bench_skip.py{' ' + m['argv'] if m['argv'] else ''}`)",
             f"{m['device']}, config {m['config']}, {m['layers']} layers{stack}, kernels={m['kernels']}, "
             f"dispatch={m['dispatch']}, max_num_batched_tokens {m['max_num_batched_tokens']}, {m['date']}."]
    if "moe" in m:
        e = m["moe"]
        lines[-1] += (f" Decoder block: RMSNorm, attention, RMSNorm, MoE ({e['num_experts']} experts, "
                      f"{e['num_experts_per_tok']} active, {e['num_shared_experts']} shared, intermediate "
                      f"{e['intermediate_size']}, grouped matmuls over tiles of each expert's rows; "
                      "DeepSeek-V3.2 routes over "
                      f"{MoEConfig.deepseek_v32().num_experts} experts: the tokens' experts and FLOPs are the model's, "
                      "the weights they pick from fewer where this is less).")
    lines += ["",
             f"(a) short prefills: input {m['prefill_input_len']} (range ratio {m['prefill_range_ratio']}), output 1.",
             f"Medians of {m['repeats']} runs a setting; the runs' range: the lowest and highest gain of run i "
             "against run i; host / device: the median step's host part (planning, launch) and device busy time.",
             "", col + "| concurrency | requests | req/s skip | req/s no skip | gain | runs' range | median TTFT ms "
             "skip | no skip | host / device ms skip | no skip |",
             sep + "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["prefill"]:
        lo, hi = r["spread"]["throughput_gain_pct"]
        lines.append(cell(r) + f"| {r['concurrency']} | {r['num_requests']} | {r['skip']['request_throughput']:.2f} | "
                     f"{r['no_skip']['request_throughput']:.2f} | {r['throughput_gain_pct']:+.2f}% | "
                     f"{lo:+.1f}..{hi:+.1f}% | {r['skip']['median_ttft_ms']:.1f} | {r['no_skip']['median_ttft_ms']:.1f} | "
                     + " | ".join(f"{r[k]['median_host_ms']:.2f} / {r[k]['median_device_ms']:.2f}"
                                  for k in ("skip", "no_skip")) + " |")
    lines += ["", f"(b) decode-heavy: input 1, output {m['decode_output_len']}.", "",
              col + "| concurrency | median TPOT ms skip | no skip | ratio | runs' range | output tok/s skip | no skip |",
              sep + "|---|---|---|---|---|---|---|"]
    for r in results["decode"]:
        lo, hi = r["spread"]["tpot_ratio"] or (float("nan"), float("nan"))
        lines.append(cell(r) + f"| {r['concurrency']} | {r['skip']['median_tpot_ms']:.3f} | "
                     f"{r['no_skip']['median_tpot_ms']:.3f} | "
                     f"{r['tpot_ratio']:.3f}{_regression_note(r['regressed'])} | {lo:.3f}..{hi:.3f} | "
                     f"{r['skip']['output_throughput']:.0f} | {r['no_skip']['output_throughput']:.0f} |")
    lines += ["", f"(c) one step through {m['layers']} layers (median ms) and the indexer scoring alone "
              "(logits + top-k, per layer, same rows).", "",
              col + "| batch | step skip | step no skip | saved | scoring x layers | share of no-skip step |",
              sep + "|---|---|---|---|---|---|"]
    for r in results["breakdown"]:
        lines.append(cell(r) + f"| {r['batch']} | {r['step_ms_skip']:.2f} | {r['step_ms_no_skip']:.2f} | "
                     f"{r['saved_ms']:.2f} ({r['saved_share_pct']:.1f}%) | {r['scoring_ms_all_layers']:.2f} | "
                     f"{r['scoring_share_pct']:.1f}% |")
    return "\n".join(lines) + "\n"


def plot(results, out_dir: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    style = {"skip": dict(marker="o", label="skip on"), "no_skip": dict(marker="s", ls="--", label="skip off")}

    def concurrency_axis(ax, cs, title):
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()

    def save(fig, name):
        fig.tight_layout()
        paths.append(os.path.join(out_dir, name))
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    blocks = results["meta"].get("blocks", ["attention"])

    def lines(phase):
        """(style, rows) per block and setting; a block's name joins the label when there are several."""
        for b, color in zip(blocks, ("C0", "C1", "C2")):
            rows = [r for r in results[phase] if r.get("block", "attention") == b]
            for name in SETTINGS:
                st = dict(style[name])
                if len(blocks) > 1:
                    st.update(color=color, label=f"{b}: {st['label']}")
                yield st, name, rows

    if results["prefill"]:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        cs = sorted({r["concurrency"] for r in results["prefill"]})
        for st, name, rows in lines("prefill"):
            rc = [r["concurrency"] for r in rows]
            ax1.plot(rc, [r[name]["request_throughput"] for r in rows], **st)
            ax2.plot(rc, [r[name]["median_ttft_ms"] for r in rows], **st)
        concurrency_axis(ax1, cs, "request throughput (req/s)")
        concurrency_axis(ax2, cs, "median TTFT (ms)")
        fig.suptitle(f"(a) short prefills, input {results['meta']['prefill_input_len']}, output 1")
        save(fig, "prefill.png")
    if results["decode"]:
        fig, ax = plt.subplots(figsize=(5, 4))
        cs = sorted({r["concurrency"] for r in results["decode"]})
        for st, name, rows in lines("decode"):
            ax.plot([r["concurrency"] for r in rows], [r[name]["median_tpot_ms"] for r in rows], **st)
        concurrency_axis(ax, cs, f"(b) decode: median TPOT (ms), output {results['meta']['decode_output_len']}")
        save(fig, "decode.png")
    if results["breakdown"]:
        fig, ax = plt.subplots(figsize=(6, 4))
        rows = results["breakdown"]
        x = np.arange(len(rows))
        ax.bar(x - 0.27, [r["step_ms_skip"] for r in rows], 0.27, label="step, skip on")
        ax.bar(x, [r["step_ms_no_skip"] for r in rows], 0.27, label="step, skip off")
        ax.bar(x + 0.27, [r["scoring_ms_all_layers"] for r in rows], 0.27, label="scoring alone x layers")
        ax.set_xticks(x, [r["batch"] if len(blocks) == 1 else f"{r['block']}\n{r['batch']}" for r in rows])
        ax.set_ylabel("ms")
        ax.set_title(f"(c) one step, {results['meta']['layers']} layers")
        ax.legend()
        save(fig, "breakdown.png")
    return paths


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compilation_cache:
        jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    config = MLAConfig.tiny() if args.config == "tiny" else MLAConfig.deepseek_v32()
    args.prefill_input_len = args.prefill_input_len or config.index_topk // 2
    page = config.page_size
    # pages: the most requests ever running at once, each holding its longest cache
    pre_len = int(round(args.prefill_input_len * (1 + args.prefill_range_ratio)))
    need = max(max(args.prefill_concurrency) * -(-pre_len // page),
               max(args.decode_concurrency) * -(-args.decode_output_len // page),
               max(args.breakdown_prefills) * -(-args.prefill_input_len // page))
    num_pages = need + 16
    t_start = time.perf_counter()
    dev = jax.devices()[0]
    results = {"meta": {
        "device": dev.device_kind, "backend": jax.default_backend(), "jax": jax.__version__,
        "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"), "argv": " ".join(sys.argv[1:]),
        "config": args.config, "config_fields": {k: str(v) for k, v in dataclasses.asdict(config).items()},
        "layers": args.layers, "kernels": args.kernels, "dispatch": args.dispatch, "num_pages": num_pages,
        "max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs,
        "prefill_input_len": args.prefill_input_len, "prefill_range_ratio": args.prefill_range_ratio,
        "decode_output_len": args.decode_output_len, "repeats": args.repeats,
        "blocks": args.block,
        "clock": "each step's wall time (scheduling + planning + all layers to block_until_ready)"}}
    results["prefill"], results["decode"], results["breakdown"] = [], [], []
    try:
        moes = {block: decoder_moe(config, args.moe_experts) if block == "decoder" else None for block in args.block}
    except ValueError as e:  # e.g. fewer experts than a token is routed to
        raise SystemExit(f"--moe-experts {args.moe_experts}: {e}") from None
    for block, moe in moes.items():  # every stack checked before the first runs
        check_fits(stack_bytes(config, args.layers, num_pages, moe), dev, f"{args.layers} {block} layers")
    for block, moe in moes.items():
        t_block = time.perf_counter()
        engine = Engine(config, num_layers=args.layers, num_pages=num_pages, seed=args.seed, kernels=args.kernels,
                        dispatch=args.dispatch, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_num_seqs=args.max_num_seqs, block=block, moe=moe,
                        buckets=BucketPolicy(min_pages_per_seq=args.min_pages_per_seq))
        moe_note = f", MoE {engine.moe}" if engine.moe else ""
        print(f"{dev.device_kind} ({jax.default_backend()}), config {args.config}, {args.layers} {block} layers, "
              f"{num_pages} pages/layer, kernels={args.kernels}, dispatch={args.dispatch}{moe_note}", flush=True)
        if engine.moe:
            results["meta"]["moe"] = dataclasses.asdict(engine.moe)
        results["prefill"] += [{"block": block, **row} for row in phase_prefill(engine, args, t_block)]
        results["decode"] += [{"block": block, **row} for row in phase_decode(engine, args, t_block)]
        results["breakdown"] += [{"block": block, **row} for row in phase_breakdown(engine, args)]
        results["meta"][f"{block}_s"] = time.perf_counter() - t_block
        del engine  # (a decoder stack at the real dims holds 5.6 GB of experts a layer, 22.5 GB with 256)
        gc.collect()
    results["meta"]["total_s"] = time.perf_counter() - t_start
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    table = markdown(results)
    with open(os.path.join(args.out_dir, "table.md"), "w") as f:
        f.write(table)
    paths = plot(results, args.out_dir)
    print()
    print(table)
    print(f"wrote {args.out_dir}/results.json, table.md, {', '.join(os.path.basename(p) for p in paths)} "
          f"in {results['meta']['total_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
