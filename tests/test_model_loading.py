"""Whole-model loading: every attention layer (MTP included) of a fake multi-shard DeepSeek-V3.2
checkpoint, onto one device and onto meshes of virtual CPU devices, and orbax round trips of
the whole layer stack."""

import codecs
import dataclasses
import functools
import json
import math
import pathlib
import shutil
import tracemalloc

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_sparse_mla
from jax_sparse_mla import MLAConfig, init_cache
from jax_sparse_mla.checkpoint import restore_model_checkpoint, save_checkpoint, save_model_checkpoint
from jax_sparse_mla.hf_checkpoint import load_hf_config, load_layer_from_safetensors, load_model_from_safetensors
from jax_sparse_mla.params import hf_tensor_to_param, param_shapes
from jax_sparse_mla.serving import Engine
from jax_sparse_mla.sharding import cache_shardings, make_mesh, param_shardings, param_specs
from tests.support import run_with_cpu_devices
from tests.support.checkpoints import (HF_CONFIG, OVERRIDES, bits, shard_names,
                                       write_fake_checkpoint)

LAYERS = (0, 1, 2)  # num_hidden_layers=2, plus the MTP layer model.layers.2
SHARDS = shard_names(3)
CONFIG = MLAConfig.from_hf_config(HF_CONFIG, **OVERRIDES)
README = pathlib.Path(jax_sparse_mla.__file__).absolute().parent.parent / "README.md"


def write(directory, **kw):
    return write_fake_checkpoint(directory, layers=LAYERS, num_files=3, bf16_layers=(0, 2), **kw)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    return path, write(path)


def assert_same_arrays(got, want, what=""):
    assert got.keys() == want.keys(), what
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, (what, name)
        np.testing.assert_array_equal(bits(got[name]), bits(want[name]), err_msg=f"{what} {name}")


# ---- loading every layer -------------------------------------------------------------------------

