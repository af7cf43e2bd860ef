"""Top-k of indexer logits in jnp (lax.top_k): the XLA path and the kernels' oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def topk_reference(logits, k: int):
    """logits: [N, L] float32 with -inf for invalid keys -> [N, k] int32 key indices.

    Entries beyond the row's count of finite logits are -1 (also every entry past L when k > L).
    Order within a row is unspecified by contract; here it is descending. NaN counts as invalid,
    as in `api.topk` (lax.top_k ranks NaN above everything: a NaN would take a valid key's place).
    """
    kk = min(k, logits.shape[1])
    values, index = jax.lax.top_k(jnp.where(jnp.isnan(logits), -jnp.inf, logits), kk)
    index = jnp.where(values > -jnp.inf, index, -1).astype(jnp.int32)
    return jnp.pad(index, ((0, 0), (0, k - kk)), constant_values=-1)
