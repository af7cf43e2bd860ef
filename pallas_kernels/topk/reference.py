"""Top-k of indexer logits in jnp (lax.top_k): the XLA path and the kernels' oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def topk_reference(logits, k: int, lengths=None):
    """logits: [N, L] float32 with -inf for invalid keys -> [N, k] int32 key indices.

    lengths: [N] int (optional): row n's keys are columns [0, lengths[n]); the rest are ignored
    whatever they hold (negative lengths count as 0, lengths past L as L).
    Entries beyond the row's count of finite logits are -1 (also every entry past L when k > L).
    Order within a row is unspecified by contract; here it is descending. NaN counts as invalid,
    as in `api.topk` (lax.top_k ranks NaN above everything: a NaN would take a valid key's place).
    """
    kk = min(k, logits.shape[1])
    valid = ~jnp.isnan(logits)
    if lengths is not None:
        valid &= jnp.arange(logits.shape[1])[None, :] < jnp.asarray(lengths)[:, None]
    values, index = jax.lax.top_k(jnp.where(valid, logits, -jnp.inf), kk)
    index = jnp.where(values > -jnp.inf, index, -1).astype(jnp.int32)
    return jnp.pad(index, ((0, 0), (0, k - kk)), constant_values=-1)
