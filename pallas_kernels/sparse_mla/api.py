"""Absorbed (MQA-form) sparse MLA attention over selected latent-cache rows.

For each query row n and head h, over the cache slots idx = slots[n, :] that are >= 0:
    score[j] = scale * (q[n, h, :R] . c[idx_j] + q[n, h, R:] . k_pe[idx_j])
    out[n, h] = softmax(score) @ c[idx],   lse[n, h] = logsumexp(score)
Rows with no valid slot give out = 0 and lse = +inf (FlashMLA's convention). A -1 slot adds
nothing whatever the cache holds (slot 0, which it addresses, may hold another request's NaN):
its gathered row is zero by select (the reference), masked loads (Triton) or zero-filled copies
(Mosaic GPU), never by a 0 probability times its values (0 * NaN = NaN).

`sparse_mla` runs the implementation the caller names: "xla", `reference.sparse_mla_reference`,
the jnp oracle, or a Pallas GPU kernel with the same results. An fp8 cache is dequantised either inside the
kernel, per gathered row, or "upfront": the cache pages the rows can reach dequantised once into
a bf16 copy that the bf16 kernel then reads (`dequantize=`, below). Two kernels, named by the
caller (jax_sparse_mla.kernels.resolve for the layer; the route by its plan, policy.py):
  * "mosaic": `mosaic.sparse_mla_mosaic`, Pallas Mosaic GPU (Hopper) with wgmma and a
    warp-specialised producer that gathers the selected rows with cp.async;
  * "triton": `triton.sparse_mla_triton`, the Pallas Triton kernel, the portable one
    (`interpret=True` runs it on CPU, which is how the CPU tests cover the semantics; other
    GPUs; shapes the Mosaic kernel does not take).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ..config import TuningConfig, check_implementation, overrides
from . import mosaic
from .reference import dequantize_latent, sparse_mla_reference
from .triton import sparse_mla_triton


DEQUANTIZE = ("kernel", "upfront")


@dataclasses.dataclass(frozen=True)
class TritonConfig(TuningConfig):
    """Tuning of the Triton kernel (None: its default; see `triton.sparse_mla_triton`)."""

    block_h: int | None = None
    block_k: int | None = None
    num_splits: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None


@dataclasses.dataclass(frozen=True)
class MosaicConfig(TuningConfig):
    """Tuning of the Mosaic GPU kernel (None: its choice; see `mosaic.sparse_mla_mosaic`)."""

    num_splits: int | None = None


CONFIGS = {"xla": None, "triton": TritonConfig, "mosaic": MosaicConfig}  # implementation -> its config class
IMPLEMENTATIONS = tuple(CONFIGS)


def copy_rows(num_slots, pages, page_size):
    """Rows of `dequantize_pages`'s copy: pages.size * page_size, or num_slots for pages None."""
    if pages is None:
        return num_slots
    if not isinstance(page_size, int) or page_size <= 0 or num_slots % page_size:
        raise ValueError(f"page_size must be a positive int dividing the cache's {num_slots} slots, got {page_size!r}")
    return pages.size * page_size


