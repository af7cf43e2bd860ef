"""Orbax round trips of params and caches; loading a layer from a (fake) HF safetensors checkpoint."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from jax_sparse_mla import MLAConfig, Request, init_cache, init_params, plan_batch
from jax_sparse_mla.checkpoint import load_layer_from_safetensors, restore_checkpoint, save_checkpoint
from jax_sparse_mla.model import jit_forward
from jax_sparse_mla.params import param_shapes
from jax_sparse_mla.sharding import cache_shardings, make_mesh, param_shardings
from jax_sparse_mla.synthetic import Harness
from tests.conftest import quantize_fp8_blocks

TINY = MLAConfig.tiny()


def _bits(a):
    """Exact comparison of any dtype (fp8 included)."""
    a = np.asarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


# ---- orbax --------------------------------------------------------------------------------------

def test_orbax_round_trip_params_and_fp8_cache(tmp_path):
    config = MLAConfig.tiny(kv_cache_dtype="fp8")  # e4m3 latent + scales, e4m3 indexer keys + scales
    h = Harness(config, num_pages=16)
    h.add(0, 21)
    h.step([(0, 20)])  # fills both caches
    save_checkpoint(tmp_path / "ckpt", h.params, h.cache, config=config)
    got_config, params, cache = restore_checkpoint(tmp_path / "ckpt")
    assert got_config == config
    assert params.keys() == h.params.keys()
    for name in params:
        assert params[name].dtype == h.params[name].dtype
        np.testing.assert_array_equal(_bits(params[name]), _bits(h.params[name]))
    for field in dataclasses.fields(cache):
        got, want = getattr(cache, field.name), getattr(h.cache, field.name)
        assert got.dtype == want.dtype and got.shape == want.shape, field.name
        np.testing.assert_array_equal(_bits(got), _bits(want))
    # The restored state serves the next token exactly like the original.
    h.params, h.cache = params, cache
    out, _, _ = h.step([(0, 1)])
    h.check(out, 1e-4)


def test_orbax_params_only_bf16_sharded_restore_and_overwrite(tmp_path):
    config = MLAConfig.tiny(dtype="bfloat16")
    params = init_params(config, jax.random.key(1))
    path = tmp_path / "ckpt"
    save_checkpoint(path, params, config=config)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_checkpoint(path, params, config=config)
    params = {k: v + 1 for k, v in params.items()}
    cache = init_cache(config, 4)
    save_checkpoint(path, params, cache, config=config, overwrite=True)
    mesh = make_mesh(1, 1)
    _, restored, restored_cache = restore_checkpoint(path, param_shardings=param_shardings(mesh, config),
                                                     cache_shardings=cache_shardings(mesh, config))
    assert restored["q_b_proj.weight"].dtype == jnp.bfloat16
    assert restored["q_b_proj.weight"].sharding.spec == jax.sharding.PartitionSpec("tensor", None)
    assert restored_cache.latent.sharding.spec == jax.sharding.PartitionSpec("data")
    for name in params:
        np.testing.assert_array_equal(_bits(restored[name]), _bits(params[name]))


def test_orbax_save_rejects_bad_params_and_cache(tmp_path):
    params = init_params(TINY, jax.random.key(0))
    bad = dict(params)
    del bad["indexer.wk.weight"]
    with pytest.raises(ValueError, match="params has no 'indexer.wk.weight'"):
        save_checkpoint(tmp_path / "a", bad, config=TINY)
    bad = {**params, "o_proj.weight": params["o_proj.weight"][:, :3]}
    with pytest.raises(ValueError, match=r"params\['o_proj.weight'\] has shape \(64, 3\), expected \(64, 64\)"):
        save_checkpoint(tmp_path / "a", bad, config=TINY)
    with pytest.raises(ValueError, match=r"cache.latent has bfloat16\[4, 4, 128\], expected float8_e4m3fn"):
        save_checkpoint(tmp_path / "a", params, init_cache(TINY, 4), config=MLAConfig.tiny(kv_cache_dtype="fp8"))
    with pytest.raises(FileNotFoundError):
        restore_checkpoint(tmp_path / "nothing")


# ---- Hugging Face safetensors ---------------------------------------------------------------------

# A small DeepSeek-V3.2-shaped config.json; hidden 160 and q_lora 48 make several 128x128 fp8 blocks.
HF_CONFIG = {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "vocab_size": 100,
    "hidden_size": 160, "num_attention_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 128,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "index_n_heads": 4,
    "index_head_dim": 16, "index_topk": 16, "num_hidden_layers": 2, "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]},
}
OVERRIDES = dict(page_size=4, dtype="float32")
FP8_WEIGHTS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "indexer.wq_b", "indexer.wk")


def _write_fake_checkpoint(directory, *, shapes_override=None, bad_scale=None, drop=(), index=True):
    """Layers 0 and 1 (+ unrelated tensors) over two shard files plus the index, like the real release.

    Returns {layer: {name: expected float32 param}}.
    """
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(HF_CONFIG))
    config = MLAConfig.from_hf_config(HF_CONFIG, **OVERRIDES)
    rng = np.random.default_rng(0)
    files = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    names = list(files)
    files[names[0]]["model.embed_tokens.weight"] = rng.standard_normal((100, 160)).astype(ml_dtypes.bfloat16)
    files[names[1]]["model.layers.0.mlp.gate_proj.weight"] = rng.standard_normal((8, 160)).astype(np.float32)
    expected = {}
    for layer in (0, 1):
        expected[layer] = {}
        for i, (name, shape) in enumerate(param_shapes(config).items()):
            full = f"model.layers.{layer}.self_attn.{name}"
            if (shapes_override or {}).get(full):
                shape = shapes_override[full]
            target = files[names[(layer + i) % 2]]  # each layer spread over both files
            w = rng.standard_normal(shape).astype(np.float32) * 0.1
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                w = w + 1.0
            if name.removesuffix(".weight") in FP8_WEIGHTS:
                q, scale = quantize_fp8_blocks(w)
                target[full], target[full + "_scale_inv"] = q, scale
                if full == bad_scale:
                    target[full + "_scale_inv"] = np.ones((scale.shape[0], scale.shape[1] + 1), np.float32)
                full_scale = np.repeat(np.repeat(scale, 128, 0), 128, 1)[:shape[0], :shape[1]]
                expected[layer][name] = np.asarray(q, np.float32) * full_scale
            elif layer == 0:  # bfloat16, as the release stores norms
                target[full] = w.astype(ml_dtypes.bfloat16)
                expected[layer][name] = target[full].astype(np.float32)
            else:
                target[full] = w
                expected[layer][name] = w
    files = {name: {k: v for k, v in tensors.items() if k not in drop} for name, tensors in files.items()}
    if not index:
        save_file({k: v for tensors in files.values() for k, v in tensors.items()}, str(directory / "model.safetensors"))
        return expected
    weight_map = {}
    for file_name, tensors in files.items():
        save_file(tensors, str(directory / file_name))
        weight_map.update(dict.fromkeys(tensors, file_name))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return expected


@pytest.mark.parametrize("index", [True, False], ids=["sharded+index", "single-file"])
def test_load_layer_from_safetensors(tmp_path, index):
    expected = _write_fake_checkpoint(tmp_path, index=index)
    for layer in (0, 1):
        config, params = load_layer_from_safetensors(tmp_path, layer, **OVERRIDES)
        assert config == MLAConfig.from_hf_config(HF_CONFIG, **OVERRIDES)
        assert config.hidden_size == 160 and config.index_n_heads == 4 and config.rope_scaling.factor == 4.0
        assert params.keys() == expected[layer].keys()
        for name, want in expected[layer].items():
            assert params[name].dtype == jnp.float32
            np.testing.assert_array_equal(np.asarray(params[name]), want, err_msg=name)


def test_loaded_layer_runs(tmp_path):
    _write_fake_checkpoint(tmp_path)
    config, params = load_layer_from_safetensors(tmp_path, 1, **OVERRIDES)
    plan, meta = plan_batch(config, [Request(0, 9, [0, 1, 2])], num_pages=4)
    x = jax.random.normal(jax.random.key(0), (plan.num_tokens, config.hidden_size))
    out, _ = jit_forward(params, x, init_cache(config, 4), meta, plan=plan, config=config)
    assert np.all(np.isfinite(np.asarray(out)))


def test_load_errors_name_the_tensor(tmp_path):
    kv_b = "model.layers.1.self_attn.kv_b_proj.weight"
    _write_fake_checkpoint(tmp_path / "missing", drop=(kv_b,))
    with pytest.raises(ValueError, match=f"model.safetensors.index.json in .* has no tensor '{kv_b}'"):
        load_layer_from_safetensors(tmp_path / "missing", 1, **OVERRIDES)
    config, _ = load_layer_from_safetensors(tmp_path / "missing", 0, **OVERRIDES)  # layer 0 is complete

    wk = "model.layers.0.self_attn.indexer.wk.weight"
    _write_fake_checkpoint(tmp_path / "shape", shapes_override={wk: (16, 159)})
    with pytest.raises(ValueError, match=rf"tensor '{wk}' in model-0000\d-of-00002.safetensors has shape \(16, 159\), "
                                         r"expected \(16, 160\)"):
        load_layer_from_safetensors(tmp_path / "shape", 0, **OVERRIDES)

    q_b = "model.layers.1.self_attn.q_b_proj.weight"
    _write_fake_checkpoint(tmp_path / "scale", bad_scale=q_b)
    with pytest.raises(ValueError, match=rf"tensor '{q_b}_scale_inv' in .* has shape \(1, 2\), expected \(1, 1\)"):
        load_layer_from_safetensors(tmp_path / "scale", 1, **OVERRIDES)

    norm = "model.layers.0.self_attn.kv_a_layernorm.weight"
    _write_fake_checkpoint(tmp_path / "norm", shapes_override={norm: (127,)})
    with pytest.raises(ValueError, match=rf"tensor '{norm}' in .* has shape \(127,\), expected \(128,\)"):
        load_layer_from_safetensors(tmp_path / "norm", 0, **OVERRIDES)

    with pytest.raises(ValueError, match="layer_idx 3 is out of range"):
        load_layer_from_safetensors(tmp_path / "norm", 3, **OVERRIDES)

    (tmp_path / "norm" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors is missing"):
        load_layer_from_safetensors(tmp_path / "norm", 1, **OVERRIDES)

    scale = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    _write_fake_checkpoint(tmp_path / "noscale", drop=(scale,))
    with pytest.raises(ValueError, match="'o_proj.weight' is fp8 but has no o_proj.weight_scale_inv"):
        load_layer_from_safetensors(tmp_path / "noscale", 1, **OVERRIDES)
