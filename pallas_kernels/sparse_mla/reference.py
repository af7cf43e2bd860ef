"""Sparse MLA attention in jnp, float32: the XLA path and the kernels' oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp


ROW_CHUNK = 32  # rows per step of the reference, bounding its [rows, topk, R] gather


def dequantize_latent(latent, latent_scale):
    """latent: [..., R] (bf16 | f32 | e4m3); latent_scale: [..., R // tile] f32 or None -> f32."""
    values = latent.astype(jnp.float32)
    if latent_scale is None:
        return values
    tile = latent.shape[-1] // latent_scale.shape[-1]
    shaped = values.reshape(values.shape[:-1] + (latent_scale.shape[-1], tile))
    return (shaped * latent_scale[..., None]).reshape(values.shape)


def sparse_mla_reference(q, latent, latent_scale, k_pe, slots, *, scale):
    """Sparse MLA attention in jnp, float32.

    q: [N, H, R + P]; latent: [num_slots, R]; latent_scale: [num_slots, R // 128] f32 or None;
    k_pe: [num_slots, P]; slots: [N, K] int32 (-1 = skip). Returns (out [N, H, R] f32, lse [N, H] f32).
    """
    rank = latent.shape[-1]

    def one_row(args):
        q_n, idx = args
        valid = idx >= 0
        safe = jnp.where(valid, idx, 0)
        # A -1 slot reads slot 0 (static shapes), which may hold another request's NaN / inf:
        # its rows are zeroed by select, never by the p = 0 product below (0 * NaN = NaN).
        c = jnp.where(valid[:, None], dequantize_latent(
            latent[safe], None if latent_scale is None else latent_scale[safe]), 0.0)  # [K, R]
        pe = jnp.where(valid[:, None], k_pe[safe].astype(jnp.float32), 0.0)  # [K, P]
        q_n = q_n.astype(jnp.float32)
        hi = jax.lax.Precision.HIGHEST
        s = (jnp.einsum("hr,kr->hk", q_n[:, :rank], c, precision=hi)
             + jnp.einsum("hp,kp->hk", q_n[:, rank:], pe, precision=hi)) * scale
        s = jnp.where(valid[None, :], s, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.exp(s - m)
        denom = jnp.sum(p, axis=-1)
        out = jnp.einsum("hk,kr->hr", p, c, precision=hi) / jnp.where(denom > 0, denom, 1.0)[:, None]
        lse = jnp.where(denom > 0, jnp.log(denom) + m[:, 0], jnp.inf)
        return out, lse

    return jax.lax.map(one_row, (q, slots), batch_size=ROW_CHUNK)
