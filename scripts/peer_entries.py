"""The project's kernels behind the peer comparison's calling convention (FlashMLA / DeepGEMM
bench: `PEERS_ENTRIES` names these functions), with the choices the layer's plan and dispatch
make for the same shapes, so the bench times what a forward runs.

    PEERS_ENTRIES=sparse_mla_attention=scripts.peer_entries:sparse_mla_attention,\
sparse_mla_reference=scripts.peer_entries:sparse_mla_reference,\
dequantize_route=scripts.peer_entries:dequantize_route,\
indexer_logits=scripts.peer_entries:indexer_logits,\
indexer_logits_reference=scripts.peer_entries:indexer_logits_reference

Mosaic GPU kernels only: the comparison runs on Hopper.
"""

from jax_sparse_mla import policy
from jax_sparse_mla.policy import dequantize_route
from pallas_kernels.indexer_logits import indexer_logits as _indexer_logits
from pallas_kernels.indexer_logits import indexer_logits_reference
from pallas_kernels.sparse_mla import sparse_mla, sparse_mla_reference

__all__ = ["dequantize_route", "indexer_logits", "indexer_logits_reference", "sparse_mla_attention",
           "sparse_mla_reference"]


def sparse_mla_attention(q, latent, latent_scale, k_pe, slots, *, scale):
    """q [N, H, 576] bf16, caches as `sparse_mla`, slots [N, topk] -> (out [N, H, 512] f32, lse [N, H])."""
    dequantize = "kernel"
    if latent_scale is not None:
        # the plan's fp8 route for these rows; with no page list the upfront copy holds the whole cache
        dequantize = dequantize_route(q.shape[0], q.shape[1], slots.shape[-1], latent.shape[0])
    return sparse_mla(q, latent, latent_scale, k_pe, slots, scale=scale, implementation="mosaic",
                      dequantize=dequantize)


def indexer_logits(q, weights, k_cache, k_scale, block_tables, row_seq, row_end, *, page_size):
    """The Mosaic kernel `policy.indexer_kernel` picks for these rows and sequences (clean logits)."""
    kind = policy.indexer_kernel(q.shape[0], block_tables.shape[0])
    return _indexer_logits(q, weights, k_cache, k_scale, block_tables, row_seq, row_end, page_size=page_size,
                           implementation="mosaic", kernel=kind)
