"""Dense causal MHA over packed ragged prefills: `dense_mha` (Pallas Mosaic GPU, Hopper; Mosaic
GPU's interpreter off the GPU) and `dense_mha_reference` (jnp, float32). Design and measurements:
docs/design/dense_mha.md."""

from .api import (CONFIGS, IMPLEMENTATIONS, INTERPRET_MIN_CPU_THREADS, KERNEL_DTYPES, MosaicConfig, XlaConfig,
                  dense_mha, unsupported_reason)
from .reference import dense_mha_reference

__all__ = ["CONFIGS", "IMPLEMENTATIONS", "INTERPRET_MIN_CPU_THREADS", "KERNEL_DTYPES", "MosaicConfig", "XlaConfig",
           "dense_mha", "dense_mha_reference", "unsupported_reason"]
