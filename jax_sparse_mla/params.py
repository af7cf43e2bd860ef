"""Parameters of one layer: a flat dict keyed by Hugging Face names, arrays in torch [out, in] layout."""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from .config import MLAConfig, check_config_type
from .validate import array_dtype, check_type

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


def is_fp8(dtype) -> bool:
    return np.dtype(dtype).name.startswith("float8")


def check_arrays(arrays: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], what: str) -> None:
    """Raises ValueError naming `what` if it is not a dict, else its first missing, non-array,
    non-float (fp8 included), misshapen or unexpected entry (`what[name]`). Each entry must be
    an array (numpy, jax, or a ShapeDtypeStruct / tracer) of float16, bfloat16, float32 or
    float64 with the shape `shapes[name]`."""
    check_type(arrays, what, Mapping, "a dict of arrays")
    for name, shape in shapes.items():
        if name not in arrays:
            raise ValueError(f"{what} has no {name!r}")
        value = arrays[name]
        dtype = array_dtype(value)
        if dtype is None:
            raise ValueError(f"{what}[{name!r}] is a {type(value).__name__}, not an array")
        if not jnp.issubdtype(dtype, jnp.floating) or is_fp8(dtype):
            raise ValueError(f"{what}[{name!r}] has dtype {dtype}, expected a floating dtype "
                             f"(float16, bfloat16, float32 or float64; fp8 weights go through params_from_hf)")
        if tuple(value.shape) != shape:
            raise ValueError(f"{what}[{name!r}] has shape {tuple(value.shape)}, expected {shape}")
    unexpected = sorted(set(arrays) - set(shapes), key=str)
    if unexpected:
        raise ValueError(f"unexpected {what}: {unexpected}")


def check_params(params: Mapping[str, Any], config: MLAConfig, what: str = "params") -> None:
    """Raises ValueError naming `config` if it is not an MLAConfig, else as check_arrays with
    param_shapes(config) (fp8 weights are dequantized by params_from_hf, not taken here). Values
    are not read (see check_finite)."""
    check_config_type(config)
    check_arrays(params, param_shapes(config), what)


@jax.jit
def _all_finite(arrays):
    return {name: jnp.all(jnp.isfinite(a)) for name, a in arrays.items()}


def check_finite(arrays: Mapping[str, Any], what: str) -> None:
    """Raises ValueError naming the first array of the dict `arrays` (float arrays, as
    check_arrays checks them; `what` names the dict) that holds a NaN or an infinity. Reads the
    values: one device program over the concrete arrays (abstract values and tracers are skipped)."""
    concrete = {name: a for name, a in arrays.items()
                if isinstance(a, (np.ndarray, jax.Array)) and not isinstance(a, jax.core.Tracer)}
    finite = jax.device_get(_all_finite(concrete))
    for name in concrete:
        if not finite[name]:
            raise ValueError(f"{what}[{name!r}] has non-finite values (NaN or inf)")


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


