"""GPU kernels of DeepSeek-V3.2 sparse attention, each beside its pure-jnp reference.

One folder per op, named as its dispatch key and its public function: `indexer_logits`, `topk`,
`sparse_mla`, `dense_mha`; each holds `api` (the public function and its input checks),
`reference` (the jnp oracle) and one module per backend (`triton`, `mosaic*`); `device`
holds the device facts they share, `mosaic_inline` the helpers and address formulas of the
Mosaic GPU kernels' hand-written MLIR and inline PTX. The kernels know nothing of layers: they
take arrays and static sizes. The references are the XLA path (CPU, and the baseline on GPU) and
the oracles the kernels are tested against.
"""

from . import compat  # noqa: F401  (first: refuses a jax outside the tested range)

# Registers pallas_fuser_disable_nested_fuse, a jit-cache-key setting: left to the first interpreted
# pallas_call's lazy import, it changes every key and everything compiled before compiles again.
import jax.experimental.pallas.fuser  # noqa: F401
