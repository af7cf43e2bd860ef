"""The elementwise math against independent numpy formulations."""

import jax.numpy as jnp
import numpy as np

from jax_sparse_mla import MLAConfig, ops
from jax_sparse_mla.kernels import dequantize_latent

CFG = MLAConfig.tiny()


def test_rope_interleaved_is_complex_rotation_of_pairs():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, CFG.qk_rope_head_dim)).astype(np.float32)
    pos = np.array([0, 1, 7, 30, 100])
    got = np.asarray(ops.rope_interleaved(jnp.asarray(x), jnp.asarray(pos), CFG))
    freqs = ops.rope_frequencies(CFG)
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * pos[:, None, None] * freqs)
    want = np.stack([z.real, z.imag], -1).reshape(x.shape)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_rope_neox_rotates_half_split_of_the_prefix_only():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 2, CFG.index_head_dim)).astype(np.float32)
    pos = np.array([0, 3, 17, 64])
    got = np.asarray(ops.rope_neox_prefix(jnp.asarray(x), jnp.asarray(pos), CFG))
    r = CFG.qk_rope_head_dim
    z = (x[..., : r // 2] + 1j * x[..., r // 2:r]) * np.exp(1j * pos[:, None, None] * ops.rope_frequencies(CFG))
    np.testing.assert_allclose(got[..., : r // 2], z.real, atol=1e-5)
    np.testing.assert_allclose(got[..., r // 2:r], z.imag, atol=1e-5)
    np.testing.assert_array_equal(got[..., r:], x[..., r:])


def test_yarn_frequencies_interpolate_only_low_frequencies():
    real = MLAConfig.deepseek_v32()
    f = ops.rope_frequencies(real)
    base = 1.0 / 10000 ** (np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(f[:10], base[:10], rtol=1e-6)  # high frequencies kept
    np.testing.assert_allclose(f[-4:], base[-4:] / 40, rtol=1e-6)  # low ones divided by the factor


def test_hadamard_is_orthonormal_and_sylvester():
    h = ops.hadamard_matrix(16)
    np.testing.assert_allclose(h @ h.T, np.eye(16), atol=1e-6)
    assert np.all(np.abs(h) == np.float32(0.25)) and np.all(h[0] > 0) and np.all(h[:, 0] > 0)


def test_act_quant_power_of_two_scales_and_reconstruction():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 128)).astype(np.float32) * np.array([1e-6, 1e-2, 1, 10, 300, 5e4])[:, None]
    values, scale = ops.act_quant(jnp.asarray(x))
    scale = np.asarray(scale)
    assert values.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.log2(scale), np.round(np.log2(scale)))  # ue8m0
    amax = np.maximum(np.abs(x).max(-1), 1e-4)
    assert np.all(scale >= amax / 448) and np.all(scale < 2 * amax / 448)  # rounded up, not further
    recon = np.asarray(values, np.float32) * scale[:, None]
    big = amax > 1e-3  # rows above the 1e-4 amax floor quantize with e4m3's ~6% relative step
    assert np.all(np.abs(recon - x)[big] <= 0.07 * np.abs(x)[big] + scale[big, None] * 2 ** -9)


def test_quantize_tiles_round_trip_and_scale_per_tile():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 256)).astype(np.float32)
    x[:, 128:] *= 100
    v, s = ops.quantize_tiles(jnp.asarray(x), 128)
    assert s.shape == (5, 2) and np.all(np.asarray(s[:, 1]) > 50 * np.asarray(s[:, 0]))
    recon = np.asarray(dequantize_latent(v, s))
    assert np.linalg.norm(recon - x) / np.linalg.norm(x) < 0.05
