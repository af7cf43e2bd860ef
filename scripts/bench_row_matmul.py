"""The row_matmul kernel (a run-time count of leading rows) against XLA's dot over exactly those
rows, at DeepSeek-V3.2's matmuls over a bucket's rows (GPU, Hopper).

    python3 scripts/bench_row_matmul.py [--shapes q_b_proj,o_proj] [--rounds 5] [--out rows.json]
    python3 scripts/bench_row_matmul.py --smoke   # CPU: tiny shapes, the kernel interpreted

For each shape [M, K] x [N, K] and row count (M, M / 2 + 1, M / 2): XLA's dot over an array of
exactly those rows (what the cond program's conditional runs for its picked size, without the
slice and pad around it), the kernel over the M-row bucket with the count at run time, each of
--configs (MosaicConfig fields, "tile_m x tile_n" and the defaults). Rounds interleave the
variants (every other round reversed); each row is the median of the rounds' medians
(`timing.median_ms`), printed and written as soon as it is measured, with the kernel's error
against XLA's over the live rows and whether the rows past the count are 0. Ratios are XLA's
time over the kernel's (> 1: the kernel is faster).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from pallas_kernels.row_matmul import MosaicConfig, row_matmul  # noqa: E402
from timing import median_ms  # noqa: E402

SHAPES = {  # name -> (M, K, N, out dtype): the layer's matmuls over a bucket's rows, weights [N, K]
    "q_b_proj": (8192, 1536, 24576, jnp.bfloat16), "o_proj": (8192, 16384, 7168, jnp.bfloat16),
    "q_a+kv_a+wk": (8192, 7168, 2240, jnp.float32),  # the projections' matmuls over x, stacked (f32 out)
    "wq_b": (8192, 1536, 8192, jnp.bfloat16), "o_proj_2048": (2048, 16384, 7168, jnp.bfloat16),
}
SMOKE_SHAPES = {"tiny": (256, 128, 320, jnp.bfloat16), "tiny_f32": (200, 64, 136, jnp.float32)}


def configs(spec: str) -> dict[str, MosaicConfig | None]:
    """"default,128x64,128x128w16" -> {label: MosaicConfig or None (the kernel's defaults)}:
    TILE_MxTILE_N, optionally wGRID_WIDTH."""
    out = {}
    for item in spec.split(","):
        if item == "default":
            out[item] = None
        else:
            tiles, _, width = item.partition("w")
            tile_m, tile_n = (int(v) for v in tiles.split("x"))
            out[item] = MosaicConfig(tile_m=tile_m, tile_n=tile_n, grid_width=int(width) if width else None)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=None, help=f"default: all of {','.join(SHAPES)}")
    p.add_argument("--configs", default="default,128x64",
                   help="kernel tilings: default, TILE_MxTILE_N[wGRID_WIDTH], ...")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, the kernel interpreted (CPU)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    shapes = SMOKE_SHAPES if a.smoke else SHAPES
    names = a.shapes.split(",") if a.shapes else list(shapes)
    interpret = jax.default_backend() != "gpu"
    rows_out = []
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    print(f"{'shape':<13} {'rows':>5} {'variant':<16} {'ms':>8} {'TFLOP/s':>8} {'xla/this':>8} {'rel_err':>8} "
          "zero past", flush=True)
    for name in names:
        m, k, n, out_dtype = shapes[name]
        key = jax.random.key(0)
        x = jax.random.normal(key, (m, k), jnp.float32).astype(jnp.bfloat16)
        w = (jax.random.normal(jax.random.fold_in(key, 1), (n, k), jnp.float32) / k ** 0.5).astype(jnp.bfloat16)
        xla = jax.jit(lambda x, w: jnp.einsum("mk,nk->mn", x, w, preferred_element_type=jnp.float32).astype(out_dtype))
        kernels = {label: jax.jit(functools.partial(row_matmul, out_dtype=out_dtype, implementation="mosaic",
                                                    config=cfg, interpret=interpret))
                   for label, cfg in configs(a.configs).items()}  # the count is an argument: one compile each
        for count in sorted({m, m // 2 + 1, m // 2}, reverse=True):
            fns = {"xla": (xla, (x[:count], w))}
            fns.update({f"kernel {label}": (f, (x, w, jnp.int32(count))) for label, f in kernels.items()})
            ref = xla(x[:count], w).astype(jnp.float32)
            checks = {"xla": (0.0, True)}
            for label, (f, args) in list(fns.items())[1:]:
                out = f(*args)
                err = float(jnp.linalg.norm(out[:count].astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
                checks[label] = (err, bool((out[count:] == 0).all()))
            times = {v: [] for v in fns}
            for r in range(1 if a.smoke else a.rounds):
                for v in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                    times[v].append(median_ms(fns[v][0], *fns[v][1], batches=1 if a.smoke else 5))
            base = statistics.median(times["xla"])
            for v, ts in times.items():
                t = statistics.median(ts)
                row = dict(shape=name, m=m, k=k, n=n, rows=count, variant=v, ms=t,
                           tflops=2 * count * k * n / t / 1e9, xla_over_this=base / t, rel_err=checks[v][0],
                           zero_past_rows=checks[v][1], device=jax.devices()[0].device_kind)
                rows_out.append(row)
                print(f"{name:<13} {count:>5} {v:<16} {t:8.3f} {row['tflops']:8.1f} {row['xla_over_this']:8.3f} "
                      f"{checks[v][0]:8.1e} {checks[v][1]}", flush=True)
                if a.out:
                    with open(a.out, "w") as f:
                        json.dump(dict(rows=rows_out), f, indent=1)


if __name__ == "__main__":
    main()
