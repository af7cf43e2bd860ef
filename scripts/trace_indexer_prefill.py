"""Where a causal indexer prefill call's time goes, outside and inside the kernel: the host median
of the call the peer bench makes (`peer_entries.indexer_logits`, clean logits), of the same call
with its tile schedule given (computed beforehand, as a plan could do once a step: what is left
is the weights gather and the kernel) and of the clean=False kernel (the median of --rounds
interleaved rounds, the order reversed every other round, so that the board's clocks and power
cap weigh on every variant alike), and for each a profiler trace of back-to-back calls: the
busy time, the span,
and every gap between GPU events over 20 us (with the events around it). Then, traced, the
timer's own loop (`timing.median_ms`'s batches: warm-up, then batches of back-to-back calls, each
ended by a block): the kernel's duration over the loop (first, median, last: clocks under
sustained load) and the idle time between GPU events, against the loop's host time.

    python3 scripts/trace_indexer_prefill.py [--t 32768] [--rounds 5]
"""

import argparse
import functools
import glob
import statistics
import sys
import tempfile

import jax
import jax.numpy as jnp

sys.path.insert(0, "scripts")
from peer_entries import indexer_logits as peer_entry  # noqa: E402
from timing import median_ms  # noqa: E402

from pallas_kernels.indexer_logits import indexer_logits, mosaic_prefill  # noqa: E402


def inputs(t):
    """Causal prefill of one sequence of t tokens, fp8 keys with per-key scales, 64-key pages."""
    k = jax.random.split(jax.random.key(t), 4)
    q = (jax.random.normal(k[0], (t, 64, 128)) * 2).astype(jnp.float8_e4m3fn)
    w = jax.random.normal(k[1], (t, 64), jnp.float32)
    keys = (jax.random.normal(k[2], (t, 128)) * 2).astype(jnp.float8_e4m3fn)
    scales = jnp.abs(jax.random.normal(k[3], (t,), jnp.float32)) + 0.1
    tables = jnp.arange(t // 64, dtype=jnp.int32)[None]
    return q, w, keys, scales, tables, jnp.zeros((t,), jnp.int32), jnp.arange(1, t + 1, dtype=jnp.int32)


def schedule_given(x):
    """The peer entry's kernel with `mosaic_prefill._tiles` replaced, while it traces, by the
    schedule computed beforehand for these rows (constants of the program)."""
    tiles, static = mosaic_prefill._tiles, []
    call = functools.partial(indexer_logits, page_size=64, implementation="mosaic", kernel="prefill")

    def record(*a):
        static[:] = a[2:]  # num_seqs, num_keys, block_rows
        return tiles(*a)
    mosaic_prefill._tiles = record
    try:
        jax.eval_shape(call, *x)
    finally:
        mosaic_prefill._tiles = tiles
    schedule = jax.jit(tiles, static_argnums=(2, 3, 4))(x[5], x[6], *static)

    def given(*a):
        mosaic_prefill._tiles = lambda *_: schedule
        try:
            return call(*a)
        finally:
            mosaic_prefill._tiles = tiles
    return jax.jit(given)


def gpu_events(run, calls):
    """(start ns, duration ns, name) of every GPU event of run() in a profiler trace, sorted."""
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        run(calls)
        jax.profiler.stop_trace()
        profile = jax.profiler.ProfileData.from_file(glob.glob(d + "/**/*.xplane.pb", recursive=True)[0])
    return sorted((e.start_ns, e.duration_ns, e.name[:48]) for plane in profile.planes
                  if plane.name.startswith("/device:GPU") for line in plane.lines
                  if not line.name.startswith("XLA") for e in line.events)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--t", type=int, default=32768, help="tokens (a multiple of 64)")
    ap.add_argument("--calls", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the host medians")
    args = ap.parse_args()
    x = inputs(args.t)
    variants = {
        "peer entry (clean)": jax.jit(functools.partial(peer_entry, page_size=64)),
        "schedule given (clean)": schedule_given(x),
        "mosaic_prefill clean=False": jax.jit(functools.partial(indexer_logits, page_size=64,
                                                                implementation="mosaic", kernel="prefill", clean=False)),
    }
    rounds = {name: [] for name in variants}
    for r in range(args.rounds):
        for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            rounds[name].append(median_ms(variants[name], *x, batches=11))
    for name, fn in variants.items():
        host = statistics.median(rounds[name])

        def run(calls, fn=fn):
            out = None
            for _ in range(calls):
                out = fn(*x)
            jax.block_until_ready(out)
        run(2)
        evs = gpu_events(run, args.calls)
        first = evs[0][0]
        span = (evs[-1][0] + evs[-1][1] - first) / 1e6 / args.calls
        busy = sum(e[1] for e in evs) / 1e6 / args.calls
        print(f"{name}: host median {host:.3f} ms a call (rounds {', '.join(f'{v:.3f}' for v in rounds[name])}); "
              f"trace span {span:.3f}, busy {busy:.3f} ms a call")
        end = first
        for start, dur, ev in evs:
            if start - end > 20e3 or dur > 1e5:
                print(f"  at {(start - first) / 1e3:10.1f} us  gap {(start - end) / 1e3:8.1f}  "
                      f"dur {dur / 1e3:9.1f}  {ev}")
            end = max(end, start + dur)

        timed = []
        evs = gpu_events(lambda batches, fn=fn: timed.append(median_ms(fn, *x, batches=batches)), 11)
        kernels = [e[1] / 1e6 for e in evs if "indexer_logits" in e[2]]  # the Mosaic kernel's name
        idle = sum(max(0, b[0] - (a[0] + a[1])) for a, b in zip(evs, evs[1:])) / 1e6 / len(kernels)
        print(f"  the timer's loop traced ({len(kernels)} calls): its median {timed[0]:.3f} ms a call; kernel "
              f"first {kernels[0]:.3f}, median {sorted(kernels)[len(kernels) // 2]:.3f}, last {kernels[-1]:.3f} ms; "
              f"GPU idle between events {idle:.3f} ms a call")


if __name__ == "__main__":
    main()
