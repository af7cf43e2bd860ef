"""Checkpoints: orbax save / restore of a layer's params and cache, and loading one attention layer
of a DeepSeek-V3.2 Hugging Face safetensors checkpoint.

Orbax layout (`save_checkpoint`): one directory with three items,
  params/  the HF-named params dict (arrays as given, e.g. bfloat16 [out, in]);
  cache/   the PagedCache's arrays (fp8 ones included), absent when saved without a cache;
  meta/    JSON: the MLAConfig, the cache's page count and the params' dtypes,
so that `restore_checkpoint` needs nothing but the directory (and, optionally, where to put
the arrays: e.g. `sharding.param_shardings(mesh, config)` restores each device's slice directly).

Hugging Face layout (`load_layer_from_safetensors`): a directory with config.json and either
model.safetensors.index.json (`weight_map`: tensor name -> shard file) plus the shard files, or
a single model.safetensors. Layer N's tensors are `model.layers.N.self_attn.<name>` with the
names of params.param_shapes; fp8 weights come with `<name>_scale_inv` (one fp32 scale per
128x128 block) and are dequantized to config.dtype (no kernel here takes fp8 weights).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
from typing import Any, Mapping

import jax
import ml_dtypes  # registers bfloat16 / float8 with numpy (safetensors' numpy reader needs bfloat16)
import numpy as np
import orbax.checkpoint as ocp
from safetensors import safe_open

from .cache import PagedCache, check_cache, init_cache
from .config import MLAConfig, RopeScaling
from .params import FP8_WEIGHT_BLOCK, check_params, param_shapes, params_from_hf

FORMAT = "jax_sparse_mla.checkpoint/1"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


# ---- orbax -------------------------------------------------------------------------------------

def _config_to_json(config: MLAConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def _config_from_json(d: Mapping[str, Any]) -> MLAConfig:
    d = dict(d)
    if d.get("rope_scaling") is not None:
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    return MLAConfig(**d)


def _cache_fields(cache: PagedCache) -> dict[str, jax.Array]:
    return {f.name: getattr(cache, f.name) for f in dataclasses.fields(cache) if getattr(cache, f.name) is not None}


def save_checkpoint(directory, params: Mapping[str, jax.Array], cache: PagedCache | None = None, *,
                    config: MLAConfig, overwrite: bool = False) -> None:
    """Saves params (HF-named dict) and optionally a PagedCache, with the config, to `directory`.

    Arrays may be sharded (each host writes its shards). Raises ValueError naming a missing or
    misshapen parameter, or a cache that does not match the config; FileExistsError if the
    directory exists and overwrite is False.
    """
    path = pathlib.Path(directory).absolute()
    check_params(params, config)
    if cache is not None:
        check_cache(cache, config)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists (pass overwrite=True to replace it)")
    meta = {"format": FORMAT, "config": _config_to_json(config),
            "num_pages": None if cache is None else cache.num_pages,
            "param_dtypes": {name: str(np.dtype(p.dtype)) for name, p in params.items()}}
    items = {"params": ocp.args.StandardSave(dict(params)), "meta": ocp.args.JsonSave(meta)}
    if cache is not None:
        items["cache"] = ocp.args.StandardSave(_cache_fields(cache))
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
        ckptr.save(path, args=ocp.args.Composite(**items), force=overwrite)


def _sharding_for(shardings, name: str):
    if shardings is None:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    if isinstance(shardings, jax.sharding.Sharding):
        return shardings
    return shardings[name] if isinstance(shardings, Mapping) else getattr(shardings, name)


def restore_checkpoint(directory, *, param_shardings=None, cache_shardings=None
                       ) -> tuple[MLAConfig, dict[str, jax.Array], PagedCache | None]:
    """Restores (config, params, cache or None) saved by save_checkpoint.

    param_shardings: one Sharding for every param, or {name: Sharding}
      (e.g. sharding.param_shardings(mesh, config)); default: the first device.
    cache_shardings: one Sharding, or a PagedCache of Shardings (sharding.cache_shardings).
    """
    path = pathlib.Path(directory).absolute()
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint directory {path}")
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
        meta = ckptr.restore(path, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path} is not a {FORMAT} checkpoint (format {meta.get('format')!r})")
        config = _config_from_json(meta["config"])
        params_target = {name: jax.ShapeDtypeStruct(shape, np.dtype(meta["param_dtypes"][name]),
                                                    sharding=_sharding_for(param_shardings, name))
                         for name, shape in param_shapes(config).items()}
        items = {"params": ocp.args.StandardRestore(params_target)}
        if meta["num_pages"] is not None:
            abstract = jax.eval_shape(lambda: init_cache(config, meta["num_pages"]))
            items["cache"] = ocp.args.StandardRestore(
                {name: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=_sharding_for(cache_shardings, name))
                 for name, a in _cache_fields(abstract).items()})
        restored = ckptr.restore(path, args=ocp.args.Composite(**items))
    cache = None
    if meta["num_pages"] is not None:
        fields = dict(restored["cache"])
        cache = PagedCache(**{f.name: fields.get(f.name) for f in dataclasses.fields(PagedCache)})
    return config, dict(restored["params"]), cache


# ---- Hugging Face safetensors ------------------------------------------------------------------

# safetensors' numpy reader looks float8 dtypes up on the numpy module, which has none: those
# tensors are read from their byte range instead (the format: 8-byte header size, JSON header
# with each tensor's dtype, shape and data_offsets, then the data).
_RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


class _ShardFile:
    """One opened safetensors file; tensors are read on request, one at a time."""

    def __init__(self, path: pathlib.Path, stack: contextlib.ExitStack):
        if not path.is_file():
            raise FileNotFoundError(f"safetensors file {path} is missing")
        self.path = path
        self.file = stack.enter_context(safe_open(str(path), framework="np"))
        self.names = set(self.file.keys())
        self._header = None

    def shape_and_dtype(self, name: str) -> tuple[tuple[int, ...], str]:
        if name not in self.names:
            raise ValueError(f"{self.path.name} has no tensor {name!r}, though the index lists it there")
        s = self.file.get_slice(name)
        return tuple(s.get_shape()), s.get_dtype()

    def read(self, name: str) -> np.ndarray:
        shape, dtype = self.shape_and_dtype(name)
        if dtype not in _RAW_DTYPES:
            return self.file.get_tensor(name)
        if self._header is None:
            with open(self.path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                self._header = (8 + size, json.loads(f.read(size)))
        data_start, header = self._header
        begin, end = header[name]["data_offsets"]
        raw = np.fromfile(self.path, dtype=np.uint8, count=end - begin, offset=data_start + begin)
        return raw.view(_RAW_DTYPES[dtype]).reshape(shape)


def _weight_map(directory: pathlib.Path) -> tuple[dict[str, str], str]:
    """(tensor name -> file name, description of where the map came from)."""
    index = directory / INDEX_FILE
    if index.is_file():
        with open(index) as f:
            return json.load(f)["weight_map"], INDEX_FILE
    single = directory / SINGLE_FILE
    if single.is_file():
        with safe_open(str(single), framework="np") as f:
            return dict.fromkeys(f.keys(), SINGLE_FILE), SINGLE_FILE
    raise FileNotFoundError(f"{directory} has neither {INDEX_FILE} nor {SINGLE_FILE}")


def load_layer_from_safetensors(path, layer_idx: int, **config_overrides) -> tuple[MLAConfig, dict[str, jax.Array]]:
    """(config, params) of attention layer `layer_idx` of a Hugging Face DeepSeek-V3.2 checkpoint.

    path: the checkpoint directory (config.json plus safetensors, see the module docstring).
    config_overrides: MLAConfig fields that config.json does not hold or that you want changed
      (page_size, dtype, kv_cache_dtype, indexer_dtype, ...).
    Only this layer's attention tensors are read, one at a time. Raises ValueError naming the
    tensor (and the file) that is missing, misshapen, or whose weight_scale_inv is misshapen.
    """
    directory = pathlib.Path(path)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} is missing")
    with open(config_file) as f:
        hf = json.load(f)
    num_layers = hf.get("num_hidden_layers")
    if num_layers is not None:
        num_layers += hf.get("num_nextn_predict_layers", 0)  # DeepSeek's MTP layers come after the others
        if not 0 <= layer_idx < num_layers:
            raise ValueError(f"layer_idx {layer_idx} is out of range: {config_file} has {num_layers} layers")
    block = (hf.get("quantization_config") or {}).get("weight_block_size")
    if block is not None and list(block) != [FP8_WEIGHT_BLOCK, FP8_WEIGHT_BLOCK]:
        raise ValueError(f"fp8 weight_block_size {block} is not supported (only [128, 128])")
    config = MLAConfig.from_hf_config(hf, **config_overrides)

    weight_map, source = _weight_map(directory)
    prefix = f"model.layers.{layer_idx}.self_attn."
    wanted: dict[str, tuple[int, ...]] = {}  # full tensor name -> expected shape
    for name, shape in param_shapes(config).items():
        full = prefix + name
        if full not in weight_map:
            raise ValueError(f"{source} in {directory} has no tensor {full!r}")
        wanted[full] = shape
        if full + "_scale_inv" in weight_map:
            wanted[full + "_scale_inv"] = tuple(-(-n // FP8_WEIGHT_BLOCK) for n in shape)

    by_file: dict[str, list[str]] = {}
    for full in wanted:
        by_file.setdefault(weight_map[full], []).append(full)
    with contextlib.ExitStack() as stack:
        files = {name: _ShardFile(directory / name, stack) for name in by_file}
        for file_name, names in by_file.items():  # every shape is checked before any data is read
            for full in names:
                shape, _ = files[file_name].shape_and_dtype(full)
                if shape != wanted[full]:
                    raise ValueError(f"tensor {full!r} in {file_name} has shape {shape}, expected {wanted[full]}")
        state = {full: files[file_name].read(full) for file_name, names in by_file.items() for full in names}
    return config, params_from_hf(state, config)
