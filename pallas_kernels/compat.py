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
"""

from __future__ import annotations

import os
import re

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


_check_installed_jax()
reproducible_mosaic_gpu_lowering()