def test_readme_loading_memory_is_the_configs():
    """The README's memory of load_model_from_safetensors for DeepSeek-V3.2, from the config: the
    device bytes of a layer (param_shapes in config.dtype; param_shardings splits the tensors
    param_specs puts on the tensor axis), and the host's 13 bytes a value of the tensor being
    read: the FP8 values (1) and what dequantising and casting allocate (12, measured here)."""
    config = MLAConfig.deepseek_v32()
    shapes, specs = param_shapes(config), param_specs(config)
    values = {name: math.prod(shape) for name, shape in shapes.items()}
    split = {name for name in shapes if "tensor" in tuple(specs[name])}
    assert split == {"q_b_proj.weight", "kv_b_proj.weight", "o_proj.weight"}
    text = README.read_text()
    assert f"o_proj ({round(100 * sum(values[n] for n in split) / sum(values.values()))}% of a layer's bytes)" in text
    layers = 61 + 1  # num_hidden_layers + num_nextn_predict_layers: the MTP layer loads too
    for label, tp in (("one device", 1), ("`param_shardings`, tensor axis of 8", 8)):
        per_layer = sum(n // tp if name in split else n for name, n in values.items()) * config.jnp_dtype.itemsize
        row = f"| {label} | {per_layer:,} | {layers * per_layer / 2 ** 30:.1f} GiB |"
        assert row in text, row
    largest = max(values, key=values.get)
    assert largest == "o_proj.weight" and f"o_proj ({' x '.join(map(str, shapes[largest]))})" in text
    assert f"{13 * values[largest] / 2 ** 30:.1f} GiB above the process" in text
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((1024, 1536)).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.random((8, 12)).astype(np.float32)
    tracemalloc.start()
    try:
        hf_tensor_to_param("o_proj.weight", weight, scale, dataclasses.replace(CONFIG, dtype="bfloat16"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert 11 * weight.size < peak <= 12 * weight.size + 2 ** 16, peak / weight.size


def test_config_json_is_read_as_from_hf_config_reads_it(tmp_path):
    """One reader of config.json: the loaders' (load_hf_config) and MLAConfig.from_hf_config(path)
    agree, on a file with a UTF-8 byte-order mark (as some editors save JSON) and on damaged files
    (the same message)."""
    path = tmp_path / "config.json"
    path.write_bytes(codecs.BOM_UTF8 + json.dumps(HF_CONFIG).encode())
    assert load_hf_config(tmp_path, **OVERRIDES) == MLAConfig.from_hf_config(path, **OVERRIDES) == CONFIG
    wrong_field = json.dumps({**HF_CONFIG, "hidden_size": "x"}).encode()
    not_dsa = json.dumps({k: v for k, v in HF_CONFIG.items() if k != "index_topk"}).encode()
    for damaged in (b"{", b"[1]", codecs.BOM_UTF16_LE + b"{", b"\xff{}", wrong_field, not_dsa):
        path.write_bytes(damaged)
        messages = []
        for read in (lambda: load_hf_config(tmp_path, **OVERRIDES),
                     lambda: MLAConfig.from_hf_config(path, **OVERRIDES)):
            with pytest.raises(ValueError) as e:
                read()
            messages.append(str(e.value))
        assert messages[0] == messages[1] and messages[0].startswith(str(path)), (damaged, messages)


def test_the_fake_checkpoint_has_deepseeks_layout(ckpt):
    path, _ = ckpt
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(set(weight_map.values())) == SHARDS
    for layer in LAYERS:  # every layer spread over all three shards
        assert {f for k, f in weight_map.items() if k.startswith(f"model.layers.{layer}.self_attn.")} == set(SHARDS)
    assert "model.layers.0.self_attn.o_proj.weight_scale_inv" in weight_map
    assert {"model.embed_tokens.weight", "model.layers.0.mlp.gate_proj.weight", "lm_head.weight",
            "model.layers.2.eh_proj.weight"} <= set(weight_map)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_load_every_layer_equals_the_one_layer_loader(ckpt, dtype, capsys):
    path, expected = ckpt
    overrides = {**OVERRIDES, "dtype": dtype}
    progress = {"progress": True} if dtype == "float32" else {}  # by default none: stderr (captured) is no terminal
    config, layers = load_model_from_safetensors(path, **progress, **overrides)
    assert config == load_hf_config(path, **overrides) == MLAConfig.from_hf_config(HF_CONFIG, **overrides)
    assert len(layers) == 3
    for i, params in enumerate(layers):
        _, one = load_layer_from_safetensors(path, i, **overrides)
        assert_same_arrays(params, one, f"layer {i}")
        for name, a in params.items():
            assert a.sharding == jax.sharding.SingleDeviceSharding(jax.devices()[0])
            if dtype == "float32":
                np.testing.assert_array_equal(np.asarray(a), expected[i][name], err_msg=f"{i} {name}")
    err = capsys.readouterr().err
    if dtype == "float32":  # tqdm: a bar over the 3 x 12 tensors, naming the layer
        assert f"loading attention layers:   0%|          | 0/{3 * len(param_shapes(config))}" in err
        assert "layer 2]" in err
    else:
        assert "loading attention layers" not in err and "\r" not in err
    # a subset, in the order given; one sharding for every array
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    _, some = load_model_from_safetensors(path, layers=[2, 0], shardings=sharding, progress=False, **overrides)
    assert_same_arrays(some[0], layers[2], "layer 2")
    assert_same_arrays(some[1], layers[0], "layer 0")
    if dtype == "bfloat16":  # the model's layers are what Engine takes
        engine = Engine(config, num_layers=2, num_pages=8, pool_size=8, params=layers[:2])
        assert engine.num_layers == 2 and engine.params[1] is layers[1]


@pytest.fixture(scope="module")
def mesh_report(ckpt):
    path, _ = ckpt
    return run_with_cpu_devices(
        "import json; from tests.support.checkpoints import sharded_load_report; "
        f"print('RESULT', json.dumps(sharded_load_report({str(path)!r}, [(1, 4), (2, 2)], 'bfloat16')))")


@pytest.mark.parametrize("dp,tp", [(1, 4), (2, 2)])
def test_load_onto_a_mesh_of_4_cpu_devices(mesh_report, dp, tp):
    r = mesh_report[f"{dp}x{tp}"]
    assert r["num_layers"] == 3
    assert r["wrong_sharding"] == [] and r["wrong_values"] == [], r
    assert r["devices"] == [0, 1, 2, 3]
    c = CONFIG
    assert r["q_b_rows"] == [c.num_attention_heads * c.qk_head_dim // tp] * 4  # heads split, copied over data
    assert r["o_cols"] == [c.num_attention_heads * c.v_head_dim // tp] * 4
    # device 0 holds its slice of the head-split weights, whole replicated ones
    assert r["on_device_0"]["q_b_proj.weight"] == [c.num_attention_heads * c.qk_head_dim // tp, c.q_lora_rank]
    assert r["on_device_0"]["q_a_proj.weight"] == [c.q_lora_rank, c.hidden_size]


# ---- errors name the file, the layer and the tensor ----------------------------------------------

MTP = "model.layers.2.self_attn."
L1 = "model.layers.1.self_attn."


@pytest.mark.parametrize("kw,message", [
    (dict(drop=(MTP + "kv_b_proj.weight",)), f"model.safetensors.index.json in .* has no tensor '{MTP}kv_b_proj.weight'"),
    (dict(drop=(MTP + "o_proj.weight_scale_inv",)), "'o_proj.weight' is fp8 but has no o_proj.weight_scale_inv"),
    (dict(shapes_override={MTP + "indexer.wk.weight": (16, 159)}),
     rf"tensor '{MTP}indexer.wk.weight' in model-0000\d-of-00003.safetensors has shape \(16, 159\), expected \(16, 160\)"),
    (dict(replace={L1 + "q_a_layernorm.weight": np.full(48, np.nan, np.float32)}),
     rf"layer 1 of .*: tensor '{L1}q_a_layernorm.weight' has non-finite values \(in model-0000\d-of-00003.safetensors\)"),
    (dict(replace={MTP + "o_proj.weight_scale_inv": np.array([[1.0], [-1.0]], np.float32)}),
     rf"layer 2 of .*: tensor {MTP}o_proj.weight_scale_inv has non-finite or negative scales \(in model-0000\d-of"),
    (dict(replace={L1 + "kv_a_layernorm.weight": np.ones(128, np.int8)}),
     rf"tensor '{L1}kv_a_layernorm.weight' in model-0000\d-of-00003.safetensors has dtype I8"),
])
def test_load_errors_name_the_file_layer_and_tensor(tmp_path, kw, message):
    write(tmp_path, **kw)
    with pytest.raises(ValueError, match=message):
        load_model_from_safetensors(tmp_path, progress=False, **OVERRIDES)


def test_load_refuses_weights_that_overflow_the_config_dtype(tmp_path):
    """3.4e38 is a finite float32 weight and inf in bfloat16: with dtype="bfloat16" both loaders
    refuse it by name (the check is of the cast weights); float32 keeps it."""
    write(tmp_path, replace={L1 + "q_a_layernorm.weight": np.full(48, 3.4e38, np.float32)})
    bf16 = {**OVERRIDES, "dtype": "bfloat16"}
    with pytest.raises(ValueError, match=rf"layer 1 of .*: tensor '{L1}q_a_layernorm.weight' overflows bfloat16"
                                         r".*\(in model-0000\d-of-00003.safetensors\)"):
        load_model_from_safetensors(tmp_path, progress=False, **bf16)
    with pytest.raises(ValueError, match=r"layer 1 of .*: tensor 'q_a_layernorm.weight' overflows bfloat16"):
        load_layer_from_safetensors(tmp_path, 1, **bf16)
    _, params = load_layer_from_safetensors(tmp_path, 1, **OVERRIDES)
    assert float(params["q_a_layernorm.weight"].max()) == np.float32(3.4e38)


def test_load_refuses_damaged_files_bad_layers_and_shardings(tmp_path, ckpt):
    path, _ = ckpt
    with pytest.raises(ValueError, match=r"layer 3 is out of range: .*config.json has 3 layers"):
        load_model_from_safetensors(path, layers=[0, 3], **OVERRIDES)
    with pytest.raises(ValueError, match="layers lists a layer twice"):
        load_model_from_safetensors(path, layers=[1, 1], **OVERRIDES)
    with pytest.raises(ValueError, match="shardings has 2 entries, one per layer is 3"):
        load_model_from_safetensors(path, shardings=[None, None], **OVERRIDES)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with pytest.raises(ValueError, match="shardings for layer 0 has no sharding for 'q_a_layernorm.weight'"):
        load_model_from_safetensors(path, shardings={"q_a_proj.weight": one}, **OVERRIDES)
    mesh = make_mesh(1, 1)
    with pytest.raises(ValueError, match=r"shardings for layer 1: 'q_a_layernorm.weight' \(shape \(48,\)\) cannot take"):
        load_model_from_safetensors(path, shardings=[one, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
            "data", "tensor")), one], **OVERRIDES)

    damaged = tmp_path / "cut"
    shutil.copytree(path, damaged)
    shard = damaged / SHARDS[2]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ValueError, match=rf"{SHARDS[2]} is not a valid safetensors file \(cut short"):
        load_model_from_safetensors(damaged, progress=False, **OVERRIDES)
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"{SHARDS[2]} is missing"):
        load_model_from_safetensors(damaged, progress=False, **OVERRIDES)

    outside = tmp_path / "outside"
    shutil.copytree(path, outside)
    index = outside / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"][MTP + "o_proj.weight"] = "../" + SHARDS[0]
    index.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"names the file '../{SHARDS[0]}', which is outside the checkpoint directory"):
        load_model_from_safetensors(outside, progress=False, **OVERRIDES)

    no_count = tmp_path / "no_count"
    shutil.copytree(path, no_count)
    (no_count / "config.json").write_text(json.dumps({k: v for k, v in HF_CONFIG.items() if k != "num_hidden_layers"}))
    with pytest.raises(ValueError, match="config.json has no num_hidden_layers: pass layers="):
        load_model_from_safetensors(no_count, **OVERRIDES)
    assert len(load_model_from_safetensors(no_count, layers=[2], progress=False, **OVERRIDES)[1]) == 1


# ---- orbax: the whole stack ----------------------------------------------------------------------

def _filled_cache(config, num_pages, seed):
    cache = init_cache(config, num_pages)
    key = jax.random.key(seed)
    fields = {}
    for i, f in enumerate(dataclasses.fields(cache)):
        a = getattr(cache, f.name)
        if a is not None:
            fields[f.name] = jax.random.normal(jax.random.fold_in(key, i), a.shape).astype(a.dtype)
    return dataclasses.replace(cache, **fields)


@pytest.fixture(scope="module")
def stack(ckpt, tmp_path_factory):
    path, _ = ckpt
    config, layers = load_model_from_safetensors(path, progress=False, **OVERRIDES)
    caches = [_filled_cache(config, 4, i) for i in range(len(layers))]
    saved = tmp_path_factory.mktemp("stack") / "model"
    save_model_checkpoint(saved, layers, caches, config=config)
    return config, layers, caches, saved


def test_stack_round_trip(stack, tmp_path):
    config, layers, caches, saved = stack
    mesh = make_mesh(1, 1)
    got_config, got_layers, got_caches = restore_model_checkpoint(
        saved, param_shardings=functools.partial(param_shardings, mesh),
        cache_shardings=functools.partial(cache_shardings, mesh), config=config)
    assert got_config == config and len(got_layers) == len(got_caches) == 3
    for i in range(3):
        assert_same_arrays(got_layers[i], layers[i], f"layer {i}")
        assert got_layers[i]["q_b_proj.weight"].sharding.spec == jax.sharding.PartitionSpec("tensor", None)
        for f in dataclasses.fields(caches[i]):
            want, got = getattr(caches[i], f.name), getattr(got_caches[i], f.name)
            assert (want is None) == (got is None), f.name
            if want is not None:
                assert got.dtype == want.dtype and got.sharding.spec == jax.sharding.PartitionSpec("data")
                np.testing.assert_array_equal(bits(got), bits(want), err_msg=f"layer {i} {f.name}")
    # params only, overwriting with fewer layers
    path = tmp_path / "model"
    save_model_checkpoint(path, layers, config=config)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_model_checkpoint(path, layers[:2], config=config)
    bf16 = [{k: v.astype(jnp.bfloat16) for k, v in p.items()} for p in layers[:2]]
    save_model_checkpoint(path, bf16, config=config, overwrite=True)
    got_config, got_layers, got_caches = restore_model_checkpoint(path)
    assert got_config == config and got_caches is None and len(got_layers) == 2
    assert not (path / "layer_2").exists()
    for i in range(2):
        assert_same_arrays(got_layers[i], bf16[i], f"layer {i}")


def test_stack_errors_name_the_layer_and_the_array(stack, tmp_path):
    config, layers, caches, saved = stack
    bad = [layers[0], {k: v for k, v in layers[1].items() if k != "indexer.wk.weight"}]
    with pytest.raises(ValueError, match="layer 1: params has no 'indexer.wk.weight'"):
        save_model_checkpoint(tmp_path / "a", bad, config=config)
    with pytest.raises(ValueError, match=r"layer 2: cache.latent has float32\[4, 4, 128\], expected bfloat16"):
        save_model_checkpoint(tmp_path / "a", layers, caches[:2] + [init_cache(dataclasses.replace(
            config, kv_cache_dtype="float32"), 4)], config=config)
    with pytest.raises(ValueError, match="one PagedCache per layer"):
        save_model_checkpoint(tmp_path / "a", layers, caches[:2], config=config)
    assert not (tmp_path / "a").exists()  # refused before anything was written
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("not a checkpoint")
    with pytest.raises(ValueError, match="is not a model checkpoint .*not replacing it"):
        save_model_checkpoint(other, layers, config=config, overwrite=True)
    assert (other / "keep.txt").exists()

    with pytest.raises(ValueError, match="q_lora_rank: saved 48, expected 16"):
        restore_model_checkpoint(saved, config=dataclasses.replace(config, q_lora_rank=16))
    with pytest.raises(ValueError, match="param_shardings has 2 entries, one per layer is 3"):
        restore_model_checkpoint(saved, param_shardings=[None, None])
    single = tmp_path / "single"
    save_checkpoint(single, layers[0], config=config)
    with pytest.raises(ValueError, match="saved stack meta is missing or damaged"):
        restore_model_checkpoint(single)

    def damaged(name, damage):
        path = tmp_path / name
        shutil.copytree(saved, path)
        damage(path)
        return path

    def edit_meta(path, layer, edit):
        meta_file = path / f"layer_{layer}" / "meta" / "metadata"
        meta = json.loads(meta_file.read_text())
        edit(meta)
        meta_file.write_text(json.dumps(meta))

    path = damaged("missing", lambda p: shutil.rmtree(p / "layer_1"))
    with pytest.raises(ValueError, match="layer 1 of .*: layer_1/ is missing"):
        restore_model_checkpoint(path)
    path = damaged("dtype", lambda p: edit_meta(p, 2, lambda m: m["param_dtypes"].update({"o_proj.weight": "bfloat16"})))
    with pytest.raises(ValueError, match=r"layer 2 of .*: .*layer_2: params\['o_proj.weight'\]: saved dtype float32, "
                                         r"expected bfloat16"):
        restore_model_checkpoint(path)
    path = damaged("params", lambda p: shutil.rmtree(p / "layer_0" / "params"))
    with pytest.raises(ValueError, match="layer 0 of .*: the saved params are missing or damaged"):
        restore_model_checkpoint(path)
    path = damaged("config", lambda p: edit_meta(p, 1, lambda m: m["config"].update(index_topk=8)))
    with pytest.raises(ValueError, match="layer 1 of .*: the saved config differs from the expected one: index_topk"):
        restore_model_checkpoint(path)
    path = damaged("nocache", lambda p: shutil.rmtree(p / "layer_2" / "cache"))
    with pytest.raises(ValueError, match="layer 2 of .*: the saved cache are missing or damaged"):
        restore_model_checkpoint(path)


def test_stack_overwrite_replaces_the_old_stack_only_once_the_new_one_is_complete(stack, tmp_path, monkeypatch):
    """save_model_checkpoint(overwrite=True) with one layer's cache donated (deleted) is refused
    before anything is written; a failure injected while writing (after layer 0 is written) leaves
    the old stack restorable; no staging directory is left behind either way."""
    from jax_sparse_mla import checkpoint

    config, layers, caches, _ = stack
    path = tmp_path / "model"
    save_model_checkpoint(path, layers[:2], caches[:2], config=config)

    def assert_old_stack():
        _, got_layers, got_caches = restore_model_checkpoint(path, config=config)
        assert len(got_layers) == len(got_caches) == 2
        for i in range(2):
            assert_same_arrays(got_layers[i], layers[i], f"layer {i}")
            np.testing.assert_array_equal(bits(got_caches[i].latent), bits(caches[i].latent))
        assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]

    newer = [{k: v * 2 for k, v in p.items()} for p in layers]
    donated = [_filled_cache(config, 4, i) for i in range(3)]
    donated[1].k_pe.delete()
    with pytest.raises(ValueError, match="layer 1: cache.k_pe has been deleted"):
        save_model_checkpoint(path, newer, donated, config=config, overwrite=True)
    assert_old_stack()

    real, calls = checkpoint.save_checkpoint, []

    def fails_at_layer_1(directory, *args, **kw):
        calls.append(directory)
        if len(calls) == 2:
            raise OSError("disk full")
        real(directory, *args, **kw)

    monkeypatch.setattr(checkpoint, "save_checkpoint", fails_at_layer_1)
    with pytest.raises(OSError, match="disk full"):
        save_model_checkpoint(path, newer, config=config, overwrite=True)
    assert len(calls) == 2
    assert_old_stack()
    monkeypatch.setattr(checkpoint, "save_checkpoint", real)
    save_model_checkpoint(path, newer, config=config, overwrite=True)
    _, got_layers, got_caches = restore_model_checkpoint(path)
    assert got_caches is None and len(got_layers) == 3 and sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert_same_arrays(got_layers[2], newer[2], "layer 2")
