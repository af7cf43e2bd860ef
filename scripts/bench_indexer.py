"""Benchmark the Pallas indexer kernels against the XLA path (jit of the jnp references).

    python scripts/bench_indexer.py --out results.json [--quick] [--sweep] [--only prefill] [--dtypes fp8]
    python scripts/bench_indexer.py --only topk --topk-width 131072

* prefill logits: one causal sequence, T = S rows/keys (1K..32K), Hi=64, D=128, page 64, fp8
  (+ k_scale) and bf16: the Mosaic GPU kernel (`mgpu`, what the layer runs for prefill on Hopper)
  beside the Triton kernel (`triton`) and XLA; TFLOP/s counted as 2 * valid_causal_pairs * Hi * D.
* decode logits: batch B of sequences, each with --decode-rows query rows at the end of a
  context of C keys: the Mosaic GPU decode kernel (`indexer_logits(implementation="mosaic", kernel="decode")`) and, full mode
  or B=32 C=32K, the Triton kernel; GB/s of key bytes read once per sequence (D + 4 per key
  for fp8 with its scale, 2 * D for bf16) against the copy bandwidth measured in the same run on
  an array of the same bytes (copy GB/s = 2 * bytes / time, `copy_gbps`). Decode calls are
  timed on the device: 20 dependent calls unrolled in one jit, L2-cold (`decode_chain`: why not
  a fori_loop, why several copies of the cache), since a single call of a small decode batch
  takes less GPU time than JAX's host dispatch (`host_ms`, also recorded); `kernel_device_ms` is
  the decode kernel alone in a profiler trace of that chain. Two fractions of the copy are
  recorded: `copy_fraction`, the chain's time a call (`kernel_ms`) against the copy's chain, and
  `kernel_alone_fraction`, the kernel alone against the copy fusion alone (`copy_alone_GBps`,
  a profiler trace of the copy's chain). The 70% target is read against `kernel_alone_fraction`,
  because it compares like with like: each kernel's own GPU time on the same bytes. The
  chains are not alike: a decode call's time in its chain includes the harness's dependency
  fusion (row_end + a compare on the previous output, 0.93 us at B=1 on the H200), which the
  copy's chain (an optimization_barrier, no kernel) does not pay, while the decode call itself
  runs no op outside its kernel (in a model: the kernel plus a ~0.13 us CUDA-graph gap).
  `copy_fraction` stays beside it (docs/benchmarks-archive.md's numbers before 2026-11-29 are that one).
* top-k (k=2048) of [rows, L] f32 logits: pallas_kernels.topk (sampled thresholds + band select;
  backends "triton" and "mosaic", the latter's write sweep and band select a Mosaic GPU kernel)
  vs lax.top_k on the same inputs, both timed on the device (`chain_ms`: 20 dependent calls in one
  jit; the host-timed call is recorded as `host_ms`); GB/s of each row's own keys read once,
  against the copy bandwidth of the same bytes (`copy_fraction`: the >= 50% target), and the
  three kernels' GPU times (`kernels_us`). The causal shape is a T = S = 8K prefill's rows with
  lengths, as the layer calls it. `--only topk` runs just that (~1 minute). `--topk-width W`
  instead times the causal 4K and 8K prefills and 128 rows of 8K keys each at their own width and
  in [rows, W] logits (the serving program's fixed width: the same lengths, NaN past them; XLA
  skipped there), to see whether the cost follows the rows' lengths or the width. At width W read
  `kernels_us` and `host_ms`: the chain (`kernel_ms`) also copies the [rows, W] logits once (its
  first one-element update is on the jit's argument).
Every config is checked against the reference (on a sample of rows) before it is timed; a
failing config is recorded with its error and the run goes on. The XLA reference is skipped
where it would take too long or too much memory (said so in the table). --sweep adds a small
tiling sweep of the kernels --only names. Meant to finish in < 5 minutes on an H200 (`--only prefill --dtypes fp8`:
the Mosaic, Triton and XLA prefill table at T = 1K..32K, ~2 minutes).
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pallas_kernels.indexer_logits import MosaicConfig as IndexerMosaicConfig  # noqa: E402
from pallas_kernels.indexer_logits import indexer_logits, indexer_logits_reference  # noqa: E402
from pallas_kernels.indexer_logits.mosaic_prefill import indexer_logits_mosaic_prefill  # noqa: E402
from pallas_kernels.indexer_logits.triton import indexer_logits_triton  # noqa: E402
from pallas_kernels.topk import TritonConfig as TopkConfig  # noqa: E402
from pallas_kernels.topk import topk, topk_reference  # noqa: E402
from timing import median_ms  # noqa: E402

HI, D, PAGE, TOPK = 64, 128, 64, 2048
FP8 = jnp.float8_e4m3fn


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------

L2_BYTES = 50 * 2 ** 20  # the H200's L2
CHAIN_REPS = 20  # calls per timed chain


def _rotation(nbytes, reps):
    """Copies of an input that a timed chain rotates over, so that its reads come from HBM as in
    a model step (where the other layers' caches evict this one's): 4 x L2 in all, at most reps."""
    return max(1, min(reps, -(-4 * L2_BYTES // nbytes)))


def decode_chain(fn, q, w, k, k_scale, block_tables, row_seq, row_end, reps=CHAIN_REPS):
    """(jitted chain, its arguments) of `reps` calls of fn(q, w, k, k_scale, block_tables, row_seq,
    row_end) -> [N, L], L2-cold: the calls are unrolled in Python (fn jitted once inside: one
    lowering, one compile), each call's row_end depending on the previous output through one tiny
    fusion so XLA can neither hoist nor merge the calls (XLA fuses it with the wrapper's own
    glue when there is some), and the calls rotate over copies of the keys and scales
    (`_rotation`).

    Why not a lax.fori_loop (this bench's harness before): on the H200 XLA's while loop added
    6-16 us to every iteration (B=1 C=128K fp8: 23.4 us a call in the loop, 7.5 unrolled; the
    copy reference of 540 KB: 7.7 vs 2.1 us), which hid small decode calls behind the loop.
    Why rotate: 20 unrolled calls on one 17 MB cache read it from L2 (a copy of it ran at 5.3 TB/s,
    above HBM's 4.8). The unrolled chain runs as one CUDA graph (XLA command buffer, the Mosaic
    custom calls included; 0.1 us between kernels on the H200)."""
    n = _rotation(int(k.size * k.dtype.itemsize) + (0 if k_scale is None else int(k_scale.size) * 4), reps)
    ks = tuple([k] + [jnp.array(k, copy=True) for _ in range(n - 1)])
    scales = None if k_scale is None else tuple([k_scale] + [jnp.array(k_scale, copy=True) for _ in range(n - 1)])
    call = jax.jit(fn)

    def run(q, w, ks, scales, bt, rs, re):
        for i in range(reps):
            out = call(q, w, ks[i % n], None if scales is None else scales[i % n], bt, rs, re)
            re = re + (out[0, 0] == 1.2345e-30).astype(re.dtype)
        return re
    return jax.jit(run), (q, w, ks, scales, block_tables, row_seq, row_end)


def device_ms(fn, *args, reps=CHAIN_REPS):
    """Median ms per call of `decode_chain` (the dependency fusion and launch gaps included)."""
    run, run_args = decode_chain(fn, *args, reps=reps)
    return median_ms(run, *run_args) / reps


def kernel_spans_ms(run, run_args, names):
    """{name: median device duration in ms of the GPU kernels whose name contains it} in one
    execution of run(*run_args) traced by jax.profiler: each kernel alone, without the launch
    gaps and the other kernels of a chain."""
    jax.block_until_ready(run(*run_args))
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        jax.block_until_ready(run(*run_args))
        jax.profiler.stop_trace()
        profile = jax.profiler.ProfileData.from_file(glob.glob(d + "/**/*.xplane.pb", recursive=True)[0])
        events = [e for plane in profile.planes if plane.name.startswith("/device:GPU")
                  for line in plane.lines for e in line.events]
    spans = {}
    for name in names:
        durations = [e.duration_ns for e in events if name in e.name]
        if not durations:
            raise RuntimeError(f"no GPU kernel named *{name}* in the trace")
        spans[name] = statistics.median(durations) / 1e6
    return spans


def kernel_span_ms(run, run_args, name):
    """`kernel_spans_ms` of one kernel name."""
    return kernel_spans_ms(run, run_args, (name,))[name]


def chain_ms(fn, x, reps=20):
    """Median ms per call of fn(x) -> [N, k] int32 on the device: one jit runs reps calls
    unrolled, each call's x depending on the previous output through a one-element update (in
    place: no pass over x), so XLA can neither hoist nor merge the calls. x stays in L2 where it
    fits, as in the layer, where top-k reads the logits the indexer has just written. (A
    host-timed call measures JAX's dispatch of the kernels instead once they take ~100 us or
    less: median_ms's batches of async calls do not hide a per-call host cost above the kernels'.)"""
    call = jax.jit(fn)

    def run(x):
        for _ in range(reps):
            out = call(x)
            x = x.at[0, 0].add((out[0, 0] == -7).astype(x.dtype))
        return x
    return median_ms(jax.jit(run), x) / reps


def copy_gbps(nbytes, reps=CHAIN_REPS):
    """The copy ceiling: (chain, alone) GB/s = 2 * nbytes / time of an elementwise pass over an
    nbytes array, timed like `device_ms` (reps passes unrolled in one jit over `_rotation` arrays,
    one optimization_barrier after each so that XLA neither fuses nor reorders them: no kernel
    runs between passes) and, alone, the copy fusion's median duration in a profiler trace of
    that chain (`kernel_span_ms`; None where the trace fails)."""
    n = _rotation(nbytes, reps)
    xs = tuple(jnp.full((nbytes // 4,), i, jnp.uint32) for i in range(n))

    def run(xs):
        xs = list(xs)
        for i in range(reps):
            xs[i % n] = xs[i % n] ^ jnp.uint32(i + 1)
            xs = list(jax.lax.optimization_barrier(tuple(xs)))
        return xs
    run = jax.jit(run)
    ms = median_ms(run, xs) / reps
    try:
        alone = 2 * nbytes / (kernel_span_ms(run, (xs,), "xor") * 1e-3) / 1e9
    except Exception:  # noqa: BLE001  (e.g. no profiler on the machine)
        alone = None
    return 2 * nbytes / (ms * 1e-3) / 1e9, alone


# ------------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------------

def paged_inputs(key, *, dtype, lengths, rows_per_seq):
    """Keys of each sequence on shuffled pages; rows at the end of each sequence (causal)."""
    num_seqs = len(lengths)
    width = max(-(-l // PAGE) for l in lengths)
    num_pages = num_seqs * width
    kq, kk, kw, kp, ks = jax.random.split(key, 5)
    tables = jax.random.permutation(kp, num_pages).astype(jnp.int32).reshape(num_seqs, width)
    row_seq = np.concatenate([np.full(r, s, np.int32) for s, r in enumerate(rows_per_seq)])
    row_end = np.concatenate([np.arange(l - r + 1, l + 1, dtype=np.int32)
                              for l, r in zip(lengths, rows_per_seq)])
    n = len(row_seq)
    q = jax.random.normal(kq, (n, HI, D), jnp.float32)
    k = jax.random.normal(kk, (num_pages * PAGE, D), jnp.float32)
    if dtype == FP8:
        q, k = (q * 64).astype(FP8), (k * 64).astype(FP8)
        k_scale = 2.0 ** jax.random.randint(ks, (num_pages * PAGE,), -8, -4).astype(jnp.float32)
    else:
        q, k, k_scale = q.astype(dtype), k.astype(dtype), None
    w = jax.random.normal(kw, (n, HI), jnp.float32) * HI ** -0.5
    return (q, w, k, k_scale, tables, jnp.asarray(row_seq), jnp.asarray(row_end))


def check_logits_sample(out, args, num_rows=192, seed=0):
    """Relative error of the kernel's logits on a sample of rows (the reference sees only the
    sampled rows' sequences, to bound its gathered [S, L, D] f32 keys), and the -inf pattern."""
    q, w, k, ks, bt, rs, re = args
    n = q.shape[0]
    sel = np.sort(np.random.default_rng(seed).choice(n, size=min(n, num_rows), replace=False))
    seqs, sub_seq = np.unique(np.asarray(rs)[sel], return_inverse=True)
    sel_j = jnp.asarray(sel)
    ref = jax.jit(functools.partial(indexer_logits_reference, page_size=PAGE))(
        q[sel_j], w[sel_j], k, ks, bt[jnp.asarray(seqs)], jnp.asarray(sub_seq, jnp.int32), re[sel_j])
    out = np.asarray(out[sel_j])
    ref = np.asarray(ref)
    fin = np.isfinite(ref)
    if not np.array_equal(np.isfinite(out), fin):
        raise AssertionError("-inf pattern differs from the reference")
    err = float(np.linalg.norm(out[fin] - ref[fin]) / max(np.linalg.norm(ref[fin]), 1e-30))
    tol = 2e-3 if q.dtype == FP8 else 1e-4
    if not err <= tol:
        raise AssertionError(f"relative error {err:.2e} > {tol}")
    return err


