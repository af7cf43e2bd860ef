"""Checkpoints: orbax save / restore of a layer's params and cache (or of a whole stack of layers),
and loading one or every attention layer of a DeepSeek-V3.2 Hugging Face safetensors checkpoint.

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
Every file the index names must stay inside the directory (no `..`, absolute paths or symlinks
out of it, except the hub cache's snapshots/<rev>/ -> ../../blobs/ links); damaged files and
wrongly typed config fields raise ValueError naming the file (and tensor or field).

Whole models: `load_model_from_safetensors` loads every attention layer (the MTP layers,
`model.layers.{num_hidden_layers + i}`, last) as a list of params dicts, each tensor read,
dequantised and placed on its sharding (e.g. sharding.param_shardings(mesh, config)) one at a
time; `save_model_checkpoint` / `restore_model_checkpoint` keep such a list (and one cache per
layer) as one save_checkpoint directory per layer plus a stack/ item.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import shutil
from typing import Any, Callable, Mapping, Sequence

import jax
import ml_dtypes  # registers bfloat16 / float8 with numpy (safetensors' numpy reader needs bfloat16)
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from safetensors import safe_open

from .cache import PagedCache, check_cache, init_cache
from .config import MLAConfig, RopeScaling, check_config_type, read_hf_config
from .params import FP8_WEIGHT_BLOCK, check_params, hf_tensor_to_param, param_shapes, params_from_hf
from .progress import progress_bar
from .validate import check_not_deleted, is_int

FORMAT = "jax_sparse_mla.checkpoint/1"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


# ---- orbax -------------------------------------------------------------------------------------

def _config_to_json(config: MLAConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def _config_from_json(d: Any) -> MLAConfig:
    """The MLAConfig saved in meta; ValueError naming the field that is missing, unknown or wrong."""
    if not isinstance(d, Mapping):
        raise ValueError(f"saved config must be a JSON object, got {type(d).__name__}")
    d = dict(d)
    fields = {f.name for f in dataclasses.fields(MLAConfig)}
    if set(d) != fields:
        raise ValueError(f"saved config has fields missing {sorted(fields - set(d))} "
                         f"and unknown {sorted(set(d) - fields, key=str)}")
    rs = d["rope_scaling"]
    if rs is not None:
        rs_fields = {f.name for f in dataclasses.fields(RopeScaling)}
        if not isinstance(rs, Mapping) or set(rs) != rs_fields:
            raise ValueError(f"saved config's rope_scaling must be null or an object with {sorted(rs_fields)}, "
                             f"got {rs!r}")
        d["rope_scaling"] = RopeScaling(**rs)
    return MLAConfig(**d)


def _config_diff(saved: MLAConfig, expected: MLAConfig) -> str:
    return "; ".join(f"{f.name}: saved {getattr(saved, f.name)!r}, expected {getattr(expected, f.name)!r}"
                     for f in dataclasses.fields(MLAConfig) if getattr(saved, f.name) != getattr(expected, f.name))


def _check_saveable(params: Mapping[str, Any], cache: PagedCache | None, config: MLAConfig) -> None:
    """Everything a save needs of a layer, checked before anything is written: the params
    (check_params) and the cache (check_cache) match the config, and each array holds data that
    can be written (numpy or jax, not abstract, not deleted). ValueError naming the array."""
    check_params(params, config)
    arrays = {f"params[{name!r}]": value for name, value in params.items()}
    if cache is not None:
        check_cache(cache, config)
        arrays.update({f"cache.{name}": value for name, value in cache.arrays().items()})
    for what, value in arrays.items():
        if not isinstance(value, (np.ndarray, jax.Array)) or isinstance(value, jax.core.Tracer):
            raise ValueError(f"{what} is a {type(value).__name__}, not an array with data to save")
    check_not_deleted(arrays)


def _sync(tag: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"jax_sparse_mla.checkpoint:{tag}")


def _write_beside(path: pathlib.Path, write: Callable[[pathlib.Path], None]) -> None:
    """Writes a checkpoint for `path` with write(target) beside it, then puts it in place.

    target lies in a staging sibling directory (<path>.saving/); `path`, if it exists, is
    replaced only once write has returned, by renames (the old checkpoint is moved into the
    staging directory, the new one to `path`), and the old one is removed last, with the staging
    directory. A failure at any point leaves `path` as it was. A staging directory left by a
    process killed mid-save is removed first (its old checkpoint moved back if `path` is gone).
    Multi-process: every process writes its shards; the first one renames and removes.
    """
    staging = path.with_name(path.name + ".saving")
    new, replaced = staging / path.name, staging / "replaced"
    primary = jax.process_index() == 0
    if primary and staging.exists():
        if replaced.exists() and not path.exists():
            replaced.rename(path)
        shutil.rmtree(staging)
    _sync(f"staged:{path}")
    try:
        write(new)
        _sync(f"written:{path}")
        if primary:
            if path.exists():
                path.rename(replaced)
            try:
                new.rename(path)
            except BaseException:
                if replaced.exists():
                    replaced.rename(path)
                raise
    finally:
        if primary:
            shutil.rmtree(staging, ignore_errors=True)
        _sync(f"done:{path}")


def _orbax_save(path: pathlib.Path, items: Mapping[str, Any]) -> None:
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
        ckptr.save(path, args=ocp.args.Composite(**items))


def save_checkpoint(directory, params: Mapping[str, jax.Array], cache: PagedCache | None = None, *,
                    config: MLAConfig, overwrite: bool = False) -> None:
    """Saves params (HF-named dict) and optionally a PagedCache, with the config, to `directory`.

    Arrays may be sharded (each host writes its shards). Every array is checked before anything
    is written: ValueError naming a missing, non-float or misshapen parameter, a cache that does
    not match the config, or an array without data (abstract, or deleted: donated to an earlier
    call). FileExistsError if the directory exists and overwrite is False. The checkpoint is
    written beside the directory (<directory>.saving/) and moved there once complete: with
    overwrite, the old one is replaced only then, and a failure while writing leaves it as it was.
    """
    path = pathlib.Path(directory).absolute()
    check_config_type(config)
    _check_saveable(params, cache, config)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists (pass overwrite=True to replace it)")
    meta = {"format": FORMAT, "config": _config_to_json(config),
            "num_pages": None if cache is None else cache.num_pages,
            "param_dtypes": {name: str(np.dtype(p.dtype)) for name, p in params.items()}}
    items = {"params": ocp.args.StandardSave(dict(params)), "meta": ocp.args.JsonSave(meta)}
    if cache is not None:
        items["cache"] = ocp.args.StandardSave(cache.arrays())
    _write_beside(path, lambda target: _orbax_save(target, items))


def _sharding_for(shardings, name: str, what: str):
    if shardings is None:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    if isinstance(shardings, jax.sharding.Sharding):
        return shardings
    if isinstance(shardings, Mapping):
        if name not in shardings:
            raise ValueError(f"{what} has no sharding for {name!r}")
        got = shardings[name]
    else:
        got = getattr(shardings, name, None)
    if not isinstance(got, jax.sharding.Sharding):
        raise ValueError(f"{what} for {name!r} is {got!r}, not a jax.sharding.Sharding")
    return got


def _fmt(dtype, shape) -> str:
    return f"{np.dtype(dtype)}{list(shape)}"


def _check_saved_arrays(path: pathlib.Path, item: str, expected: Mapping[str, tuple[tuple[int, ...], Any]]) -> None:
    """Compares the arrays saved under path/item (orbax metadata, no data read) with {name: (shape, dtype)}."""
    try:
        saved = ocp.StandardCheckpointHandler().metadata(path / item).tree
        saved = {name: (tuple(m.shape), np.dtype(m.dtype)) for name, m in dict(saved).items()}
    except Exception as e:  # noqa: BLE001 (orbax raises assorted types for a missing or damaged item)
        raise ValueError(f"{path}: the saved {item} are missing or damaged: {type(e).__name__}: {e}") from None
    for name, (shape, dtype) in expected.items():
        if name not in saved:
            continue
        got_shape, got_dtype = saved[name]
        if got_shape != tuple(shape):
            raise ValueError(f"{path}: {item}[{name!r}]: saved {list(got_shape)}, expected {list(shape)} "
                             f"(from the saved config)")
        if got_dtype != np.dtype(dtype):
            raise ValueError(f"{path}: {item}[{name!r}]: saved dtype {got_dtype}, expected {np.dtype(dtype)}")
    for name in sorted(set(expected) - set(saved)):
        raise ValueError(f"{path}: {item}[{name!r}]: not saved, though the saved config expects it")
    for name in sorted(set(saved) - set(expected), key=str):
        raise ValueError(f"{path}: {item}[{name!r}]: saved, though the saved config has no such array")


def restore_checkpoint(directory, *, param_shardings=None, cache_shardings=None, config: MLAConfig | None = None
                       ) -> tuple[MLAConfig, dict[str, jax.Array], PagedCache | None]:
    """Restores (config, params, cache or None) saved by save_checkpoint.

    param_shardings: one Sharding for every param, or {name: Sharding}
      (e.g. sharding.param_shardings(mesh, config)); default: the first device.
    cache_shardings: one Sharding, or a PagedCache of Shardings (sharding.cache_shardings).
    config: if given, the saved config must equal it.
    Every saved array's shape and dtype is checked against the saved config before any data is
    read: a mismatch, or a missing or damaged meta / config, raises ValueError naming the array
    or field (`params['q_a_proj.weight']: saved [..], expected [..]`); FileNotFoundError if there
    is no directory.
    """
    path = pathlib.Path(directory).absolute()
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint directory {path}")
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
        try:
            meta = ckptr.restore(path, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"{path}: the saved meta (config) is missing or damaged: {type(e).__name__}: {e}") from None
        if not isinstance(meta, Mapping):
            raise ValueError(f"{path}: the saved meta is {type(meta).__name__}, not a JSON object")
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path} is not a {FORMAT} checkpoint (format {meta.get('format')!r})")
        for key in ("config", "num_pages", "param_dtypes"):
            if key not in meta:
                raise ValueError(f"{path}: the saved meta has no {key!r}")
        try:
            saved_config = _config_from_json(meta["config"])
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}: the saved config is damaged: {e}") from None
        if config is not None and saved_config != config:
            raise ValueError(f"{path}: the saved config differs from the expected one: "
                             + _config_diff(saved_config, config))
        config = saved_config
        num_pages = meta["num_pages"]
        if num_pages is not None and (not is_int(num_pages) or num_pages < 1):
            raise ValueError(f"{path}: the saved meta's num_pages is {num_pages!r}, not null or a positive int")
        shapes = param_shapes(config)
        dtypes = meta["param_dtypes"]
        if not isinstance(dtypes, Mapping) or set(dtypes) != set(shapes):
            raise ValueError(f"{path}: the saved meta's param_dtypes do not list exactly the params {sorted(shapes)}")
        param_dtypes = {}
        for name in shapes:
            try:
                dt = np.dtype(dtypes[name])
            except TypeError:
                dt = None
            if dt is None or not jax.numpy.issubdtype(dt, jax.numpy.floating) or dt.name.startswith("float8"):
                raise ValueError(f"{path}: the saved meta's param_dtypes[{name!r}] is {dtypes[name]!r}, not a float dtype")
            param_dtypes[name] = dt
        _check_saved_arrays(path, "params", {name: (shape, param_dtypes[name]) for name, shape in shapes.items()})
        params_target = {name: jax.ShapeDtypeStruct(shape, param_dtypes[name],
                                                    sharding=_sharding_for(param_shardings, name, "param_shardings"))
                         for name, shape in shapes.items()}
        items = {"params": ocp.args.StandardRestore(params_target)}
        if num_pages is not None:
            abstract = jax.eval_shape(lambda: init_cache(config, num_pages)).arrays()
            _check_saved_arrays(path, "cache", {name: (a.shape, a.dtype) for name, a in abstract.items()})
            items["cache"] = ocp.args.StandardRestore(
                {name: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=_sharding_for(cache_shardings, name, "cache_shardings"))
                 for name, a in abstract.items()})
        try:
            restored = ckptr.restore(path, args=ocp.args.Composite(**items))
        except Exception as e:  # noqa: BLE001 (e.g. a sharding that does not divide a shape, damaged data)
            raise ValueError(f"{path}: restoring the arrays failed: {type(e).__name__}: {e}") from e
    cache = None
    if num_pages is not None:
        fields = dict(restored["cache"])
        cache = PagedCache(**{f.name: fields.get(f.name) for f in dataclasses.fields(PagedCache)})
    return config, dict(restored["params"]), cache


# ---- Hugging Face safetensors ------------------------------------------------------------------

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

def _per_layer(value, config: MLAConfig, layers: list[int], what: str, is_one) -> list:
    """value for each layer: `value(config)` first when it is a callable; then one value for every
    layer (is_one(value)) or a sequence with one per layer."""
    if callable(value) and not is_one(value):
        value = value(config)
    if value is None or is_one(value):
        return [value] * len(layers)
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{what} must be a Sharding, a mapping name -> Sharding, one of those per layer, "
                         f"or a callable taking the config; got {type(value).__name__}")
    if len(value) != len(layers):
        raise ValueError(f"{what} has {len(value)} entries, one per layer is {len(layers)}")
    return list(value)


def _is_param_sharding(value) -> bool:
    return isinstance(value, (jax.sharding.Sharding, Mapping))


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
    per_layer = _per_layer(shardings, config, layers, "shardings", _is_param_sharding)
    targets = []
    for layer_idx, given in zip(layers, per_layer):
        targets.append({})
        for name, shape in shapes.items():
            what = f"shardings for layer {layer_idx}"
            sharding = _sharding_for(given, name, what)
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


# ---- orbax: a stack of layers ----------------------------------------------------------------

STACK_FORMAT = "jax_sparse_mla.checkpoint.stack/1"
STACK_ITEM = "stack"


def _layer_dir(path: pathlib.Path, layer: int) -> pathlib.Path:
    return path / f"layer_{layer}"


def _read_stack_meta(path: pathlib.Path) -> Mapping[str, Any]:
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
            meta = ckptr.restore(path / STACK_ITEM, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"{path}: the saved stack meta is missing or damaged (not a save_model_checkpoint "
                         f"directory?): {type(e).__name__}: {e}") from None
    if not isinstance(meta, Mapping) or meta.get("format") != STACK_FORMAT:
        raise ValueError(f"{path} is not a {STACK_FORMAT} checkpoint "
                         f"(format {meta.get('format') if isinstance(meta, Mapping) else meta!r})")
    return meta


def save_model_checkpoint(directory, layers: Sequence[Mapping[str, jax.Array]],
                          caches: Sequence[PagedCache] | None = None, *, config: MLAConfig,
                          overwrite: bool = False) -> None:
    """Saves a stack of layers (a list of HF-named params dicts, e.g. load_model_from_safetensors's
    or serving.Engine's .params) and optionally one PagedCache per layer (Engine's .caches).

    Layout: directory/layer_<i>/ is save_checkpoint's for layer i; directory/stack/ the number of
    layers, whether caches were saved, and the config (written last). Every array of every layer
    is checked (as save_checkpoint checks them) before anything is written: ValueError naming the
    layer and the array (`layer 1: params has no 'indexer.wk.weight'`, `layer 0: cache.latent has
    been deleted ...`). FileExistsError if the directory exists and overwrite is False; with
    overwrite, only an earlier model checkpoint (or an empty directory) is replaced, and only once
    the new one is complete (written beside it, as save_checkpoint does): a failure while writing
    leaves the old one as it was.
    """
    path = pathlib.Path(directory).absolute()
    check_config_type(config)
    if isinstance(layers, Mapping) or not isinstance(layers, Sequence) or not layers:
        raise ValueError(f"layers must be a non-empty list of per-layer params dicts, got {type(layers).__name__}")
    if caches is not None and (not isinstance(caches, Sequence) or len(caches) != len(layers)):
        raise ValueError(f"caches must be None or a list with one PagedCache per layer ({len(layers)}), "
                         f"got {type(caches).__name__}{'' if not isinstance(caches, Sequence) else f' of {len(caches)}'}")
    with_caches = caches is not None
    caches = list(caches) if with_caches else [None] * len(layers)
    for i, (params, cache) in enumerate(zip(layers, caches)):
        try:
            if with_caches and not isinstance(cache, PagedCache):
                raise ValueError(f"cache is a {type(cache).__name__}, not a PagedCache")
            _check_saveable(params, cache, config)
        except ValueError as e:
            raise ValueError(f"layer {i}: {e}") from None
    if path.exists():
        if not overwrite:
            raise FileExistsError(f"{path} exists (pass overwrite=True to replace it)")
        if not path.is_dir() or (any(path.iterdir()) and not (path / STACK_ITEM).is_dir()):
            raise ValueError(f"{path} exists and is not a model checkpoint (no {STACK_ITEM}/): not replacing it")
    meta = {"format": STACK_FORMAT, "num_layers": len(layers), "caches": with_caches,
            "config": _config_to_json(config)}

    def write(target: pathlib.Path) -> None:
        for i, (params, cache) in enumerate(zip(layers, caches)):
            save_checkpoint(_layer_dir(target, i), params, cache, config=config)
        _orbax_save(target / STACK_ITEM, {"meta": ocp.args.JsonSave(meta)})

    _write_beside(path, write)


def _is_cache_sharding(value) -> bool:
    return isinstance(value, (jax.sharding.Sharding, PagedCache))


def restore_model_checkpoint(directory, *, param_shardings=None, cache_shardings=None,
                             config: MLAConfig | None = None
                             ) -> tuple[MLAConfig, list[dict[str, jax.Array]], list[PagedCache] | None]:
    """Restores (config, [params per layer], [cache per layer] or None) saved by save_model_checkpoint.

    param_shardings: as restore_checkpoint's (one Sharding, or {name: Sharding}) for every layer,
      a sequence of those (one per layer), or a callable taking the config and returning either.
    cache_shardings: one Sharding or a PagedCache of Shardings for every layer, one per layer, or a
      callable taking the config (e.g. `functools.partial(sharding.cache_shardings, mesh)`).
    config: if given, the saved config must equal it.
    Each layer is restored by restore_checkpoint (its shapes, dtypes and config checked before
    any data is read); errors are ValueErrors naming the layer (`layer 1 of <dir>: ...`) and,
    from there, the array.
    """
    path = pathlib.Path(directory).absolute()
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint directory {path}")
    meta = _read_stack_meta(path)
    num_layers, with_caches = meta.get("num_layers"), meta.get("caches")
    if not is_int(num_layers) or num_layers < 1:
        raise ValueError(f"{path}: the saved stack meta's num_layers is {num_layers!r}, not a positive int")
    if not isinstance(with_caches, bool):
        raise ValueError(f"{path}: the saved stack meta's caches is {with_caches!r}, not true or false")
    try:
        saved_config = _config_from_json(meta.get("config"))
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: the saved stack config is damaged: {e}") from None
    if config is not None and saved_config != config:
        raise ValueError(f"{path}: the saved config differs from the expected one: " + _config_diff(saved_config, config))
    indices = list(range(num_layers))
    params_per = _per_layer(param_shardings, saved_config, indices, "param_shardings", _is_param_sharding)
    caches_per = _per_layer(cache_shardings, saved_config, indices, "cache_shardings", _is_cache_sharding)
    layers, caches = [], []
    for i in indices:
        layer_dir = _layer_dir(path, i)
        if not layer_dir.is_dir():
            raise ValueError(f"layer {i} of {path}: {layer_dir.name}/ is missing (the stack has {num_layers} layers)")
        try:
            _, params, cache = restore_checkpoint(layer_dir, param_shardings=params_per[i],
                                                  cache_shardings=caches_per[i], config=saved_config)
        except ValueError as e:
            raise ValueError(f"layer {i} of {path}: {e}") from e
        if (cache is not None) != with_caches:
            raise ValueError(f"layer {i} of {path}: {'no' if with_caches else 'a'} cache saved, though the stack "
                             f"was saved {'with' if with_caches else 'without'} caches")
        layers.append(params)
        caches.append(cache)
    return saved_config, layers, caches if with_caches else None
