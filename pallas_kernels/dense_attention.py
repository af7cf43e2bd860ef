"""Dense causal attention for short prefills (MHA form: qk head dim 192, v head dim 128 real)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_attention_reference(q, k, v, q_positions, *, scale):
    """Causal attention of padded per-sequence blocks, float32.

    q: [S, Q, H, Dqk]; k: [S, L, H, Dqk]; v: [S, L, H, Dv]; q_positions: [S, Q] int32, the
    position of each query in its sequence (-1: padding). Query at position p attends keys 0..p.
    Returns [S, Q, H, Dv] float32 (0 for padding queries).
    """
    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("sqhd,slhd->shql", q.astype(jnp.float32), k.astype(jnp.float32), precision=hi) * scale
    visible = jnp.arange(k.shape[1])[None, None, :] <= q_positions[:, :, None]  # [S, Q, L]
    s = jnp.where(visible[:, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    return jnp.einsum("shql,slhd->sqhd", p, v.astype(jnp.float32), precision=hi)
