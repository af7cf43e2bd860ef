"""The elementwise math against independent numpy formulations."""

import math

import jax.numpy as jnp
import ml_dtypes
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


def deepseek_tile_quant(x, tile):
    """DeepSeek's ue8m0 act_quant of each `tile` values, re-implemented in numpy / float64.

    scale = 2^ceil(log2(max(amax, 1e-4) / 448)) (exact, through math.frexp), values =
    clip(x / scale, -448, 448) in e4m3. Independent of ops (no jax).
    """
    tiles = np.asarray(x, np.float64).reshape(x.shape[:-1] + (x.shape[-1] // tile, tile))
    amax = np.maximum(np.abs(tiles).max(-1), 1e-4) / 448.0
    scale = np.empty(amax.shape, np.float64)
    for i, a in np.ndenumerate(amax):
        m, e = math.frexp(a)  # a = m * 2^e, m in [0.5, 1): a power of two iff m == 0.5
        scale[i] = math.ldexp(1.0, e - 1 if m == 0.5 else e)
    values = np.clip(tiles / scale[..., None], -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)
    return values.reshape(x.shape), scale.astype(np.float32)


def _hard_tiles(rng, tile):
    """Rows of 2 tiles: random magnitudes over 1e-9..1e5, and the edge cases."""
    t = np.finfo(np.float32)
    rows = [rng.standard_normal((64, 2 * tile)) * np.exp(rng.uniform(np.log(1e-9), np.log(1e5), (64, 2 * tile)))]
    rows.append(rng.standard_normal((16, 2 * tile)) * 10.0 ** rng.integers(-8, 6, (16, 1)))  # one magnitude a row
    edge = np.zeros((12, 2 * tile))  # row 0: all-zero tiles
    edge[1] = rng.standard_normal(2 * tile) * 1e-7  # tiny: under the 1e-4 amax floor
    edge[2] = rng.standard_normal(2 * tile) * 1e-30
    for r, k in zip(range(3, 7), (-3, 0, 1, 7)):  # amax exactly 448 * 2^k (scale 2^k, not 2^(k+1))
        edge[r] = rng.uniform(-1, 1, 2 * tile) * 448 * 2.0 ** k
        edge[r, 5] = -448 * 2.0 ** k
        edge[r, tile + 9] = 448 * 2.0 ** k
    edge[7] = 448 * np.nextafter(np.float32(1), np.float32(2)) * np.sign(rng.standard_normal(2 * tile))  # just above
    edge[8] = rng.uniform(440, 448, 2 * tile) * np.sign(rng.standard_normal(2 * tile))  # near the clamp
    edge[9] = -np.abs(rng.standard_normal(2 * tile)) * 3.0  # all negative
    edge[10, :tile] = 1e-4  # exactly the floor
    edge[10, tile:] = t.tiny  # smallest normal f32
    edge[11] = np.where(rng.random(2 * tile) < 0.5, 1e4, -1e-6)  # wide range inside a tile
    rows.append(edge)
    return np.concatenate(rows).astype(np.float32)


def test_quantize_tiles_is_deepseeks_ue8m0_act_quant_byte_exact():
    """The fp8 latent cache's format: same e4m3 bytes and fp32 scales as the numpy quantiser."""
    rng = np.random.default_rng(4)
    x = _hard_tiles(rng, 128)
    values, scale = ops.quantize_tiles(jnp.asarray(x), 128)
    want_values, want_scale = deepseek_tile_quant(x, 128)
    assert values.dtype == jnp.float8_e4m3fn and scale.dtype == jnp.float32 and scale.shape == (len(x), 2)
    np.testing.assert_array_equal(np.asarray(scale).view(np.uint32), want_scale.view(np.uint32))
    np.testing.assert_array_equal(np.asarray(values).view(np.uint8), want_values.view(np.uint8))
    # the edge rows: exact powers of two times 448 keep scale 2^k; the all-zero tile the floor's
    k_rows = len(x) - 12 + np.arange(3, 7)
    np.testing.assert_array_equal(np.asarray(scale)[k_rows], np.repeat(2.0 ** np.array([-3, 0, 1, 7]), 2).reshape(4, 2))
    assert np.all(np.asarray(scale)[len(x) - 12] == 2.0 ** -22)  # 1e-4 / 448 = 2^-22.09 -> 2^-22
    # and act_quant is the same quantiser over a whole row
    rv, rs = ops.act_quant(jnp.asarray(x[:, :128]))
    np.testing.assert_array_equal(np.asarray(rs), want_scale[:, 0])
    np.testing.assert_array_equal(np.asarray(rv).view(np.uint8), want_values[:, :128].view(np.uint8))


def test_quantize_tiles_round_trip_and_scale_per_tile():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 256)).astype(np.float32)
    x[:, 128:] *= 100
    v, s = ops.quantize_tiles(jnp.asarray(x), 128)
    s = np.asarray(s)
    assert s.shape == (5, 2) and np.all(s[:, 1] > 25 * s[:, 0])  # its own scale per tile (x100, to within 2x)
    amax = np.abs(x.reshape(5, 2, 128)).max(-1)
    assert np.all(s >= amax / 448) and np.all(s < 2 * amax / 448)  # rounded up to a power of two, not further
    recon = np.asarray(dequantize_latent(v, s))
    assert np.linalg.norm(recon - x) / np.linalg.norm(x) < 0.05
