"""The one dispatch point between the layer and the kernels of `pallas_kernels`.

`kernels="xla"` runs each op's pure-jnp implementation and `"pallas"` every Pallas kernel
(compiled on a GPU, in Pallas interpret mode elsewhere: slow, for tests). `"auto"` picks per op
what measured fastest on the H200 and XLA off the GPU:
  indexer logits: Pallas (Mosaic GPU on Hopper); top-k: Pallas (Triton backend; several times
  lax.top_k); sparse MLA: Pallas (Mosaic GPU on Hopper, an fp8 prefill through its upfront bf16
  copy); dense MHA: Pallas (Mosaic GPU, the only option taking the packed layout). Numbers:
  docs/benchmarks.md.
"""

from __future__ import annotations

import os

import jax

from pallas_kernels import dense_mha as dense_mha_lib
from pallas_kernels import indexer_logits as indexer_logits_lib
from pallas_kernels import sparse_mla as sparse_mla_lib
from pallas_kernels import topk as topk_lib

CHOICES = ("auto", "xla", "pallas")
OPS = ("indexer_logits", "topk", "sparse_mla", "dense_mha")
AUTO_ON_GPU = dict.fromkeys(OPS, "pallas")


def resolve(kernels: str, config) -> dict[str, str]:
    """kernels choice and the layer's MLAConfig -> {op: "xla" | "pallas"}.

    Dense MHA runs on XLA whatever the choice where the dense Mosaic kernel does not take the
    config (float32 oracles, head dims that are not multiples of 64: the tiny test configs), and
    off the GPU when XLA's CPU thread pool (PJRT_NPROC, else the schedulable CPUs) is too small
    for Mosaic GPU's interpreter: it runs the kernel's warpgroups as concurrent callbacks on that
    pool and deadlocks with fewer threads than warpgroups (tests/conftest.py sets PJRT_NPROC).
    """
    if kernels not in CHOICES:
        raise ValueError(f"kernels must be one of {CHOICES}, got {kernels!r}")
    if kernels == "auto":
        impl = dict(AUTO_ON_GPU) if jax.default_backend() == "gpu" else dict.fromkeys(OPS, "xla")
    else:
        impl = dict.fromkeys(OPS, kernels)
    too_few_threads = _interpret() and _cpu_threads() < dense_mha_lib.INTERPRET_MIN_CPU_THREADS
    if too_few_threads or dense_mha_lib.unsupported_reason(config.jnp_dtype, config.qk_head_dim,
                                                             config.v_head_dim):
        impl["dense_mha"] = "xla"
    return impl


def _interpret() -> bool:
    return jax.default_backend() != "gpu"


def _cpu_threads() -> int:
    """The size of XLA's CPU thread pool: PJRT_NPROC if set, else the CPUs this process may use."""
    return int(os.environ.get("PJRT_NPROC") or len(os.sched_getaffinity(0)))


def indexer_logits(q, weights, k_cache, k_scale, block_tables, row_seq, row_end, *, page_size, impl):
    """[N, W * page_size] f32 indexer logits, -inf outside [0, row_end) (see pallas_kernels.indexer_logits)."""
    if impl == "pallas":
        return indexer_logits_lib.indexer_logits(q, weights, k_cache, k_scale, block_tables, row_seq, row_end,
                                                 page_size=page_size, interpret=_interpret())
    return indexer_logits_lib.indexer_logits_reference(q, weights, k_cache, k_scale, block_tables, row_seq, row_end,
                                                       page_size=page_size)


def topk(logits, k: int, *, impl):
    """[N, k] int32 positions of the k largest finite logits per row, -1 padded."""
    if impl == "pallas":
        return topk_lib.topk(logits, k, interpret=_interpret())
    return topk_lib.topk_reference(logits, k)


def sparse_mla(q, latent, latent_scale, k_pe, slots, pages, *, scale, page_size, impl):
    """(out [N, H, R] f32, lse [N, H]) of absorbed attention over cache slots (-1 skipped).

    pages: the page ids (-1 ignored) holding every slot; with an fp8 cache the Pallas route may
    dequantise those pages once ahead of the kernel, a copy with a row for every entry (-1
    included). The layer passes its prefill rows' own pages under the plan's fp8 split
    (BatchPlan.num_upfront_rows), else the block tables [num_seqs, pages_per_seq]."""
    if impl == "pallas":
        return sparse_mla_lib.sparse_mla(q, latent, latent_scale, k_pe, slots, scale=scale,
                                         pages=pages, page_size=page_size, interpret=_interpret())
    return sparse_mla_lib.sparse_mla_reference(q, latent, latent_scale, k_pe, slots, scale=scale)


def dense_mha(q, k, v, q_start_loc, k_start_loc, *, scale, impl):
    """[T, H, Dv] causal attention of packed ragged sequences (see pallas_kernels.dense_mha)."""
    if impl == "pallas":
        return dense_mha_lib.dense_mha(q, k, v, q_start_loc, k_start_loc, scale=scale, interpret=_interpret())
    return dense_mha_lib.dense_mha_reference(q, k, v, q_start_loc, k_start_loc, scale=scale)


gather_paged_rows = indexer_logits_lib.gather_paged_rows
dequantize_index_keys = indexer_logits_lib.dequantize_index_keys
dequantize_latent = sparse_mla_lib.dequantize_latent
dequantize_route = sparse_mla_lib.dequantize_route
