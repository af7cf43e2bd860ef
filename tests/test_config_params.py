"""MLAConfig validation and HF loading, params_from_hf (fp8 blocks included)."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sparse_mla import MLAConfig, RopeScaling, init_params, params_from_hf
from jax_sparse_mla.params import dequantize_fp8_weight, param_shapes
from tests.support import quantize_fp8_blocks

TINY = MLAConfig.tiny()
# what a DeepSeek-V3.2 config.json has beside the fields a test is about
DSA = {"model_type": "deepseek_v32", "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048}


def _from_hf(hf, **overrides):
    """MLAConfig.from_hf_config of a DSA config with hf's keys."""
    return MLAConfig.from_hf_config({**DSA, **hf}, **overrides)


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
        _from_hf({"rope_scaling": {"type": "linear", "factor": 2}})


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


@pytest.mark.parametrize("dtype,source,value", [
    ("bfloat16", np.float32, 3.4e38),     # finite in float32, rounds to inf in bfloat16
    ("bfloat16", np.float32, -3.4e38),
    ("bfloat16", np.float64, 1e300),
    ("float32", np.float64, 1e39),        # finite in float64, inf in float32
    ("float32", np.float64, -3.5e38),
])
def test_params_from_hf_refuses_weights_that_overflow_the_config_dtype(dtype, source, value):
    """The finiteness check is of the cast weights: one that overflows config.dtype is refused by
    name, not stored as inf."""
    config = dataclasses.replace(TINY, dtype=dtype)
    state = {k: np.array(v, source) for k, v in init_params(TINY, jax.random.key(0)).items()}
    state["kv_b_proj.weight"][3, 5] = value
    with pytest.raises(ValueError, match=f"tensor 'kv_b_proj.weight' overflows {dtype}"):
        params_from_hf(state, config)
    state["kv_b_proj.weight"][3, 5] = 1e30  # fits
    assert np.isfinite(np.asarray(params_from_hf(state, config)["kv_b_proj.weight"], np.float32)).all()
    state["kv_b_proj.weight"][3, 5] = np.inf  # a non-finite source says so
    with pytest.raises(ValueError, match="tensor 'kv_b_proj.weight' has non-finite values"):
        params_from_hf(state, config)


# ---- refusing wrongly typed weights and configs -------------------------------------------------

@pytest.mark.parametrize("value,message", [
    (np.zeros((64, 64), np.int8), "has dtype int8, expected a floating dtype"),
    (np.zeros((64, 64), bool), "has dtype bool, expected a floating dtype"),
    (np.zeros((64, 64), np.complex64), "has dtype complex64"),
    (jnp.zeros((64, 64), jnp.float8_e4m3fn), "has dtype float8_e4m3fn.*params_from_hf"),
    ([[0.0] * 64] * 64, "is a list, not an array"),
    (1.0, "is a float, not an array"),
    ("weights", "is a str, not an array"),
])
def test_check_params_refuses_non_float_and_non_arrays(value, message):
    from jax_sparse_mla.params import check_params
    params = dict(init_params(TINY, jax.random.key(0)))
    check_params(params, TINY)
    check_params({k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in params.items()}, TINY)  # abstract is fine
    params["o_proj.weight"] = value
    with pytest.raises(ValueError, match=r"params\['o_proj.weight'\] " + message):
        check_params(params, TINY)


def _hf_state():
    return {k: np.asarray(v) for k, v in init_params(TINY, jax.random.key(0)).items()}


def _fp8(name):
    w, s = quantize_fp8_blocks(np.asarray(init_params(TINY, jax.random.key(0))[name], np.float32))
    return {name: w, name + "_scale_inv": s}


