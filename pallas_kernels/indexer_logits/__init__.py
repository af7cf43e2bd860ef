"""Lightning-indexer logits over a paged key cache: `indexer_logits` (the Pallas kernels' router:
Mosaic GPU prefill and decode kernels on Hopper, the Triton-backend kernel elsewhere) and
`indexer_logits_reference` (jnp, float32). Design and measurements: docs/design/indexer.md."""

from .api import MGPU_MIN_ROWS_PER_SEQ, dequantize_index_keys, indexer_logits
from .layout import gather_paged_rows
from .reference import indexer_logits_reference

__all__ = ["MGPU_MIN_ROWS_PER_SEQ", "dequantize_index_keys", "gather_paged_rows", "indexer_logits",
           "indexer_logits_reference"]
