"""Hugging Face checkpoints: loading one or every attention layer of a DeepSeek-V3.2 safetensors
checkpoint, so that the layer runs on DeepSeek's published weights (read lazily, a tensor at a time).

Layout (`load_layer_from_safetensors`): a directory with config.json and either
model.safetensors.index.json (`weight_map`: tensor name -> shard file) plus the shard files, or
a single model.safetensors. Layer N's tensors are `model.layers.N.self_attn.<name>` with the
names of params.param_shapes; fp8 weights come with `<name>_scale_inv` (one fp32 scale per
128x128 block) and are dequantized to config.dtype (no kernel here takes fp8 weights).
Every file the index names must stay inside the directory (no `..`, absolute paths or symlinks
out of it, except the hub cache's snapshots/<rev>/ -> ../../blobs/ links); damaged files and
wrongly typed config fields raise ValueError naming the file (and tensor or field).

Whole models: `load_model_from_safetensors` loads every attention layer (the MTP layers,
`model.layers.{num_hidden_layers + i}`, last) as a list of params dicts, each tensor read,
dequantised and placed on its sharding (e.g. sharding.param_shardings(mesh, config)) one at a
time (checkpoint.save_model_checkpoint keeps such a list).
"""

from __future__ import annotations

import contextlib
import json
import pathlib
from typing import Any, Mapping, Sequence

import jax
import ml_dtypes  # registers bfloat16 / float8 with numpy (safetensors' numpy reader needs bfloat16)
import numpy as np
from safetensors import safe_open

from .config import MLAConfig, read_hf_config
from .params import FP8_WEIGHT_BLOCK, hf_tensor_to_param, param_shapes, params_from_hf
from .progress import progress_bar
from .validate import is_int, is_param_sharding, per_layer, sharding_for

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


# safetensors' numpy reader looks float8 dtypes up on the numpy module, which has none: those
# tensors are read from their byte range instead (the format: 8-byte header size, JSON header
# with each tensor's dtype, shape and data_offsets, then the data).
_RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # weights: these, or fp8 (_RAW_DTYPES) with a weight_scale_inv


def _confined(directory: pathlib.Path, name: Any, source: str) -> pathlib.Path:
    """directory / name, refused (ValueError) unless it stays inside directory once resolved.

    `..`, absolute paths and symlinks out of the directory are refused; the one exception is the
    Hugging Face hub cache, whose snapshots/<revision>/ files are symlinks into ../../blobs/.
    """
    if not isinstance(name, str) or not name or "\x00" in name:
        raise ValueError(f"{source} in {directory} names the file {name!r}, which is not a file name")
    parts = pathlib.PurePosixPath(name.replace("\\", "/")).parts
    if pathlib.PurePosixPath(name).is_absolute() or pathlib.PureWindowsPath(name).is_absolute() or ".." in parts:
        raise ValueError(f"{source} in {directory} names the file {name!r}, which is outside the checkpoint directory")
    root = directory.resolve()
    target = (directory / name).resolve()
    hub_blobs = root.parent.parent / "blobs" if root.parent.name == "snapshots" else None
    if not (target.is_relative_to(root) or (hub_blobs is not None and target.parent == hub_blobs)):
        raise ValueError(f"{source} in {directory} names the file {name!r}, which resolves to {target}, "
                         f"outside the checkpoint directory (a symlink out of it?)")
    return directory / name


def _read_json(path: pathlib.Path) -> Any:
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def _open_safetensors(path: pathlib.Path, stack: contextlib.ExitStack):
    if not path.is_file():
        raise FileNotFoundError(f"safetensors file {path} is missing")
    try:
        f = stack.enter_context(safe_open(str(path), framework="np"))
        return f, set(f.keys())
    except Exception as e:  # noqa: BLE001 (SafetensorError for a cut file or a bad header, and others)
        raise ValueError(f"{path} is not a valid safetensors file (cut short or bad header?): "
                         f"{type(e).__name__}: {e}") from None