def check_topk_sample(out, logits, k, num_rows=12, seed=0):
    n = logits.shape[0]
    sel = np.sort(np.random.default_rng(seed).choice(n, size=min(n, num_rows), replace=False))
    x = np.asarray(logits[jnp.asarray(sel)])
    got = np.asarray(out[jnp.asarray(sel)])
    ref = np.asarray(topk_reference(jnp.asarray(x), k))
    for i in range(len(sel)):
        g = got[i][got[i] >= 0]
        r = ref[i][ref[i] >= 0]
        if len(g) != len(r) or len(np.unique(g)) != len(g):
            raise AssertionError(f"row {sel[i]}: {len(g)} selected, want {len(r)}")
        if not np.array_equal(np.sort(x[i][g]), np.sort(x[i][r])):
            raise AssertionError(f"row {sel[i]}: selected values differ from the reference")
    return 0.0


# ------------------------------------------------------------------------------------------------
# benchmarks
# ------------------------------------------------------------------------------------------------

RESULTS = []
DEADLINE = [float("inf")]  # configs starting after this time.time() are skipped


def record(**kw):
    RESULTS.append(kw)
    status = kw.get("error") or ""
    print(json.dumps({k: v for k, v in kw.items() if k != "trace"}), flush=True)
    return status


def run_config(kind, params, make, kernel_fn, xla_fn, metric, unit, check, xla_skip_reason=None,
               others=None):
    """make() -> args; kernel_fn/xla_fn(*args); metric(ms) -> value in `unit`. others: {name: fn}
    of further kernels, each checked and timed beside the kernel (`<name>_ms`, `<name>_<unit>`)."""
    rec = dict(kind=kind, **params, unit=unit)
    if time.time() > DEADLINE[0]:
        rec["error"] = "skipped: run time budget spent"
        return record(**rec)
    try:
        args = make()
        out = jax.block_until_ready(kernel_fn(*args))
        rec["check_err"] = check(out, args)
        del out
        rec["kernel_ms"] = median_ms(kernel_fn, *args)
        rec["kernel_" + unit] = metric(rec["kernel_ms"])
    except Exception as e:  # noqa: BLE001
        rec["error"] = f"kernel: {type(e).__name__}: {str(e)[:300]}"
        rec["trace"] = traceback.format_exc()[-2000:]
        return record(**rec)
    for name, fn in (others or {}).items():
        try:
            out = jax.block_until_ready(fn(*args))
            rec[name + "_check_err"] = check(out, args)
            del out
            rec[name + "_ms"] = median_ms(fn, *args)
            rec[name + "_" + unit] = metric(rec[name + "_ms"])
        except Exception as e:  # noqa: BLE001
            rec[name] = f"failed: {type(e).__name__}: {str(e)[:200]}"
    if xla_skip_reason:
        rec["xla"] = "skipped: " + xla_skip_reason
    else:
        try:
            rec["xla_ms"] = median_ms(xla_fn, *args)
            rec["xla_" + unit] = metric(rec["xla_ms"])
            rec["speedup"] = rec["xla_ms"] / rec["kernel_ms"]
        except Exception as e:  # noqa: BLE001
            rec["xla"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
    del args
    return record(**rec)


def bench_prefill(quick, tiling=None, sizes=None, dtypes=(FP8, jnp.bfloat16), tag="", compare=True):
    """The Mosaic GPU kernel (`kernel`, with `tiling`); with `compare`, beside the Triton kernel
    (`triton`, default tiling) and XLA on the same inputs."""
    sizes = sizes or ([1024, 2048, 4096, 8192] + ([] if quick else [16384, 32768]))
    kern = jax.jit(functools.partial(indexer_logits_mosaic_prefill, page_size=PAGE, **(tiling or {})))
    others = {"triton": jax.jit(functools.partial(indexer_logits_triton, page_size=PAGE))} if compare else {}
    xla = jax.jit(functools.partial(indexer_logits_reference, page_size=PAGE))
    for dtype in dtypes:
        for t in sizes:
            flops = 2.0 * (t * (t + 1) / 2) * HI * D
            skip = None if t <= 16384 else "T > 16K: the reference would take ~1 s a call"
            if not compare:
                skip = "tiling sweep"
            run_config(
                "prefill" + tag, dict(dtype=jnp.dtype(dtype).name, T=t, tiling=tiling or "default"),
                lambda: paged_inputs(jax.random.key(t), dtype=dtype, lengths=[t], rows_per_seq=[t]),
                kern, xla, lambda ms: flops / (ms * 1e-3) / 1e12, "TFLOPs",
                lambda out, args: check_logits_sample(out, args), xla_skip_reason=skip, others=others)


def bench_decode(quick, tiling=None, batches=None, contexts=None, dtypes=(FP8, jnp.bfloat16), rows=1,
                 tag="", compare=None):
    """The Mosaic decode kernel (with `tiling` overrides, if any) on the decode grid,
    device-timed, beside the copy ceiling of the same bytes; compare: also time the Triton
    kernel (default: full mode, or the B=32 C=32K config)."""
    batches = batches or ([1, 32, 128] if quick else [1, 8, 32, 64, 128])
    contexts = contexts or ([131072, 32768] if quick else [4096, 16384, 32768, 65536, 131072])  # quick: 128K first
    kern = functools.partial(indexer_logits, implementation="mosaic", kernel="decode", page_size=PAGE,
                             config=IndexerMosaicConfig(**tiling) if tiling else None)
    triton = functools.partial(indexer_logits_triton, page_size=PAGE)
    copies = {}
    for dtype in dtypes:
        key_bytes = D + 4 if dtype == FP8 else 2 * D
        for b in batches:
            for c in contexts:
                nbytes = b * c * key_bytes
                rec = dict(kind="decode" + tag, dtype=jnp.dtype(dtype).name, B=b, C=c, rows_per_seq=rows,
                           tiling=tiling or "default", unit="GBps")
                if time.time() > DEADLINE[0]:
                    record(**rec, error="skipped: run time budget spent")
                    continue
                try:
                    args = paged_inputs(jax.random.key(b * 7 + c), dtype=dtype, lengths=[c] * b,
                                        rows_per_seq=[rows] * b)
                    out = jax.block_until_ready(jax.jit(kern)(*args))
                    rec["check_err"] = check_logits_sample(out, args, num_rows=8)
                    del out
                    run, run_args = decode_chain(kern, *args)
                    rec["kernel_ms"] = median_ms(run, *run_args) / CHAIN_REPS
                    rec["kernel_GBps"] = nbytes / (rec["kernel_ms"] * 1e-3) / 1e9
                    try:
                        rec["kernel_device_ms"] = kernel_span_ms(run, run_args, "indexer_logits_decode_mgpu")
                    except Exception as e:  # noqa: BLE001  (e.g. no profiler on the machine)
                        rec["kernel_device_ms"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
                    del run, run_args
                    if nbytes not in copies:
                        copies[nbytes] = copy_gbps(nbytes)
                    rec["copy_GBps"], rec["copy_alone_GBps"] = copies[nbytes]
                    rec["copy_fraction"] = rec["kernel_GBps"] / rec["copy_GBps"]
                    if isinstance(rec["kernel_device_ms"], float) and rec["copy_alone_GBps"]:
                        rec["kernel_alone_fraction"] = (nbytes / (rec["kernel_device_ms"] * 1e-3) / 1e9
                                                        / rec["copy_alone_GBps"])
                    rec["host_ms"] = median_ms(jax.jit(kern), *args)
                    if compare if compare is not None else (not quick or (b, c) == (32, 32768)):
                        rec["triton_ms"] = device_ms(triton, *args)
                        rec["triton_GBps"] = nbytes / (rec["triton_ms"] * 1e-3) / 1e9
                    del args
                except Exception as e:  # noqa: BLE001
                    rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    rec["trace"] = traceback.format_exc()[-2000:]
                record(**rec)


def topk_inputs(rows, length, causal, seed, width=None):
    """-> (x [rows, width] f32, lengths [rows] or None); width: the logits' columns (default
    length). causal: a prefill's rows, row r of one causal sequence seeing its first
    (r + 1) * length // rows keys; else, in a wider array, each row's first `length` columns.
    The lengths are passed (as the layer does), the columns past them NaN (the kernel must not
    read them)."""
    width = width or length
    x = jax.random.normal(jax.random.key(seed), (rows, width), jnp.float32)
    if causal:
        ends = ((jnp.arange(rows) + 1) * length // rows).astype(jnp.int32)
    elif width > length:
        ends = jnp.full((rows,), length, jnp.int32)
    else:
        return x, None
    return jnp.where(jnp.arange(width)[None, :] < ends[:, None], x, jnp.nan), ends


TOPK_KERNELS = ("topk_thresholds", "topk_write", "topk_select")
TOPK_BACKENDS = ("triton", "mosaic")  # "mosaic": the Mosaic GPU write sweep and band select


def bench_topk(quick, tiling=None, shapes=None, tag=""):
    """The top-k kernel vs lax.top_k on the same inputs, per shape (rows, length, causal[, width]:
    `topk_inputs`): device-timed chains, the logits' bytes (each row's own keys) against the copy
    bandwidth of the same bytes, and each of the three kernels' GPU time from a profiler trace
    (`kernels_us`). The kernel is checked on a sample of rows before it is timed; lax.top_k is
    skipped where the width exceeds the length (it would sort the padding)."""
    del quick
    shapes = shapes or ([(128, 32768, False), (512, 32768, False), (1024, 32768, False),
                         (4096, 32768, False), (8192, 8192, True), (128, 131072, False)])
    xla = jax.jit(lambda x: jax.lax.top_k(x, TOPK)[1])
    copies = {}
    for rows, length, causal, *wide in shapes:
        width = wide[0] if wide else length
        params = dict(rows=rows, L=length, k=TOPK, causal=causal, **(dict(width=width) if wide else {}))
        if time.time() > DEADLINE[0]:
            record(kind="topk" + tag, **params, unit="GBps", error="skipped: run time budget spent")
            continue
        try:
            x, lengths = topk_inputs(rows, length, causal, rows + length, width)
            nbytes = 4.0 * (rows * length if lengths is None else int(jnp.sum(lengths)))
            clean = jnp.where(jnp.isnan(x), -jnp.inf, x)  # lax.top_k's input: it ranks NaN highest
            xla_ms = chain_ms(xla, clean) if width == length else None
        except Exception as e:  # noqa: BLE001
            record(kind="topk" + tag, **params, unit="GBps", error=f"inputs/xla: {type(e).__name__}: {e}"[:300])
            continue
        for backend in TOPK_BACKENDS:  # the two on the same inputs, one after the other
            kern = functools.partial(topk, k=TOPK, lengths=lengths, implementation=backend,
                                     config=TopkConfig(**tiling) if tiling else None)
            jitted = jax.jit(kern)
            rec = dict(kind="topk" + tag, **params, backend=backend, tiling=tiling or "default", unit="GBps")
            if xla_ms is None:
                rec["xla"] = "skipped: width > length"
            else:
                rec.update(xla_ms=xla_ms, xla_GBps=nbytes / (xla_ms * 1e-3) / 1e9)
            try:
                out = jax.block_until_ready(jitted(x))
                rec["check_err"] = check_topk_sample(out, clean, TOPK)
                del out
                rec["kernel_ms"] = chain_ms(kern, x)
                rec["kernel_GBps"] = nbytes / (rec["kernel_ms"] * 1e-3) / 1e9
                if xla_ms is not None:
                    rec["speedup"] = xla_ms / rec["kernel_ms"]
                rec["host_ms"] = median_ms(jitted, x)
                if nbytes not in copies:
                    copies[nbytes] = copy_gbps(int(nbytes))
                rec["copy_GBps"], rec["copy_alone_GBps"] = copies[nbytes]
                rec["copy_fraction"] = rec["kernel_GBps"] / rec["copy_GBps"]
                try:
                    rec["kernels_us"] = {name: ms * 1e3 for name, ms in kernel_spans_ms(jitted, (x,), TOPK_KERNELS).items()}
                except RuntimeError as e:  # no GPU kernels in the trace (e.g. no profiler on the machine)
                    rec["kernels_us"] = None
                    rec["trace_error"] = str(e)[:200]
            except Exception as e:  # noqa: BLE001
                rec["error"] = f"kernel: {type(e).__name__}: {str(e)[:300]}"
                rec["trace"] = traceback.format_exc()[-2000:]
            record(**rec)
        del x, clean


def sweep(only):
    """A few tilings of each kernel named in `only` (prefill, decode, topk)."""
    # compute_wgs: fp8 takes 4 and bf16 2 by default (mosaic_prefill._COMPUTE_WGS); stages must be a
    # multiple of compute_wgs // PrefillTiling.owners
    for t in [dict(block_rows=8), dict(block_rows=8, stages=8), dict(group=1), dict(compute_wgs=2),
              dict(compute_wgs=4)] if "prefill" in only else []:
        bench_prefill(True, tiling=t, sizes=[8192], dtypes=(FP8, jnp.bfloat16), tag="-sweep", compare=False)
    for t in [dict(step_blocks=1), dict(step_blocks=4, stages=4), dict(stages=8), dict(chunk=32),
              dict(chunk=256)] if "decode" in only else []:
        bench_decode(True, tiling=t, batches=[32], contexts=[32768], dtypes=(FP8,), tag="-sweep",
                     compare=False)
    for t in [dict(num_warps=4), dict(num_warps=8), dict(num_warps=16), dict(block=512, num_warps=2),
              dict(block=512), dict(block=256), dict(block=2048), dict(slices=4)] if "topk" in only else []:
        bench_topk(True, tiling=t, shapes=[(1024, 32768, False), (128, 131072, False), (8192, 8192, True)],
                   tag="-sweep")


def print_table():
    print("\n" + "=" * 110)
    print(f"{'kind':14} {'config':62} {'kernel':>18} {'XLA':>18} {'speedup':>8}  note")
    for r in RESULTS:
        unit = r["unit"]
        cfg = {k: v for k, v in r.items() if k in ("dtype", "T", "B", "C", "rows", "L", "width", "causal", "backend")}
        if r.get("tiling") not in (None, "default"):
            cfg["tiling"] = r["tiling"]
        cfg = " ".join(f"{k}={v}" for k, v in cfg.items())
        kern = f"{r['kernel_ms']:.3f}ms {r['kernel_' + unit]:.0f}" if "kernel_ms" in r else "-"
        xla = f"{r['xla_ms']:.3f}ms {r['xla_' + unit]:.0f}" if "xla_ms" in r else "-"
        sp = f"{r['speedup']:.1f}x" if "speedup" in r else ""
        note = r.get("error") or r.get("xla", "")
        if "copy_GBps" in r:
            note = f"copy {r['copy_GBps']:.0f} ({r['copy_fraction']:.0%}) host {r['host_ms']:.3f}ms " + note
        if r.get("kernels_us"):
            note = "/".join(f"{v:.1f}" for v in r["kernels_us"].values()) + "us " + note
        if isinstance(r.get("kernel_device_ms"), float):
            alone = (f" ({r['kernel_alone_fraction']:.0%} of copy alone {r['copy_alone_GBps']:.0f})"
                     if "kernel_alone_fraction" in r else "")
            note = f"kernel alone {r['kernel_device_ms'] * 1e3:.1f}us{alone} " + note
        if "triton_ms" in r:
            note = f"triton {r['triton_ms']:.3f}ms {r['triton_' + unit]:.0f} ({r['triton_ms'] / r['kernel_ms']:.1f}x) " + note
        print(f"{r['kind']:14} {cfg[:62]:62} {kern:>18} {xla:>18} {sp:>8}  {unit} {note[:90]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_indexer.json")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also sweep a few tilings of the --only kernels")
    ap.add_argument("--only", default="prefill,decode,topk", help="comma list of prefill,decode,topk")
    ap.add_argument("--budget-s", type=float, default=270, help="skip configs starting later than this")
    ap.add_argument("--decode-rows", type=int, default=1, help="query rows per decode sequence (MTP: 2)")
    ap.add_argument("--dtypes", default="fp8,bf16", help="comma list of fp8,bf16 (prefill and decode)")
    ap.add_argument("--topk-width", type=int, default=None,
                    help="top-k: the causal 4K / 8K prefills and 128 rows of 8K keys at their own width and "
                         "in logits of this many columns, instead of the default shapes")
    a = ap.parse_args()
    t0 = time.time()
    DEADLINE[0] = t0 + a.budget_s
    only = a.only.split(",")
    dtypes = tuple({"fp8": FP8, "bf16": jnp.bfloat16}[d] for d in a.dtypes.split(","))
    if "topk" in only:
        shapes = None
        if a.topk_width:
            shapes = [(rows, length, causal, width) for rows, length, causal in
                      ((4096, 4096, True), (8192, 8192, True), (128, 8192, False)) for width in (length, a.topk_width)]
        bench_topk(a.quick, shapes=shapes)
    if "prefill" in only:
        bench_prefill(a.quick, dtypes=dtypes)
    if "decode" in only:
        bench_decode(a.quick, rows=a.decode_rows, dtypes=dtypes)
    if a.sweep:
        sweep(only)
    print_table()
    info = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__, python=platform.python_version(),
                timer="scripts/timing.py median_ms",
                total_s=time.time() - t0, quick=a.quick)
    with open(a.out, "w") as f:
        json.dump(dict(info=info, results=RESULTS), f, indent=1)
    print(f"\nwrote {a.out} ({len(RESULTS)} configs, {sum('error' in r for r in RESULTS)} failed) "
          f"in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