@pytest.mark.parametrize("mutate,message", [
    (lambda s: s.update({"o_proj.weight": np.ones((64, 64), np.int8)}), "'o_proj.weight' has dtype int8: weights must be floating"),
    (lambda s: s.update({"kv_a_layernorm.weight": np.ones(128, bool)}), "'kv_a_layernorm.weight' has dtype bool"),
    (lambda s: s.update({"o_proj.weight": np.ones((64, 64), np.int32),
                         "o_proj.weight_scale_inv": np.ones((1, 1), np.float32)}), "'o_proj.weight' has dtype int32"),
    (lambda s: s.update({"o_proj.weight": [[1.0]]}), "'o_proj.weight' is a list, not an array"),
    (lambda s: s.update({"indexer.k_norm.bias": np.full(16, np.nan, np.float32)}), "'indexer.k_norm.bias' has non-finite"),
    # weight_scale_inv: beside a 1-D tensor, beside a non-fp8 weight, not float, not finite, negative, misshapen
    (lambda s: s.update({"q_a_layernorm.weight_scale_inv": np.ones((1,), np.float32)}),
     "'q_a_layernorm.weight' has a q_a_layernorm.weight_scale_inv but is 1-D"),
    (lambda s: s.update({"o_proj.weight_scale_inv": np.ones((1, 1), np.float32)}),
     "'o_proj.weight' has a o_proj.weight_scale_inv but is float32, not fp8"),
    (lambda s: s.update({**_fp8("o_proj.weight"), "o_proj.weight_scale_inv": np.ones((1, 1), np.int32)}),
     "o_proj.weight_scale_inv has dtype int32"),
    (lambda s: s.update({**_fp8("o_proj.weight"), "o_proj.weight_scale_inv": np.full((1, 1), np.inf, np.float32)}),
     "o_proj.weight_scale_inv has non-finite or negative"),
    (lambda s: s.update({**_fp8("o_proj.weight"), "o_proj.weight_scale_inv": -np.ones((1, 1), np.float32)}),
     "o_proj.weight_scale_inv has non-finite or negative"),
    (lambda s: s.update({**_fp8("o_proj.weight"), "o_proj.weight_scale_inv": np.ones((1, 2), np.float32)}),
     r"o_proj.weight_scale_inv has shape \(1, 2\), expected \(1, 1\)"),
])
def test_params_from_hf_refuses_non_float_weights_and_bad_scales(mutate, message):
    state = _hf_state()
    mutate(state)
    with pytest.raises(ValueError, match=message):
        params_from_hf(state, TINY)


INT_FIELDS = ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
              "qk_rope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim", "index_topk",
              "max_position_embeddings", "page_size")


def test_every_config_field_is_type_checked():
    assert {f.name for f in dataclasses.fields(MLAConfig)} == set(INT_FIELDS) | {
        "rope_theta", "rms_norm_eps", "rope_scaling", "dtype", "kv_cache_dtype", "indexer_dtype"}
    for field in INT_FIELDS:
        good = getattr(TINY, field)
        for bad in (str(good), float(good), True, None, [good]):
            with pytest.raises(ValueError, match=f"{field} must be an integer"):
                dataclasses.replace(TINY, **{field: bad})
        assert getattr(dataclasses.replace(TINY, **{field: np.int64(good)}), field) == good  # numpy ints are ints
    for field in ("rope_theta", "rms_norm_eps"):
        for bad, message in (("1e4", "must be a real number"), (True, "must be a real number"), (None, "must be a real number"),
                             (float("nan"), "must be finite"), (float("inf"), "must be finite"), (-1.0, "must be positive")):
            with pytest.raises(ValueError, match=f"{field} {message}"):
                dataclasses.replace(TINY, **{field: bad})
    c = dataclasses.replace(TINY, rope_theta=10000)
    assert type(c.rope_theta) is float and c == dataclasses.replace(TINY, rope_theta=10000.0)
    for field in ("dtype", "kv_cache_dtype", "indexer_dtype"):
        for bad in (None, 1, float, jnp.int8, np.dtype(np.float16), "float16", ["float32"]):
            with pytest.raises(ValueError, match=f"{field} must be one of"):
                dataclasses.replace(TINY, **{field: bad})
    with pytest.raises(ValueError, match="rope_scaling must be a RopeScaling"):
        dataclasses.replace(TINY, rope_scaling={"type": "yarn", "factor": 4.0})


@pytest.mark.parametrize("field,value,message", [
    ("hidden_size", "7168", r"hidden_size must be an integer, got .* \(str\)"),
    ("hidden_size", 7168.0, r"hidden_size must be an integer, got .* \(float\)"),
    ("hidden_size", True, r"hidden_size must be an integer, got .* \(bool\)"),
    ("hidden_size", None, r"hidden_size must be an integer, got .* \(NoneType\)"),
    ("rope_theta", "x", "rope_theta must be a real number"),
    ("max_position_embeddings", "163840", "max_position_embeddings must be an integer"),
    ("rms_norm_eps", -1e-6, "rms_norm_eps must be positive"),
])
def test_from_hf_config_refuses_wrongly_typed_fields(field, value, message):
    with pytest.raises(ValueError, match=message):
        _from_hf({field: value})


