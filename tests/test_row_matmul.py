"""The matmul over a run-time count of leading rows, every implementation against a numpy product.

Implementations (`pallas_kernels.row_matmul.row_matmul(..., implementation=)`): "xla" (the jnp
oracle) and "mosaic" (the Hopper kernel; Mosaic GPU's interpreter on CPU). x's rows at and past
the count are NaN: they must come out exactly 0 (zeroed, never multiplied by 0), and the live
rows must match float64 numpy within one rounding of the output dtype: 4e-3 for bfloat16 (2^-8),
1e-5 for float32 (the summation order). Counts sit at and around the kernel's tile bounds, at 0,
at M and past it; shapes that do not tile exercise the padding. One compiled program serves every
count (the count is traced). The `gpu` twin compiles the kernel at a layer's shapes.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.row_matmul import MosaicConfig, row_matmul
from pallas_kernels.row_matmul.mosaic import tile_order
from tests.support import INTERPRET, compiled_functions, ops

param = functools.partial(ops.implementation_param, "row_matmul")
IMPLEMENTATIONS = [param("xla"), param("mosaic")]
SMALL = MosaicConfig(tile_m=64, tile_n=64)  # CTA tiles of 64 x 128: several tiles at test sizes
TOL = {jnp.bfloat16: 4e-3, jnp.float32: 1e-5}


def operands(seed, m, k, n, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k), np.float32)
    w = rng.standard_normal((n, k), np.float32) / np.sqrt(k)
    return jnp.asarray(x, dtype), jnp.asarray(w, dtype)


def check(out, x, w, rows, out_dtype):
    """out against float64 numpy over the live rows (of x as given, before the poison), 0 past them."""
    live = min(max(rows, 0), x.shape[0])
    want = np.asarray(x, np.float64)[:live] @ np.asarray(w, np.float64).T
    got = np.asarray(out, np.float64)
    assert out.shape == (x.shape[0], w.shape[0]) and out.dtype == jnp.dtype(out_dtype)
    assert np.all(got[live:] == 0), "rows past the count must be exactly 0"
    if live:
        err = np.linalg.norm(got[:live] - want) / np.linalg.norm(want)
        assert err < TOL[out_dtype], err


def run(implementation, x, w, rows, **kw):
    poisoned = x.at[max(rows, 0):].set(jnp.nan)
    kw = dict(config=SMALL, **kw) if implementation == "mosaic" else kw
    return row_matmul(poisoned, w, rows, implementation=implementation, interpret=INTERPRET, **kw)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("rows", [0, 1, 63, 64, 65, 129, 255, 256, 300, -2])
def test_rows_at_and_around_tile_bounds(implementation, rows):
    x, w = operands(rows % 7, 256, 128, 256)
    check(run(implementation, x, w, rows), x, w, rows, jnp.bfloat16)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("m,k,n,rows,out_dtype", [
    (200, 96, 300, 129, jnp.float32),  # no dimension tiles: every operand padded, the result sliced
    (192, 128, 2240 // 8, 150, jnp.float32),  # N of the fused projections' shape (2240 / 8): N padded
    (128, 192, 128, 128, jnp.bfloat16),  # one row tile, every row live
])
def test_shapes_that_do_not_tile(implementation, m, k, n, rows, out_dtype):
    x, w = operands(m + n, m, k, n)
    check(run(implementation, x, w, rows, out_dtype=out_dtype), x, w, rows, out_dtype)


@pytest.mark.parametrize("m_iters,n_iters,width", [(16, 56, 8), (3, 5, 2), (7, 3, 4), (1, 4, 8), (5, 1, 2)])
def test_tile_order_deals_the_live_tiles_first(m_iters, n_iters, width):
    """The persistent programs' tile order is a permutation of the tiles at every live row-tile
    count, the live ones first (so the programs share them evenly), the first band's column
    tiles row by row."""
    lin = jnp.arange(m_iters * n_iters, dtype=jnp.int32)
    order = jax.jit(jax.vmap(lambda i, live_m: tile_order(i, live_m, m_iters, n_iters, width), (0, None)))
    for live_m in range(m_iters + 1):
        mi, ni = (np.asarray(v) for v in order(lin, jnp.int32(live_m)))
        assert sorted(zip(mi.tolist(), ni.tolist())) == [(m, n) for m in range(m_iters) for n in range(n_iters)]
        live = live_m * n_iters
        assert np.all(mi[:live] < live_m) and np.all(mi[live:] >= live_m)
        band = min(width, n_iters)
        np.testing.assert_array_equal(mi[:band * live_m], np.arange(band * live_m) // band)


def test_one_program_serves_every_count():
    x, w = operands(0, 256, 128, 256)
    f = jax.jit(functools.partial(row_matmul, implementation="mosaic", config=SMALL, interpret=INTERPRET))
    with compiled_functions() as compiled:
        for rows in (0, 70, 256):
            check(f(x.at[rows:].set(jnp.nan), w, jnp.int32(rows)), x, w, rows, jnp.bfloat16)
    assert compiled.count("jit(row_matmul)") == 1, compiled  # (the interpreter compiles helpers of its own)


@pytest.mark.parametrize("x_shape,w_shape,rows,dtype,match", [
    ((64, 32), (16, 48), 3, jnp.bfloat16, "share K"),
    ((64, 32), (16, 32), 3.0, jnp.bfloat16, "integer scalar"),
    ((64, 32), (16, 32), np.array([3]), jnp.bfloat16, "integer scalar"),
    ((64, 32), (16, 32), 3, jnp.float32, "float32"),
])
def test_bad_operands_are_refused(x_shape, w_shape, rows, dtype, match):
    x, w = jnp.zeros(x_shape, dtype), jnp.zeros(w_shape, dtype)
    with pytest.raises(ValueError, match=match):
        row_matmul(x, w, rows, implementation="mosaic", interpret=INTERPRET)


@pytest.mark.parametrize("config,match", [(MosaicConfig(tile_n=256, num_stages=4), "shared memory"),
                                          (MosaicConfig(tile_n=96), "multiples of 64"),
                                          (MosaicConfig(tile_m=32), "multiples of 64")])
def test_tiles_the_kernel_cannot_run_are_refused(config, match):
    x, w = operands(0, 256, 128, 512)
    with pytest.raises(ValueError, match=match):
        row_matmul(x, w, 3, implementation="mosaic", config=config, interpret=INTERPRET)


@pytest.mark.parametrize("m,k,n,out_dtype", [(8192, 1536, 24576, jnp.bfloat16), (4096, 7168, 2240, jnp.float32),
                                             (2048, 16384, 7168, jnp.bfloat16), (1024, 7168, 2240, jnp.float32),
                                             (200, 96, 300, jnp.float32)])
def test_kernel_lowers_for_hopper_at_the_layers_shapes(m, k, n, out_dtype):
    """The compiled kernel, with its default tiles and stages, lowered for the GPU on any machine:
    Mosaic GPU's lowering rules and its shared-memory bound (a float32 output's pieces leave room
    for three stages, not four) are checked here, not only on a GPU."""
    sd = jax.ShapeDtypeStruct
    fn = jax.jit(functools.partial(row_matmul, out_dtype=out_dtype, implementation="mosaic"))
    text = fn.trace(sd((m, k), jnp.bfloat16), sd((n, k), jnp.bfloat16), sd((), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,out_dtype", [(4096, 1536, 24576, jnp.bfloat16), (4096, 7168, 2240, jnp.float32),
                                             (2048, 16384, 7168, jnp.bfloat16), (1024, 7168, 2240, jnp.float32)])
def test_layer_shapes_compiled(m, k, n, out_dtype):
    x, w = operands(1, m, k, n)
    for rows in (m, m // 2 + 1, 1):
        out = row_matmul(x.at[rows:].set(jnp.nan), w, rows, out_dtype=out_dtype, implementation="mosaic")
        check(out, x, w, rows, out_dtype)
