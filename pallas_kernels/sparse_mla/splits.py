"""A row's slot list split across programs (when rows x head blocks can't fill the GPU) and the
per-split partial results merged by their log-sum-exp; shared by the sparse MLA kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..device import HOPPER_SMS


def live_blocks(slots, block: int):
    """slots [N, K] i32 (-1 = skip) -> [N] i32: blocks of `block` slots up to a row's last valid one.

    The kernels walk a row's slot list only that far: top-k pads its selection with trailing -1,
    so a row of padding (every slot -1) costs no gathers and no products, and a row with fewer
    valid keys than K (short contexts) walks only the blocks that hold them.
    """
    extent = jnp.max(jnp.where(slots >= 0, jnp.arange(1, slots.shape[-1] + 1, dtype=jnp.int32), 0), axis=-1)
    return pl.cdiv(extent, block).astype(jnp.int32)


def combine_splits(out, lse):
    """Merge per-split partial results: out [S, N, H, R], lse [S, N, H] (-inf = empty) -> final."""
    if out.shape[0] == 1:
        return out[0], jnp.where(lse[0] == -jnp.inf, jnp.inf, lse[0])
    total = jax.nn.logsumexp(lse, axis=0)  # -inf where every split was empty
    weight = jnp.where(lse == -jnp.inf, 0.0, jnp.exp(lse - jnp.where(total == -jnp.inf, 0.0, total)))
    merged = jnp.einsum("snh,snhr->nhr", weight, out, precision=lax.Precision.HIGHEST)
    return merged, jnp.where(total == -jnp.inf, jnp.inf, total)


def auto_num_splits(rows, head_blocks, num_blocks, wave=2 * HOPPER_SMS, min_blocks_per_split=4):
    """The most splits of a row's slot list whose programs still run in one wave.

    rows x head_blocks programs become rows x head_blocks x splits; a split count that spills
    past `wave` programs (what the GPU runs at once: default 2 an SM) starts a second wave of
    the same per-program work, so it costs a whole wave for nothing (and the merge reads every
    split's partial output). Each split keeps >= min_blocks_per_split slot blocks of work.
    Measured for the Mosaic kernel (docs/design/sparse_mla.md, "Split counts by measurement").
    """
    programs = rows * head_blocks
    return max(1, min(wave // max(programs, 1), num_blocks // min_blocks_per_split))
