"""The one dispatch point between the layer and the kernels of `pallas_kernels`.

`kernels="xla"` runs each op's pure-jnp implementation and `"pallas"` every Pallas kernel
(compiled on a GPU, in Pallas interpret mode elsewhere: slow, for tests). `"auto"` picks per op
what measured fastest on the H200 (docs/benchmarks.md) and XLA off the GPU:
  indexer logits: Pallas (Mosaic GPU on Hopper: prefill 578 TFLOP/s fp8 at T = S = 8K against the
    Triton kernel's 252 and XLA's 12; decode 3340 GB/s at B = 32, C = 32K, 87% of a copy, against
    the Triton kernel's 1367);
  top-k: Pallas (thresholds / counted writes / band select: 6.1x lax.top_k at 128 x 32K, 9.0x at
    1024 x 32K, 8.0x at 128 x 128K);
  sparse MLA attention: Pallas (Mosaic GPU on Hopper, 4096 x 8K / 4096 x 128K prefill, 128 x 2
    decode: bf16 462-475 / 411-428 / 403 TFLOP/s; fp8 466-477 / 403-404 with the prefill's pages
    dequantised upfront (336-340 / 326-339 in the kernel) and 326 decode in the kernel; the Triton
    kernel 164, XLA's gather + einsum 27-33);
  dense MHA (short prefills): Pallas (Mosaic GPU over packed ragged sequences: 542 TFLOP/s at
    4 x 2048 and 351 at 16 x 512, cuDNN 373 and 203 and tokamax 517 and 315 on padded batches;
    the only option that takes the packed layout; XLA 53).
"""

from __future__ import annotations

import os

import jax

from pallas_kernels import dense_attention, indexer, indexer_layout, sparse_attention, topk

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
    too_few_threads = _interpret() and _cpu_threads() < dense_attention.INTERPRET_MIN_CPU_THREADS
    if too_few_threads or dense_attention.unsupported_reason(config.jnp_dtype, config.qk_head_dim,
                                                             config.v_head_dim):
        impl["dense_mha"] = "xla"
    return impl


def _interpret() -> bool:
    return jax.default_backend() != "gpu"


def _cpu_threads() -> int:
    """The size of XLA's CPU thread pool: PJRT_NPROC if set, else the CPUs this process may use."""
    return int(os.environ.get("PJRT_NPROC") or len(os.sched_getaffinity(0)))


def indexer_logits(q, weights, k_cache, k_scale, block_tables, row_seq, row_end, *, page_size, impl):
    """[N, W * page_size] f32 indexer logits, -inf outside [0, row_end) (see pallas_kernels.indexer)."""
    if impl == "pallas":
        return indexer.indexer_logits(q, weights, k_cache, k_scale, block_tables, row_seq, row_end,
                                      page_size=page_size, interpret=_interpret())
    return indexer.indexer_logits_reference(q, weights, k_cache, k_scale, block_tables, row_seq, row_end,
                                            page_size=page_size)


def topk_indices(logits, k: int, *, impl):
    """[N, k] int32 positions of the k largest finite logits per row, -1 padded."""
    if impl == "pallas":
        return topk.topk(logits, k, interpret=_interpret())
    return topk.topk_reference(logits, k)


def sparse_mla(q, latent, latent_scale, k_pe, slots, pages, *, scale, page_size, impl):
    """(out [N, H, R] f32, lse [N, H]) of absorbed attention over cache slots (-1 skipped).

    pages: the page ids (-1 ignored) holding every slot; with an fp8 cache the Pallas route may
    dequantise those pages once ahead of the kernel, a copy with a row for every entry (-1
    included). The layer passes its prefill rows' own pages under the plan's fp8 split
    (BatchPlan.num_upfront_rows), else the block tables [num_seqs, pages_per_seq]."""
    if impl == "pallas":
        return sparse_attention.sparse_mla_attention(q, latent, latent_scale, k_pe, slots, scale=scale,
                                                     pages=pages, page_size=page_size, interpret=_interpret())
    return sparse_attention.sparse_mla_reference(q, latent, latent_scale, k_pe, slots, scale=scale)


def causal_attention(q, k, v, q_start_loc, k_start_loc, *, scale, impl):
    """[T, H, Dv] causal attention of packed ragged sequences (see pallas_kernels.dense_attention)."""
    if impl == "pallas":
        return dense_attention.causal_varlen_attention(q, k, v, q_start_loc, k_start_loc, scale=scale,
                                                       interpret=_interpret())
    return dense_attention.causal_varlen_attention_reference(q, k, v, q_start_loc, k_start_loc, scale=scale)


gather_paged_rows = indexer_layout.gather_paged_rows
dequantize_index_keys = indexer.dequantize_index_keys
dequantize_latent = sparse_attention.dequantize_latent
dequantize_route = sparse_attention.dequantize_route