def _check_scale(name: str, weight_shape: tuple[int, ...], scale) -> np.ndarray:
    """weight_scale_inv as float32 [ceil(out/128), ceil(in/128)]; ValueError naming `name` otherwise."""
    if len(weight_shape) != 2:
        raise ValueError(f"tensor {name!r} has a weight_scale_inv but is {len(weight_shape)}-D "
                         f"(shape {tuple(weight_shape)}); only 2-D weights are fp8 with block scales")
    dtype = array_dtype(scale)
    if dtype is None:
        raise ValueError(f"tensor {name}_scale_inv is a {type(scale).__name__}, not an array")
    if not jnp.issubdtype(dtype, jnp.floating) or is_fp8(dtype):
        raise ValueError(f"tensor {name}_scale_inv has dtype {dtype}, expected float32 (or another non-fp8 float)")
    rows, cols = weight_shape
    expected = (-(-rows // FP8_WEIGHT_BLOCK), -(-cols // FP8_WEIGHT_BLOCK))
    if tuple(scale.shape) != expected:
        raise ValueError(f"tensor {name}_scale_inv has shape {tuple(scale.shape)}, expected {expected} "
                         f"for a weight of shape {tuple(weight_shape)}")
    s = np.asarray(scale, dtype=np.float32)
    if not np.all(np.isfinite(s)) or np.any(s < 0):  # 0 is an all-zero block's scale
        raise ValueError(f"tensor {name}_scale_inv has non-finite or negative scales")
    return s


def dequantize_fp8_weight(weight, scale_inv, name: str = "weight") -> np.ndarray:
    """fp8 weight [out, in] with one fp32 scale per 128x128 block -> float32 (w * scale)."""
    shape = tuple(np.shape(weight))
    s = _check_scale(name, shape, scale_inv)
    w = np.asarray(weight).astype(np.float32)
    rows, cols = shape
    full = np.repeat(np.repeat(s, FP8_WEIGHT_BLOCK, 0), FP8_WEIGHT_BLOCK, 1)[:rows, :cols]
    return w * full


def cast_param(name: str, value, dtype):
    """A weight cast to `dtype` (numpy stays numpy, on the host; a jax array stays a jax array),
    refused (ValueError naming tensor `name`) where the cast result is not finite: a non-finite
    value, or a finite one beyond dtype's range (3.4e38 float32 is inf in bfloat16, 1e5 in
    float16). The check is of the result, so no cast stores inf from finite weights. Under a
    trace (a jax tracer) the values are unknown and the cast is unchecked."""
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused below, by name
        out = value.astype(dtype)
    if isinstance(out, jax.core.Tracer):
        return out
    xp = np if isinstance(out, np.ndarray) else jnp
    if bool(xp.all(xp.isfinite(out))):
        return out
    if not bool(xp.all(xp.isfinite(value))):
        raise ValueError(f"tensor {name!r} has non-finite values")
    raise ValueError(f"tensor {name!r} overflows {np.dtype(dtype).name}: its largest magnitude is "
                     f"{float(xp.max(xp.abs(value))):.6g}, {np.dtype(dtype).name} holds at most "
                     f"{float(jnp.finfo(dtype).max):.6g}")


def hf_tensor_to_param(name: str, value, scale_inv, config: MLAConfig) -> np.ndarray:
    """One checked HF tensor as a parameter, on the host: fp8 dequantised with its block scales
    (scale_inv; None for other dtypes), cast to config.dtype and refused if the result is not
    finite (cast_param: a non-finite weight, or one beyond config.dtype's range)."""
    if scale_inv is not None:
        value = dequantize_fp8_weight(value, scale_inv, name)
    return cast_param(name, np.asarray(value), config.jnp_dtype)


def params_from_hf(state_dict: Mapping[str, Any], config: MLAConfig) -> dict[str, jax.Array]:
    """Builds params from a Hugging Face state dict of one attention module.

    Keys may carry a `model.layers.N.self_attn.` prefix. fp8 weights come with a
    `<name>_scale_inv` tensor (`q_a_proj.weight_scale_inv`, finite, >= 0, float) and are
    dequantized; other tensors must be float16 / bfloat16 / float32 / float64. Missing, misshapen,
    non-float or unexpected tensors raise ValueError naming them.
    """
    local = {}
    for key, value in state_dict.items():
        if not isinstance(key, str):
            raise ValueError(f"state dict key {key!r} is not a str")
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
        dtype = array_dtype(value)
        if dtype is None:
            raise ValueError(f"tensor {name!r} is a {type(value).__name__}, not an array")
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"tensor {name!r} has dtype {dtype}: weights must be floating point "
                             "(float16, bfloat16, float32, float64, or fp8 with a weight_scale_inv)")
        if tuple(value.shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(value.shape)}, expected {shape}")
        if name + "_scale_inv" in local:
            if len(shape) != 2:
                raise ValueError(f"tensor {name!r} has a {name}_scale_inv but is {len(shape)}-D (shape {shape}); "
                                 "only 2-D weights are fp8 with block scales")
            if not is_fp8(dtype):
                raise ValueError(f"tensor {name!r} has a {name}_scale_inv but is {dtype}, not fp8")
        elif is_fp8(dtype):
            raise ValueError(f"tensor {name!r} is fp8 but has no {name}_scale_inv")
        params[name] = jnp.asarray(hf_tensor_to_param(name, value, local.get(name + "_scale_inv"), config))
    return params