YARN = {"factor": 8, "original_max_position_embeddings": 2048, "beta_fast": 16, "beta_slow": 2, "mscale": 0.75,
        "mscale_all_dim": 0.75}


def test_from_hf_config_reads_rope_parameters():
    c = _from_hf({"rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0, **YARN}})
    assert c.rope_theta == 50000.0 and c.rope_scaling == RopeScaling(**YARN)
    assert c.rope_scaling.factor == 8.0 and c.rope_scaling.original_max_position_embeddings == 2048
    # the old spelling gives the same config; both may be given when they agree
    old = {"rope_theta": 50000, "rope_scaling": {"type": "yarn", **YARN}}
    assert _from_hf(old) == c
    assert _from_hf({**old, "rope_parameters": {"rope_type": "yarn", "rope_theta": 5e4, **YARN}}) == c
    # "default" (or no rope_type) means no scaling
    c = _from_hf({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert c.rope_theta == 1e6 and c.rope_scaling is None
    assert _from_hf({"rope_parameters": {"rope_theta": 1e6}}).rope_scaling is None
    assert _from_hf({"rope_scaling": None}).rope_scaling is None
    # harmless HF extras are ignored
    extras = {"rope_type": "yarn", **YARN, "truncate": True, "attention_factor": None, "low_freq_factor": 1}
    assert _from_hf({"rope_scaling": extras}).rope_scaling == RopeScaling(**YARN)


@pytest.mark.parametrize("hf,message", [
    ({"rope_theta": 10000.0, "rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0, **YARN}},
     "rope_theta and rope_parameters.rope_theta disagree"),
    ({"rope_scaling": {"type": "yarn", **YARN}, "rope_parameters": {"rope_type": "yarn", **YARN, "factor": 4}},
     "rope_scaling and rope_parameters disagree"),
    ({"rope_scaling": {"type": "yarn", **YARN}, "rope_parameters": {"rope_type": "default"}},
     "rope_scaling and rope_parameters disagree"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8}}, "rope_parameters type 'llama3' is not supported"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 8}}, "rope_parameters type 'dynamic'"),
    ({"rope_scaling": {"factor": 8}}, "rope_scaling type None is not supported"),
    ({"rope_scaling": {"type": "yarn", "rope_type": "linear", **YARN}}, "has type 'yarn' and rope_type 'linear'"),
    ({"rope_parameters": "yarn"}, "rope_parameters must be a JSON object"),
    ({"rope_scaling": ["yarn"]}, "rope_scaling must be a JSON object"),
    ({"rope_scaling": {"type": "yarn", **YARN, "attention_factor": 2.0}}, "attention_factor=2.0 is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": "1e4", **YARN}}, "rope_parameters.rope_theta must be a real"),
])
def test_from_hf_config_refuses_bad_or_conflicting_rope(hf, message):
    with pytest.raises(ValueError, match=message):
        _from_hf(hf)


@pytest.mark.parametrize("key,value,message", [
    ("factor", "4", "factor must be a real number"),
    ("factor", 0, "factor must be positive"),
    ("factor", float("nan"), "factor must be finite"),
    ("original_max_position_embeddings", 4096.0, "original_max_position_embeddings must be an integer"),
    ("original_max_position_embeddings", True, "original_max_position_embeddings must be an integer"),
    ("original_max_position_embeddings", 0, "original_max_position_embeddings must be >= 1"),
    ("beta_fast", None, "beta_fast must be a real number"),
    ("beta_slow", -1, "beta_slow must be positive"),
    ("beta_slow", 64, "beta_fast .* must be >= beta_slow"),
    ("mscale", "1.0", "mscale must be a real number"),
    ("mscale_all_dim", float("inf"), "mscale_all_dim must be finite"),
])
def test_rope_scaling_fields_are_type_checked(key, value, message):
    with pytest.raises(ValueError, match=f"invalid rope_scaling: {message}"):
        RopeScaling.from_hf({"type": "yarn", **YARN, key: value})
    with pytest.raises(ValueError, match=f"invalid rope_parameters: {message}"):
        _from_hf({"rope_parameters": {"rope_type": "yarn", **YARN, key: value}})
    with pytest.raises(ValueError, match=message):
        RopeScaling(**{**YARN, key: value})


