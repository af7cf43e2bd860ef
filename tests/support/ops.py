"""The op implementations the per-op suites parametrise over, their limits, and the adapters the
suites not yet calling the ops directly still use.

tests/test_topk.py and tests/test_padding.py call each op as `op(..., implementation=, config=,
interpret=INTERPRET)`. tests/test_indexer_logits.py, test_sparse_mla.py and test_dense_mha.py
still call the function of the op's name here, with a test backend name first ("reference":
the op's "xla" implementation; "mosaic_prefill" / "mosaic_decode": "mosaic" with that kernel)
and keyword tuning, mapped onto the op's `implementation=` and `config=`.

`BACKENDS[op]`: the names a suite parametrises over; Pallas kernels are interpreted on CPU and
compiled on a GPU, except those in `GPU_ONLY`, which have no interpret mode. "auto" is the
kernel the layer picks for the inputs and device, where an op has more than one kernel.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jax_sparse_mla import policy
from pallas_kernels import dense_mha as dense_mha_lib
from pallas_kernels import indexer_logits as indexer_logits_lib
from pallas_kernels import sparse_mla as sparse_mla_lib
from pallas_kernels import topk as topk_lib
from pallas_kernels.device import on_hopper
from pallas_kernels.topk.triton import topk_stages as topk_stages_triton

from jax_sparse_mla.kernels import cpu_threads

from . import INTERPRET

BACKENDS = {
    "indexer_logits": ("reference", "auto", "triton", "mosaic_prefill", "mosaic_decode"),
    "topk": ("xla", "triton", "mosaic"),
    "sparse_mla": ("xla", "triton", "mosaic"),
    "dense_mha": ("xla", "mosaic"),
}
# (op, backend) pairs that only run compiled on a GPU: the sparse Mosaic kernel's gathers and the
# Mosaic top-k write sweep are inline PTX, which Mosaic GPU's interpreter cannot run.
GPU_ONLY = {("sparse_mla", "mosaic"), ("topk", "mosaic")}


def implementation_param(op: str, implementation: str, *values, id: str | None = None, marks=()):
    """pytest.param(implementation, *values) with the `gpu` mark where it only runs on a GPU; id
    defaults to the implementation's name."""
    if implementation not in BACKENDS[op]:
        raise ValueError(f"{op}: unknown implementation {implementation!r}; one of {BACKENDS[op]}")
    marks = tuple(marks) if isinstance(marks, (list, tuple)) else (marks,)
    if (op, implementation) in GPU_ONLY:
        marks += (pytest.mark.gpu,)
    return pytest.param(implementation, *values, id=id or implementation, marks=marks)


IMPLEMENTATION = {"reference": "xla"}  # a test backend -> the op's implementation; "mosaic_prefill": "mosaic", kernel "prefill"


def _interpret(interpret):
    return INTERPRET if interpret is None else interpret


def _config(lib, implementation, tuning):
    """The op's config for `implementation` from a case's keyword tuning (None for none)."""
    if not tuning:
        return None
    if lib.CONFIGS.get(implementation) is None:
        raise ValueError(f"{implementation} takes no tuning, got {tuning}")
    return lib.CONFIGS[implementation](**tuning)




# ------------------------------------------------------------------------------------------------
# indexer logits
# ------------------------------------------------------------------------------------------------

def indexer_logits(backend, q, weights, k_cache, k_scale, block_tables, row_seq, row_end, *, page_size,
                   interpret=None, **tiling):
    """[N, W * page_size] f32 logits by `backend`; tiling: the kernel's own overrides (see each kernel)."""
    clean = {"clean": tiling.pop("clean")} if "clean" in tiling else {}
    args = (q, weights, k_cache, k_scale, block_tables, row_seq, row_end)
    if backend == "auto":
        backend = indexer_logits_auto(q, k_cache, block_tables, interpret=_interpret(interpret), tiling=tiling)
    implementation, _, kernel = IMPLEMENTATION.get(backend, backend).partition("_")
    config = _config(indexer_logits_lib, implementation, tiling)
    return indexer_logits_lib.indexer_logits(*args, page_size=page_size, implementation=implementation,
                                             kernel=kernel or None, config=config, interpret=_interpret(interpret),
                                             **clean)


def indexer_logits_auto(q, k_cache, block_tables, *, interpret, tiling):
    """The kernel the layer runs for these inputs (jax_sparse_mla.kernels.resolve, then the plan's
    jax_sparse_mla.policy.indexer_kernel): a Mosaic GPU kernel for fp8 / bf16 on Hopper, the
    prefill one for >= policy.MGPU_MIN_ROWS_PER_SEQ rows per sequence, else the decode one;
    the Triton kernel in interpret mode, elsewhere, and for any Triton tiling override."""
    fp8 = jnp.float8_e4m3fn
    if (not interpret and not tiling and on_hopper() and q.dtype == k_cache.dtype
            and q.dtype in (fp8, jnp.bfloat16)):
        return "mosaic_" + policy.indexer_kernel(q.shape[0], block_tables.shape[0])
    return "triton"


# ------------------------------------------------------------------------------------------------
# top-k
# ------------------------------------------------------------------------------------------------

def topk(backend, logits, k, *, lengths=None, interpret=None, **tuning):
    """[N, k] int32 top-k positions by `backend` (of each row's first lengths[n] columns, when
    given); tuning: the Triton kernels' knobs (block, sample, ...)."""
    implementation = IMPLEMENTATION.get(backend, backend)
    return topk_lib.topk(logits, k, lengths=lengths, implementation=implementation,
                         config=_config(topk_lib, implementation, tuning), interpret=_interpret(interpret))


