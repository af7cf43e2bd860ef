"""Host-side argument checks shared by the package's entry points (the planner, the layer step,
the caches, the serving loop, the checkpoints): ValueError naming the argument."""

from __future__ import annotations

import collections.abc
import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np

INT32_MAX = 2 ** 31 - 1


def is_int(value) -> bool:
    """A Python or numpy integer; bool is not one here."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def array_scalar_hint(value) -> str:
    """The fix for a 0-d integer array where an integer is expected (jnp.int32(0) is a jax.Array,
    np.array(3) a numpy array, and is_int refuses both: sizes and ids are host values):
    "; convert it with int(...)" ("...; it is traced: call this on the host, outside jit" for a
    tracer), else "". Appended to the type messages of integer arguments."""
    dtype = array_dtype(value)
    if dtype is None or dtype.kind not in "iu" or getattr(value, "shape", None) != ():
        return ""
    if isinstance(value, jax.core.Tracer):
        return "; it is traced: call this on the host, outside jit"
    return "; convert it with int(...)"


def as_int(value, what: str, minimum: int) -> int:
    """value (a Python or numpy integer, not bool, in [minimum, 2**31)) as an int; ValueError naming `what`
    (with array_scalar_hint's hint for a 0-d array)."""
    if not is_int(value):
        raise ValueError(f"{what} must be an integer, got {value!r} ({type(value).__name__}){array_scalar_hint(value)}")
    if not minimum <= value <= INT32_MAX:
        raise ValueError(range_message(what, minimum, value))
    return int(value)


def range_message(what: str, minimum: int, value) -> str:
    """as_int's message for an integer outside [minimum, 2**31)."""
    return f"{what} must be >= {minimum}" + (", got " if value < minimum else " and < 2**31, got ") + str(value)


def as_real(value, what: str, *, finite: bool = False, positive: bool = False, nonnegative: bool = False) -> float:
    """value (an int or float, numpy's too, not bool) as a float, optionally finite, > 0 or >= 0;
    ValueError naming `what`."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{what} must be a real number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if finite and not math.isfinite(value):
        raise ValueError(f"{what} must be finite, got {value}")
    if positive and not value > 0:
        raise ValueError(f"{what} must be positive, got {value}")
    if nonnegative and not value >= 0:
        raise ValueError(f"{what} must be >= 0, got {value}")
    return value


def as_bool(value, what: str) -> bool:
    """value (a Python or numpy bool) as a bool; ValueError naming `what`."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{what} must be a bool, got {value!r}")
    return bool(value)


def check_type(value, what: str, kind, expected: str) -> None:
    """ValueError naming `what` unless value is an instance of `kind` (a type or tuple of types),
    described to the caller as `expected` ("a PagedCache (from init_cache)", ...)."""
    if not isinstance(value, kind):
        raise ValueError(f"{what} must be {expected}, got {type(value).__name__}")


def array_dtype(value) -> np.dtype | None:
    """The dtype of an array-like with a shape (numpy, jax, ShapeDtypeStruct, tracer), else None."""
    if not (hasattr(value, "shape") and hasattr(value, "dtype")) or isinstance(value, (str, bytes)):
        return None
    try:
        return np.dtype(value.dtype)
    except TypeError:
        return None


def as_page_ids(table, what: str) -> np.ndarray:
    """A block table (a list, tuple or 1-D numpy integer array of page ids, on the host) as an
    int64 array; ValueError naming `what` (or its entry `what[k]`) for what is not a table of
    integers. Entries past int64 are refused as outside int32; the int32 range of the others is
    the caller's to check (plan_batch reports it in its order of a request's problems)."""
    if isinstance(table, np.ndarray):
        if table.ndim != 1:
            raise ValueError(f"{what} must be 1-D, got a numpy array of shape {table.shape}")
        if table.dtype.kind not in "iu":
            raise ValueError(f"{what} must hold integer page ids, got a numpy array of dtype {table.dtype}")
        if table.dtype == np.uint64 and table.size and table.max() > np.iinfo(np.int64).max:
            k = int(np.argmax(table > INT32_MAX))
            raise ValueError(f"{what}[{k}] = {table[k]} is outside int32")
        return table.astype(np.int64)
    if isinstance(table, (str, bytes)) or not isinstance(table, collections.abc.Sequence):
        hint = "; convert it with np.asarray(...)" if isinstance(table, jax.Array) else ""
        raise ValueError(f"{what} must be a list, tuple or 1-D numpy integer array of page ids (on the host), "
                         f"got {type(table).__name__}{hint}")
    values = table if isinstance(table, list) else list(table)
    if not all(type(v) is int for v in values):  # (fast path: plain ints)
        for k, v in enumerate(values):
            if not is_int(v):
                raise ValueError(f"{what}[{k}] must be an integer page id, got {v!r} ({type(v).__name__})"
                                 f"{array_scalar_hint(v)}")
        values = [int(v) for v in values]
    try:
        return np.array(values, np.int64)
    except OverflowError:  # an entry past int64
        k = next(k for k, v in enumerate(values) if not -INT32_MAX - 1 <= v <= INT32_MAX)
        raise ValueError(f"{what}[{k}] = {values[k]} is outside int32") from None


def check_not_deleted(arrays: Mapping[str, Any]) -> None:
    """ValueError naming the first of `arrays` ({its name in the message: value}) that is a deleted
    jax.Array (donated to an earlier call, or .delete()d), and the fix: a step donates its input
    cache, so the next call takes the cache that step returned. Other values (numpy arrays,
    abstract values, tracers) pass."""
    for what, value in arrays.items():
        if isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer) and value.is_deleted():
            raise ValueError(f"{what} has been deleted: donated to an earlier call, or .delete()d. jit_forward, "
                             "jit_sharded_forward and data_parallel_step donate their input cache: pass the cache "
                             "that call returned (out, cache = jit_forward(..., cache, ...)), not its input")


def sharding_for(shardings, name: str, what: str):
    """The Sharding for array `name` out of a shardings argument (`what` in messages): None (the
    first device), one Sharding for every array, a mapping name -> Sharding, or an object with
    one attribute per name (a PagedCache of Shardings). ValueError naming `what` and the array."""
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


def per_layer(value, config, layers: list[int], what: str, is_one) -> list:
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


def is_param_sharding(value) -> bool:
    """One params-shardings value (a Sharding, or a mapping name -> Sharding), not one per layer."""
    return isinstance(value, (jax.sharding.Sharding, Mapping))
