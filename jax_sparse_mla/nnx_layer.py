"""Flax NNX layer over the functional core (`model.forward`, which takes the HF-named params dict)."""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from .cache import PagedCache
from .config import MLAConfig, check_config_type
from .kernels import Kernels, check_kernels
from .model import forward
from .params import cast_param, check_params, init_params, is_fp8, params_from_hf
from .plan import BatchMeta, BatchPlan
from .sharding import DATA, TENSOR, cache_specs, param_specs, shard_config, sharded_forward


def _place(value, spec, mesh):
    """value laid out as `spec` on `mesh` (a concrete Mesh, or the abstract mesh of jax.set_mesh)."""
    if isinstance(mesh, Mesh):
        return jax.device_put(value, NamedSharding(mesh, spec))
    if mesh.are_all_axes_explicit:
        return jax.sharding.reshard(value, spec)
    return jax.lax.with_sharding_constraint(value, NamedSharding(mesh, spec))


class SparseMLA(nnx.Module):
    """One DeepSeek-V3.2 sparse-MLA attention layer.

    `self.weights` maps each Hugging Face name to an nnx.Param in torch [out, in] layout, so the
    state path of a parameter is ("weights", <HF name>) and `params()` is exactly the dict that
    `model.forward`, `checkpoint` and `sharding` take. Loading: `SparseMLA.from_hf(state_dict,
    config)` (keys with or without the `model.layers.N.self_attn.` prefix; fp8 blocks dequantised,
    see params_from_hf), or `SparseMLA(config, params=...)`.

    ============================  ==================================  ==============================
    HF name (state path key)      shape                               partition (param_specs)
    ============================  ==================================  ==============================
    q_a_proj.weight               [q_lora_rank, hidden]               replicated
    q_a_layernorm.weight          [q_lora_rank]                       replicated
    q_b_proj.weight               [H * qk_head_dim, q_lora_rank]      (tensor, None): rows by head
    kv_a_proj_with_mqa.weight     [kv_lora_rank + rope, hidden]       replicated
    kv_a_layernorm.weight         [kv_lora_rank]                      replicated
    kv_b_proj.weight              [H * (nope + v), kv_lora_rank]      (tensor, None): rows by head
    o_proj.weight                 [hidden, H * v_head_dim]            (None, tensor): columns by head
    indexer.wq_b.weight           [Hi * index_head_dim, q_lora_rank]  replicated
    indexer.wk.weight             [index_head_dim, hidden]            replicated
    indexer.k_norm.weight / bias  [index_head_dim]                    replicated
    indexer.weights_proj.weight   [Hi, hidden]                        replicated
    ============================  ==================================  ==============================

    Every Param carries its partition as `out_sharding` metadata (the tensor_axis name in place
    of "tensor"), so `nnx.get_partition_spec(nnx.state(layer))` gives `sharding.param_specs(
    config, tensor_axis=...)` and the usual NNX recipes (sharded init under nnx.jit with
    with_sharding_constraint, nnx.get_named_sharding for checkpoints) apply. With `mesh=` (or
    inside `jax.set_mesh(mesh)`) the values are also placed on the mesh as they are created;
    without a mesh they stay where they are (the metadata is recorded either way).

    Args:
      config: the layer's dimensions and dtypes.
      rngs: random init (init_params from `rngs.params()`), unless `params` is given.
      params: an HF-named dict (params_from_hf, a checkpoint), checked against the config.
      kernels: "auto" | "xla" | "pallas", as in model.forward.
      param_dtype: storage dtype of the parameters (any float but fp8); default: config.dtype for
        a random init, the given dtypes for `params` (float64 as float32 without
        jax_enable_x64). forward casts each weight to the computation dtype where it is used, so
        storage and computation may differ. A weight that is not finite as stored (a
        non-finite value, or one beyond the storage dtype's range: 1e5 in float16) raises
        ValueError naming it (params.cast_param; unchecked under a trace).
      dtype: the computation dtype. It is config.dtype (the plan records the config, and
        `model.forward` computes in it); accepted for the Flax convention and validated against
        it: a different dtype raises ValueError (use `dataclasses.replace(config, dtype=...)`).
      tensor_axis / data_axis: mesh axis names for the heads and the sequences ("tensor" /
        "data" by default); they go into the partition metadata, `cache_specs()` and `sharded()`.
      mesh: place the parameters on this mesh as created (it needs tensor_axis, and the heads
        must divide over it).

    Use inside a caller's jit (nnx.jit, or nnx.split/merge around jax.jit); plan is static.
    Arguments of another type raise ValueError naming them, here and in each call (forward's
    checks, model.check_arguments).
    """

    def __init__(self, config: MLAConfig, *, rngs: nnx.Rngs | None = None, params: Mapping[str, Any] | None = None,
                 kernels: Kernels = "auto", param_dtype=None, dtype=None, tensor_axis: str = TENSOR,
                 data_axis: str = DATA, mesh: Mesh | None = None):
        check_config_type(config)
        check_kernels(kernels)
        if dtype is not None and jnp.dtype(dtype) != config.jnp_dtype:
            raise ValueError(f"dtype={jnp.dtype(dtype).name} differs from config.dtype={config.dtype!r}: the "
                             f"computation dtype is the config's; use dataclasses.replace(config, dtype=...)")
        if param_dtype is not None:
            pd = jnp.dtype(param_dtype)
            if not jnp.issubdtype(pd, jnp.floating) or is_fp8(pd):
                raise ValueError(f"param_dtype must be a float dtype other than fp8, got {pd.name}")
        if not isinstance(tensor_axis, str) or not isinstance(data_axis, str) or tensor_axis == data_axis:
            raise ValueError(f"tensor_axis and data_axis must be two different names, got {tensor_axis!r}, "
                             f"{data_axis!r}")
        if params is None:
            if rngs is None:
                raise ValueError("SparseMLA needs rngs (random init) or params (e.g. from params_from_hf)")
            params = init_params(config, rngs.params())
        check_params(params, config)
        if mesh is None:  # the mesh of an enclosing jax.set_mesh, if any
            context = jax.sharding.get_abstract_mesh()
            mesh = None if context.empty else context
        specs = param_specs(config, tensor_axis=tensor_axis)
        if mesh is not None:
            if tensor_axis not in mesh.axis_names:
                raise ValueError(f"the mesh has no axis {tensor_axis!r} (tensor_axis); it has {tuple(mesh.axis_names)}")
            shard_config(config, mesh.shape[tensor_axis])  # heads must divide
        self.config = config
        self.kernels = kernels
        self.tensor_axis = tensor_axis
        self.data_axis = data_axis
        weights = {}
        for name, value in params.items():
            # stored as param_dtype (default: its own, as jax keeps it): refused where that overflows
            stored = jax.dtypes.canonicalize_dtype(value.dtype if param_dtype is None else param_dtype)
            value = jnp.asarray(cast_param(name, value, stored))
            if mesh is not None:
                value = _place(value, specs[name], mesh)
            # eager_sharding=False: the placement is done above (flax's would skip replicated params)
            weights[name] = nnx.Param(value, out_sharding=tuple(specs[name]), eager_sharding=False)
        self.weights = nnx.data(weights)

    @classmethod
    def from_hf(cls, state_dict: Mapping[str, Any], config: MLAConfig, **kwargs) -> "SparseMLA":
        """A layer from a Hugging Face state dict of one attention module (see params_from_hf);
        kwargs as in the constructor (kernels, param_dtype, axis names, mesh)."""
        return cls(config, params=params_from_hf(state_dict, config), **kwargs)

    def params(self) -> dict[str, jax.Array]:
        """The HF-named params dict that model.forward takes."""
        return {name: p[...] for name, p in self.weights.items()}

    def cache_specs(self):
        """PartitionSpecs of a PagedCache for this layer: pages over data_axis (sharding.cache_specs)."""
        return cache_specs(self.config, data_axis=self.data_axis)

    def __call__(self, hidden: jax.Array, cache: PagedCache, meta: BatchMeta, plan: BatchPlan
                 ) -> tuple[jax.Array, PagedCache]:
        """model.forward with this layer's params, config and kernels: hidden [plan.num_tokens,
        hidden_size] (rows in plan_batch's order, padding last) -> (out [plan.num_tokens,
        hidden_size] in config.dtype, new cache). plan (static under jit) and meta from
        plan_batch(..., num_pages=cache.num_pages); donate the cache under jit."""
        return forward(self.params(), hidden, cache, meta, plan=plan, config=self.config, kernels=self.kernels)

    def sharded(self, hidden, cache, meta, plan, *, mesh: Mesh):
        """sharding.sharded_forward over `mesh` with this layer's axis names (plan from plan_data_parallel)."""
        return sharded_forward(self.params(), hidden, cache, meta, mesh=mesh, plan=plan, config=self.config,
                               kernels=self.kernels, data_axis=self.data_axis, tensor_axis=self.tensor_axis)
