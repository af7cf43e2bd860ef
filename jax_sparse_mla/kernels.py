"""The one dispatch point between the layer and the kernels of `pallas_kernels`.

`resolve(kernels, config)` makes every device-dependent choice once: which backend runs each op
("xla": the pure-jnp reference; "triton": a Pallas Triton-backend kernel; "mosaic": a Pallas
Mosaic GPU kernel), whether it interprets (off the GPU), and its tuning. The batch-dependent
choices (the Mosaic indexer kernel's shape, an fp8 cache's dequantisation route) are the plan's
(BatchPlan.groups, policy.py). The wrappers below pass both to the kernels, which decide nothing.

`kernels="xla"` runs each op's pure-jnp implementation and `"pallas"` every Pallas kernel
(compiled on a GPU, in interpret mode elsewhere: slow, for tests). `"auto"` is what measured
fastest on the H200 and XLA off the GPU: on a GPU the same as "pallas":
  indexer logits: Mosaic GPU on Hopper (prefill and decode kernels), Triton elsewhere; top-k:
  Triton (several times lax.top_k); sparse MLA: Mosaic GPU on Hopper where it takes the
  config's operands, Triton elsewhere; dense MHA: Mosaic GPU (the only option taking the packed
  layout). Numbers: docs/benchmarks.md.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Literal, get_args

import jax
import jax.numpy as jnp

from pallas_kernels import dense_mha as dense_mha_lib
from pallas_kernels import indexer_logits as indexer_logits_lib
from pallas_kernels import sparse_mla as sparse_mla_lib
from pallas_kernels import topk as topk_lib
from pallas_kernels.device import on_hopper

Kernels = Literal["auto", "xla", "pallas"]  # the `kernels` argument of forward, SparseMLA, ...
CHOICES = get_args(Kernels)
OPS = ("indexer_logits", "topk", "sparse_mla", "dense_mha")
BACKENDS = ("xla", "triton", "mosaic")
MOSAIC_INDEXER_DTYPES = ("fp8", "bfloat16")  # indexer dtypes the Mosaic indexer kernels take (q and keys alike)


@dataclasses.dataclass(frozen=True)
class OpImpl:
    """How one op runs: backend "xla" | "triton" | "mosaic", interpret (Pallas interpret mode,
    off the GPU), tuning (keyword overrides for that backend's kernel, as (name, value) pairs;
    empty: its own defaults)."""

    backend: str
    interpret: bool = False
    tuning: tuple[tuple[str, object], ...] = ()

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")


@dataclasses.dataclass(frozen=True)
class Implementations:
    """One OpImpl per op (hashable: part of a jitted forward's static state)."""

    indexer_logits: OpImpl
    topk: OpImpl
    sparse_mla: OpImpl
    dense_mha: OpImpl


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
        PJRT_NPROC).
    Off the GPU every Pallas backend interprets.
    """
    check_kernels(kernels)
    interpret = interpret_mode()
    if kernels == "xla" or (kernels == "auto" and interpret):
        return Implementations(XLA, XLA, XLA, XLA)
    hopper = not interpret and on_hopper()
    triton = OpImpl("triton", interpret)
    indexer = OpImpl("mosaic") if hopper and config.indexer_dtype in MOSAIC_INDEXER_DTYPES else triton
    sparse = OpImpl("mosaic") if hopper and _sparse_mosaic_takes(config) else triton
    too_few_threads = interpret and cpu_threads() < dense_mha_lib.INTERPRET_MIN_CPU_THREADS
    dense_unsupported = dense_mha_lib.unsupported_reason(config.jnp_dtype, config.qk_head_dim, config.v_head_dim)
    dense = XLA if too_few_threads or dense_unsupported else OpImpl("mosaic", interpret)
    topk = OpImpl("mosaic") if hopper else triton
    return Implementations(indexer_logits=indexer, topk=topk, sparse_mla=sparse, dense_mha=dense)


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


def indexer_logits(q, weights, k_cache, k_scale, block_tables, row_seq, row_end, *, page_size, impl: OpImpl,
                   kernel: str):
    """[N, W * page_size] f32 indexer logits of columns [0, row_end); the rest unspecified (the
    Mosaic kernels skip the -inf fill past a row tile's computed blocks: clean=False in
    pallas_kernels.indexer_logits): read them through topk(lengths=row_end).
    kernel: "prefill" | "decode", the Mosaic kernel shape the plan chose for these rows
    (RowGroup.indexer_kernel; used when impl runs Mosaic)."""
    if impl.backend == "xla":
        return indexer_logits_lib.indexer_logits_reference(q, weights, k_cache, k_scale, block_tables, row_seq,
                                                           row_end, page_size=page_size)
    backend = f"mosaic_{kernel}" if impl.backend == "mosaic" else impl.backend
    return indexer_logits_lib.indexer_logits(q, weights, k_cache, k_scale, block_tables, row_seq, row_end,
                                             page_size=page_size, backend=backend, clean=False,
                                             interpret=impl.interpret, **dict(impl.tuning))


def topk(logits, k: int, *, lengths, impl: OpImpl):
    """[N, k] int32 positions of the k largest finite logits per row among its first lengths[n]
    ([N] int32) columns, -1 padded."""
    if impl.backend == "xla":
        return topk_lib.topk_reference(logits, k, lengths)
    return topk_lib.topk(logits, k, lengths=lengths, backend=impl.backend, interpret=impl.interpret,
                         **dict(impl.tuning))


def sparse_mla(q, latent, latent_scale, k_pe, slots, pages, *, scale, page_size, impl: OpImpl, dequantize: str):
    """(out [N, H, R] f32, lse [N, H]) of absorbed attention over cache slots (-1 skipped).

    dequantize: "kernel" | "upfront", the plan's route for these rows (RowGroup.dequantize;
    used by Pallas backends with an fp8 cache). pages: the page ids (-1 ignored) holding every
    slot, which "upfront" dequantises once ahead of the kernel (a copy with a row for every
    entry, -1 included): the prefill rows' own pages under the plan's fp8 split
    (BatchPlan.num_upfront_rows), else the block tables [num_seqs, pages_per_seq]."""
    if impl.backend == "xla":
        return sparse_mla_lib.sparse_mla_reference(q, latent, latent_scale, k_pe, slots, scale=scale)
    return sparse_mla_lib.sparse_mla(q, latent, latent_scale, k_pe, slots, scale=scale, backend=impl.backend,
                                     dequantize=dequantize, pages=pages, page_size=page_size,
                                     interpret=impl.interpret, **dict(impl.tuning))


def dense_mha(q, k, v, q_start_loc, k_start_loc, *, scale, impl: OpImpl, selection=None, max_kv_len=None):
    """[T, H, Dv] causal attention of packed ragged sequences, each row restricted to the key
    positions of its selection row when one is given (masked MHA; see pallas_kernels.dense_mha)."""
    if impl.backend == "xla":
        return dense_mha_lib.dense_mha_reference(q, k, v, q_start_loc, k_start_loc, scale=scale, selection=selection)
    return dense_mha_lib.dense_mha(q, k, v, q_start_loc, k_start_loc, scale=scale, selection=selection,
                                   max_kv_len=max_kv_len, backend=impl.backend, interpret=impl.interpret,
                                   **dict(impl.tuning))


gather_paged_rows = indexer_logits_lib.gather_paged_rows
dequantize_index_keys = indexer_logits_lib.dequantize_index_keys
dequantize_latent = sparse_mla_lib.dequantize_latent
