"""A matmul over a run-time count of leading rows, zero past them: `row_matmul` (Pallas Mosaic GPU,
Hopper; Mosaic GPU's interpreter off the GPU) and `row_matmul_reference` (jnp). Design and
measurements: docs/design/row_matmul.md."""

from .api import (CONFIGS, IMPLEMENTATIONS, INTERPRET_MIN_CPU_THREADS, KERNEL_DTYPES, MosaicConfig, row_matmul,
                  unsupported_reason)
from .reference import row_matmul_reference

__all__ = ["CONFIGS", "IMPLEMENTATIONS", "INTERPRET_MIN_CPU_THREADS", "KERNEL_DTYPES", "MosaicConfig", "row_matmul",
           "row_matmul_reference", "unsupported_reason"]
