"""MLAConfig validation and HF loading, params_from_hf (fp8 blocks included)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sparse_mla import MLAConfig, RopeScaling, init_params, params_from_hf
from jax_sparse_mla.params import dequantize_fp8_weight, param_shapes
from tests.conftest import quantize_fp8_blocks

TINY = MLAConfig.tiny()


def test_deepseek_v32_dimensions_and_scale():
    c = MLAConfig.deepseek_v32()
    assert (c.hidden_size, c.num_attention_heads, c.kv_lora_rank, c.index_topk) == (7168, 128, 512, 2048)
    assert c.latent_dim == 576 and c.qk_head_dim == 192
    assert abs(c.softmax_scale - 0.13523) < 1e-5


def test_from_hf_config_reads_known_keys_and_ignores_others():
    hf = {"hidden_size": 7168, "num_attention_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
          "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "index_n_heads": 64,
          "index_head_dim": 128, "index_topk": 2048, "rope_theta": 10000, "rms_norm_eps": 1e-6,
          "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                           "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
          "vocab_size": 129280, "num_hidden_layers": 61, "architectures": ["DeepseekV32ForCausalLM"]}
    c = MLAConfig.from_hf_config(hf)
    assert c == MLAConfig.deepseek_v32(rope_theta=10000, rope_scaling=RopeScaling(factor=40, beta_fast=32, beta_slow=1))
    assert hash(c) == hash(MLAConfig.from_hf_config(hf))
    assert MLAConfig.from_hf_config(hf, kv_cache_dtype="fp8").kv_cache_dtype == "fp8"


@pytest.mark.parametrize("overrides,message", [
    ({"kv_cache_dtype": "int8"}, "kv_cache_dtype"),
    ({"indexer_dtype": "fp16"}, "indexer_dtype"),
    ({"dtype": "float16"}, "dtype"),
    ({"qk_rope_head_dim": 7}, "even"),
    ({"index_head_dim": 24}, "power of two"),
    ({"kv_lora_rank": 96, "kv_cache_dtype": "fp8"}, "multiple of 128"),
    ({"index_topk": 0}, "index_topk"),
    ({"qk_rope_head_dim": 32}, "index_head_dim must be >= qk_rope_head_dim"),
])
def test_invalid_configs_raise(overrides, message):
    with pytest.raises(ValueError, match=message):
        MLAConfig.tiny(**overrides)


def test_unsupported_rope_scaling_raises():
    with pytest.raises(ValueError, match="rope_scaling type 'linear'"):
        MLAConfig.from_hf_config({"rope_scaling": {"type": "linear", "factor": 2}})


def test_params_from_hf_round_trip_with_prefix_and_fp8_blocks():
    cfg = dataclasses.replace(TINY, hidden_size=200)  # 200 columns: a partial 128-block
    params = init_params(cfg, jax.random.key(0))
    state = {f"model.layers.3.self_attn.{k}": np.asarray(v) for k, v in params.items()}
    fp8_names = ["q_a_proj.weight", "kv_b_proj.weight", "indexer.wk.weight"]
    for name in fp8_names:
        w, s = quantize_fp8_blocks(np.asarray(params[name], np.float32))
        state[f"model.layers.3.self_attn.{name}"] = w
        state[f"model.layers.3.self_attn.{name}_scale_inv"] = s
    loaded = params_from_hf(state, cfg)
    assert set(loaded) == set(params)
    for name in params:
        err = float(jnp.linalg.norm(loaded[name] - params[name]) / jnp.linalg.norm(params[name]))
        assert err < (0.05 if name in fp8_names else 1e-7), (name, err)
        if name in fp8_names:  # dequantized with the right block's scale: e4m3 has ~3 bits of mantissa
            assert err > 1e-4


def test_dequantize_uses_each_blocks_own_scale():
    w = jnp.ones((130, 260), jnp.float8_e4m3fn)
    scale = np.arange(1, 7, dtype=np.float32).reshape(2, 3)
    d = dequantize_fp8_weight(w, scale)
    assert d[0, 0] == 1 and d[0, 128] == 2 and d[0, 259] == 3 and d[129, 0] == 4 and d[129, 259] == 6


@pytest.mark.parametrize("mutate,message", [
    (lambda s: s.pop("o_proj.weight"), "missing tensors: \\['o_proj.weight'\\]"),
    (lambda s: s.update({"q_a_proj.weight": np.zeros((3, 3))}), "'q_a_proj.weight' has shape"),
    (lambda s: s.update({"gate.weight": np.zeros(3)}), "unexpected tensors: \\['gate.weight'\\]"),
    (lambda s: s.update({"indexer.wk.weight": jnp.zeros(param_shapes(TINY)["indexer.wk.weight"], jnp.float8_e4m3fn)}),
     "no indexer.wk.weight_scale_inv"),
])
def test_params_from_hf_errors_name_the_tensor(mutate, message):
    state = {k: np.asarray(v) for k, v in init_params(TINY, jax.random.key(0)).items()}
    mutate(state)
    with pytest.raises(ValueError, match=message):
        params_from_hf(state, TINY)