class _ShardFile:
    """One opened safetensors file; tensors are read on request, one at a time."""

    def __init__(self, path: pathlib.Path, stack: contextlib.ExitStack):
        self.path = path
        self.file, self.names = _open_safetensors(path, stack)
        self._header = None

    def shape_and_dtype(self, name: str) -> tuple[tuple[int, ...], str]:
        if name not in self.names:
            raise ValueError(f"{self.path.name} has no tensor {name!r}, though the index lists it there")
        try:
            s = self.file.get_slice(name)
            return tuple(s.get_shape()), s.get_dtype()
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"tensor {name!r} in {self.path} cannot be read: {type(e).__name__}: {e}") from None

    def read(self, name: str) -> np.ndarray:
        shape, dtype = self.shape_and_dtype(name)
        try:
            if dtype not in _RAW_DTYPES:
                return self.file.get_tensor(name)
            if self._header is None:
                with open(self.path, "rb") as f:
                    size = int.from_bytes(f.read(8), "little")
                    self._header = (8 + size, json.loads(f.read(size)))
            data_start, header = self._header
            begin, end = header[name]["data_offsets"]
            count = int(np.prod(shape, dtype=np.int64))
            if end - begin != count:
                raise ValueError(f"data_offsets {[begin, end]} hold {end - begin} bytes, the shape needs {count}")
            raw = np.fromfile(self.path, dtype=np.uint8, count=count, offset=data_start + begin)
            if raw.size != count:
                raise ValueError(f"the file ends after {raw.size} of its {count} bytes")
            return raw.view(_RAW_DTYPES[dtype]).reshape(shape)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"tensor {name!r} in {self.path} cannot be read: {type(e).__name__}: {e}") from None


def _weight_map(directory: pathlib.Path) -> tuple[dict[str, str], str]:
    """(tensor name -> file name, description of where the map came from).

    Every file name is checked to stay inside `directory` (see _confined); a damaged index
    (not JSON, no weight_map, not str -> str) raises ValueError naming it.
    """
    index = directory / INDEX_FILE
    if index.is_file():
        _confined(directory, INDEX_FILE, "the index")
        data = _read_json(index)
        if not isinstance(data, dict) or "weight_map" not in data:
            raise ValueError(f"{index} has no 'weight_map' (a JSON object with one is expected)")
        weight_map = data["weight_map"]
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: weight_map must be an object (tensor name -> file name), "
                             f"got {type(weight_map).__name__}")
        for key, value in weight_map.items():
            if not isinstance(value, str):
                raise ValueError(f"{index}: weight_map[{key!r}] must be a file name (str), got {value!r}")
        for file_name in sorted(set(weight_map.values())):
            _confined(directory, file_name, INDEX_FILE)
        return weight_map, INDEX_FILE
    single = directory / SINGLE_FILE
    if single.is_file():
        _confined(directory, SINGLE_FILE, "the checkpoint")
        with contextlib.ExitStack() as stack:
            _, names = _open_safetensors(single, stack)
        return dict.fromkeys(names, SINGLE_FILE), SINGLE_FILE
    raise FileNotFoundError(f"{directory} has neither {INDEX_FILE} nor {SINGLE_FILE}")


def _optional_int(hf: Mapping[str, Any], key: str, default):
    value = hf.get(key)
    if value is None:
        return default
    if not is_int(value) or value < 0:
        raise ValueError(f"{key} must be a non-negative int, got {value!r}")
    return value


