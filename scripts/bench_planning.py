"""Host time of planning a batch: plan_arrays (host arrays) against plan_batch (Request lists),
and the one device_put of the metadata, for MLAConfig.deepseek_v32() decode batches.

    python scripts/bench_planning.py [--out planning.md] [--repeats 200] [--cases 1x4K,256x32K] [--dispatch cond]

CPU only (JAX_PLATFORMS=cpu unless set): the planner runs on the host whatever the device.
Each case is B decodes (query_len 1) after a context of L tokens, their pages a random
permutation of a cache of num_pages pages (the smallest power of two >= 65536 that holds them),
block tables [B, ceil((L + 1) / 64)] int32; plan_batch gets the same batch as Requests with
list tables (what an engine holding lists would pass). --dispatch cond plans the serving program
as the Engine does (BucketPolicy.for_limits at 256 sequences of up to 128K tokens: block tables
of the full [256, 2048] width every step); static (the default) the exact program under the
default BucketPolicy. Times: median ms over --repeats calls
after warm-up calls, each call timed alone (time.perf_counter):
  arrays:      check_arrays + plan_host (plan_arrays without its transfer), the host planning;
  batch:       check_batch + plan_host (plan_batch without its transfer), Requests -> arrays included;
  device_put:  jax.device_put of the metadata pytree, until ready;
  plan_arrays: the whole call (host planning + device_put).
Each row is printed and appended to --out (a markdown table) as soon as it is measured, so a
run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jax_sparse_mla import MLAConfig, Request, plan_arrays  # noqa: E402
from jax_sparse_mla import plan as plan_lib  # noqa: E402

CASES = {"1x4K": (1, 4096), "64x4K": (64, 4096), "256x4K": (256, 4096), "256x32K": (256, 32768),
         "256x128K": (256, 131072)}
OPTIONS = dict(force_sparse=False, skip_indexer=True, tensor_parallel=1, prefill_route="auto")
ENGINE_LIMITS = dict(max_num_seqs=256, max_model_len=131072)  # --dispatch cond: the Engine's BucketPolicy.for_limits
HEADER = "| case | num_pages | arrays (host) ms | batch (host) ms | device_put ms | plan_arrays ms |"


def median_ms(fn, repeats: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def decode_batch(config: MLAConfig, num_seqs: int, context_len: int, seed: int = 0):
    """(context_lens, query_lens, block_tables, num_pages) of num_seqs decodes after context_len tokens."""
    pages = -(-(context_len + 1) // config.page_size)
    num_pages = max(65536, 1 << (num_seqs * pages - 1).bit_length())
    ids = np.random.default_rng(seed).permutation(num_pages)[:num_seqs * pages].astype(np.int32)
    return (np.full(num_seqs, context_len, np.int32), np.ones(num_seqs, np.int32), ids.reshape(num_seqs, pages),
            num_pages)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="append each row to this markdown file")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {list(CASES)}")
    parser.add_argument("--dispatch", choices=plan_lib.DISPATCH_MODES, default="static")
    args = parser.parse_args(argv)
    config = MLAConfig.deepseek_v32()
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, numpy {np.__version__}"

    def emit(line: str) -> None:
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")

    emit(f"\n{machine}; median of {args.repeats} calls; MLAConfig.deepseek_v32() decodes; dispatch {args.dispatch}\n")
    emit(HEADER)
    emit("|---" * (HEADER.count("|") - 1) + "|")
    for name in args.cases.split(","):
        num_seqs, context_len = CASES[name]
        ctx, q, tables, num_pages = decode_batch(config, num_seqs, context_len)
        requests = [Request(int(c), int(n), t.tolist()) for c, n, t in zip(ctx, q, tables)]
        buckets = (plan_lib.BucketPolicy.for_limits(config, num_pages=num_pages, **ENGINE_LIMITS)
                   if args.dispatch == "cond" else plan_lib.BucketPolicy())
        options = dict(OPTIONS, dispatch=args.dispatch, buckets=buckets)

        def host_arrays():
            batch, pages = plan_lib.check_arrays(config, ctx, q, tables, num_pages, **options)
            return plan_lib.plan_host(config, batch, num_pages=pages, **options)

        def host_batch():
            batch, pages = plan_lib.check_batch(config, requests, num_pages, **options)
            return plan_lib.plan_host(config, batch, num_pages=pages, **options)

        plan, meta = host_arrays()
        want_plan, want_meta = host_batch()
        assert plan == want_plan and all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(meta),
                                                                             jax.tree.leaves(want_meta)))
        t_arrays = median_ms(host_arrays, args.repeats)
        t_batch = median_ms(host_batch, max(5, args.repeats // 10))
        t_put = median_ms(lambda: jax.block_until_ready(jax.device_put(meta)), args.repeats)
        t_full = median_ms(lambda: jax.block_until_ready(plan_arrays(config, ctx, q, tables, num_pages=num_pages,
                                                                     **options)[1]),
                           args.repeats)
        emit(f"| {name} | {num_pages} | {t_arrays:.3f} | {t_batch:.3f} | {t_put:.3f} | {t_full:.3f} |")


if __name__ == "__main__":
    main()
