"""Lightning-indexer logits over a paged key cache: `indexer_logits` (the Pallas kernels, as the caller
names: Mosaic GPU prefill and decode kernels for Hopper, the Triton-backend kernel) and
`indexer_logits_reference` (jnp, float32). Design and measurements: docs/design/indexer.md."""

from .api import BACKENDS, dequantize_index_keys, indexer_logits
from .layout import gather_paged_rows
from .reference import indexer_logits_reference

__all__ = ["BACKENDS", "dequantize_index_keys", "gather_paged_rows", "indexer_logits",
           "indexer_logits_reference"]