def test_softmax_scale_uses_mscale_all_dim():
    base = MLAConfig.tiny(rope_scaling=RopeScaling(factor=40.0, mscale=1.0, mscale_all_dim=1.0))
    m = 0.1 * 1.0 * np.log(40.0) + 1.0
    assert base.softmax_scale == pytest.approx(base.qk_head_dim ** -0.5 * m * m)
    half = MLAConfig.tiny(rope_scaling=RopeScaling(factor=40.0, mscale=0.5, mscale_all_dim=0.5))
    m = 0.1 * 0.5 * np.log(40.0) + 1.0
    assert half.softmax_scale == pytest.approx(half.qk_head_dim ** -0.5 * m * m)
    assert MLAConfig.tiny(rope_scaling=None).softmax_scale == base.qk_head_dim ** -0.5


def test_rope_scaling_refuses_mscale_other_than_mscale_all_dim():
    """HF's DeepSeek rope scales cos / sin by get_mscale(factor, mscale) / get_mscale(factor,
    mscale_all_dim); the rotation here is unscaled, so the two must agree."""
    with pytest.raises(ValueError, match=r"mscale=0.707 != mscale_all_dim=1.0 is not supported"):
        RopeScaling(factor=40.0, mscale=0.707, mscale_all_dim=1.0)
    with pytest.raises(ValueError, match=r"invalid rope_parameters: mscale=0.5 != mscale_all_dim=0.75 is not supported"):
        _from_hf({"rope_parameters": {"rope_type": "yarn", **YARN, "mscale": 0.5}})
    with pytest.raises(ValueError, match=r"invalid rope_scaling: mscale=1.0 != mscale_all_dim=0.0"):
        _from_hf({"rope_scaling": {"type": "yarn", **YARN, "mscale": 1, "mscale_all_dim": 0}})


# ---- what from_hf_config refuses or reads beside the dimensions ------------------------------------

V3_ATTENTION = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 128, "q_lora_rank": 1536,
                "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}


def test_from_hf_config_refuses_configs_without_sparse_attention():
    """A DeepSeek-V3 config has MLA but no indexer: filling in V3.2's indexer defaults would make
    a layer its checkpoint has no weights for."""
    no_indexer = {k: v for k, v in V3_ATTENTION.items() if k != "model_type"}
    with pytest.raises(ValueError, match=r"not a DeepSeek-V3.2 sparse attention \(DSA\) config: it has no "
                                         r"index_n_heads, index_head_dim, index_topk \(the lightning indexer"):
        MLAConfig.from_hf_config(no_indexer)
    with pytest.raises(ValueError, match="it has no index_topk "):
        MLAConfig.from_hf_config({**no_indexer, "index_n_heads": 64, "index_head_dim": 128})
    with pytest.raises(ValueError, match="model_type 'deepseek_v3' is not DeepSeek-V3.2 sparse attention: "
                                         "expected 'deepseek_v32'"):
        MLAConfig.from_hf_config({**V3_ATTENTION, **{k: v for k, v in DSA.items() if k != "model_type"}})
    with pytest.raises(ValueError, match="model_type 'deepseek_v3' is not"):  # checked first
        MLAConfig.from_hf_config(V3_ATTENTION)
    dsa = {k: v for k, v in DSA.items() if k != "model_type"}
    assert MLAConfig.from_hf_config(dsa) == MLAConfig.deepseek_v32()  # no model_type: the keys decide


@pytest.mark.parametrize("hf,overrides,dtype", [
    ({"torch_dtype": "float32"}, {}, "float32"),
    ({"torch_dtype": "bfloat16"}, {}, "bfloat16"),
    ({"dtype": "float32"}, {}, "float32"),                                  # transformers 5's spelling
    ({"torch_dtype": "float32", "dtype": "float32"}, {}, "float32"),
    ({"torch_dtype": None}, {}, "bfloat16"),                                # MLAConfig's default
    ({"torch_dtype": "float16"}, {"dtype": "float32"}, "float32"),          # an override wins
    ({"torch_dtype": "float32"}, {"dtype": jnp.bfloat16}, "bfloat16"),
])
def test_from_hf_config_honours_torch_dtype(hf, overrides, dtype):
    assert _from_hf(hf, **overrides).dtype == dtype


