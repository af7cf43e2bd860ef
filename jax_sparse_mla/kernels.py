"""The one dispatch point between the layer and the kernels of `pallas_kernels`.

`resolve(kernels, config)` makes every device-dependent choice once: which backend runs each op
("xla": the pure-jnp reference; "triton": a Pallas Triton-backend kernel; "mosaic": a Pallas
Mosaic GPU kernel), whether it interprets (off the GPU), and its config. The batch-dependent
choices (the Mosaic indexer kernel's shape, an fp8 cache's dequantisation route) are the plan's
(BatchPlan.groups, policy.py). The layer calls the five ops of `pallas_kernels`, re-exported
below, with both: `op(..., **impl.kwargs, <the plan's choice>)`; the ops decide nothing.

`kernels="xla"` runs each op's pure-jnp implementation and `"pallas"` every Pallas kernel
(compiled on a GPU, in interpret mode elsewhere: slow, for tests). `"auto"` is what measured
fastest on the H200 and XLA off the GPU: on a GPU the same as "pallas":
  indexer logits: Mosaic GPU on Hopper (prefill and decode kernels), Triton elsewhere; top-k:
  Triton (several times lax.top_k); sparse MLA: Mosaic GPU on Hopper where it takes the
  config's operands, Triton elsewhere; dense MHA: Mosaic GPU (the only option taking the packed
  layout); the cond program's matmuls over every row: Mosaic GPU on Hopper in buckets of
  ROW_KERNEL_MIN_TOKENS rows or more (a run-time row count, no conditional), XLA's ladder of
  sizes below and elsewhere. Numbers: docs/benchmarks.md.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Literal, get_args

import jax
import jax.numpy as jnp

from pallas_kernels import dense_mha as dense_mha_lib
from pallas_kernels import indexer_logits as indexer_logits_lib
from pallas_kernels import row_matmul as row_matmul_lib
from pallas_kernels import sparse_mla as sparse_mla_lib
from pallas_kernels import topk as topk_lib
from pallas_kernels.device import on_hopper

Kernels = Literal["auto", "xla", "pallas"]  # the `kernels` argument of forward, SparseMLA, ...
CHOICES = get_args(Kernels)
OPS = ("indexer_logits", "topk", "sparse_mla", "dense_mha", "row_matmul")
IMPLEMENTATIONS = ("xla", "triton", "mosaic")  # every op's names (dense_mha has no "triton")
MOSAIC_INDEXER_DTYPES = ("fp8", "bfloat16")  # indexer dtypes the Mosaic indexer kernels take (q and keys alike)
# Bucket rows from which a cond program's row stages run through row_matmul (below: the ladder of
# XLA matmuls): on an H100 the kernel lost to cuBLAS over full 2048-row buckets and was even or
# ahead from 4096 (docs/design/row_matmul.md).
ROW_KERNEL_MIN_TOKENS = 4096


@dataclasses.dataclass(frozen=True)
class OpImpl:
    """How one op runs: implementation "xla" | "triton" | "mosaic" (the op's name for it),
    config (that implementation's frozen config, e.g. pallas_kernels.sparse_mla.TritonConfig;
    None: its defaults), interpret (Pallas interpret mode, off the GPU)."""

    implementation: str
    config: object = None
    interpret: bool = False

    def __post_init__(self):
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {self.implementation!r}")

    @property
    def kwargs(self) -> dict:
        """The op's implementation, config and interpret keywords."""
        return dict(implementation=self.implementation, config=self.config, interpret=self.interpret)


@dataclasses.dataclass(frozen=True)
class Implementations:
    """One OpImpl per op (hashable: part of a jitted forward's static state), and whether the
    layer's dots with config-dtype operands or results (model.per_head, model.linear) run in
    float32 and round after (XLA's CPU backend: it has no batched bf16 x bf16 -> f32 dot, and a
    bf16-output one accumulates in bf16) or take and write the config's dtype with float32
    accumulation inside the dot (the GPU: no float32 copies, no convert kernels)."""

    indexer_logits: OpImpl
    topk: OpImpl
    sparse_mla: OpImpl
    dense_mha: OpImpl
    row_matmul: OpImpl
    dots_in_f32: bool


XLA = OpImpl("xla")


def check_kernels(kernels) -> None:
    """ValueError naming `kernels` unless it is one of CHOICES."""
    if not isinstance(kernels, str) or kernels not in CHOICES:
        raise ValueError(f"kernels must be one of {CHOICES}, got {kernels!r}")


def resolve(kernels: str, config) -> Implementations:
    """kernels choice and the layer's (per-shard) MLAConfig -> Implementations, decided once.

    "xla", and "auto" off the GPU: XLA for every op. "pallas", and "auto" on a GPU:
      indexer_logits: "mosaic" on Hopper for fp8 / bf16 indexers (the plan's RowGroup picks the
        prefill or decode kernel), else "triton";
      topk: "mosaic" on Hopper (the Triton kernels with `pallas_kernels.topk.mosaic`'s write
        sweep and band select where they apply: ~2x the Triton kernels' speed at >= 1024 rows,
        docs/design/topk.md), else "triton";
      sparse_mla: "mosaic" on Hopper when `sparse_mla.unsupported_reason` accepts the operands
        the config gives it (bf16 q and k_pe, rank and rope widths; an fp8 cache's upfront copy
        is accepted exactly when the cache is), else "triton";
      dense_mha: "mosaic", but "xla" where the kernel does not take the config (float32
        oracles, head dims that are not multiples of 64: the tiny test configs) and off the GPU
        when XLA's CPU thread pool (PJRT_NPROC, else the schedulable CPUs) is too small for
        Mosaic GPU's interpreter: it runs the kernel's warpgroups as concurrent callbacks on
        that pool and deadlocks with fewer threads than warpgroups (tests/conftest.py sets
        PJRT_NPROC);
      row_matmul: "mosaic" on Hopper (and interpreted off the GPU) for bf16 / f16 configs, with
        dense_mha's thread condition off the GPU (`row_kernel` says for which buckets the layer
        uses it); else "xla" (the layer then runs its ladder of row counts through a
        conditional instead).
    Off the GPU every Pallas backend interprets, and the per-head einsums run in float32.
    """
    check_kernels(kernels)
    interpret = interpret_mode()
    if kernels == "xla" or (kernels == "auto" and interpret):
        return Implementations(XLA, XLA, XLA, XLA, XLA, dots_in_f32=interpret)
    hopper = not interpret and on_hopper()
    triton = OpImpl("triton", interpret=interpret)
    indexer = OpImpl("mosaic") if hopper and config.indexer_dtype in MOSAIC_INDEXER_DTYPES else triton
    sparse = OpImpl("mosaic") if hopper and _sparse_mosaic_takes(config) else triton

    def too_few_threads(lib) -> bool:  # Mosaic GPU's interpreter needs a CPU thread per warpgroup
        return interpret and cpu_threads() < lib.INTERPRET_MIN_CPU_THREADS

    dense_unsupported = dense_mha_lib.unsupported_reason(config.jnp_dtype, config.qk_head_dim, config.v_head_dim)
    dense = XLA if too_few_threads(dense_mha_lib) or dense_unsupported else OpImpl("mosaic", interpret=interpret)
    topk = OpImpl("mosaic") if hopper else triton
    rows_unsupported = row_matmul_lib.unsupported_reason(config.jnp_dtype, config.jnp_dtype)
    row = (OpImpl("mosaic", interpret=interpret)
           if (hopper or interpret) and not rows_unsupported and not too_few_threads(row_matmul_lib) else XLA)
    return Implementations(indexer_logits=indexer, topk=topk, sparse_mla=sparse, dense_mha=dense, row_matmul=row,
                           dots_in_f32=interpret)


def row_kernel(impl: OpImpl, num_tokens: int) -> OpImpl | None:
    """The row_matmul implementation (Implementations.row_matmul) a cond program of num_tokens rows
    runs its row stages through, with the real row count given at run time; None: the ladder
    (XLA, or a bucket under ROW_KERNEL_MIN_TOKENS rows)."""
    return impl if impl.implementation != "xla" and num_tokens >= ROW_KERNEL_MIN_TOKENS else None


def _sparse_mosaic_takes(config) -> bool:
    """Whether the Mosaic sparse kernel takes the operands the layer passes under `config`: q
    [N, H, R + P] in the config's dtype and the latent cache as stored, or, for an fp8 cache,
    its upfront copy (latent in q's dtype, no scales); the two agree (asserted) because the
    config makes an fp8 cache's rank a multiple of its 128-value scale tile."""
    latent_dtype, scales, k_pe_dtype = config.latent_cache_layout
    latent = jax.ShapeDtypeStruct((config.page_size, config.kv_lora_rank), latent_dtype)
    latent_scale = jax.ShapeDtypeStruct((config.page_size, scales), jnp.float32) if scales else None
    k_pe = jax.ShapeDtypeStruct((config.page_size, config.qk_rope_head_dim), k_pe_dtype)
    q = jax.ShapeDtypeStruct((1, config.num_attention_heads, latent.shape[-1] + k_pe.shape[-1]), config.jnp_dtype)
    takes = sparse_mla_lib.unsupported_reason(q, latent, latent_scale, k_pe) is None
    if latent_scale is not None:  # the upfront route's operands
        copy = jax.ShapeDtypeStruct(latent.shape, q.dtype)
        assert takes == (sparse_mla_lib.unsupported_reason(q, copy, None, k_pe) is None), config
    return takes


def interpret_mode() -> bool:
    """Whether Pallas kernels interpret (no GPU backend): resolve's one device check."""
    return jax.default_backend() != "gpu"


def cpu_threads() -> int:
    """The size of XLA's CPU thread pool: PJRT_NPROC if set, else the CPUs this process may use."""
    return int(os.environ.get("PJRT_NPROC") or len(os.sched_getaffinity(0)))


# The five ops (called with an OpImpl's kwargs) and the cache-layout helpers the layer shares with them.
indexer_logits = indexer_logits_lib.indexer_logits
topk = topk_lib.topk
sparse_mla = sparse_mla_lib.sparse_mla
dense_mha = dense_mha_lib.dense_mha
row_matmul = row_matmul_lib.row_matmul
gather_paged_rows = indexer_logits_lib.gather_paged_rows
dequantize_index_keys = indexer_logits_lib.dequantize_index_keys
dequantize_latent = sparse_mla_lib.dequantize_latent
