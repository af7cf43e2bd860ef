"""Benchmark dense causal prefill attention (the dense route): the Mosaic GPU varlen kernel
against cuDNN, tokamax's Mosaic GPU flash attention and XLA.

    python scripts/bench_dense_attention.py [--quick] [--out results.json]

Shapes are DeepSeek-V3.2's MHA form: 128 heads, q/k head dim 192 (128 nope + 64 rope), v head
dim 128, bf16. Batches of B prefills of L new tokens after C cached ones (C = 0: plain prefill).
Options:
  mosaic_varlen  dense_mha on the packed [T, H, D] layout (this project's kernel)
  cudnn          jax.nn.dot_product_attention(implementation="cudnn") on [B, L, H, D], V padded to
                 192 before timing (cuDNN wants one head dim); with context, q front-padded with C zero rows
                 (cuDNN's causal mask is top-left and it has no right window)
  cudnn_packed   the lower-level cuDNN path (jax._src.cudnn.fused_attention_stablehlo), which takes
                 packed sequences: [1, T, H, D] with per-sequence offsets and lengths, padding-causal
                 mask; V padded and q front-padded as for cudnn
  tokamax        tokamax.dot_product_attention(implementation="mosaic") on [B, L, H, D] (skipped,
                 with the reason printed, when tokamax does not import); with context, a window
                 reaching C keys to the right (bottom-right causal)
  xla            jax.nn.dot_product_attention(implementation="xla") on [B, L, H, D], V padded;
                 with context, the same right window
  reference      dense_mha_reference (float32; the model's XLA path)
--quick runs QUICK_OPTIONS on QUICK's cases (the kernel and the two it must beat)
Every option is first checked against the float32 reference on 8 heads (relative error < 2e-2);
an option that fails or mismatches is reported and left out of the ranking.
TFLOP/s count causal work: sum over sequences of 2 * visible (query, key) pairs * heads * (192 + 128).
Times: a case's options are compiled and checked first, then timed in REPEATS interleaved rounds
(each scripts/timing.py's median_ms: median of batches of back-to-back calls after warm-up), the
options in reverse order every other round (so none always runs first after the others have
heated the GPU); the reported time is the median over the rounds (the GPU's clocks and the other
kernels' times drift between runs by several percent, so options are only compared within one
case's rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from timing import median_ms  # noqa: E402
from jax._src.cudnn.fused_attention_stablehlo import (  # noqa: E402 - cuDNN's packed (THD) path
    MaskType as CudnnMask, dot_product_attention as cudnn_attention)
from pallas_kernels.dense_mha import dense_mha, dense_mha_reference  # noqa: E402

HEADS, D_QK, D_V = 128, 192, 128
SCALE = D_QK ** -0.5
CHECK_HEADS = 8
REPEATS = 5  # interleaved timing rounds per case (~0.07 s each per option)
TOL = 2e-2  # bf16 inputs and outputs; the kernels round probabilities to bf16 (see the kernel tests)

# (batch, new tokens per sequence, cached context per sequence)
FULL = [(4, 2048, 0), (8, 1024, 0), (16, 512, 0), (32, 256, 0), (64, 128, 0),
        (4, 1024, 1024), (8, 512, 512), (16, 256, 768)]
# ~1 min on the H200; the closest contests with tokamax first (this kernel's margins over it on
# 2026-11-29..30: 4x2048 -0.8% to +10% (2026-11-30 probes: +4.5%, +5.0%), 64x128 0 to +1% (both
# at the HBM ceiling), 8x1024 +5% to +17%, 16x512 +11% to +22%, 4x1024+1024 +25%)
QUICK = [(4, 2048, 0), (64, 128, 0), (8, 1024, 0), (16, 512, 0), (4, 1024, 1024)]
QUICK_OPTIONS = ("mosaic_varlen", "cudnn", "cudnn_packed", "tokamax")

try:
    import tokamax
    TOKAMAX_ERROR = None
except Exception as e:  # noqa: BLE001 - any import failure only disables that option
    tokamax = None
    TOKAMAX_ERROR = f"{type(e).__name__}: {e}"


def causal_flops(batch, new, ctx):
    visible = new * ctx + new * (new + 1) // 2
    return batch * 2 * visible * HEADS * (D_QK + D_V)


def make_case(batch, new, ctx, seed=0):
    """Packed q [B*L, H, 192], k [B*(C+L), H, 192], v [B*(C+L), H, 128] bf16 and start locations."""
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (batch * new, HEADS, D_QK), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(kk, (batch * (ctx + new), HEADS, D_QK), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(kv, (batch * (ctx + new), HEADS, D_V), jnp.float32).astype(jnp.bfloat16)
    q_start = jnp.arange(batch + 1, dtype=jnp.int32) * new
    k_start = jnp.arange(batch + 1, dtype=jnp.int32) * (ctx + new)
    return q, k, v, q_start, k_start


def options(batch, new, ctx):
    """name -> (fn(*prepare(q, k, v, q_start, k_start)) -> packed [T, H, Dv], prepare (untimed
    layout conversion), skip reason or None)."""
    def padded(q, k, v):  # uniform lengths: the padded layout is a reshape
        return (q.reshape(batch, new, HEADS, D_QK), k.reshape(batch, ctx + new, HEADS, D_QK),
                v.reshape(batch, ctx + new, HEADS, D_V))

    # query i attends keys 0..ctx+i: causal when ctx == 0, else a window reaching ctx keys right
    window = dict(is_causal=True) if ctx == 0 else dict(local_window_size=(ctx + new, ctx))

    def jax_nn_prepare(implementation):
        def prepare(q, k, v, q_start, k_start):  # untimed: V padded to 192 (and q, see cudnn)
            qb, kb, vb = padded(q, k, v)
            vb = jnp.pad(vb, ((0, 0), (0, 0), (0, 0), (0, D_QK - D_V)))
            if implementation == "cudnn" and ctx:
                # cuDNN has no right window: ctx zero query rows in front make its top-left
                # causal mask the bottom-right one (their work is wasted, and counted against it)
                qb = jnp.pad(qb, ((0, 0), (ctx, 0), (0, 0), (0, 0)))
            return qb, kb, vb
        return prepare

    def jax_nn(implementation):
        def fn(qb, kb, vb):
            if implementation == "cudnn" and ctx:
                out = jax.nn.dot_product_attention(qb, kb, vb, scale=SCALE, is_causal=True,
                                                   implementation=implementation)[:, ctx:]
            else:
                out = jax.nn.dot_product_attention(qb, kb, vb, scale=SCALE,
                                                   implementation=implementation, **window)
            return out[..., :D_V].reshape(batch * new, HEADS, D_V)
        return fn

    def cudnn_packed_prepare(q, k, v, q_start, k_start):
        """Untimed: cudnn's padded layout (V padded, q front-padded with ctx rows), packed into
        one row of sequences: q's segments are then k's."""
        packed_rows = lambda x: x.reshape(1, batch * (ctx + new), HEADS, D_QK)  # noqa: E731
        qkv = [packed_rows(x) for x in jax_nn_prepare("cudnn")(q, k, v, q_start, k_start)]
        return (*qkv, jnp.full((1, batch), ctx + new, jnp.int32), k_start[None])

    def cudnn_packed(q1, k1, v1, seq_len, offsets):
        out = cudnn_attention(q1, k1, v1, q_seqlen=seq_len, kv_seqlen=seq_len, q_offsets=offsets,
                              kv_offsets=offsets, scale=SCALE, mask_type=CudnnMask.PADDING_CAUSAL)
        out = out.reshape(batch, ctx + new, HEADS, D_QK)[:, ctx:, :, :D_V]
        return out.reshape(batch * new, HEADS, D_V)

    def tokamax_fn(q, k, v, q_start, k_start):
        out = tokamax.dot_product_attention(*padded(q, k, v), scale=SCALE, implementation="mosaic",
                                            **window)
        return out.reshape(batch * new, HEADS, D_V)

    def mosaic(q, k, v, q_start, k_start):
        return dense_mha(q, k, v, q_start, k_start, scale=SCALE, implementation="mosaic")

    def reference(q, k, v, q_start, k_start):
        return dense_mha_reference(q, k, v, q_start, k_start, scale=SCALE)

    packed = lambda *args: args  # noqa: E731 - the packed inputs as they are
    return {
        "mosaic_varlen": (mosaic, packed, None),
        "cudnn": (jax_nn("cudnn"), jax_nn_prepare("cudnn"), None),
        "cudnn_packed": (cudnn_packed, cudnn_packed_prepare, None),
        "tokamax": (tokamax_fn, packed, None if tokamax else f"tokamax unavailable ({TOKAMAX_ERROR})"),
        "xla": (jax_nn("xla"), jax_nn_prepare("xla"), None),
        "reference": (reference, packed, None),
    }


def run_case(batch, new, ctx, option_names):
    name = f"{batch}x{new}" + (f"+ctx{ctx}" if ctx else "")
    q, k, v, q_start, k_start = make_case(batch, new, ctx)
    heads = slice(0, CHECK_HEADS)
    expected = np.asarray(dense_mha_reference(q[:, heads], k[:, heads], v[:, heads],
                                              q_start, k_start, scale=SCALE))
    flops = causal_flops(batch, new, ctx)
    results = []
    timed = {}  # option -> (jitted, args, row): checked, timed once, then in the rounds below
    for option, (fn, prepare, skip) in options(batch, new, ctx).items():
        row = dict(case=name, batch=batch, new=new, ctx=ctx, option=option)
        results.append(row)
        if option not in option_names:
            skip = "skipped (--quick)"
        if skip:
            row["status"] = skip
            continue
        try:
            jitted = jax.jit(fn)
            args = jax.block_until_ready(jax.jit(prepare)(q, k, v, q_start, k_start))
            out = np.asarray(jitted(*args)[:, heads], np.float32)
            err = float(np.linalg.norm(out - expected) / np.linalg.norm(expected))
            row["rel_err"] = err
            if not err < TOL:
                row["status"] = f"WRONG (rel err {err:.2e})"
            else:
                ms = median_ms(jitted, *args, batches=3)
                row.update(status="ok", ms=ms, tflops=flops / ms / 1e9, rounds_ms=[])
                timed[option] = (jitted, args, row)
        except Exception as e:  # noqa: BLE001 - report and go on with the other options
            traceback.print_exc()
            row["status"] = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        print(f"  {name:>16} {option:>14}: " + (f"{row['ms']:8.3f} ms {row['tflops']:6.0f} TFLOP/s "
              f"(rel err {row['rel_err']:.1e}, first timing)" if row["status"] == "ok"
              else row["status"]), flush=True)
    for repeat in range(REPEATS):
        order = list(timed.values())
        for jitted, args, row in (order[::-1] if repeat % 2 else order):
            row["rounds_ms"].append(median_ms(jitted, *args, batches=3))
    for option, (_, _, row) in timed.items():
        row["ms"] = statistics.median(row["rounds_ms"])
        row["tflops"] = flops / row["ms"] / 1e9
        rounds = " ".join(f"{flops / ms / 1e9:.0f}" for ms in row["rounds_ms"])
        print(f"  {name:>16} {option:>14}: {row['ms']:8.3f} ms {row['tflops']:6.0f} TFLOP/s "
              f"(median of {REPEATS} interleaved rounds: {rounds})", flush=True)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer cases (see QUICK)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    cases = QUICK if args.quick else FULL
    print(f"devices: {jax.devices()}")
    if TOKAMAX_ERROR:
        print(f"tokamax not benchmarked: {TOKAMAX_ERROR}")
    option_names = QUICK_OPTIONS if args.quick else tuple(options(1, 1, 0))
    results = []
    for case in cases:
        results += run_case(*case, option_names)
        if args.out:  # after every case: a run cut short by a time limit keeps what it measured
            with open(args.out, "w") as f:
                json.dump(dict(device=str(jax.devices()[0]), results=results), f, indent=1)

    names = list(dict.fromkeys(r["option"] for r in results))
    print("\ncausal TFLOP/s (ms); '-' = skipped, failed or wrong (see above)")
    print("| case | " + " | ".join(names) + " | best |")
    print("|---" * (len(names) + 2) + "|")
    for case in dict.fromkeys(r["case"] for r in results):
        rows = {r["option"]: r for r in results if r["case"] == case}
        cells = [f"{rows[n]['tflops']:.0f} ({rows[n]['ms']:.3f})" if rows[n]["status"] == "ok" else "-"
                 for n in names]
        ok = [n for n in names if rows[n]["status"] == "ok"]
        best = max(ok, key=lambda n: rows[n]["tflops"]) if ok else "-"
        print(f"| {case} | " + " | ".join(cells) + f" | {best} |")
    if args.out:
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
