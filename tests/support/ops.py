"""The op implementations the per-op suites parametrise over, their limits, and the test-only
choices the suites make beside calling each op as `op(..., implementation=, config=,
interpret=INTERPRET)`.

`BACKENDS[op]`: the implementations a suite parametrises over; Pallas kernels are interpreted on
CPU and compiled on a GPU, except those in `GPU_ONLY`, which have no interpret mode.
`indexer_logits_auto` and `sparse_mla_auto` ("auto" in a suite): the kernel the layer picks for
the inputs and device, where an op has more than one; `sparse_mla_dequantize`: the layer's
dequantize route for an fp8 cache. `topk_stages`: the Triton top-k's intermediates. The
`*_unsupported` checks say why an implementation cannot take given operands here.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jax_sparse_mla import policy
from pallas_kernels import dense_mha as dense_mha_lib
from pallas_kernels import sparse_mla as sparse_mla_lib
from pallas_kernels.device import on_hopper
from pallas_kernels.topk.triton import topk_stages as topk_stages_triton

from jax_sparse_mla.kernels import cpu_threads

from . import INTERPRET

BACKENDS = {
    "indexer_logits": ("xla", "auto", "triton", "mosaic"),
    "topk": ("xla", "triton", "mosaic"),
    "sparse_mla": ("xla", "triton", "mosaic"),
    "dense_mha": ("xla", "mosaic"),
    "row_matmul": ("xla", "mosaic"),
}
# (op, implementation) pairs that only run compiled on a GPU: the sparse Mosaic kernel's gathers and the
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


# ------------------------------------------------------------------------------------------------
# indexer logits
# ------------------------------------------------------------------------------------------------

def indexer_logits_auto(q, k_cache, block_tables, *, interpret):
    """(implementation, kernel) the layer runs for these inputs (jax_sparse_mla.kernels.resolve,
    then the plan's jax_sparse_mla.policy.indexer_kernel): a Mosaic GPU kernel for fp8 / bf16 on
    Hopper, "prefill" for >= policy.MGPU_MIN_ROWS_PER_SEQ rows per sequence, else "decode"; the
    Triton kernel (kernel None) in interpret mode and elsewhere."""
    fp8 = jnp.float8_e4m3fn
    if not interpret and on_hopper() and q.dtype == k_cache.dtype and q.dtype in (fp8, jnp.bfloat16):
        return "mosaic", policy.indexer_kernel(q.shape[0], block_tables.shape[0])
    return "triton", None


# ------------------------------------------------------------------------------------------------
# top-k
# ------------------------------------------------------------------------------------------------

def topk_stages(logits, k, *, lengths=None, interpret=INTERPRET, **tuning):
    """Every intermediate of the Triton top-k (`pallas_kernels.topk.triton.topk_stages`): "out",
    "counts" [N, slices, 3] (definite, band, valid keys per slice), "capacity", ...;
    lengths default to whole rows; backend="mosaic" (in tuning): the Mosaic write sweep."""
    opts = dict(block=None, num_warps=None, num_stages=None, sample=None, capacity=None, slices=None, group=None)
    opts.update(tuning)
    return topk_stages_triton(logits, k, lengths=lengths, interpret=interpret, **opts)


# ------------------------------------------------------------------------------------------------
# sparse MLA
# ------------------------------------------------------------------------------------------------

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


def sparse_mla_unsupported(implementation, q, latent, latent_scale, k_pe):
    """Why `implementation` cannot take these operands (None: it can). Only the Mosaic kernel has limits
    (bf16 q and k_pe, rank a multiple of 128 up to 512, ...; `mosaic.unsupported_reason`)."""
    if implementation == "mosaic":
        return sparse_mla_lib.unsupported_reason(q, latent, latent_scale, k_pe)
    return None


# ------------------------------------------------------------------------------------------------
# dense MHA
# ------------------------------------------------------------------------------------------------

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
