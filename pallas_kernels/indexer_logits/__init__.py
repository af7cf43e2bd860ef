"""Lightning-indexer logits over a paged key cache: `indexer_logits` (the implementation the caller
names: "xla", the jnp reference; "mosaic", the Mosaic GPU prefill and decode kernels for Hopper;
"triton", the Triton-backend kernel) and
`indexer_logits_reference` (jnp, float32). Design and measurements: docs/design/indexer.md."""

from .api import CONFIGS, IMPLEMENTATIONS, MosaicConfig, TritonConfig, indexer_logits
from .layout import gather_paged_rows
from .reference import dequantize_index_keys, indexer_logits_reference

__all__ = ["CONFIGS", "IMPLEMENTATIONS", "MosaicConfig", "TritonConfig", "dequantize_index_keys",
           "gather_paged_rows", "indexer_logits", "indexer_logits_reference"]
