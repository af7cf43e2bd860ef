"""Fake Hugging Face DeepSeek-V3.2 checkpoints (DeepSeek's layout, tiny shapes) for the checkpoint
suites, and the multi-device checks they run in a subprocess with virtual CPU devices."""

from __future__ import annotations

import json
import pathlib

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from jax_sparse_mla import MLAConfig
from jax_sparse_mla.params import param_shapes

from . import quantize_fp8_blocks

# A small DeepSeek-V3.2-shaped config.json; hidden 160 and q_lora 48 make several 128x128 fp8 blocks.
# Two layers plus one MTP layer (model.layers.2).
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


def shard_names(num_files: int) -> list[str]:
    return [f"model-{k + 1:05d}-of-{num_files:05d}.safetensors" for k in range(num_files)]


def write_fake_checkpoint(directory, *, layers=(0, 1), num_files=2, bf16_layers=(0,), shapes_override=None,
                          bad_scale=None, drop=(), index=True, replace=None, extra=None):
    """`layers`' attention tensors (+ unrelated ones) over num_files shard files plus the index,
    like the real release: each layer's tensors spread over every file, fp8 (with weight_scale_inv)
    for FP8_WEIGHTS, bfloat16 for the other tensors of bf16_layers and float32 for the rest.

    replace: {tensor: array} written instead of the tensor; extra: {tensor: array} added to the first file.
    Returns {layer: {name: expected float32 param}}.
    """
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(HF_CONFIG))
    config = MLAConfig.from_hf_config(HF_CONFIG, **OVERRIDES)
    rng = np.random.default_rng(0)
    names = shard_names(num_files)
    files = {name: {} for name in names}
    files[names[0]]["model.embed_tokens.weight"] = rng.standard_normal((100, 160)).astype(ml_dtypes.bfloat16)
    files[names[1 % num_files]]["model.layers.0.mlp.gate_proj.weight"] = rng.standard_normal((8, 160)).astype(np.float32)
    expected = {}
    for layer in layers:
        expected[layer] = {}
        for i, (name, shape) in enumerate(param_shapes(config).items()):
            full = f"model.layers.{layer}.self_attn.{name}"
            if (shapes_override or {}).get(full):
                shape = shapes_override[full]
            target = files[names[(layer + i) % num_files]]  # each layer spread over every file
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
            elif layer in bf16_layers:  # bfloat16, as the release stores norms
                target[full] = w.astype(ml_dtypes.bfloat16)
                expected[layer][name] = target[full].astype(np.float32)
            else:
                target[full] = w
                expected[layer][name] = w
    if num_files > 2:  # more of what a real checkpoint holds beside attention: all ignored
        q, scale = quantize_fp8_blocks(rng.standard_normal((160, 8)).astype(np.float32))
        files[names[2]]["model.layers.1.mlp.experts.0.down_proj.weight"] = q
        files[names[2]]["model.layers.1.mlp.experts.0.down_proj.weight_scale_inv"] = scale
        files[names[-1]]["model.norm.weight"] = np.ones(160, ml_dtypes.bfloat16)
        files[names[-1]]["lm_head.weight"] = rng.standard_normal((100, 160)).astype(ml_dtypes.bfloat16)
        mtp = HF_CONFIG["num_hidden_layers"]  # the MTP layer's own (non-attention) tensors
        files[names[0]][f"model.layers.{mtp}.eh_proj.weight"] = rng.standard_normal((160, 320)).astype(np.float32)
        files[names[1]][f"model.layers.{mtp}.enorm.weight"] = np.ones(160, ml_dtypes.bfloat16)
    files = {name: {k: (replace or {}).get(k, v) for k, v in tensors.items() if k not in drop}
             for name, tensors in files.items()}
    files[names[0]].update(extra or {})
    if not index:
        save_file({k: v for tensors in files.values() for k, v in tensors.items()}, str(directory / "model.safetensors"))
        return expected
    weight_map = {}
    for file_name, tensors in files.items():
        save_file(tensors, str(directory / file_name))
        weight_map.update(dict.fromkeys(tensors, file_name))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return expected


def bits(a):
    """An array's bits, for exact comparison of any dtype (fp8 included)."""
    a = np.asarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def sharded_load_report(directory, meshes, dtype="float32") -> dict:
    """(Run with several devices.) Loads every attention layer of the checkpoint in `directory` onto
    each (data, tensor) mesh with param_shardings and compares each array's sharding and bits with
    the requested sharding and the one-device load_layer_from_safetensors. -> {"DxT": report}."""
    import functools

    import jax

    from jax_sparse_mla.hf_checkpoint import load_layer_from_safetensors, load_model_from_safetensors
    from jax_sparse_mla.sharding import make_mesh, param_shardings

    overrides = {**OVERRIDES, "dtype": dtype}
    one = None
    results = {}
    for dp, tp in meshes:
        mesh = make_mesh(dp, tp)
        config, layers = load_model_from_safetensors(directory, shardings=functools.partial(param_shardings, mesh),
                                                     progress=False, **overrides)
        if one is None:
            one = [load_layer_from_safetensors(directory, i, **overrides)[1] for i in range(len(layers))]
        want = param_shardings(mesh, config)
        wrong_sharding, wrong_values, on_device_0 = [], [], []
        for i, params in enumerate(layers):
            for name, a in params.items():
                if a.sharding != want[name]:
                    wrong_sharding.append(f"{i}:{name}: {a.sharding}")
                if a.dtype != one[i][name].dtype or not np.array_equal(bits(a), bits(one[i][name])):
                    wrong_values.append(f"{i}:{name}")
                shard0 = [s for s in a.addressable_shards if s.device == jax.devices()[0]]
                on_device_0.append([name, list(shard0[0].data.shape)])
        results[f"{dp}x{tp}"] = {
            "num_layers": len(layers), "wrong_sharding": wrong_sharding, "wrong_values": wrong_values,
            "devices": sorted(d.id for d in layers[0]["q_b_proj.weight"].sharding.device_set),
            "q_b_rows": sorted(s.data.shape[0] for s in layers[0]["q_b_proj.weight"].addressable_shards),
            "o_cols": sorted(s.data.shape[1] for s in layers[-1]["o_proj.weight"].addressable_shards),
            "on_device_0": dict(on_device_0)}
    return results
