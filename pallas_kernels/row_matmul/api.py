"""A matmul over a run-time count of leading rows: what a bucket-sized program runs for a stage
whose real rows vary by step (the projections, o_proj), paying for those rows only, with no
conditional to pick a size and no slice or pad around it.

`row_matmul` runs the Pallas Mosaic GPU kernel of `mosaic` (Hopper) or the jnp oracle of
`reference`. Design and measurements: docs/design/row_matmul.md.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ..config import TuningConfig, check_implementation, overrides
from ..device import SMEM_BYTES, num_sms
from .mosaic import CONSUMER_WGS, EPI, row_matmul_mosaic
from .reference import row_matmul_reference

# Mosaic GPU's interpreter runs the warpgroups (a producer and the consumers) as concurrent
# callbacks on XLA's CPU thread pool: fewer threads than that and they wait on each other forever.
INTERPRET_MIN_CPU_THREADS = CONSUMER_WGS + 1
KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)  # wgmma operands; the accumulation is float32


@dataclasses.dataclass(frozen=True)
class MosaicConfig(TuningConfig):
    """Tuning of the Mosaic GPU kernel (None: its default). tile_m x tile_n: one consumer
    warpgroup's output tile (a CTA computes tile_m x 2 tile_n; multiples of 64); tile_k: the K
    step (64: one 128-byte swizzled row of 16-bit values); num_stages: K steps in flight
    (default: as many as shared memory holds, up to MAX_STAGES); grid_width: column tiles to a
    band of the tile order (`mosaic.tile_order`); num_programs: persistent CTAs (default one per
    SM, at most one per output tile)."""

    tile_m: int | None = None
    tile_n: int | None = None
    tile_k: int | None = None
    num_stages: int | None = None
    grid_width: int | None = None
    num_programs: int | None = None


CONFIGS = {"xla": None, "mosaic": MosaicConfig}  # implementation -> its config class
IMPLEMENTATIONS = tuple(CONFIGS)
DEFAULTS = dict(tile_m=128, tile_k=64, grid_width=8)
MAX_STAGES = 4  # K steps in flight by default: as many as shared memory holds, up to this
SMALL_M = 2048  # at most this many rows: tile_n 64 (CTA tiles 128 x 128), else 128 (128 x 256)


def default_tile_n(m: int) -> int:
    """The kernel's tile_n for an M-row x: 128 x 256 CTA tiles where there are enough of them to
    fill the SMs, 128 x 128 at SMALL_M rows and below (H200, o_proj's shape at 2048 rows: 0.713
    ms against 0.832 with the wider tiles; at 8192 rows the wider tiles win,
    docs/design/row_matmul.md)."""
    return 64 if m <= SMALL_M else 128


def unsupported_reason(x_dtype, w_dtype) -> str | None:
    """Why the Mosaic kernel cannot take operands of these dtypes (None: it can)."""
    if jnp.dtype(x_dtype) != jnp.dtype(w_dtype) or jnp.dtype(x_dtype) not in KERNEL_DTYPES:
        return (f"x and w must share a dtype of (bfloat16, float16), got {jnp.dtype(x_dtype).name} and "
                f"{jnp.dtype(w_dtype).name}")
    return None


def smem_bytes(tiles: dict, itemsize: int, out_itemsize: int, num_stages: int) -> int:
    """Shared memory of the kernel: num_stages x and w tiles, and each consumer's two output
    pieces (mosaic.EPI square), plus 1 KiB for the barriers."""
    stage = (tiles["tile_m"] + CONSUMER_WGS * tiles["tile_n"]) * tiles["tile_k"] * itemsize
    return num_stages * stage + CONSUMER_WGS * 2 * EPI * EPI * out_itemsize + 1024


def _pad_to(a, multiples):
    """a zero-padded at the end of each axis to a multiple of multiples[axis] (no copy where it is)."""
    widths = [(0, -size % mult) for size, mult in zip(a.shape, multiples)]
    return jnp.pad(a, widths) if any(hi for _, hi in widths) else a


def row_matmul(x, w, rows, *, out_dtype=None, implementation, config=None, interpret=False):
    """x [M, K] @ w[N, K]^T over x's first `rows` rows, accumulated in float32 -> [M, N] in
    out_dtype (default x.dtype); the rows at and past `rows` are 0 whatever x holds there (NaN
    included): no work is spent on them.

    x, w: the same floating dtype (w as a linear layer stores it, [out, in]); rows: int scalar,
    traced or not (one compiled program serves every count), read as clamped to [0, M].
    implementation: "xla" (`reference.row_matmul_reference`: the product over every row, then
    the select) or "mosaic" (`mosaic.row_matmul_mosaic`, Hopper; bfloat16 / float16 operands,
    ValueError otherwise). Shapes that do not tile are zero-padded here (M to tile_m, N to 2
    tile_n, K to tile_k: a copy of the operand that needs it) and the result sliced back.
    config: CONFIGS[implementation] or None. interpret=True runs the kernel in Mosaic GPU's
    interpret mode (CPU); "xla" ignores it.
    """
    check_implementation("row_matmul", implementation, config, CONFIGS)
    if getattr(x, "ndim", None) != 2 or getattr(w, "ndim", None) != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"row_matmul: x [M, K] and w [N, K] must share K, got x {getattr(x, 'shape', x)} "
                         f"and w {getattr(w, 'shape', w)}")
    if jnp.ndim(rows) != 0 or not jnp.issubdtype(jnp.result_type(rows), jnp.integer):
        raise ValueError(f"row_matmul: rows must be an integer scalar, got {rows!r}")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if implementation == "xla":
        return row_matmul_reference(x, w, rows, out_dtype=out_dtype)
    reason = unsupported_reason(x.dtype, w.dtype)
    if reason:
        raise ValueError(f"row_matmul: {reason}")
    m, n = x.shape[0], w.shape[0]
    tiles = {**DEFAULTS, "tile_n": default_tile_n(m), **overrides(config)}
    if tiles["tile_m"] % EPI or tiles["tile_n"] % EPI or tiles["tile_k"] % EPI:
        raise ValueError(f"row_matmul: tile_m, tile_n and tile_k must be multiples of {EPI} (the kernel stores and "
                         f"swizzles in pieces of {EPI}), got {config}")
    cta_m, cta_n = tiles["tile_m"], CONSUMER_WGS * tiles["tile_n"]
    xp = _pad_to(x, (cta_m, tiles["tile_k"]))
    wp = _pad_to(w, (cta_n, tiles["tile_k"]))
    num_tiles = (xp.shape[0] // cta_m) * (wp.shape[0] // cta_n)
    num_programs = min(tiles.pop("num_programs", None) or num_sms(), num_tiles)
    sizes = (x.dtype.itemsize, out_dtype.itemsize)
    if "num_stages" not in tiles:  # (a float32 output's pieces take what a fourth stage would)
        fit = [s for s in range(2, MAX_STAGES + 1) if smem_bytes(tiles, *sizes, s) <= SMEM_BYTES]
        tiles["num_stages"] = max(fit, default=2)
    need = smem_bytes(tiles, *sizes, tiles["num_stages"])
    if need > SMEM_BYTES:
        raise ValueError(f"row_matmul: tiles {tiles} with {out_dtype.name} output need {need} bytes of shared "
                         f"memory, over {SMEM_BYTES}")
    live = jnp.clip(jnp.asarray(rows, jnp.int32), 0, m).reshape(1)
    out = row_matmul_mosaic(xp, wp, live, out_dtype=out_dtype, num_programs=num_programs, interpret=interpret,
                            **tiles)
    return out[:m, :n] if out.shape != (m, n) else out
