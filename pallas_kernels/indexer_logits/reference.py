"""Lightning-indexer logits in jnp, float32: the XLA path and the kernels' oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .layout import gather_paged_rows

ROW_CHUNK = 64  # rows per step of the reference, bounding its [rows, heads, keys] intermediate


def dequantize_index_keys(keys, scale):
    """keys: [..., D] (e4m3 | bf16 | f32); scale: [...] f32 (fp8 keys) or None -> [..., D] f32."""
    keys = keys.astype(jnp.float32)
    return keys if scale is None else keys * scale[..., None]


def indexer_logits_reference(q, weights, k_cache, k_scale, block_tables, row_seq, row_end, *, page_size):
    """Indexer logits in jnp, float32.

    q: [N, Hi, D] (e4m3 | bf16 | f32); weights: [N, Hi] f32 (q scales and softmax scales folded in);
    k_cache: [num_slots, D]; k_scale: [num_slots] f32 or None; block_tables: [S, W] int32;
    row_seq: [N] int32; row_end: [N] int32 (keys [0, row_end) are valid).
    Returns [N, W * page_size] float32.
    """
    keys = dequantize_index_keys(gather_paged_rows(k_cache, block_tables, page_size),  # [S, L, D]
                                 None if k_scale is None else gather_paged_rows(k_scale, block_tables, page_size))
    num_keys = keys.shape[1]

    def one_row(args):
        q_n, w_n, seq, end = args
        scores = jnp.einsum("hd,ld->hl", q_n.astype(jnp.float32), keys[seq],
                            precision=jax.lax.Precision.HIGHEST)
        logits = jnp.einsum("h,hl->l", w_n, jax.nn.relu(scores), precision=jax.lax.Precision.HIGHEST)
        return jnp.where(jnp.arange(num_keys) < end, logits, -jnp.inf)

    return jax.lax.map(one_row, (q, weights.astype(jnp.float32), row_seq, row_end), batch_size=ROW_CHUNK)
