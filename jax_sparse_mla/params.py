"""Parameters of one layer: a flat dict keyed by Hugging Face names, arrays in torch [out, in] layout."""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from .config import MLAConfig

HF_PREFIX_MARK = ".self_attn."
FP8_WEIGHT_BLOCK = 128  # weight_scale_inv holds one scale per 128x128 block


def param_shapes(config: MLAConfig) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape, for one attention module (torch [out, in] layout)."""
    c = config
    return {
        "q_a_proj.weight": (c.q_lora_rank, c.hidden_size),
        "q_a_layernorm.weight": (c.q_lora_rank,),
        "q_b_proj.weight": (c.num_attention_heads * c.qk_head_dim, c.q_lora_rank),
        "kv_a_proj_with_mqa.weight": (c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size),
        "kv_a_layernorm.weight": (c.kv_lora_rank,),
        "kv_b_proj.weight": (c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
        "o_proj.weight": (c.hidden_size, c.num_attention_heads * c.v_head_dim),
        "indexer.wq_b.weight": (c.index_n_heads * c.index_head_dim, c.q_lora_rank),
        "indexer.wk.weight": (c.index_head_dim, c.hidden_size),
        "indexer.k_norm.weight": (c.index_head_dim,),
        "indexer.k_norm.bias": (c.index_head_dim,),
        "indexer.weights_proj.weight": (c.index_n_heads, c.hidden_size),
    }


def check_params(params: Mapping[str, Any], config: MLAConfig) -> None:
    """Raises ValueError naming the first missing, misshapen or unexpected parameter."""
    shapes = param_shapes(config)
    for name, shape in shapes.items():
        if name not in params:
            raise ValueError(f"params has no {name!r}")
        if tuple(params[name].shape) != shape:
            raise ValueError(f"params[{name!r}] has shape {tuple(params[name].shape)}, expected {shape}")
    unexpected = sorted(set(params) - set(shapes))
    if unexpected:
        raise ValueError(f"unexpected params: {unexpected}")


def init_params(config: MLAConfig, key: jax.Array) -> dict[str, jax.Array]:
    """Random parameters: projections ~ N(0, 1/fan_in), norm weights near 1, bias near 0."""
    shapes = param_shapes(config)
    keys = dict(zip(shapes, jax.random.split(key, len(shapes))))
    params = {}
    for name, shape in shapes.items():
        k = keys[name]
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            p = 1.0 + 0.1 * jax.random.normal(k, shape)
        elif name.endswith(".bias"):
            p = 0.1 * jax.random.normal(k, shape)
        else:
            p = jax.random.normal(k, shape) * shape[1] ** -0.5
        params[name] = p.astype(config.jnp_dtype)
    return params


def dequantize_fp8_weight(weight, scale_inv) -> np.ndarray:
    """fp8 weight [out, in] with one fp32 scale per 128x128 block -> float32 (w * scale)."""
    w = np.asarray(weight).astype(np.float32)
    s = np.asarray(scale_inv, dtype=np.float32)
    rows, cols = w.shape
    expected = (-(-rows // FP8_WEIGHT_BLOCK), -(-cols // FP8_WEIGHT_BLOCK))
    if s.shape != expected:
        raise ValueError(f"weight_scale_inv has shape {s.shape}, expected {expected} for a weight of shape {w.shape}")
    full = np.repeat(np.repeat(s, FP8_WEIGHT_BLOCK, 0), FP8_WEIGHT_BLOCK, 1)[:rows, :cols]
    return w * full


def params_from_hf(state_dict: Mapping[str, Any], config: MLAConfig) -> dict[str, jax.Array]:
    """Builds params from a Hugging Face state dict of one attention module.

    Keys may carry a `model.layers.N.self_attn.` prefix. fp8 weights come with a
    `<name>_scale_inv` tensor (`q_a_proj.weight_scale_inv`) and are dequantized. Missing, misshapen
    or unexpected tensors raise ValueError naming them.
    """
    local = {}
    for key, value in state_dict.items():
        name = key.split(HF_PREFIX_MARK, 1)[1] if HF_PREFIX_MARK in key else key
        if name in local:
            raise ValueError(f"tensor {name!r} appears twice in the state dict")
        local[name] = value
    shapes = param_shapes(config)
    missing = sorted(set(shapes) - set(local))
    if missing:
        raise ValueError(f"missing tensors: {missing}")
    unexpected = sorted(set(local) - set(shapes) - {n + "_scale_inv" for n in shapes})
    if unexpected:
        raise ValueError(f"unexpected tensors: {unexpected}")
    params = {}
    for name, shape in shapes.items():
        value = local[name]
        if name + "_scale_inv" in local:
            value = dequantize_fp8_weight(value, local[name + "_scale_inv"])
        elif str(getattr(value, "dtype", "")).startswith("float8"):
            raise ValueError(f"tensor {name!r} is fp8 but has no {name}_scale_inv")
        if tuple(value.shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(value.shape)}, expected {shape}")
        params[name] = jnp.asarray(np.asarray(value, dtype=np.float32)).astype(config.jnp_dtype)
    return params
