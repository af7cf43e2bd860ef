"""Absorbed sparse MLA attention over selected latent-cache rows, bf16 or FlashMLA's fp8 layout:
`sparse_mla` (Pallas: Mosaic GPU on Hopper, the Triton backend elsewhere; an fp8 prefill's pages
dequantised once upfront when that pays) and `sparse_mla_reference` (jnp, float32). Design and
measurements: docs/design/sparse_mla.md."""

from .api import (
    UPFRONT_MIN_USES,
    copy_rows,
    dequantize_latent,
    dequantize_pages,
    dequantize_route,
    sparse_mla,
)
from .reference import sparse_mla_reference

__all__ = ["UPFRONT_MIN_USES", "copy_rows", "dequantize_latent", "dequantize_pages", "dequantize_route",
           "sparse_mla", "sparse_mla_reference"]