@pytest.mark.parametrize("hf,message", [
    ({"torch_dtype": "float16"}, r"torch_dtype='float16' is not supported: the layer's parameters and activations "
                                 r"\(MLAConfig.dtype\) are one of \('bfloat16', 'float32'\); pass dtype=\.\.\. to choose"),
    ({"dtype": "float8_e4m3fn"}, "dtype='float8_e4m3fn' is not supported"),
    ({"torch_dtype": 16}, "torch_dtype=16 is not supported"),
    ({"torch_dtype": "bfloat16", "dtype": "float32"}, "torch_dtype='bfloat16' and dtype='float32' disagree"),
])
def test_from_hf_config_refuses_an_unsupported_torch_dtype(hf, message):
    with pytest.raises(ValueError, match=message):
        _from_hf(hf)


def test_from_hf_config_reads_a_path(tmp_path):
    hf = {**DSA, "hidden_size": 1024, "torch_dtype": "float32"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    config = MLAConfig.from_hf_config(hf, page_size=16)
    assert config.hidden_size == 1024 and config.dtype == "float32"
    assert MLAConfig.from_hf_config(path, page_size=16) == MLAConfig.from_hf_config(str(path), page_size=16) == config
    # errors name the file
    path.write_text(json.dumps({**hf, "hidden_size": "1024"}))
    with pytest.raises(ValueError, match=f"{path}: invalid MLAConfig: hidden_size must be an integer"):
        MLAConfig.from_hf_config(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match=f"{path} is not valid JSON"):
        MLAConfig.from_hf_config(path)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match=f"{path} must hold a JSON object, got list"):
        MLAConfig.from_hf_config(path)


FORMS = r"must be a dict \(a parsed config.json\) or the path of a config.json \(str or os.PathLike\)"


@pytest.mark.parametrize("make,error,message", [
    (lambda d: json.dumps(DSA), ValueError, FORMS + ", got a string of JSON text: pass json.loads\\(text\\)"),
    (lambda d: 7, ValueError, FORMS + ", got int"),
    (lambda d: [DSA], ValueError, FORMS + ", got list"),
    (lambda d: str(d), ValueError, "is a directory: pass the path of its config.json"),
    (lambda d: d / "missing.json", FileNotFoundError, "missing.json: no such file \\(a Hugging Face config " + FORMS),
])
def test_from_hf_config_refuses_other_forms_with_a_hint(tmp_path, make, error, message):
    with pytest.raises(error, match=message):
        MLAConfig.from_hf_config(make(tmp_path))


def test_dtype_fields_take_numpy_and_jnp_dtypes():
    """A dtype object gives the config its name: equal (and hashing alike) to the string's."""
    for dtype in (jnp.bfloat16, jnp.dtype("bfloat16"), "bfloat16"):
        c = MLAConfig.tiny(dtype=dtype)
        assert c.dtype == "bfloat16" and c == MLAConfig.tiny(dtype="bfloat16") and hash(c) == hash(
            MLAConfig.tiny(dtype="bfloat16"))
    assert MLAConfig.tiny(dtype=np.float32).dtype == "float32"
    assert MLAConfig.tiny(kv_cache_dtype=jnp.float8_e4m3fn).kv_cache_dtype == "fp8"
    assert MLAConfig.tiny(kv_cache_dtype=np.dtype("float32")).kv_cache_dtype == "float32"
    assert MLAConfig.tiny(indexer_dtype=jnp.float8_e4m3fn).indexer_dtype == "fp8"
    assert MLAConfig.tiny(indexer_dtype=jnp.bfloat16).indexer_dtype == "bfloat16"
    with pytest.raises(ValueError, match=r"dtype must be one of \('bfloat16', 'float32'\) \(or that numpy / jnp "
                                         r"dtype\), got <class '.*float8_e4m3fn'>"):
        MLAConfig.tiny(dtype=jnp.float8_e4m3fn)  # fp8 is a storage format, not an activation dtype
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .*got <class 'numpy.float16'>"):
        MLAConfig.tiny(kv_cache_dtype=np.float16)
