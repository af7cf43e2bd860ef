"""DeepSeek-V3.2 sparse MLA attention (DSA) for JAX.

Functional core: MLAConfig, init_params / params_from_hf, init_cache, plan_batch, forward.
Flax NNX wrapper: SparseMLA. Oracle: jax_sparse_mla.reference.
Meshes (heads over "tensor", sequences over "data"): jax_sparse_mla.sharding.
Checkpoints (orbax; Hugging Face safetensors layers): jax_sparse_mla.checkpoint.
"""

from .cache import PagedCache, init_cache, read_indexer_keys, read_latent
from .checkpoint import load_layer_from_safetensors, restore_checkpoint, save_checkpoint
from .config import MLAConfig, RopeScaling
from .model import forward, jit_forward
from .nnx_layer import SparseMLA
from .params import init_params, params_from_hf
from .plan import BatchMeta, BatchPlan, BucketPolicy, Request, plan_batch
from .sharding import (init_sharded_cache, jit_sharded_forward, make_mesh, plan_data_parallel, shard_params,
                       sharded_forward)

__all__ = [
    "BatchMeta", "BatchPlan", "BucketPolicy", "MLAConfig", "PagedCache", "Request", "RopeScaling",
    "SparseMLA", "forward", "init_cache", "init_params", "init_sharded_cache", "jit_forward", "jit_sharded_forward",
    "load_layer_from_safetensors", "make_mesh", "params_from_hf", "plan_batch", "plan_data_parallel",
    "read_indexer_keys", "read_latent", "restore_checkpoint", "save_checkpoint", "shard_params", "sharded_forward",
]
