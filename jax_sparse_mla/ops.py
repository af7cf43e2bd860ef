"""Elementwise math of the layer, shared by the fast path and the reference.

Each function follows DeepSeek-V3.2's reference inference code; computation is in float32
whatever the input dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from .config import MLAConfig

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0


def cast_rounded(x, dtype):
    """x cast to a narrower storage dtype, kept rounded when cast back up.

    XLA on GPU folds a cast round trip (f32 -> fp8 -> f32) inside one program into nothing
    (excess precision), which would silently skip quantisation; the barrier keeps it.
    """
    return jax.lax.optimization_barrier(x.astype(dtype))


def matmul_precision(dtype):
    """HIGHEST for float32 operands, DEFAULT otherwise: float32 computations serve as oracles, and a
    GPU runs DEFAULT float32 matmuls in tf32 (~1e-3 relative)."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def rms_norm(x, weight, eps):
    """RMSNorm over the last axis. x: [..., D], weight: [D]."""
    x = x.astype(jnp.float32)
    x = x * jnp.reciprocal(jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps))
    return x * weight.astype(jnp.float32)


def layer_norm(x, weight, bias, eps):
    """LayerNorm over the last axis. x: [..., D], weight and bias: [D]."""
    x = x.astype(jnp.float32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * weight.astype(jnp.float32) + bias.astype(jnp.float32)


def rope_frequencies(config: MLAConfig) -> np.ndarray:
    """Rotation frequencies [qk_rope_head_dim // 2] with YaRN applied (DeepSeek's precompute_freqs_cis)."""
    dim, base = config.qk_rope_head_dim, config.rope_theta
    freqs = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    rs = config.rope_scaling
    if rs is not None:
        def correction_dim(rotations):
            return dim * math.log(rs.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(rs.beta_fast)), 0)
        high = min(math.ceil(correction_dim(rs.beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        smooth = 1 - ramp
        freqs = freqs / rs.factor * (1 - smooth) + freqs * smooth
    return freqs.astype(np.float32)


def _cos_sin(positions, config):
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_frequencies(config))
    return jnp.cos(angles), jnp.sin(angles)


def rope_interleaved(x, positions, config: MLAConfig):
    """MLA rope: rotates pairs (2i, 2i+1). x: [T, ..., R], positions: [T]."""
    cos, sin = _cos_sin(positions, config)
    cos = cos.reshape(cos.shape[:1] + (1,) * (x.ndim - 2) + cos.shape[1:])
    sin = sin.reshape(cos.shape)
    x = x.astype(jnp.float32)
    even, odd = x[..., 0::2], x[..., 1::2]
    return jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1).reshape(x.shape)


def rope_neox_prefix(x, positions, config: MLAConfig):
    """Indexer rope: NeoX (half split) rotation of the first qk_rope_head_dim dims.

    x: [T, ..., D], positions: [T]; dims past qk_rope_head_dim pass through.
    """
    r = config.qk_rope_head_dim
    cos, sin = _cos_sin(positions, config)
    cos = cos.reshape(cos.shape[:1] + (1,) * (x.ndim - 2) + cos.shape[1:])
    sin = sin.reshape(cos.shape)
    x = x.astype(jnp.float32)
    a, b, rest = x[..., : r // 2], x[..., r // 2 : r], x[..., r:]
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos, rest], axis=-1)


def hadamard_matrix(n: int) -> np.ndarray:
    """Sylvester Hadamard matrix [n, n] scaled by n^-0.5 (orthonormal)."""
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h * np.float32(n ** -0.5)


def hadamard(x):
    """Orthonormal Hadamard transform of the last axis (a power of two)."""
    # HIGHEST: a TF32 product on GPU would move values across fp8 rounding boundaries.
    return jnp.matmul(x.astype(jnp.float32), jnp.asarray(hadamard_matrix(x.shape[-1])),
                      precision=jax.lax.Precision.HIGHEST)


def power_of_two_scale(amax):
    """DeepSeek's ue8m0 fp8 scale: max(amax, 1e-4) / 448 rounded UP to a power of two (float32).

    Exact: frexp/ldexp, not exp2(ceil(log2())), which is approximate on CPU. An amax of exactly
    448 * 2^k gives 2^k; anything above it 2^(k + 1).
    """
    amax = jnp.maximum(amax.astype(jnp.float32), 1e-4)
    mantissa, exponent = jnp.frexp(amax / FP8_MAX)  # value = mantissa * 2^exponent, mantissa in [0.5, 1)
    return jnp.ldexp(jnp.ones_like(amax), jnp.where(mantissa == 0.5, exponent - 1, exponent))


def act_quant(x):
    """DeepSeek's fp8 act_quant over the last axis with power-of-two (ue8m0) scales.

    Returns (e4m3 values [..., D], fp32 scales [...]) with x ~= values * scale: scale =
    power_of_two_scale(amax of the row), values = clamp(x / scale, +-448) cast to e4m3 (x / scale is
    exact, a power-of-two division, so the cast is the only rounding).
    """
    x = x.astype(jnp.float32)
    scale = power_of_two_scale(jnp.max(jnp.abs(x), axis=-1))
    values = cast_rounded(jnp.clip(x / scale[..., None], -FP8_MAX, FP8_MAX), FP8_DTYPE)
    return values, scale


def quantize_tiles(x, tile: int):
    """Per-tile fp8 quantization of the last axis: act_quant over each run of `tile` values.

    The fp8 latent cache's format (FlashMLA's 656-byte layout for R=512; DeepSeek-V3.2-Exp's
    reference and FlashMLA's tests quantise it this way): each tile gets its own power-of-two (ue8m0)
    scale, max(amax, 1e-4) / 448 rounded up, and values clamp(x / scale, +-448) in e4m3.
    x: [..., D] with D % tile == 0 -> (e4m3 [..., D], fp32 scales [..., D // tile]).
    """
    x = x.astype(jnp.float32)
    values, scale = act_quant(x.reshape(x.shape[:-1] + (x.shape[-1] // tile, tile)))
    return values.reshape(x.shape), scale
