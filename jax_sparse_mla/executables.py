"""A directory of compiled programs, so that a restarted process loads its programs without
tracing, lowering or compiling them.

Why: jax's persistent compilation cache is keyed by the lowered module, so a process has to trace
and lower a program before it can look it up, and lowering this library's Mosaic GPU kernels
costs seconds of Python each (layout inference, dialect lowering): most of a restarted
engine's warm-up. A store entry is keyed by what decides the program instead (the function,
its static arguments, its arguments' shapes, dtypes and shardings, the library's source, jax and
the devices), and holds the serialized XLA executable (jax.experimental.serialize_executable).

Loading an entry unpickles it: point a store only at a directory that no one else writes.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import pickle
import re
import sys
import tempfile
import warnings

import jax
from jax.experimental.serialize_executable import deserialize_and_load, serialize

_PACKAGES = ("jax_sparse_mla", "pallas_kernels")  # the source a program is built from


@functools.cache
def source_digest() -> str:
    """sha256 of every .py file of this library's packages (path and content): a store entry
    written by other code is never loaded."""
    h = hashlib.sha256()
    root = pathlib.Path(__file__).resolve().parent.parent
    for package in _PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def program_name(fn) -> str:
    """fn's module and name, a store key's name for its program: only a function defined at
    module level in this library's packages (the source digest covers it and the jit options
    written beside it), never a lambda, closure or partial, whose name does not tell its program
    apart (ValueError)."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    defined = getattr(sys.modules.get(module), name, None) if module and name else None
    if defined is None or defined not in (fn, getattr(fn, "__wrapped__", None)) or module.split(".")[0] not in _PACKAGES:
        raise ValueError(f"store= needs program functions defined at module level in {' or '.join(_PACKAGES)} "
                         f"(their name and the library's source key the store), got {fn!r}")
    return f"{module}.{name}"


def _environment() -> tuple:
    """What besides the program decides its executable: jax and jaxlib, jax's tracing
    configuration (x64, matmul precision, ...), the backend and its version (driver, CUDA), the
    devices, XLA's flags, the CPU threads (interpreted kernels' choices, kernels.resolve) and this
    library's source."""
    import jaxlib
    from jax._src import config

    from .kernels import cpu_threads

    backend = jax.devices()[0].client
    tracing = re.sub(r" at 0x[0-9a-f]+", "", str(config.trace_context()))  # no object addresses
    return (jax.__version__, jaxlib.__version__, tracing, backend.platform, backend.platform_version,
            tuple(d.device_kind for d in jax.devices()), os.environ.get("XLA_FLAGS", ""), cpu_threads(),
            source_digest())


source_digest()  # of the source this process imported, not of later edits


def _signature(args) -> tuple:
    """The arguments' tree structure and each leaf's shape, dtype, weak type and sharding."""
    leaves, tree = jax.tree.flatten(args)
    return str(tree), tuple((tuple(a.shape), str(a.dtype), bool(getattr(a, "weak_type", False)),
                             str(getattr(a, "sharding", None))) for a in leaves)


class ExecutableStore:
    """Serialized executables in `directory` (created by the first save), one file per key.

    key(name, static, args): the entry's name for the program `name` (the jitted function, e.g.
      "serving.layer_stack") with static arguments `static` (a mapping whose values have stable
      reprs: frozen dataclasses, strings, numbers) called on `args` (arrays or
      ShapeDtypeStructs, any pytree), in this process's environment (_environment).
    load(key) -> jax.stages.Compiled, or None when there is no entry, or (with a warning) when
      the entry cannot be loaded (truncated, written by another jax): the caller compiles again.
    save(key, compiled): writes the entry atomically (a temporary file renamed into place), or
      warns when it cannot (a full disk, an executable that does not serialize).
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = pathlib.Path(directory)

    def key(self, name: str, static: dict, args) -> str:
        text = repr((name, sorted((k, repr(v)) for k, v in static.items()), _signature(args), _environment()))
        return hashlib.sha256(text.encode()).hexdigest()

    def _path(self, key: str) -> pathlib.Path:
        return self.directory / f"{key}.executable"

    def load(self, key: str) -> jax.stages.Compiled | None:
        path = self._path(key)
        if not path.exists():
            return None
        try:
            payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            return deserialize_and_load(payload, in_tree, out_tree)
        except Exception as e:  # noqa: BLE001 (any unreadable entry is a miss; the caller compiles)
            warnings.warn(f"executable store: cannot load {path.name} ({type(e).__name__}: {e}); compiling again",
                          stacklevel=2)
            return None

    def save(self, key: str, compiled: jax.stages.Compiled) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(pickle.dumps(serialize(compiled)))
            os.replace(tmp, self._path(key))
        except Exception as e:  # noqa: BLE001 (a program that cannot be stored still runs: compiled again next time)
            warnings.warn(f"executable store: cannot write {key}.executable ({type(e).__name__}: {e})", stacklevel=2)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
