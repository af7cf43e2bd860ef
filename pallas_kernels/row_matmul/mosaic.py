"""`row_matmul` on Hopper: a persistent Pallas Mosaic GPU matmul (TMA, wgmma; one producer and two
consumer warpgroups) whose row tiles past the run-time row count load and multiply nothing and
store zeros. Measured against cuBLAS at the layer's shapes in docs/design/row_matmul.md."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

CONSUMER_WGS = 2  # side by side on a CTA tile's columns: tile_m x (2 tile_n)
EPI = 64  # side of one output store


def _transforms(cols: int, dtype):
    """Shared-memory tiling and swizzle of a tile whose rows hold `cols` values of dtype."""
    item = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(cols * item * 8)
    return plgpu.TilingTransform((8, swizzle // item)), plgpu.SwizzleTransform(swizzle)


def tile_order(lin, live_m, m_iters: int, n_iters: int, width: int):
    """The lin-th output tile (row tile, column tile) the persistent programs take: first the
    tiles of the live_m row tiles that hold a live row, in jax's planar snake over them (bands of
    `width` column tiles walked row by row, every other band upwards: a band's tiles share w's
    columns from L2, a row's share x's rows), then the other tiles row by row. Live tiles first:
    the programs deal them out evenly whatever the count (the snake over the whole bucket
    interleaves the dead ones with them, so a program can draw one more live tile than the
    others: 0.61 against 0.34 ms for cuBLAS at 1025 of 2048 rows). lin, live_m: int32 scalars
    (lax's scalar ops, as planar_snake's: what the kernel lowers)."""
    live = live_m * n_iters
    is_live = lin < live
    # (a dead tile's index is kept inside the snake's domain: past it the snake divides by 0)
    mi, ni = plgpu.planar_snake(lax.select(is_live, lin, jnp.int32(0)), (lax.max(live_m, jnp.int32(1)), n_iters), 1,
                                width)
    dead = lax.max(lin - live, jnp.int32(0))
    return (lax.select(is_live, mi, live_m + lax.div(dead, jnp.int32(n_iters))),
            lax.select(is_live, ni, lax.rem(dead, jnp.int32(n_iters))))


def row_matmul_mosaic(x, w, rows, *, out_dtype, tile_m: int, tile_n: int, tile_k: int, num_stages: int,
                      grid_width: int, num_programs: int, interpret: bool = False):
    """x [M, K] @ w[N, K]^T over x's first rows[0] rows -> [M, N] out_dtype, zero past them.

    rows: [1] int32. Shapes must tile: M by tile_m, N by 2 tile_n, K by tile_k (the api pads).
    num_programs persistent programs walk the (M / tile_m) x (N / 2 tile_n) output tiles in
    `tile_order` (the live ones first, grid_width column tiles to a band). A tile with no live row
    stores zeros without loading anything; a tile with some stores its products' live rows and
    zeros below them.
    """
    m, k = x.shape
    n = w.shape[0]
    cta_n = CONSUMER_WGS * tile_n
    m_iters, n_iters, k_iters = m // tile_m, n // cta_n, k // tile_k
    operand = _transforms(tile_k, x.dtype)
    out_transforms = _transforms(EPI, out_dtype)

    def body(rows_gmem, x_gmem, w_gmem, o_gmem):
        def pipeline(step, context):
            return plgpu.emit_pipeline_warp_specialized(
                step, grid=(k_iters,), memory_registers=40,
                in_specs=[plgpu.BlockSpec((tile_m, tile_k), lambda kk: (0, kk), transforms=operand,
                                          memory_space=plgpu.SMEM),
                          plgpu.BlockSpec((cta_n, tile_k), lambda kk: (0, kk), transforms=operand,
                                          memory_space=plgpu.SMEM)],
                wg_axis="wg", num_compute_wgs=CONSUMER_WGS, max_concurrent_steps=num_stages,
                compute_context=context)

        unused = lambda *_, **__: None  # noqa: E731 (the allocations do not depend on the bodies)

        @functools.partial(pl.run_scoped, allocs=pipeline(unused, unused).get_allocations(x_gmem, w_gmem),
                           out_smem=plgpu.SMEM((CONSUMER_WGS, 2, EPI, EPI), out_dtype, transforms=out_transforms),
                           collective_axes="wg")
        def _(allocs, out_smem):
            wg = lax.axis_index("wg")
            live_rows = rows_gmem[0]
            live_m = lax.min(lax.div(live_rows + tile_m - 1, jnp.int32(tile_m)), jnp.int32(m_iters))  # live row tiles

            @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
            def _(info):
                (lin,) = info.index
                mi, ni = tile_order(lin, live_m, m_iters, n_iters, grid_width)
                m_slice, n_slice = pl.ds(mi * tile_m, tile_m), pl.ds(ni * cta_n, cta_n)
                wg_n = pl.ds(wg * tile_n, tile_n)  # this consumer's columns of the tile
                live = live_rows - mi * tile_m  # the tile's live rows (<= 0: none)

                def store(values):  # [tile_m, tile_n] f32 in registers -> this consumer's part of the tile
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    for a in range(tile_m // EPI):
                        for b in range(tile_n // EPI):
                            slot = (a * (tile_n // EPI) + b) % 2
                            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                            out_smem[wg, slot] = values[a * EPI:(a + 1) * EPI, b * EPI:(b + 1) * EPI].astype(out_dtype)
                            plgpu.commit_smem()
                            plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], o_gmem.at[m_slice, n_slice].at[
                                :, wg_n].at[pl.ds(a * EPI, EPI), pl.ds(b * EPI, EPI)])

                def context(run):
                    @functools.partial(pl.run_scoped, acc=plgpu.ACC((tile_m, tile_n), jnp.float32))
                    def _(acc):
                        run(acc)
                        row = plgpu.broadcasted_iota(jnp.int32, (tile_m, tile_n), 0, layout=plgpu.Layout.WGMMA)
                        store(jnp.where(row < live, acc[...], 0.0))  # a select: x past the rows may hold NaN

                def mma(_, x_smem, w_smem, acc):
                    plgpu.wgmma(acc, x_smem, w_smem.at[wg_n, :].transpose((1, 0)))
                    plgpu.wgmma_wait(0)
                    return acc

                @pl.when(live > 0)
                def _():
                    pipeline(mma, context)(x_gmem.at[m_slice, :], w_gmem.at[n_slice, :], allocations=allocs)

                @pl.when((live <= 0) & (wg < CONSUMER_WGS))
                def _():
                    store(plgpu.layout_cast(jnp.zeros((tile_m, tile_n), jnp.float32), plgpu.Layout.WGMMA))

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((m, n), out_dtype), grid=(num_programs,),
                          grid_names=("sm",), num_threads=CONSUMER_WGS + 1, thread_name="wg",
                          compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    if interpret:
        with plgpu.force_gpu_interpret_mode():
            return kernel(rows, x, w)
    return kernel(rows, x, w)