def dequantize_pages(latent, latent_scale, k_pe, slots, pages, *, page_size, dtype):
    """An fp8 cache's pages dequantised once, and slots renumbered into the copy.

    latent: [num_slots, R] e4m3; latent_scale: [num_slots, R // tile] f32; k_pe: [num_slots, P];
    slots: [N, K] int32 (-1 = skip); pages: int32 page ids, any shape (-1 entries ignored), or None
    for the whole cache; slot s lies on page s // page_size.
    Returns (latent [W, R] dtype, k_pe [W, P], slots [N, K] into them), W = pages.size * page_size
    (num_slots for None); a -1 entry's rows are zeros that no slot names (static shapes: they
    cost their copy; zeros rather than a copy of page 0, whose NaN would then reach a kernel that
    masks by multiplying). A slot whose page is not listed becomes -1: `pages` must hold every
    page the slots name (a sequence's block table does).
    """
    copy_rows(latent.shape[0], pages, page_size)  # checks page_size
    if pages is None:
        return dequantize_latent(latent, latent_scale).astype(dtype), k_pe, slots
    num_pages = latent.shape[0] // page_size
    pages = pages.reshape(-1).astype(jnp.int32)
    listed = pages >= 0

    def rows_of(a):  # [num_slots, ...] -> the listed pages' rows [W, ...]; zeros for -1 entries
        paged = a.reshape(num_pages, page_size, *a.shape[1:])
        rows = paged[jnp.where(listed, pages, 0)]
        rows = jnp.where(listed.reshape((-1,) + (1,) * (rows.ndim - 1)), rows, jnp.zeros((), rows.dtype))
        return rows.reshape(pages.size * page_size, *a.shape[1:])

    copy_page = jnp.full((num_pages,), -1, jnp.int32).at[jnp.where(listed, pages, num_pages)].set(
        jnp.arange(pages.size, dtype=jnp.int32), mode="drop")  # cache page -> its page in the copy
    page = copy_page[jnp.clip(slots // page_size, 0, num_pages - 1)]
    renumbered = jnp.where((slots >= 0) & (page >= 0), page * page_size + slots % page_size, -1)
    return (dequantize_latent(rows_of(latent), rows_of(latent_scale)).astype(dtype), rows_of(k_pe),
            renumbered.astype(jnp.int32))


def sparse_mla(q, latent, latent_scale, k_pe, slots, *, scale, implementation, config=None, dequantize="kernel",
               pages=None, page_size=None, interpret=False):
    """Sparse MLA attention; the semantics of `reference.sparse_mla_reference`.

    q: [N, H, R + P] (bf16 | f32); latent: [num_slots, R] (bf16 | f32 | float8_e4m3fn);
    latent_scale: [num_slots, R // 128] f32 (fp8 cache: FlashMLA's per-128-value tile scales) or
    None; k_pe: [num_slots, P]; slots: [N, K] int32 (-1 = skip).
    Returns (out [N, H, R] f32, lse [N, H] f32); rows with no valid slot give out 0, lse +inf.
    `scale` is a static Python number (folded into the kernel).

    implementation: "xla" (`reference.sparse_mla_reference`, jnp: the oracle; it dequantises
    per gathered row and ignores dequantize, pages and interpret), "mosaic"
    (`mosaic.sparse_mla_mosaic`: Hopper, bf16 q and k_pe, compiled only; it raises ValueError
    for operands `unsupported_reason` names rather than running another kernel) or "triton"
    (`triton.sparse_mla_triton`; interpret=True runs it on CPU).
    config: CONFIGS[implementation] (TritonConfig | MosaicConfig; "xla" takes none) or None.

    fp8 caches (`dequantize_pages`): pages [..] int32 (-1 ignored) lists every cache page the
    slots may name (page_size slots each; e.g. the batch's block tables), None = the whole cache.
    dequantize: "kernel" dequantises each gathered row inside the kernel; "upfront" dequantises
    the listed pages once, to q's dtype (the kernel's rounding), and runs the kernel on that copy
    (a transient [pages * page_size, R] buffer): it pays for prefill rows, which gather each
    row many times (jax_sparse_mla.policy.dequantize_route; docs/design/sparse_mla.md).
    "upfront" needs latent_scale (an fp8 cache; ValueError otherwise).

    Why two backends: the Mosaic kernel (cp.async gather producer + wgmma consumers) is ~2x the
    Triton one on Hopper; the Triton one is the portable path (interprets on CPU, any
    power-of-two rank, f32). Triton lowers the gathers (`ref[idx_vector]`, pointer-tensor loads)
    and the dots, but in one program-wide pipeline; the Mosaic kernel specialises warpgroups. One
    program over all 128 heads, to gather each row once, does not fit either way: its
    accumulator alone (128 x 512 f32 = 256 KiB) is the whole register file. (jax 0.11 marks the
    Pallas Triton backend deprecated and warns on each lowering.)
    """
    check_implementation("sparse_mla", implementation, config, CONFIGS)
    if dequantize not in DEQUANTIZE:
        raise ValueError(f"dequantize must be one of {DEQUANTIZE}, got {dequantize!r}")
    if implementation == "xla":
        return sparse_mla_reference(q, latent, latent_scale, k_pe, slots, scale=scale)
    if latent_scale is None and dequantize == "upfront":
        raise ValueError("dequantize='upfront' needs an fp8 cache (latent_scale)")
    if dequantize == "upfront":
        latent, k_pe, slots = dequantize_pages(latent, latent_scale, k_pe, slots, pages,
                                               page_size=page_size, dtype=q.dtype)
        latent_scale = None
    if implementation == "mosaic":
        if interpret:
            raise ValueError("the Mosaic GPU kernel has no interpret mode (its gathers are inline PTX)")
        return mosaic.sparse_mla_mosaic(q, latent, latent_scale, k_pe, slots, scale=scale, **overrides(config))
    return sparse_mla_triton(q, latent, latent_scale, k_pe, slots, scale=scale, interpret=interpret,
                             **overrides(config))
