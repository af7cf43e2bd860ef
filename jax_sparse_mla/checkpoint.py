"""Orbax checkpoints: save / restore of a layer's params and cache, or of a whole stack of layers,
so that a layer's state (fp8 caches included) survives a process and comes back sharded.

Layout (`save_checkpoint`): one directory with three items,
  params/  the HF-named params dict (arrays as given, e.g. bfloat16 [out, in]);
  cache/   the PagedCache's arrays (fp8 ones included), absent when saved without a cache;
  meta/    JSON: the MLAConfig, the cache's page count and the params' dtypes,
so that `restore_checkpoint` needs nothing but the directory (and, optionally, where to put
the arrays: e.g. `sharding.param_shardings(mesh, config)` restores each device's slice directly).

Whole models: `save_model_checkpoint` / `restore_model_checkpoint` keep a list of per-layer params
dicts (e.g. hf_checkpoint.load_model_from_safetensors's) and one cache per layer as one
save_checkpoint directory per layer plus a stack/ item.
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from .cache import PagedCache, check_cache, init_cache
from .config import MLAConfig, RopeScaling, check_config_type
from .params import check_params, param_shapes
from .validate import check_not_deleted, is_int, is_param_sharding, per_layer, sharding_for

FORMAT = "jax_sparse_mla.checkpoint/1"


# ---- one layer ---------------------------------------------------------------------------------

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
                                                    sharding=sharding_for(param_shardings, name, "param_shardings"))
                         for name, shape in shapes.items()}
        items = {"params": ocp.args.StandardRestore(params_target)}
        if num_pages is not None:
            abstract = jax.eval_shape(lambda: init_cache(config, num_pages)).arrays()
            _check_saved_arrays(path, "cache", {name: (a.shape, a.dtype) for name, a in abstract.items()})
            items["cache"] = ocp.args.StandardRestore(
                {name: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding_for(cache_shardings, name, "cache_shardings"))
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


# ---- a stack of layers -----------------------------------------------------------------------

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
    params_per = per_layer(param_shardings, saved_config, indices, "param_shardings", is_param_sharding)
    caches_per = per_layer(cache_shardings, saved_config, indices, "cache_shardings", _is_cache_sharding)
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
