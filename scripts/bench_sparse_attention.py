"""Benchmark the Pallas sparse MLA kernels against the XLA path (jit of the jnp reference).

    python scripts/bench_sparse_attention.py --out results.json [--quick] [--sweep] [--impls triton,mosaic]
                                             [--empty 0,0.5,1] [--splits 1,2,4] [--base REV] [--rounds N]

Kernels, side by side in one run (--impls): "triton" (the Pallas Triton kernel, the earlier
implementation) and "mosaic" (the Pallas Mosaic GPU kernel, Hopper only); "xla" is the reference.

Shapes are DeepSeek-V3.2's: 128 heads, latent rank 512, rope 64, topk 2048, bf16 q.
  prefill: 4096 query rows of one sequence, slots drawn from a cache of s_kv tokens (8K..128K);
  decode:  batch 1..128 x s_q 1..2 rows, each sequence selecting from its own 32K-token cache.
Cache formats: bf16 (latent + rope, 1152 B/token) and fp8 (FlashMLA's layout: e4m3 latent with
one f32 scale per 128 values, bf16 rope: 656 B/token).
fp8 runs each dequantisation route of --dequantize: "kernel" (each gathered row dequantised in
the kernel) and "upfront" (the problem's pages, its sequences' 64-slot pages, dequantised once
to bf16 ahead of the kernel, inside the timed call); the record's "auto" names the route the
library picks for the shape. The cache is one array sized for the largest config, as a serving
engine's is: upfront copies only the pages a problem lists.
Every config is first checked against the reference (relative error of out, lse), then timed (median of 7 batches of back-to-back calls, after warm-up).
TFLOP/s follow FlashMLA's convention: 2 * rows * topk * heads * (d_qk + d_v), d_qk 576, d_v 512.
GB/s counts the gathered cache bytes (rows * topk * bytes per token) plus q and out.
A config whose kernel fails to compile or mismatches is recorded with its error; the run goes on.
--sweep also times a few kernel tilings (block_h, block_k, num_warps, num_stages) on two configs.
--splits S,..: the Mosaic kernel again at each num_splits S (a row's slot list over S programs,
merged by LSE), beside its own choice (splits.auto_num_splits), to measure that choice.
--empty F,..: each config again with the last fraction F of its rows padding (every slot -1, as
a bucket's padding rows are); TFLOP/s and GB/s then count the real rows' work only, so a kernel
whose cost follows the real rows keeps its rate.
--base REV: an A/B against a kernel change. pallas_kernels as of git revision REV (`git archive`,
imported under another package name: the module copy) runs beside the working tree's. Each of
--impls gets a variant "<impl>@REV" on the same inputs, checked against the reference like the
others. The record of the working tree's kernel then holds `speedup`: the base's time over its
own (above 1: the working tree is faster).
--rounds N: time a config's variants N times, interleaved, and record the median of the rounds
(with `spread`, (max - min) / median of the rounds): the A/B method of docs/design/sparse_mla.md.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
import warnings
import zlib

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from jax_sparse_mla.config import FP8_TILE  # noqa: E402
from timing import median_ms  # noqa: E402
from jax_sparse_mla.ops import quantize_tiles  # noqa: E402
from jax_sparse_mla.policy import dequantize_route  # noqa: E402
from pallas_kernels import sparse_mla as kernels_here  # noqa: E402
from pallas_kernels.sparse_mla import sparse_mla_reference  # noqa: E402

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")

HEADS, RANK, ROPE, TOPK = 128, 512, 64, 2048
SCALE = (128 + 64) ** -0.5 * (0.1 * np.log(40.0) + 1) ** 2  # the model's softmax scale (YaRN mscale^2)
BYTES_PER_TOKEN = {"bf16": (RANK + ROPE) * 2, "fp8": RANK + 4 * RANK // 128 + 2 * ROPE}
OUT_TOL = 2e-2  # bf16 q: probabilities round to bf16 in the kernel (see the kernel tests)
LSE_TOL = {"bf16": 1e-2, "fp8": 3e-2}  # fp8: e4m3 x scale is rounded to bf16 (see the kernel tests)

FULL = {
    "prefill": [(4096, s_kv) for s_kv in (8192, 32768, 65536, 131072)],
    "decode": [(b, s_q) for b in (1, 8, 32, 64, 128) for s_q in (1, 2)],
}
QUICK = {
    "prefill": [(4096, 8192), (4096, 131072)],
    "decode": [(128, 2)],
}
DECODE_S_KV = 32768
PAGE_SIZE = 64
DEQUANTIZE = ("kernel", "upfront")  # fp8 routes (--dequantize)
INTERPRET = {}  # {"interpret": True} under --smoke
TILING_KEYS = ("block_h", "block_k", "num_warps", "num_stages")
SWEEP = [  # TILING_KEYS
    (64, 32, 8, 2), (64, 32, 8, 1), (64, 32, 8, 3), (64, 64, 8, 2),
    (64, 16, 8, 2), (64, 32, 4, 2), (32, 32, 4, 2), (32, 64, 4, 2), (16, 32, 4, 2),
]


_caches = {}


def get_cache(fmt, num_slots):
    """One cache per format, sized for the largest config up front (smaller configs use a prefix)."""
    if fmt not in _caches:
        make = jax.jit(lambda k: (jax.random.normal(k, (num_slots, RANK), jnp.float32),
                                  jax.random.normal(jax.random.fold_in(k, 1), (num_slots, ROPE), jnp.bfloat16)))
        latent, k_pe = make(jax.random.key(1))
        if fmt == "fp8":
            latent, scale = jax.jit(quantize_tiles, static_argnums=1)(latent, FP8_TILE)
        else:
            latent, scale = latent.astype(jnp.bfloat16), None
        _caches[fmt] = jax.block_until_ready((latent, scale, k_pe))
    return _caches[fmt]


def cache_slots(kind, a, b):
    return b if kind == "prefill" else a * DECODE_S_KV


@functools.partial(jax.jit, static_argnums=(2, 3))
def _random_subset(key, offsets, s_kv, topk):
    """[rows] offsets -> [rows, topk] distinct random slots in [offset, offset + s_kv), random order."""
    noise = jax.random.uniform(key, (offsets.shape[0], s_kv))
    return (jax.lax.top_k(noise, topk)[1] + offsets[:, None]).astype(jnp.int32)


def make_problem(kind, a, b):
    """-> (q, slots, s_kv, batch, s_q) for prefill (rows=a, s_kv=b) or decode (batch=a, s_q=b)."""
    if kind == "prefill":
        rows, s_kv, batch, s_q = a, b, 1, a
        offsets = jnp.zeros((rows,), jnp.int32)
    else:
        batch, s_q, s_kv = a, b, DECODE_S_KV
        rows = batch * s_q
        offsets = jnp.repeat(jnp.arange(batch, dtype=jnp.int32) * s_kv, s_q)
    key = jax.random.key(zlib.crc32(f"{kind} {a} {b}".encode()))
    q = jax.random.normal(key, (rows, HEADS, RANK + ROPE), jnp.bfloat16)
    slots = _random_subset(jax.random.fold_in(key, 1), offsets, s_kv, TOPK)
    return q, slots, s_kv, batch, s_q


def rel_err(out, ref_out, lse, ref_lse, slots):
    live = np.asarray((slots >= 0).any(axis=1))
    if not np.array_equal(np.asarray(out)[~live], np.zeros_like(np.asarray(out)[~live])) or \
            not (np.asarray(lse)[~live] == np.inf).all():
        return float("inf"), float("inf")  # padding rows must give out 0, lse +inf
    if not live.any():
        return 0.0, 0.0
    out, ref_out = np.asarray(out)[live], np.asarray(ref_out)[live]
    err = float(np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out))
    lse_err = float(np.max(np.abs(np.asarray(lse)[live] - np.asarray(ref_lse)[live])))
    return err, lse_err


BASES = {}  # --base: {label "@REV": pallas_kernels.sparse_mla as of REV}


def import_base(rev):
    """pallas_kernels.sparse_mla as of git revision `rev`, imported from a copy of that revision's
    pallas_kernels under another package name (its imports are relative)."""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    archive = subprocess.run(["git", "-C", root, "archive", rev, "pallas_kernels"], capture_output=True)
    if archive.returncode:
        raise SystemExit(f"--base {rev}: git archive failed: {archive.stderr.decode().strip()}")
    tree = archive.stdout
    where = tempfile.mkdtemp(prefix="bench_base_")
    with tarfile.open(fileobj=io.BytesIO(tree)) as tar:
        tar.extractall(where, filter="data")
    name = f"pallas_kernels_{zlib.crc32(rev.encode()):08x}"
    os.rename(os.path.join(where, "pallas_kernels"), os.path.join(where, name))
    sys.path.insert(0, where)
    return importlib.import_module(f"{name}.sparse_mla")


def kernel_fn(impl, tiling, dequantize, num_splits=None, rev=""):
    """The jitted kernel of one backend ("triton", with an optional tiling, or "mosaic", with an
    optional num_splits), from the working tree or (rev "@REV") from BASES."""
    kernels = BASES[rev] if rev else kernels_here
    tuning = {} if tiling is None else dict(zip(TILING_KEYS, tiling))
    if num_splits is not None:
        tuning["num_splits"] = num_splits
    config = kernels.CONFIGS[impl](**tuning) if tuning else None
    return jax.jit(functools.partial(kernels.sparse_mla, scale=SCALE, implementation=impl, config=config,
                                     dequantize=dequantize, page_size=PAGE_SIZE, **INTERPRET))


def run_config(kind, fmt, a, b, num_slots, reference_fn, impls, tilings=(None,), time_reference=True, empty=0.0,
               splits=(), rounds=1):
    q, slots, s_kv, batch, s_q = make_problem(kind, a, b)
    latent, latent_scale, k_pe = get_cache(fmt, num_slots)
    rows = q.shape[0]
    real = rows - int(round(empty * rows))
    slots = slots.at[real:].set(-1)  # padding rows
    flops = 2 * real * TOPK * HEADS * (RANK + ROPE + RANK)
    moved = real * (TOPK * BYTES_PER_TOKEN[fmt] + HEADS * (RANK + ROPE) * 2 + HEADS * RANK * 4)
    pages = jnp.arange(batch * s_kv // PAGE_SIZE, dtype=jnp.int32)  # the problem's sequences, from slot 0
    base = dict(kind=kind, cache=fmt, rows=rows, batch=batch, s_q=s_q, s_kv=s_kv, topk=TOPK, heads=HEADS,
                empty=empty)
    if fmt == "fp8":
        base["auto"] = dequantize_route(rows, HEADS, TOPK, pages.size * PAGE_SIZE)
    records = []

    def record(impl, tiling=None, **extra):
        rec = dict(base, impl=impl, **extra)
        if tiling is not None:
            rec["tiling"] = dict(zip(TILING_KEYS, tiling))
        if "seconds" in rec:
            rec["ms"] = rec["seconds"] * 1e3
        if "seconds" in rec and real:
            rec["tflops"] = flops / rec["seconds"] / 1e12
            rec["gbps"] = moved / rec["seconds"] / 1e9
        records.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k != "traceback"}), flush=True)

    args = (q, latent, latent_scale, k_pe, slots)
    try:
        ref_out, ref_lse = jax.block_until_ready(reference_fn(*args))
        if time_reference:
            record("xla", seconds=median_ms(reference_fn, *args) / 1e3)
    except Exception as e:  # noqa: BLE001 - record and go on
        record("xla", error=f"{type(e).__name__}: {e}"[:2000])
        return records

    variants = [(impl, tiling, None, rev) for impl in impls for rev in ("", *BASES)
                for tiling in (tilings if impl == "triton" else (None,))]
    variants += [("mosaic", None, s, "") for s in splits if "mosaic" in impls]
    checked = []  # [variant, rev, record fields, the call, times]: every variant checked before any is timed
    for impl, tiling, num_splits, rev in variants:
        for dequantize in DEQUANTIZE if fmt == "fp8" else ("kernel",):
            extra = dict(dequantize=dequantize) if fmt == "fp8" else {}
            if num_splits is not None:
                extra["num_splits"] = num_splits
            try:
                fn = kernel_fn(impl, tiling, dequantize, num_splits, rev)
                out, lse = jax.block_until_ready(fn(*args, pages=pages))
                err, lse_err = rel_err(out, ref_out, lse, ref_lse, slots)
                if not (err < OUT_TOL and lse_err < LSE_TOL[fmt]):
                    raise AssertionError(f"mismatch vs reference: rel err {err:.3e}, lse err {lse_err:.3e}")
                fields = dict(rel_err=err, lse_err=lse_err, **extra)
                checked.append([(impl, tiling, num_splits, dequantize), rev, fields, functools.partial(fn, pages=pages), []])
            except Exception as e:  # noqa: BLE001 - a config that fails to compile must not end the run
                record(impl + rev, tiling, error=f"{type(e).__name__}: {e}"[:2000],
                       traceback=traceback.format_exc()[-3000:], **extra)
    for r in range(rounds):  # interleaved: each round times every variant once, every other round in reverse
        for entry in checked[::-1] if r % 2 else checked:
            entry[4].append(median_ms(entry[3], *args))
    base_ms = {variant: statistics.median(t) for variant, rev, _, _, t in checked if rev}
    for variant, rev, extra, _, t in checked:
        ms = statistics.median(t)
        if not rev and variant in base_ms:  # the working tree's kernel against the base's twin
            extra["speedup"] = base_ms[variant] / ms
        record(variant[0] + rev, variant[1], seconds=ms / 1e3, spread=(max(t) - min(t)) / ms, **extra)
    return records


def print_table(records):
    head = f"{'kind':8} {'cache':5} {'batch':>5} {'s_q':>5} {'s_kv':>7} {'impl':14} {'ms':>9} {'TFLOP/s':>8} {'GB/s':>7}  note"
    print("\n" + head + "\n" + "-" * len(head))
    for r in records:
        note = r.get("error", "")[:60] or (f"err {r['rel_err']:.1e}" if "rel_err" in r else "")
        if "dequantize" in r:
            note = f"dequantize {r['dequantize']}{' (auto)' if r['dequantize'] == r['auto'] else ''} " + note
        if "tiling" in r:
            note = f"{tuple(r['tiling'].values())} " + note
        if r.get("empty"):
            note = f"{r['empty']:.0%} padding rows " + note
        if "num_splits" in r:
            note = f"num_splits {r['num_splits']} " + note
        if "speedup" in r:
            note = f"{r['speedup']:.3f}x the base " + note
        ms = f"{r['ms']:9.3f}" if "ms" in r else f"{'-':>9}"
        tf = f"{r['tflops']:8.1f}" if "tflops" in r else f"{'-':>8}"
        gb = f"{r['gbps']:7.0f}" if "gbps" in r else f"{'-':>7}"
        print(f"{r['kind']:8} {r['cache']:5} {r['batch']:5} {r['s_q']:5} {r['s_kv']:7} {r['impl']:14} {ms} {tf} {gb}  {note}")


def main():
    global HEADS, RANK, ROPE, TOPK, DECODE_S_KV, PAGE_SIZE, DEQUANTIZE, FULL, QUICK, SWEEP, BYTES_PER_TOKEN
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results.json")
    parser.add_argument("--quick", action="store_true", help="a few configs only")
    parser.add_argument("--sweep", action="store_true", help="also time several kernel tilings")
    parser.add_argument("--formats", default="bf16,fp8", help="comma list of bf16, fp8")
    parser.add_argument("--kinds", default="prefill,decode", help="comma list of prefill, decode")
    parser.add_argument("--impls", default="triton,mosaic", help="comma list of triton, mosaic")
    parser.add_argument("--dequantize", default=",".join(DEQUANTIZE), help="fp8 routes: comma list of kernel, upfront")
    parser.add_argument("--empty", default="0", help="comma list of padding-row fractions (see above)")
    parser.add_argument("--splits", default="", help="comma list of Mosaic num_splits to time beside the auto choice")
    parser.add_argument("--base", default="", help="git revision whose kernels run beside the working tree's (A/B)")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved timing rounds a config (median)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes in Pallas interpret mode: checks this script on a CPU")
    args = parser.parse_args()
    if args.smoke:  # the tiny test config; timings are meaningless
        HEADS, RANK, ROPE, TOPK, DECODE_S_KV, PAGE_SIZE = 4, 128, 8, 16, 64, 16
        BYTES_PER_TOKEN = {"bf16": (RANK + ROPE) * 2, "fp8": RANK + 4 * RANK // 128 + 2 * ROPE}
        FULL = QUICK = {"prefill": [(8, 64)], "decode": [(2, 2)]}
        SWEEP = [(16, 16, 4, 1)]
        INTERPRET["interpret"] = True

    DEQUANTIZE = tuple(args.dequantize.split(","))
    if args.base:
        BASES["@" + args.base] = import_base(args.base)
    start = time.perf_counter()
    print(f"devices: {jax.devices()}", flush=True)
    reference_fn = jax.jit(lambda q, l, s, p, i: sparse_mla_reference(q, l, s, p, i, scale=SCALE))
    configs = QUICK if args.quick else FULL
    formats, kinds = args.formats.split(","), args.kinds.split(",")
    impls = args.impls.split(",")
    if args.smoke:  # Mosaic GPU kernels need a GPU (their inline gathers do not interpret)
        impls = [i for i in impls if i != "mosaic"]
    empties = [float(e) for e in args.empty.split(",")]
    plan = [(kind, fmt, a, b) for kind in kinds for fmt in formats for a, b in configs[kind]]
    sweep = [(kind, fmt, a, b) for kind, a, b in (("prefill", 4096, 32768), ("decode", 64, 2))
             for fmt in formats] if args.sweep else []
    if args.smoke:
        sweep = [(kind, fmt, a, b) for kind, fmt, a, b in plan[:1]] if args.sweep else []
    num_slots = max(cache_slots(kind, a, b) for kind, _, a, b in plan + sweep)

    records = []

    def save():  # after every config: a run cut short keeps what it measured
        with open(args.out, "w") as f:
            json.dump(dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                           elapsed_s=time.perf_counter() - start, records=records), f, indent=1)

    for kind, fmt, a, b in plan:
        for empty in empties:
            records += run_config(kind, fmt, a, b, num_slots, reference_fn, impls, empty=empty,
                                  splits=[int(x) for x in args.splits.split(",") if x], rounds=args.rounds)
            save()
    for kind, fmt, a, b in sweep:
        records += run_config(kind, fmt, a, b, num_slots, reference_fn, ("triton",), tilings=tuple(SWEEP),
                              time_reference=False)
        save()

    print_table(records)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    save()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