def topk_stages(logits, k, *, lengths=None, interpret=None, **tuning):
    """Every intermediate of the Triton top-k (`pallas_kernels.topk.triton.topk_stages`): "out",
    "counts" [N, slices, 3] (definite, band, valid keys per slice), "capacity", ...;
    lengths default to whole rows; backend="mosaic" (in tuning): the Mosaic write sweep."""
    opts = dict(block=None, num_warps=None, num_stages=None, sample=None, capacity=None, slices=None, group=None)
    opts.update(tuning)
    return topk_stages_triton(logits, k, lengths=lengths, interpret=_interpret(interpret), **opts)


# ------------------------------------------------------------------------------------------------
# sparse MLA
# ------------------------------------------------------------------------------------------------

TRITON_ONLY_TUNING = ("block_h", "block_k", "num_warps", "num_stages")  # the Mosaic kernel takes num_splits only


def sparse_mla(backend, q, latent, latent_scale, k_pe, slots, *, scale, interpret=None, dequantize="auto",
               pages=None, page_size=None, **tuning):
    """(out [N, H, R] f32, lse [N, H]) by `backend`.

    dequantize (fp8 caches): "kernel" | "upfront" | "auto" (the layer's route for these rows:
    jax_sparse_mla.policy.dequantize_route over the copy `pages` would make). tuning: the Triton
    kernel's knobs and num_splits; the Mosaic kernel gets num_splits only (a case's Triton tiling
    does not apply to it). "auto": the Mosaic kernel on Hopper where it takes the operands
    (compiled), else the Triton one (jax_sparse_mla.kernels.resolve's choice)."""
    if backend == "reference":
        return sparse_mla_lib.sparse_mla(q, latent, latent_scale, k_pe, slots, scale=scale, implementation="xla",
                                         config=_config(sparse_mla_lib, "xla", tuning))
    interpret = _interpret(interpret)
    if backend == "auto":
        backend = "mosaic" if not interpret and on_hopper() and sparse_mla_unsupported(
            "mosaic", q, latent, latent_scale, k_pe) is None else "triton"
    if backend not in ("triton", "mosaic"):
        raise ValueError(f"sparse_mla: unknown backend {backend!r}")
    if backend == "mosaic":
        tuning = {name: v for name, v in tuning.items() if name not in TRITON_ONLY_TUNING}
    if dequantize == "auto":
        dequantize = "kernel" if latent_scale is None else policy.dequantize_route(
            q.shape[0], q.shape[1], slots.shape[-1], sparse_mla_lib.copy_rows(latent.shape[0], pages, page_size))
    return sparse_mla_lib.sparse_mla(q, latent, latent_scale, k_pe, slots, scale=scale, implementation=backend,
                                     config=_config(sparse_mla_lib, backend, tuning), dequantize=dequantize,
                                     pages=pages, page_size=page_size, interpret=interpret)


def sparse_mla_auto(q, latent, latent_scale, k_pe):
    """The kernel the layer runs for these operands (jax_sparse_mla.kernels.resolve's choice): the
    Mosaic kernel on Hopper where it takes them (compiled), else the Triton one."""
    if not INTERPRET and on_hopper() and sparse_mla_unsupported("mosaic", q, latent, latent_scale, k_pe) is None:
        return "mosaic"
    return "triton"


def sparse_mla_dequantize(q, latent, latent_scale, slots, pages=None, page_size=None):
    """The layer's dequantize route for these rows: "kernel" for a bf16 / f32 cache, else
    jax_sparse_mla.policy.dequantize_route over the copy `pages` would make."""
    if latent_scale is None:
        return "kernel"
    return policy.dequantize_route(q.shape[0], q.shape[1], slots.shape[-1],
                                   sparse_mla_lib.copy_rows(latent.shape[0], pages, page_size))


def sparse_mla_unsupported(backend, q, latent, latent_scale, k_pe):
    """Why `backend` cannot take these operands (None: it can). Only the Mosaic kernel has limits
    (bf16 q and k_pe, rank a multiple of 128 up to 512, ...; `mosaic.unsupported_reason`)."""
    if backend == "mosaic":
        return sparse_mla_lib.unsupported_reason(q, latent, latent_scale, k_pe)
    return None


# ------------------------------------------------------------------------------------------------
# dense MHA
# ------------------------------------------------------------------------------------------------

def dense_mha(backend, q, k, v, q_start_loc, k_start_loc, *, scale, interpret=None, **kw):
    """[T, H, Dv] causal attention of packed sequences by `backend`; kw: the reference's
    max_scores, or the Mosaic kernel's tiling (block_kv, num_stages, num_programs)."""
    implementation = IMPLEMENTATION.get(backend, backend)
    args = {name: kw.pop(name) for name in ("selection", "max_kv_len") if name in kw}
    return dense_mha_lib.dense_mha(q, k, v, q_start_loc, k_start_loc, scale=scale, implementation=implementation,
                                   config=_config(dense_mha_lib, implementation, kw),
                                   interpret=_interpret(interpret), **args)


def dense_mha_unsupported(implementation, dtype, d_qk, d_v):
    """Why `implementation` cannot run inputs of this dtype and head dims here (None: it can): only
    the Mosaic kernel has limits: bf16 / f16 with head dims that are multiples of 64 (<= 256), and
    off the GPU its interpreter needs a CPU thread per kernel warpgroup (else it deadlocks)."""
    if implementation != "mosaic":
        return None
    reason = dense_mha_lib.unsupported_reason(jnp.dtype(dtype), d_qk, d_v)
    if reason is None and INTERPRET and cpu_threads() < dense_mha_lib.INTERPRET_MIN_CPU_THREADS:
        reason = (f"Mosaic GPU's interpreter needs {dense_mha_lib.INTERPRET_MIN_CPU_THREADS} CPU threads, "
                  f"the pool has {cpu_threads()} (set PJRT_NPROC)")
    return reason
