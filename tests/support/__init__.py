"""Shared test helpers (not a test module: pytest collects nothing here).

`tests.support` holds the facts about where the suite runs and the helpers several test modules
share (subprocess runs of the checkout, a scored plan, fp8 quantisation, an engine run against
its oracle); `tests.support.ops` the
implementations each op's suite runs and their limits; `tests.support.cases` the input builders
more than one op's suite uses.
"""

import contextlib
import json
import os
import pathlib
import subprocess
import sys

# Mosaic GPU's interpreter needs a CPU thread per simulated warpgroup (see jax_sparse_mla.kernels.resolve);
# set before jax creates its CPU client, so the dense kernel also runs inside the forward on a 2-core CI box.
os.environ.setdefault("PJRT_NPROC", "4")

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from jax_sparse_mla.serving import reference_outputs  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
# scripts/dev.sh runs the CPU suite with XLA's CPU backend at -O0, since compiles dominate it. A
# test that runs an interpreted kernel over thousands of programs jits that one call with these
# options (-O2, XLA's default): at -O0 the 4096-row top-k took 5x longer.
OPTIMIZED = {"xla_backend_optimization_level": 2}


COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch.BACKEND_COMPILE_EVENT


@contextlib.contextmanager
def compiled_functions():
    """Yields a list that collects the name of every function XLA compiles inside the block
    (jax.monitoring's backend-compile events, e.g. 'jit(forward)')."""
    names = []

    def listener(event, secs, **kw):
        if event == COMPILE_EVENT:
            names.append(kw.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def equations_outside_kernels(jaxpr, primitives: tuple[str, ...]) -> list[str]:
    """The equations of a jaxpr and its sub-jaxprs whose primitive is one of `primitives`
    (e.g. ("while", "scan"), ("cond",)), kernel bodies left out (each as its text's first 200
    characters)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("pallas_call", "mpmd_map", "core_map"):  # a kernel's own control flow
            continue
        if eqn.primitive.name in primitives:
            found.append(str(eqn)[:200])
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                if hasattr(sub, "jaxpr") and hasattr(sub, "consts"):
                    found += equations_outside_kernels(sub.jaxpr, primitives)
                elif hasattr(sub, "eqns"):
                    found += equations_outside_kernels(sub, primitives)
    return found


def quantize_fp8_blocks(w):
    """float32 [out, in] -> (e4m3 [out, in], fp32 scales [ceil(out/128), ceil(in/128)]), DeepSeek's layout."""
    rows, cols = w.shape
    nb = (-(-rows // 128), -(-cols // 128))
    scale = np.zeros(nb, np.float32)
    q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    for i in range(nb[0]):
        for j in range(nb[1]):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            scale[i, j] = np.abs(blk).max() / 448.0
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (blk / scale[i, j]).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def assert_same_as_clean(got, want, err_msg=""):
    """Equal to the clean run (to float32 round-off) and NaN-free where the clean run is: the
    isolation tests' check that planted NaN / inf reached nothing it may not."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert not np.isnan(got).any(), f"NaN leaked {err_msg}"
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=err_msg)


def run_python(code: str, *args: str, env: dict | None = None, timeout: int = 300):
    """Runs `code` in a fresh Python process of the checkout under test (sys.argv[1:] = args; env:
    variables set over this process's) -> the json it prints on its last 'RESULT <json>' line."""
    import jax_sparse_mla

    root = pathlib.Path(jax_sparse_mla.__file__).absolute().parent.parent  # the checkout under test
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, **(env or {})}
    proc = subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=root, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def run_with_cpu_devices(code: str, devices: int = 4):
    """`run_python(code)` with `devices` virtual CPU devices (added to this process's XLA_FLAGS) and
    the GPU hidden."""
    flags = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), f"--xla_force_host_platform_device_count={devices}"]))
    return run_python(code, env={"XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"})


def scored_plan(config):
    """One scored plan (a 9-token prefill beside a decode, force_sparse) and its metadata, for a
    cache of 8 pages."""
    from jax_sparse_mla import Request, plan_batch

    plan, meta = plan_batch(config, [Request(0, 9, [0, 1, 2]), Request(12, 1, [3, 4, 5, 6])], num_pages=8,
                            force_sparse=True)
    assert plan.has_indexer_scoring
    return plan, meta


def lower_mosaic_kernel() -> str:
    """The Mosaic GPU indexer decode kernel (fp8, 2 rows, 1024 keys) lowered for the GPU on any
    machine: the program's text."""
    import functools

    import jax.numpy as jnp

    from pallas_kernels.indexer_logits import indexer_logits

    from .cases import FP8

    sd = jax.ShapeDtypeStruct
    args = (sd((2, 64, 128), FP8), sd((2, 64), jnp.float32), sd((1024, 128), FP8), sd((1024,), jnp.float32),
            sd((2, 8), jnp.int32), sd((2,), jnp.int32), sd((2,), jnp.int32))
    fn = jax.jit(functools.partial(indexer_logits, page_size=64, implementation="mosaic", kernel="decode"))
    return fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def oracle_error(engine, result, specs):
    """Over the RequestSpecs `specs` of an Engine run with collect_outputs: (the largest error of
    any request's rows against `reference_outputs` (the request served alone), relative to the
    reference's largest value; the number of rows compared). Rows whose reference top-k hinges on
    a near-tie are left out."""
    worst, decided = 0.0, 0
    for spec in specs:
        ref, ambiguous = reference_outputs(engine, spec)
        out = result.outputs[spec.id]
        assert out.shape == ref.shape, (spec.id, out.shape, ref.shape)
        keep = ~ambiguous
        decided += int(keep.sum())
        worst = max(worst, float(np.abs(out[keep] - ref[keep]).max() / np.abs(ref).max()))
    return worst, decided
