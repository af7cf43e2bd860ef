"""The one timer of the benchmark scripts: median milliseconds per call of a JAX function."""

import statistics
import time

import jax


def median_ms(fn, *args, batches: int = 7) -> float:
    """Median ms per call over `batches` batches of back-to-back async calls (>= ~20 ms a batch),
    after compilation and a warm-up call. Batching amortises JAX's per-call dispatch for small
    kernels. (triton's do_bench is not used: its CUDA events live on torch's stream, not JAX's.)
    """
    jax.block_until_ready(fn(*args))  # compile + warm-up
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = time.perf_counter() - t0
    reps = int(min(200, max(1, 0.02 / max(once, 1e-6))))
    samples = []
    for _ in range(batches):
        t0 = time.perf_counter()
        out = None
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / reps * 1e3)
    return statistics.median(samples)