def _hf_config(directory: pathlib.Path, config_overrides: Mapping[str, Any]
               ) -> tuple[MLAConfig, int | None, pathlib.Path]:
    """(config, number of attention layers (MTP included) or None, the config.json path).

    The file is read as MLAConfig.from_hf_config(path) reads it (config.read_hf_config), then
    the loaders' fields beside the layer's are checked. ValueError naming config.json and the
    field for a damaged or wrongly typed config.
    """
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} is missing")
    _confined(directory, "config.json", "the checkpoint")
    hf, where = read_hf_config(config_file)
    try:
        num_layers = _optional_int(hf, "num_hidden_layers", None)
        if num_layers is not None:
            num_layers += _optional_int(hf, "num_nextn_predict_layers", 0)  # DeepSeek's MTP layers come after the others
        quant = hf.get("quantization_config")
        if quant is not None and not isinstance(quant, dict):
            raise ValueError(f"quantization_config must be an object, got {quant!r}")
        block = (quant or {}).get("weight_block_size")
        if block is not None and (not isinstance(block, list) or block != [FP8_WEIGHT_BLOCK, FP8_WEIGHT_BLOCK]
                                  or any(isinstance(b, bool) for b in block)):
            raise ValueError(f"fp8 weight_block_size {block!r} is not supported (only [128, 128])")
        config = MLAConfig.from_hf_config(hf, **config_overrides)
    except ValueError as e:
        raise ValueError(f"{where}{e}") from None
    return config, num_layers, config_file


def load_hf_config(path, **config_overrides) -> MLAConfig:
    """The MLAConfig of a Hugging Face DeepSeek-V3.2 checkpoint directory's config.json (with
    config_overrides applied, as the loaders take them): e.g. to build shardings before loading.
    MLAConfig.from_hf_config(path / "config.json") gives the same config; this also checks the
    fields the loaders read (num_hidden_layers, num_nextn_predict_layers, the fp8 weight block)."""
    return _hf_config(pathlib.Path(path), config_overrides)[0]


