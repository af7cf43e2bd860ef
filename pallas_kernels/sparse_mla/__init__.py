"""Absorbed sparse MLA attention over selected latent-cache rows, bf16 or FlashMLA's fp8 layout:
`sparse_mla` (Pallas: the Mosaic GPU kernel (Hopper) or the Triton backend; an fp8 cache
dequantised in the kernel or its pages once upfront; both as the caller names) and
`sparse_mla_reference` (jnp, float32). Design and measurements: docs/design/sparse_mla.md."""

from .api import CONFIGS, IMPLEMENTATIONS, MosaicConfig, TritonConfig, copy_rows, dequantize_pages, sparse_mla
from .mosaic import unsupported_reason
from .reference import dequantize_latent, sparse_mla_reference

__all__ = ["CONFIGS", "IMPLEMENTATIONS", "MosaicConfig", "TritonConfig", "copy_rows", "dequantize_latent",
           "dequantize_pages", "sparse_mla", "sparse_mla_reference", "unsupported_reason"]
