"""DeepSeek-V3.2 sparse MLA attention (DSA) for JAX.

Functional core: MLAConfig, init_params / params_from_hf, init_cache, plan_batch, forward.
Flax NNX wrapper: SparseMLA. Oracle: jax_sparse_mla.reference.
"""

from .cache import PagedCache, init_cache, read_indexer_keys, read_latent
from .config import MLAConfig, RopeScaling
from .model import forward, jit_forward
from .nnx_layer import SparseMLA
from .params import init_params, params_from_hf
from .plan import BatchMeta, BatchPlan, BucketPolicy, Request, plan_batch

__all__ = [
    "BatchMeta", "BatchPlan", "BucketPolicy", "MLAConfig", "PagedCache", "Request", "RopeScaling",
    "SparseMLA", "forward", "init_cache", "init_params", "jit_forward", "params_from_hf", "plan_batch",
    "read_indexer_keys", "read_latent",
]