def _layer_tensors(directory: pathlib.Path, weight_map: Mapping[str, str], source: str, config: MLAConfig,
                   layer_idx: int) -> tuple[str, dict[str, tuple[int, ...]]]:
    """(prefix, {full tensor name: expected shape}) of one attention layer: its weights and the
    weight_scale_inv of those that have one. ValueError naming the index and a missing tensor."""
    prefix = f"model.layers.{layer_idx}.self_attn."
    wanted: dict[str, tuple[int, ...]] = {}  # full tensor name -> expected shape
    for name, shape in param_shapes(config).items():
        full = prefix + name
        if full not in weight_map:
            raise ValueError(f"{source} in {directory} has no tensor {full!r}")
        wanted[full] = shape
        if full + "_scale_inv" in weight_map:
            if len(shape) != 2:
                raise ValueError(f"{source} in {directory} lists {full}_scale_inv beside the {len(shape)}-D tensor "
                                 f"{full!r}: only 2-D weights are fp8 with block scales")
            wanted[full + "_scale_inv"] = tuple(-(-n // FP8_WEIGHT_BLOCK) for n in shape)
    return prefix, wanted


def _by_file(weight_map: Mapping[str, str], wanted) -> dict[str, list[str]]:
    by_file: dict[str, list[str]] = {}
    for full in wanted:
        by_file.setdefault(weight_map[full], []).append(full)
    return by_file


def _check_layer_tensors(files: Mapping[str, _ShardFile], by_file: Mapping[str, list[str]],
                         wanted: Mapping[str, tuple[int, ...]], prefix: str) -> None:
    """Every wanted tensor's shape and dtype from its file's header (no data read): ValueError
    naming the tensor and the file."""
    for file_name, names in by_file.items():
        for full in names:
            shape, dtype = files[file_name].shape_and_dtype(full)
            if shape != wanted[full]:
                raise ValueError(f"tensor {full!r} in {file_name} has shape {shape}, expected {wanted[full]}")
            is_scale = full.endswith("_scale_inv")
            local = full[len(prefix):]
            if is_scale and dtype not in _FLOAT_DTYPES:
                raise ValueError(f"tensor {full!r} in {file_name} has dtype {dtype}, expected F32 "
                                 f"(a weight_scale_inv must be {'/'.join(_FLOAT_DTYPES)})")
            if not is_scale and dtype not in _FLOAT_DTYPES + tuple(_RAW_DTYPES):
                raise ValueError(f"tensor {full!r} in {file_name} has dtype {dtype}: weights must be floating "
                                 f"point ({'/'.join(_FLOAT_DTYPES)}, or fp8 with a weight_scale_inv)")
            if not is_scale and dtype in _RAW_DTYPES and full + "_scale_inv" not in wanted:
                raise ValueError(f"tensor {full!r} in {file_name}: {local!r} is fp8 but has no {local}_scale_inv")
            if not is_scale and dtype not in _RAW_DTYPES and full + "_scale_inv" in wanted:
                raise ValueError(f"tensor {full!r} in {file_name} has dtype {dtype} but a weight_scale_inv: "
                                 f"only fp8 weights have one")


def load_layer_from_safetensors(path, layer_idx: int, **config_overrides) -> tuple[MLAConfig, dict[str, jax.Array]]:
    """(config, params) of attention layer `layer_idx` of a Hugging Face DeepSeek-V3.2 checkpoint.

    path: the checkpoint directory (config.json plus safetensors, see the module docstring).
    config_overrides: MLAConfig fields that config.json does not hold or that you want changed
      (page_size, dtype, kv_cache_dtype, indexer_dtype, ...).
    Only this layer's attention tensors are read, one at a time. Raises ValueError naming the
    file (and the tensor) that is missing, misshapen, not floating point (fp8 needs its
    weight_scale_inv), damaged (cut short, bad header, bad JSON, wrongly typed config fields), or
    outside the directory (index entries with `..`, absolute paths, symlinks out of it).
    """
    directory = pathlib.Path(path)
    if not is_int(layer_idx):
        raise ValueError(f"layer_idx must be an integer, got {layer_idx!r}")
    config, num_layers, config_file = _hf_config(directory, config_overrides)
    if num_layers is not None and not 0 <= layer_idx < num_layers:
        raise ValueError(f"layer_idx {layer_idx} is out of range: {config_file} has {num_layers} layers")

    weight_map, source = _weight_map(directory)
    prefix, wanted = _layer_tensors(directory, weight_map, source, config, layer_idx)
    by_file = _by_file(weight_map, wanted)
    with contextlib.ExitStack() as stack:
        files = {name: _ShardFile(_confined(directory, name, source), stack) for name in by_file}
        _check_layer_tensors(files, by_file, wanted, prefix)  # every shape and dtype is checked before any data is read
        state = {full: files[file_name].read(full) for file_name, names in by_file.items() for full in names}
    try:
        return config, params_from_hf(state, config)
    except ValueError as e:
        raise ValueError(f"layer {layer_idx} of {directory}: {e}") from None


# ---- every attention layer of a checkpoint, placed as they are read ----------------------------

def _place(value: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """value as a jax.Array with `sharding`: each device receives only its own slice."""
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def load_model_from_safetensors(path, *, layers: Sequence[int] | None = None, shardings=None,
                                progress: bool | None = None, **config_overrides
                                ) -> tuple[MLAConfig, list[dict[str, jax.Array]]]:
    """(config, [params of each attention layer]) of a Hugging Face DeepSeek-V3.2 checkpoint.

    layers: the layer indices to load, in this order (default: every one, 0 .. num_hidden_layers
      + num_nextn_predict_layers - 1: the MTP layers come last, as `model.layers.{num_hidden_layers
      + i}.self_attn.*`). The list's first num_hidden_layers entries are what `serving.Engine(
      params=...)` takes for the model's stack.
    shardings: where each array goes: None (the first device), one Sharding for every array, a
      mapping param name -> Sharding (e.g. sharding.param_shardings(mesh, config)), a sequence with
      one of those per loaded layer, or a callable taking the config and returning any of those
      (e.g. `functools.partial(param_shardings, mesh)`; see also load_hf_config).
    progress: a tqdm bar over the tensors (None: only when stderr is a terminal).
    config_overrides: as load_layer_from_safetensors's.
    Lazy: every tensor's shape and dtype (from the shard headers) is checked for every layer
    first; then the tensors are read one at a time, dequantised on the host (fp8 with their
    weight_scale_inv) and placed with jax.make_array_from_callback, each device receiving only
    its own slice. The arrays equal load_layer_from_safetensors(path, i)'s. Errors as there:
    ValueError naming the file, the layer and the tensor (`model.layers.N.self_attn.<name>`).
    """
    directory = pathlib.Path(path)
    config, num_layers, config_file = _hf_config(directory, config_overrides)
    if layers is None:
        if num_layers is None:
            raise ValueError(f"{config_file} has no num_hidden_layers: pass layers=[...] (the indices to load)")
        layers = list(range(num_layers))
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or not layers:
        raise ValueError(f"layers must be a non-empty sequence of layer indices, got {layers!r}")
    layers = list(layers)
    for layer_idx in layers:
        if not is_int(layer_idx):
            raise ValueError(f"layers must hold integers, got {layer_idx!r}")
        if num_layers is not None and not 0 <= layer_idx < num_layers:
            raise ValueError(f"layer {layer_idx} is out of range: {config_file} has {num_layers} layers")
    if len(set(layers)) != len(layers):
        raise ValueError(f"layers lists a layer twice: {layers}")
    shapes = param_shapes(config)
    shardings_per = per_layer(shardings, config, layers, "shardings", is_param_sharding)
    targets = []
    for layer_idx, given in zip(layers, shardings_per):
        targets.append({})
        for name, shape in shapes.items():
            what = f"shardings for layer {layer_idx}"
            sharding = sharding_for(given, name, what)
            spec = getattr(sharding, "spec", ())
            try:
                if len(spec) > len(shape):
                    raise ValueError(f"its spec {spec} has more entries than the array has dimensions")
                sharding.shard_shape(shape)
            except Exception as e:  # noqa: BLE001
                raise ValueError(f"{what}: {name!r} (shape {shape}) cannot take {sharding}: {e}") from None
            targets[-1][name] = sharding

    weight_map, source = _weight_map(directory)
    plans = [(layer_idx, *_layer_tensors(directory, weight_map, source, config, layer_idx)) for layer_idx in layers]
    needed = sorted({weight_map[full] for _, _, wanted in plans for full in wanted})
    out = []
    with contextlib.ExitStack() as stack:
        files = {name: _ShardFile(_confined(directory, name, source), stack) for name in needed}
        for _, prefix, wanted in plans:  # every layer's shapes and dtypes before any data is read
            _check_layer_tensors(files, _by_file(weight_map, wanted), wanted, prefix)
        bar = stack.enter_context(progress_bar(total=len(plans) * len(shapes), progress=progress,
                                               desc="loading attention layers", unit="tensor", leave=False))
        for (layer_idx, prefix, wanted), target in zip(plans, targets):
            bar.set_postfix_str(f"layer {layer_idx}")
            params = {}
            for name in shapes:
                full = prefix + name
                file_name = weight_map[full]
                weight = files[file_name].read(full)
                scale_name = full + "_scale_inv"
                scale = files[weight_map[scale_name]].read(scale_name) if scale_name in wanted else None
                try:
                    value = hf_tensor_to_param(full, weight, scale, config)
                except ValueError as e:
                    raise ValueError(f"layer {layer_idx} of {directory}: {e} (in {file_name})") from None
                del weight, scale
                try:
                    params[name] = _place(value, target[name])
                except Exception as e:  # noqa: BLE001
                    raise ValueError(f"layer {layer_idx} of {directory}: placing tensor {full!r} on "
                                     f"{target[name]} failed: {type(e).__name__}: {e}") from e
                del value
                bar.update()
            out.append(params)
    return config, out
