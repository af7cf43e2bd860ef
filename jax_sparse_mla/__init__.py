"""DeepSeek-V3.2 sparse MLA attention (DSA) for JAX.

Functional core: MLAConfig, init_params / params_from_hf, init_cache (sized by page_bytes /
num_pages_for_budget), plan_batch (plan_arrays: from host arrays), forward.
Flax NNX wrapper: SparseMLA. Oracle: jax_sparse_mla.reference.
Meshes (heads over "tensor", sequences over "data"): jax_sparse_mla.sharding; a program per
device (data-parallel attention, each device its own plan and cache): jax_sparse_mla.data_parallel.
Checkpoints: orbax save / restore, jax_sparse_mla.checkpoint; Hugging Face safetensors layers,
jax_sparse_mla.hf_checkpoint.
The harness that drives the layer (the serving loop and its page allocator, the tests' synthetic
Harness, the demo): jax_sparse_mla.serving, which no layer module imports.
"""

__version__ = "0.2.0"  # the single source: pyproject.toml reads this literal (no import at build time)

import importlib

# The public names (also __all__, below) -> the submodule defining each, imported on first use
# (PEP 562), so that importing one submodule (e.g. jax_sparse_mla.plan on a host that only plans)
# loads only what it needs.
_EXPORTS = {
    "PagedCache": "cache", "init_cache": "cache", "num_pages_for_budget": "cache", "page_bytes": "cache",
    "read_indexer_keys": "cache", "read_latent": "cache",
    "restore_checkpoint": "checkpoint", "save_checkpoint": "checkpoint",
    "MLAConfig": "config", "RopeScaling": "config",
    "load_layer_from_safetensors": "hf_checkpoint",
    "forward": "model", "jit_forward": "model",
    "SparseMLA": "nnx_layer",
    "init_params": "params", "params_from_hf": "params",
    "count_programs": "precompile", "enumerate_plans": "precompile",  # (precompile: jax_sparse_mla.precompile)
    "BatchMeta": "plan", "BatchPlan": "plan", "BucketPolicy": "plan", "Request": "plan", "plan_arrays": "plan",
    "plan_batch": "plan",
    "init_sharded_cache": "sharding", "jit_sharded_forward": "sharding", "make_mesh": "sharding",
    "plan_data_parallel": "sharding", "shard_params": "sharding", "sharded_forward": "sharding",
}


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = sorted(_EXPORTS)
