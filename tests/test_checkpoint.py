"""Orbax round trips of params and caches; loading a layer from a (fake) HF safetensors checkpoint."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sparse_mla import MLAConfig, Request, init_cache, init_params, plan_batch
from jax_sparse_mla.checkpoint import restore_checkpoint, save_checkpoint
from jax_sparse_mla.hf_checkpoint import load_layer_from_safetensors
from jax_sparse_mla.model import jit_forward
from jax_sparse_mla.sharding import cache_shardings, make_mesh, param_shardings
from jax_sparse_mla.serving.synthetic import Harness
from tests.support.checkpoints import HF_CONFIG, OVERRIDES, write_fake_checkpoint

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


def test_orbax_overwrite_replaces_the_old_checkpoint_only_once_the_new_one_is_complete(tmp_path, monkeypatch):
    """overwrite=True: arrays that cannot be saved (deleted: donated to an earlier call; abstract)
    are refused before anything is written, and a failure while writing leaves the old checkpoint
    restorable and no staging directory behind."""
    from jax_sparse_mla import checkpoint

    params, cache = init_params(TINY, jax.random.key(0)), init_cache(TINY, 4)
    path = tmp_path / "ckpt"
    save_checkpoint(path, params, cache, config=TINY)

    def assert_old_checkpoint():
        _, got, got_cache = restore_checkpoint(path, config=TINY)
        for name in params:
            np.testing.assert_array_equal(_bits(got[name]), _bits(params[name]))
        assert got_cache.num_pages == 4
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging directory left

    newer = {k: v + 1 for k, v in params.items()}
    donated = init_cache(TINY, 4)
    donated.index_k.delete()
    with pytest.raises(ValueError, match="cache.index_k has been deleted"):
        save_checkpoint(path, newer, donated, config=TINY, overwrite=True)
    deleted = {**newer, "o_proj.weight": newer["o_proj.weight"] * 2}
    deleted["o_proj.weight"].delete()
    with pytest.raises(ValueError, match=r"params\['o_proj.weight'\] has been deleted"):
        save_checkpoint(path, deleted, config=TINY, overwrite=True)
    abstract = {**newer, "q_a_proj.weight": jax.ShapeDtypeStruct(newer["q_a_proj.weight"].shape, jnp.float32)}
    with pytest.raises(ValueError, match=r"params\['q_a_proj.weight'\] is a ShapeDtypeStruct, not an array with data"):
        save_checkpoint(path, abstract, config=TINY, overwrite=True)
    assert_old_checkpoint()

    real = checkpoint._orbax_save

    def fails_after_writing(target, items):
        real(target, items)
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "_orbax_save", fails_after_writing)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, newer, config=TINY, overwrite=True)
    assert_old_checkpoint()
    monkeypatch.setattr(checkpoint, "_orbax_save", real)
    save_checkpoint(path, newer, config=TINY, overwrite=True)
    _, got, got_cache = restore_checkpoint(path)
    assert got_cache is None and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    np.testing.assert_array_equal(_bits(got["o_proj.weight"]), _bits(newer["o_proj.weight"]))


# ---- Hugging Face safetensors ---------------------------------------------------------------------

@pytest.mark.parametrize("index", [True, False], ids=["sharded+index", "single-file"])
def test_load_layer_from_safetensors(tmp_path, index):
    expected = write_fake_checkpoint(tmp_path, index=index)
    for layer in (0, 1):
        config, params = load_layer_from_safetensors(tmp_path, layer, **OVERRIDES)
        assert config == MLAConfig.from_hf_config(HF_CONFIG, **OVERRIDES)
        assert config.hidden_size == 160 and config.index_n_heads == 4 and config.rope_scaling.factor == 4.0
        assert params.keys() == expected[layer].keys()
        for name, want in expected[layer].items():
            assert params[name].dtype == jnp.float32
            np.testing.assert_array_equal(np.asarray(params[name]), want, err_msg=name)


def test_loaded_layer_runs(tmp_path):
    write_fake_checkpoint(tmp_path)
    config, params = load_layer_from_safetensors(tmp_path, 1, **OVERRIDES)
    plan, meta = plan_batch(config, [Request(0, 9, [0, 1, 2])], num_pages=4)
    x = jax.random.normal(jax.random.key(0), (plan.num_tokens, config.hidden_size))
    out, _ = jit_forward(params, x, init_cache(config, 4), meta, plan=plan, config=config)
    assert np.all(np.isfinite(np.asarray(out)))


def test_load_errors_name_the_tensor(tmp_path):
    kv_b = "model.layers.1.self_attn.kv_b_proj.weight"
    write_fake_checkpoint(tmp_path / "missing", drop=(kv_b,))
    with pytest.raises(ValueError, match=f"model.safetensors.index.json in .* has no tensor '{kv_b}'"):
        load_layer_from_safetensors(tmp_path / "missing", 1, **OVERRIDES)
    config, _ = load_layer_from_safetensors(tmp_path / "missing", 0, **OVERRIDES)  # layer 0 is complete

    wk = "model.layers.0.self_attn.indexer.wk.weight"
    write_fake_checkpoint(tmp_path / "shape", shapes_override={wk: (16, 159)})
    with pytest.raises(ValueError, match=rf"tensor '{wk}' in model-0000\d-of-00002.safetensors has shape \(16, 159\), "
                                         r"expected \(16, 160\)"):
        load_layer_from_safetensors(tmp_path / "shape", 0, **OVERRIDES)

    q_b = "model.layers.1.self_attn.q_b_proj.weight"
    write_fake_checkpoint(tmp_path / "scale", bad_scale=q_b)
    with pytest.raises(ValueError, match=rf"tensor '{q_b}_scale_inv' in .* has shape \(1, 2\), expected \(1, 1\)"):
        load_layer_from_safetensors(tmp_path / "scale", 1, **OVERRIDES)

    norm = "model.layers.0.self_attn.kv_a_layernorm.weight"
    write_fake_checkpoint(tmp_path / "norm", shapes_override={norm: (127,)})
    with pytest.raises(ValueError, match=rf"tensor '{norm}' in .* has shape \(127,\), expected \(128,\)"):
        load_layer_from_safetensors(tmp_path / "norm", 0, **OVERRIDES)

    with pytest.raises(ValueError, match="layer_idx 3 is out of range"):
        load_layer_from_safetensors(tmp_path / "norm", 3, **OVERRIDES)

    (tmp_path / "norm" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors is missing"):
        load_layer_from_safetensors(tmp_path / "norm", 1, **OVERRIDES)

    scale = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    write_fake_checkpoint(tmp_path / "noscale", drop=(scale,))
    with pytest.raises(ValueError, match="'o_proj.weight' is fp8 but has no o_proj.weight_scale_inv"):
        load_layer_from_safetensors(tmp_path / "noscale", 1, **OVERRIDES)


# ---- refusing bad weights, damaged files and paths out of the directory ---------------------------

L0 = "model.layers.0.self_attn."


@pytest.mark.parametrize("replace,extra,message", [
    ({L0 + "kv_a_layernorm.weight": np.ones(128, np.int8)}, {},
     rf"tensor '{L0}kv_a_layernorm.weight' in model-0000\d-of-00002.safetensors has dtype I8: weights must be floating"),
    ({L0 + "indexer.k_norm.bias": np.zeros(16, bool)}, {}, rf"tensor '{L0}indexer.k_norm.bias' in .* has dtype BOOL"),
    ({L0 + "o_proj.weight": np.ones((160, 64), np.int8)}, {}, rf"tensor '{L0}o_proj.weight' in .* has dtype I8"),
    ({L0 + "o_proj.weight_scale_inv": np.ones((2, 1), np.int32)}, {},
     rf"tensor '{L0}o_proj.weight_scale_inv' in .* has dtype I32, expected F32"),
    ({L0 + "o_proj.weight_scale_inv": np.array([[1.0], [np.nan]], np.float32)}, {},
     "layer 0 of .*o_proj.weight_scale_inv has non-finite or negative scales"),
    ({}, {L0 + "kv_a_layernorm.weight_scale_inv": np.ones(1, np.float32)},
     rf"lists {L0}kv_a_layernorm.weight_scale_inv beside the 1-D tensor '{L0}kv_a_layernorm.weight'"),
    ({}, {L0 + "indexer.weights_proj.weight_scale_inv": np.ones((1, 2), np.float32)},
     rf"tensor '{L0}indexer.weights_proj.weight' in .* has dtype BF16 but a weight_scale_inv"),
])
def test_load_refuses_non_float_weights_and_bad_scales(tmp_path, replace, extra, message):
    write_fake_checkpoint(tmp_path, replace=replace, extra=extra)
    with pytest.raises(ValueError, match=message):
        load_layer_from_safetensors(tmp_path, 0, **OVERRIDES)


def _planted_outside(tmp_path):
    """A complete checkpoint in tmp_path/ckpt whose index can be pointed at tmp_path/evil.safetensors."""
    write_fake_checkpoint(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "model-00001-of-00002.safetensors").rename(tmp_path / "evil.safetensors")
    index = tmp_path / "ckpt" / "model.safetensors.index.json"
    return json.loads(index.read_text()), index


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink", "subdir-dotdot"])
def test_load_refuses_shard_paths_outside_the_directory(tmp_path, how):
    data, index = _planted_outside(tmp_path)
    target = {"dotdot": "../evil.safetensors", "absolute": str(tmp_path / "evil.safetensors"),
              "symlink": "link.safetensors", "subdir-dotdot": "sub/../../evil.safetensors"}[how]
    if how == "symlink":
        (tmp_path / "ckpt" / "link.safetensors").symlink_to(tmp_path / "evil.safetensors")
    data["weight_map"] = {k: target if v == "model-00001-of-00002.safetensors" else v for k, v in data["weight_map"].items()}
    index.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"names the file '{target}', which .*outside the checkpoint directory"):
        load_layer_from_safetensors(tmp_path / "ckpt", 0, **OVERRIDES)


def test_load_follows_symlinks_inside_the_directory_and_into_hub_blobs(tmp_path):
    # a symlink to another file of the directory is fine
    write_fake_checkpoint(tmp_path / "ckpt")
    shard = tmp_path / "ckpt" / "model-00001-of-00002.safetensors"
    shard.rename(tmp_path / "ckpt" / "real.safetensors")
    shard.symlink_to("real.safetensors")
    load_layer_from_safetensors(tmp_path / "ckpt", 0, **OVERRIDES)
    # the Hugging Face hub cache: snapshots/<rev>/<file> -> ../../blobs/<hash>
    repo = tmp_path / "models--x--y"
    snap, blobs = repo / "snapshots" / "abc", repo / "blobs"
    write_fake_checkpoint(snap)
    blobs.mkdir()
    for i, f in enumerate(sorted(snap.iterdir())):
        f.rename(blobs / f"blob{i}")
        f.symlink_to(f"../../blobs/blob{i}")
    load_layer_from_safetensors(snap, 1, **OVERRIDES)


def _damage(directory, what):
    shard = directory / "model-00001-of-00002.safetensors"
    index = directory / "model.safetensors.index.json"
    config = directory / "config.json"
    if what == "cut shard":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif what == "bad header":
        b = shard.read_bytes()
        shard.write_bytes(b[:8] + b"{not json" + b[17:])
    elif what == "huge header size":
        b = shard.read_bytes()
        shard.write_bytes((10 ** 12).to_bytes(8, "little") + b[8:])
    elif what == "empty shard":
        shard.write_bytes(b"")
    elif what == "index not json":
        index.write_text("{weight_map: ")
    elif what == "index not utf-8":
        index.write_bytes(b"\xff\xfe\x00")
    elif what == "index without weight_map":
        index.write_text(json.dumps({"metadata": {}}))
    elif what == "index is a list":
        index.write_text(json.dumps([1, 2]))
    elif what == "weight_map is a list":
        index.write_text(json.dumps({"weight_map": ["model-00001-of-00002.safetensors"]}))
    elif what == "weight_map value not str":
        data = json.loads(index.read_text())
        data["weight_map"][L0 + "o_proj.weight"] = 1
        index.write_text(json.dumps(data))
    elif what == "config not json":
        config.write_text("{")
    elif what == "config is a list":
        config.write_text("[]")
    elif what == "listed but missing in shard":
        data = json.loads(index.read_text())
        data["weight_map"][L0 + "o_proj.weight"] = "model-00002-of-00002.safetensors" if data["weight_map"][
            L0 + "o_proj.weight"] == shard.name else shard.name
        index.write_text(json.dumps(data))


DAMAGE = {
    "cut shard": r"model-00001-of-00002.safetensors is not a valid safetensors file \(cut short or bad header\?\)",
    "bad header": "model-00001-of-00002.safetensors is not a valid safetensors file",
    "huge header size": "model-00001-of-00002.safetensors is not a valid safetensors file",
    "empty shard": "model-00001-of-00002.safetensors is not a valid safetensors file",
    "index not json": "model.safetensors.index.json is not valid JSON",
    "index not utf-8": "model.safetensors.index.json is not valid JSON",
    "index without weight_map": "model.safetensors.index.json has no 'weight_map'",
    "index is a list": "model.safetensors.index.json has no 'weight_map'",
    "weight_map is a list": "model.safetensors.index.json: weight_map must be an object",
    "weight_map value not str": rf"weight_map\['{L0}o_proj.weight'\] must be a file name \(str\), got 1",
    "config not json": "config.json is not valid JSON",
    "config is a list": "config.json must hold a JSON object, got list",
    "listed but missing in shard": rf"model-0000\d-of-00002.safetensors has no tensor '{L0}o_proj.weight', though the index",
}


@pytest.mark.parametrize("what", list(DAMAGE))
def test_load_damaged_files_raise_value_error_naming_the_file(tmp_path, what):
    write_fake_checkpoint(tmp_path)
    _damage(tmp_path, what)
    with pytest.raises(ValueError, match=DAMAGE[what]):
        load_layer_from_safetensors(tmp_path, 0, **OVERRIDES)


def test_load_damaged_single_file(tmp_path):
    write_fake_checkpoint(tmp_path, index=False)
    single = tmp_path / "model.safetensors"
    single.write_bytes(single.read_bytes()[:1000])
    with pytest.raises(ValueError, match="model.safetensors is not a valid safetensors file"):
        load_layer_from_safetensors(tmp_path, 0, **OVERRIDES)


@pytest.mark.parametrize("key,value,message", [
    ("hidden_size", "7168", r"hidden_size must be an integer, got .* \(str\)"),
    ("hidden_size", 160.0, r"hidden_size must be an integer, got .* \(float\)"),
    ("hidden_size", True, r"hidden_size must be an integer, got .* \(bool\)"),
    ("hidden_size", None, r"hidden_size must be an integer, got .* \(NoneType\)"),
    ("rope_theta", "x", "rope_theta must be a real number"),
    ("num_hidden_layers", "2", "num_hidden_layers must be a non-negative int"),
    ("num_nextn_predict_layers", 1.5, "num_nextn_predict_layers must be a non-negative int"),
    ("quantization_config", "fp8", "quantization_config must be an object"),
    ("rope_scaling", {"type": "yarn", "factor": "4"}, "invalid rope_scaling: factor must be a real number"),
    ("rope_parameters", {"rope_type": "longrope"}, "rope_parameters type 'longrope' is not supported"),
])
def test_load_refuses_wrongly_typed_config_fields(tmp_path, key, value, message):
    (tmp_path / "config.json").write_text(json.dumps({**HF_CONFIG, key: value}))
    with pytest.raises(ValueError, match=f"config.json: .*{message}"):
        load_layer_from_safetensors(tmp_path, 0, **OVERRIDES)  # refused before any safetensors is looked for


def test_load_reads_rope_parameters(tmp_path):
    write_fake_checkpoint(tmp_path)
    hf = {k: v for k, v in HF_CONFIG.items() if k not in ("rope_scaling", "rope_theta")}
    hf["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, **{k: v for k, v in HF_CONFIG["rope_scaling"].items()
                                                                          if k != "type"}}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    config, _ = load_layer_from_safetensors(tmp_path, 0, **OVERRIDES)
    assert config == MLAConfig.from_hf_config(HF_CONFIG, **OVERRIDES)
    with pytest.raises(ValueError, match="layer_idx must be an integer"):
        load_layer_from_safetensors(tmp_path, True, **OVERRIDES)


# ---- orbax: restoring into mismatched configs, damaged meta ---------------------------------------

def _meta_file(path):
    return path / "meta" / "metadata"


def _edit_meta(path, edit):
    meta = json.loads(_meta_file(path).read_text())
    edit(meta)
    _meta_file(path).write_text(json.dumps(meta))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("orbax") / "ckpt"
    save_checkpoint(path, init_params(TINY, jax.random.key(0)), init_cache(TINY, 4), config=TINY)
    return path


@pytest.mark.parametrize("edit,message", [
    (lambda m: m["config"].update(q_lora_rank=16),
     r"params\['q_a_layernorm.weight'\]: saved \[32\], expected \[16\]|params\['q_a_proj.weight'\]: saved \[32, 64\], expected \[16, 64\]"),
    (lambda m: m["config"].update(hidden_size=32), r"params\['.*'\]: saved \[\d+, 64\], expected \[\d+, 32\]"),
    (lambda m: m.update(num_pages=8), r"cache\['\w+'\]: saved \[4, .*\], expected \[8, .*\]"),
    (lambda m: m["config"].update(kv_cache_dtype="fp8"), r"cache\['latent'\]: saved dtype bfloat16, expected float8_e4m3fn"),
    (lambda m: m["param_dtypes"].update({"o_proj.weight": "bfloat16"}), r"params\['o_proj.weight'\]: saved dtype float32, expected bfloat16"),
    (lambda m: m["param_dtypes"].update({"o_proj.weight": "int8"}), r"param_dtypes\['o_proj.weight'\] is 'int8', not a float dtype"),
    (lambda m: m["param_dtypes"].update({"o_proj.weight": "nonsense"}), r"param_dtypes\['o_proj.weight'\] is 'nonsense'"),
    (lambda m: m["config"].update(hidden_size="64"), "saved config is damaged: .*hidden_size must be an integer"),
    (lambda m: m["config"].pop("page_size"), r"saved config has fields missing \['page_size'\]"),
    (lambda m: m["config"].update(extra=1), r"unknown \['extra'\]"),
    (lambda m: m["config"].update(rope_scaling={"factor": 4.0}), "rope_scaling must be null or an object with"),
    (lambda m: m["config"].update(rope_scaling={**dataclasses.asdict(TINY.rope_scaling), "factor": -1}),
     "saved config is damaged: invalid rope_scaling: factor must be positive"),
    (lambda m: m.update(config=[1]), "saved config is damaged: saved config must be a JSON object"),
    (lambda m: m.pop("param_dtypes"), "the saved meta has no 'param_dtypes'"),
    (lambda m: m.update(num_pages="4"), "num_pages is '4', not null or a positive int"),
])
def test_restore_refuses_meta_that_does_not_match_the_arrays(saved, tmp_path, edit, message):
    import shutil
    path = tmp_path / "ckpt"
    shutil.copytree(saved, path)
    _edit_meta(path, edit)
    with pytest.raises(ValueError, match=message):
        restore_checkpoint(path)


def test_restore_refuses_missing_or_damaged_meta_and_mismatched_arguments(saved, tmp_path):
    import shutil
    with pytest.raises(ValueError, match="q_lora_rank: saved 32, expected 16"):
        restore_checkpoint(saved, config=MLAConfig.tiny(q_lora_rank=16))
    assert restore_checkpoint(saved, config=TINY)[0] == TINY
    with pytest.raises(ValueError, match="param_shardings has no sharding for 'q_a_layernorm.weight'"):
        restore_checkpoint(saved, param_shardings={"q_a_proj.weight": jax.sharding.SingleDeviceSharding(jax.devices()[0])})
    for damage, message in [("meta not json", "saved meta .* is missing or damaged"),
                            ("meta missing", "saved meta .* is missing or damaged"),
                            ("params missing", "saved params are missing or damaged"),
                            ("cache missing", "saved cache are missing or damaged")]:
        path = tmp_path / damage.replace(" ", "_")
        shutil.copytree(saved, path)
        if damage == "meta not json":
            _meta_file(path).write_text("{")
        else:
            shutil.rmtree(path / damage.split()[0])
        with pytest.raises(ValueError, match=message):
            restore_checkpoint(path)


def test_restore_refuses_cache_dtypes_other_than_the_saved_configs(saved, tmp_path):
    import shutil
    path = tmp_path / "ckpt"
    shutil.copytree(saved, path)
    _edit_meta(path, lambda m: m["config"].update(kv_cache_dtype="float32", indexer_dtype="bfloat16"))
    with pytest.raises(ValueError, match=r"cache\['latent'\]: saved dtype bfloat16, expected float32"):
        restore_checkpoint(path)
    config = MLAConfig.tiny(kv_cache_dtype="fp8")
    path = tmp_path / "fp8"
    save_checkpoint(path, init_params(config, jax.random.key(0)), init_cache(config, 4), config=config)
    _edit_meta(path, lambda m: m["config"].update(kv_cache_dtype="bfloat16", indexer_dtype="fp8"))
    with pytest.raises(ValueError, match=r"cache\['latent'\]: saved dtype float8_e4m3fn, expected bfloat16"):
        restore_checkpoint(path)


def test_load_refuses_config_and_index_symlinked_out_of_the_directory(tmp_path):
    write_fake_checkpoint(tmp_path / "ckpt")
    for name in ("model.safetensors.index.json", "config.json"):
        real = tmp_path / "ckpt" / name
        real.rename(tmp_path / name)
        real.symlink_to(tmp_path / name)
        with pytest.raises(ValueError, match=f"names the file '{name}', which resolves to .*outside the checkpoint"):
            load_layer_from_safetensors(tmp_path / "ckpt", 0, **OVERRIDES)
