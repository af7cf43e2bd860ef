"""The jax versions these kernels are tested with, checked when pallas_kernels is imported, and
the one workaround of a jax behaviour in that range (reproducible Mosaic GPU lowering, below).

The kernels use Pallas, Mosaic GPU and Triton lowering internals (`jax._src.pallas`,
`jax._src.lib`, `jax.experimental.mosaic.gpu`) that change between jax minor releases without
notice, so a jax outside the tested range fails at import with a message naming the range,
instead of failing later inside a kernel's lowering. The range is the one pyproject.toml
declares (`jax>=0.11.2,<0.12`; tests/test_packaging.py checks that the two agree). Set
JAX_SPARSE_MLA_SKIP_JAX_CHECK=1 to import anyway (trying a new jax release).

Reproducible Mosaic GPU lowering: jax 0.11 stamps each Mosaic GPU kernel module it lowers with
`mosaic_gpu.dump_basename = "<kernel>_<n>"`, n a process-wide counter (the file name of debug
dumps), and the serialized module, counter included, is the kernel's identity: its hash keys the
runtime's compiled-kernel cache, and the program that carries it keys jax's compilation caches.
So the n-th lowering of a kernel is a new kernel (compiled again by every program that holds
it) and a new program (a program compiled ahead of time or by another process is not found).
`reproducible_mosaic_gpu_lowering` drops the attribute before the module is serialized (the
runtime sets its own when it dumps), so a kernel lowers to the same bytes every time.

Memoized Mosaic GPU lowering: lowering a Mosaic GPU kernel (layout inference, dialect lowering)
is Python that costs up to seconds a kernel, and jax lowers every call site of every program
again, though a serving engine's programs hold the same kernels many times (its 30 programs at
DeepSeek-V3.2 limits: 313 kernel lowerings of 93 distinct kernels, 179 of 305 lowering seconds on
repeats). `memoized_mosaic_gpu_lowering` keeps each distinct kernel's lowered module (as MLIR
bytecode) for the process and hands later lowerings a copy parsed into their own context.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import io
import os
import re
import threading
import types

MIN_JAX = (0, 11, 2)  # inclusive
MAX_JAX = (0, 12, 0)  # exclusive
SUPPORTED = f">={'.'.join(map(str, MIN_JAX))},<{'.'.join(map(str, MAX_JAX[:2]))}"
SKIP_ENV = "JAX_SPARSE_MLA_SKIP_JAX_CHECK"


def parse_version(version: str) -> tuple[int, int, int]:
    """'0.11.2', '0.11.2.dev20261201', '0.12.0rc1' -> (major, minor, patch) of the release."""
    m = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", version)
    if m is None:
        raise ValueError(f"cannot parse jax version {version!r}")
    return int(m[1]), int(m[2]), int(m[3] or 0)


def check_jax_version(version: str) -> None:
    """Raises ImportError naming the supported range when `version` is outside it."""
    try:
        release = parse_version(version)
    except ValueError as e:
        raise ImportError(f"pallas_kernels supports jax{SUPPORTED}: {e}") from None
    if not MIN_JAX <= release < MAX_JAX:
        raise ImportError(
            f"pallas_kernels supports jax{SUPPORTED} (it uses Pallas / Mosaic GPU internals that change "
            f"between jax releases); found jax {version}. Install a supported jax "
            f"(pip install 'jax{SUPPORTED}'), or set {SKIP_ENV}=1 to import anyway.")


def _check_installed_jax() -> None:
    if os.environ.get(SKIP_ENV, "") not in ("", "0"):
        return
    import jax

    check_jax_version(jax.__version__)


DUMP_BASENAME = "mosaic_gpu.dump_basename"


def reproducible_mosaic_gpu_lowering() -> None:
    """Makes Mosaic GPU kernels lower without the dump-name counter (the module docstring says
    why): wraps jax.experimental.mosaic.gpu.core._run_serde_pass, which serializes every kernel
    module before it is hashed. Idempotent."""
    from jax.experimental.mosaic.gpu import core

    serde = core._run_serde_pass
    if hasattr(serde, "wrapped"):  # already this wrapper
        return

    def run_serde_pass(module, *, serialize, ir_version=None):
        attrs = module.operation.attributes
        if serialize and DUMP_BASENAME in attrs:
            del attrs[DUMP_BASENAME]
        return serde(module, serialize=serialize, ir_version=ir_version)

    run_serde_pass.wrapped = serde  # jax's own (tests/test_precompile.py shows why it is wrapped)
    core._run_serde_pass = run_serde_pass


def _unprinted(value, out: list, seen: set[int]) -> bool:
    """What a kernel jaxpr's equation parameter `value` holds that the jaxpr's printed text does
    not show, appended to `out`: nested jaxprs' constants (they print as names only): a tracer of
    the enclosing program by its type, a concrete array by its bytes. False when `value` holds
    something that cannot be told apart: a function defined inside another (a closure: its
    captured values do not print, and jax prints any object address as 0xXXXX) or a callable
    object printed by its address, at any depth (tuples, partials, sub-jaxprs; a jaxpr met again is not walked again)."""
    from jax._src import core

    if isinstance(value, (core.ClosedJaxpr, core.Jaxpr)):  # (in jax 0.11 a Jaxpr is also a ClosedJaxpr)
        if id(value) in seen:
            return True
        seen.add(id(value))
        for c in getattr(value, "consts", ()):
            out.append(str(c.aval) if isinstance(c, core.Tracer) else _digest(c))
        jaxpr = value if isinstance(value, core.Jaxpr) else value.jaxpr
        return all(_unprinted(v, out, seen) for eqn in jaxpr.eqns for v in eqn.params.values())
    if isinstance(value, (tuple, list)):
        return all(_unprinted(v, out, seen) for v in value)
    if isinstance(value, functools.partial):
        return all(_unprinted(v, out, seen) for v in (value.func, value.args, tuple(value.keywords.values())))
    if isinstance(value, types.FunctionType):
        return "<locals>" not in value.__qualname__ and value.__closure__ is None
    if isinstance(value, (types.BuiltinFunctionType, type)) or not callable(value):
        return True
    return re.search(r" at 0x[0-9a-fA-F]+", repr(value)) is None  # a callable object that prints its state


def _digest(array) -> str:
    import numpy as np

    a = np.ascontiguousarray(np.asarray(array))
    return f"{a.dtype}{a.shape}:" + hashlib.sha256(memoryview(a).tobytes()).hexdigest()


def _kernel_key(jax_mesh, axis_names, grid, block, cluster, in_shapes, out_shapes, jaxpr, params,
                consts) -> str | None:
    """sha256 of everything a kernel's lowering reads: the kernel's jaxpr (printed: every equation
    with its parameters, and what printing leaves out: _unprinted), where it was written, its
    grid / block / cluster / mesh, its operands' shapes and dtypes, its compiler parameters and
    its constants' bytes; None (lower it, keep nothing) when the jaxpr holds something that
    cannot be told apart."""
    unprinted: list = []
    if not _unprinted(jaxpr, unprinted, set()):
        return None
    shapes = tuple((tuple(a.shape), str(a.dtype), bool(getattr(a, "weak_type", False)))
                   for a in (*in_shapes, *out_shapes))
    text = repr((repr(jax_mesh), repr(axis_names), grid, block, cluster, len(in_shapes), shapes, str(jaxpr),
                 repr(jaxpr.debug_info), repr(params), tuple(map(_digest, consts)), tuple(unprinted)))
    return hashlib.sha256(text.encode()).hexdigest()


def memoized_mosaic_gpu_lowering(max_kernels: int = 512) -> None:
    """Lowers each distinct Mosaic GPU kernel once a process (the module docstring says why):
    wraps jax._src.pallas.mosaic_gpu.lowering.lower_jaxpr_to_module, which every Pallas Mosaic GPU
    kernel (pallas_call, plgpu.kernel) lowers through, with a cache of its results keyed by
    _kernel_key (the last max_kernels kernels; a module is stored as bytecode and parsed into the
    asking lowering's MLIR context). A kernel's module keeps the source locations of the first
    call site that lowered it. Idempotent."""
    from jax._src.lib.mlir import ir
    from jax._src.pallas.mosaic_gpu import lowering

    if hasattr(lowering.lower_jaxpr_to_module, "wrapped"):  # already this wrapper
        return
    cache: collections.OrderedDict[str, tuple[bytes, object]] = collections.OrderedDict()
    lock = threading.Lock()

    def lower_jaxpr_to_module(jax_mesh, axis_names, grid, block, cluster, in_shapes, out_shapes, jaxpr, params,
                              consts=(), outer_traceback=None):
        key = _kernel_key(jax_mesh, axis_names, grid, block, cluster, in_shapes, out_shapes, jaxpr, params, consts)
        with lock:
            hit = None if key is None else cache.get(key)
            if hit is not None:
                cache.move_to_end(key)
        if hit is not None:
            bytecode, result = hit
            return dataclasses.replace(result, module=ir.Module.parse(bytecode))
        result = lower_jaxpr_to_module.wrapped(jax_mesh, axis_names, grid, block, cluster, in_shapes, out_shapes,
                                               jaxpr, params, consts, outer_traceback=outer_traceback)
        if key is not None:
            buffer = io.BytesIO()
            result.module.operation.write_bytecode(buffer)  # before any later pass changes the module
            with lock:
                cache[key] = (buffer.getvalue(), dataclasses.replace(result, module=None))
                if len(cache) > max_kernels:
                    cache.popitem(last=False)
        return result

    lower_jaxpr_to_module.wrapped = lowering.lower_jaxpr_to_module  # jax's own
    lower_jaxpr_to_module.cache = cache
    lowering.lower_jaxpr_to_module = lower_jaxpr_to_module


_check_installed_jax()
reproducible_mosaic_gpu_lowering()
memoized_mosaic_gpu_lowering()
