"""The one dispatch point between the layer and the kernels of `pallas_kernels`.

`kernels="xla"` runs each op's pure-jnp implementation and `"pallas"` every Pallas kernel
(compiled on a GPU, in Pallas interpret mode elsewhere: slow, for tests). `"auto"` picks per op
what measured fastest on the H200 (docs/benchmarks.md) and XLA off the GPU:
  indexer logits: Pallas (5.8-17x faster than XLA for prefill at T = 1K-8K, 1-3.3x for decode);
  top-k: Pallas (sample-filter-select: 4.2-5.6x faster than lax.top_k at 32K, 2.7x at 128K);
  sparse MLA attention: Pallas (1.0-5.6x faster than XLA's gather + einsum; bf16 prefill 5.6x).
The dense route's causal attention has no Pallas kernel yet and runs on XLA everywhere.
"""

from __future__ import annotations

import jax

from pallas_kernels import dense_attention, indexer, sparse_attention, topk

CHOICES = ("auto", "xla", "pallas")
OPS = ("indexer_logits", "topk", "sparse_mla", "dense_mha")
AUTO_ON_GPU = {"indexer_logits": "pallas", "topk": "pallas", "sparse_mla": "pallas", "dense_mha": "xla"}


def resolve(kernels: str) -> dict[str, str]:
    """kernels choice -> {op: "xla" | "pallas"}."""
    if kernels not in CHOICES:
        raise ValueError(f"kernels must be one of {CHOICES}, got {kernels!r}")
    if kernels == "auto":
        return dict(AUTO_ON_GPU) if jax.default_backend() == "gpu" else dict.fromkeys(OPS, "xla")
    return dict.fromkeys(OPS, kernels)


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


def causal_attention(q, k, v, q_start_loc, k_start_loc, *, scale, impl):
    """[T, H, Dv] causal attention of packed ragged sequences (see pallas_kernels.dense_attention)."""
    if impl == "pallas":
        return dense_attention.causal_varlen_attention(q, k, v, q_start_loc, k_start_loc, scale=scale,
                                                       interpret=_interpret())
    return dense_attention.causal_varlen_attention_reference(q, k, v, q_start_loc, k_start_loc, scale=scale)


gather_paged_rows = indexer.gather_paged_rows
dequantize_index_keys = indexer.dequantize_index_keys
dequantize_latent = sparse_attention.dequantize_latent
