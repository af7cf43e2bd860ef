"""The one dispatch point between the layer and the kernels of `pallas_kernels`.

`kernels="xla"` runs each op's pure-jnp implementation, `"pallas"` the Pallas GPU kernels
(compiled on a GPU, in Pallas interpret mode elsewhere: slow, for tests), and `"auto"` the
Pallas kernels on a GPU and XLA elsewhere.
"""

from __future__ import annotations

import jax

from pallas_kernels import dense_attention, indexer, sparse_attention, topk

CHOICES = ("auto", "xla", "pallas")


def resolve(kernels: str) -> str:
    if kernels not in CHOICES:
        raise ValueError(f"kernels must be one of {CHOICES}, got {kernels!r}")
    if kernels == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return kernels


def _interpret() -> bool:
    return jax.default_backend() != "gpu"


def indexer_logits(q, weights, k_cache, k_scale, block_tables, row_seq, row_end, *, page_size, impl):
    """[N, W * page_size] f32 indexer logits, -inf outside [0, row_end) (see pallas_kernels.indexer)."""
    if impl == "pallas":
        return indexer.indexer_logits(q, weights, k_cache, k_scale, block_tables, row_seq, row_end,
                                      page_size=page_size, interpret=_interpret())
    return indexer.indexer_logits_reference(q, weights, k_cache, k_scale, block_tables, row_seq, row_end,
                                            page_size=page_size)


def topk_indices(logits, k: int, *, impl):
    """[N, k] int32 positions of the k largest finite logits per row, -1 padded."""
    if impl == "pallas":
        return topk.topk(logits, k, interpret=_interpret())
    return topk.topk_reference(logits, k)


def sparse_mla(q, latent, latent_scale, k_pe, slots, *, scale, impl):
    """(out [N, H, R] f32, lse [N, H]) of absorbed attention over cache slots (-1 skipped)."""
    if impl == "pallas":
        return sparse_attention.sparse_mla_attention(q, latent, latent_scale, k_pe, slots, scale=scale,
                                                     interpret=_interpret())
    return sparse_attention.sparse_mla_reference(q, latent, latent_scale, k_pe, slots, scale=scale)


def causal_attention(q, k, v, q_positions, *, scale):
    """[S, Q, H, Dv] f32 causal attention of padded per-sequence blocks."""
    # No Pallas kernel yet for the dense route: XLA on every backend.
    return dense_attention.causal_attention_reference(q, k, v, q_positions, scale=scale)


gather_paged_rows = indexer.gather_paged_rows
dequantize_latent = sparse_attention.dequantize_latent
