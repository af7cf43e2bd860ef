"""Absorbed (MQA-form) sparse MLA attention over selected latent-cache rows.

For each query row n and head h, over the cache slots idx = slots[n, :] that are >= 0:
    score[j] = scale * (q[n, h, :R] . c[idx_j] + q[n, h, R:] . k_pe[idx_j])
    out[n, h] = softmax(score) @ c[idx],   lse[n, h] = logsumexp(score)
Rows with no valid slot give out = 0 and lse = +inf (FlashMLA's convention). A -1 slot adds
nothing whatever the cache holds (slot 0, which it addresses, may hold another request's NaN):
its gathered row is zero by select (the reference), masked loads (Triton) or zero-filled copies
(Mosaic GPU), never by a 0 probability times its values (0 * NaN = NaN).

`sparse_mla_reference` is the jnp oracle (and the XLA path); `sparse_mla_attention` is the
Pallas GPU kernel, same signature and results. An fp8 cache is dequantised either inside the
kernel, per gathered row, or "upfront": the cache pages the rows can reach dequantised once into
a bf16 copy that the bf16 kernel then reads (`dequantize=`, below). Two backends:
  * "mosaic" (the default on a Hopper GPU): `sparse_attention_mgpu`, Pallas Mosaic GPU with
    wgmma and a warp-specialised producer that gathers the selected rows with cp.async;
  * "triton": the Pallas Triton kernel below, for everything else (`interpret=True` runs it on
    CPU, which is how the CPU tests cover the semantics; other GPUs; shapes the Mosaic kernel
    does not take).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from . import sparse_attention_mgpu
from ._device import on_hopper
from ._shapes import next_pow2
from .slot_splits import auto_num_splits, combine_splits

ROW_CHUNK = 32  # rows per step of the reference, bounding its [rows, topk, R] gather


def dequantize_latent(latent, latent_scale):
    """latent: [..., R] (bf16 | f32 | e4m3); latent_scale: [..., R // tile] f32 or None -> f32."""
    values = latent.astype(jnp.float32)
    if latent_scale is None:
        return values
    tile = latent.shape[-1] // latent_scale.shape[-1]
    shaped = values.reshape(values.shape[:-1] + (latent_scale.shape[-1], tile))
    return (shaped * latent_scale[..., None]).reshape(values.shape)


DEQUANTIZE = ("auto", "kernel", "upfront")
# Upfront dequantisation pays when the kernel would dequantise at least this many gathered rows
# (rows x topk x 64-head programs) per row of the upfront copy. H200, Mosaic kernel, rows over one
# 128K-slot sequence (docs/benchmarks.md, session 9), upfront time / in-kernel time: 4 uses a row
# 1.33, 8 1.03, 16 0.92, 32 0.82; at 4096 rows (64 a row) 0.81: even at ~10.
UPFRONT_MIN_USES = 12


def dequantize_route(rows, heads, topk, copy_rows):
    """"upfront" if the kernel would dequantise rows x topk x cdiv(heads, 64) gathered rows (one
    64-head program each) >= UPFRONT_MIN_USES x copy_rows, the rows an upfront copy holds; else "kernel"."""
    return "upfront" if rows * topk * pl.cdiv(heads, 64) >= UPFRONT_MIN_USES * copy_rows else "kernel"


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


def sparse_mla_reference(q, latent, latent_scale, k_pe, slots, *, scale):
    """Sparse MLA attention in jnp, float32.

    q: [N, H, R + P]; latent: [num_slots, R]; latent_scale: [num_slots, R // 128] f32 or None;
    k_pe: [num_slots, P]; slots: [N, K] int32 (-1 = skip). Returns (out [N, H, R] f32, lse [N, H] f32).
    """
    rank = latent.shape[-1]

    def one_row(args):
        q_n, idx = args
        valid = idx >= 0
        safe = jnp.where(valid, idx, 0)
        # A -1 slot reads slot 0 (static shapes), which may hold another request's NaN / inf:
        # its rows are zeroed by select, never by the p = 0 product below (0 * NaN = NaN).
        c = jnp.where(valid[:, None], dequantize_latent(
            latent[safe], None if latent_scale is None else latent_scale[safe]), 0.0)  # [K, R]
        pe = jnp.where(valid[:, None], k_pe[safe].astype(jnp.float32), 0.0)  # [K, P]
        q_n = q_n.astype(jnp.float32)
        hi = jax.lax.Precision.HIGHEST
        s = (jnp.einsum("hr,kr->hk", q_n[:, :rank], c, precision=hi)
             + jnp.einsum("hp,kp->hk", q_n[:, rank:], pe, precision=hi)) * scale
        s = jnp.where(valid[None, :], s, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.exp(s - m)
        denom = jnp.sum(p, axis=-1)
        out = jnp.einsum("hk,kr->hr", p, c, precision=hi) / jnp.where(denom > 0, denom, 1.0)[:, None]
        lse = jnp.where(denom > 0, jnp.log(denom) + m[:, 0], jnp.inf)
        return out, lse

    return jax.lax.map(one_row, (q, slots), batch_size=ROW_CHUNK)


# ----------------------------------------------------------------------------------------------
# Pallas GPU kernel (Triton backend)
# ----------------------------------------------------------------------------------------------

_LOG2E = 1.4426950408889634  # scores are kept in log2 units so the kernel can use exp2
_LN2 = 0.6931471805599453
_MIN_DOT = 16  # Triton's tl.dot needs every matrix dimension >= 16


def _sparse_mla_kernel(q_ref, latent_ref, *rest, heads, rank, rope, topk, tile, block_h, block_k,
                       rope_pad, blocks_per_split, qk_scale):
    """One program: one query row, `block_h` heads, one split of the row's slot blocks.

    Refs are whole arrays (raw pointers on Triton): q [N, H, R+P], latent [S, R],
    latent_scale [S, R // tile] (fp8 only), k_pe [S, P], slots [N, K];
    outputs out [splits, N, H, R] f32 and lse [splits, N, H] f32 (natural log, -inf if empty).
    """
    has_scale = tile is not None
    if has_scale:
        scale_ref, kpe_ref, slots_ref, out_ref, lse_ref = rest
    else:
        scale_ref = None
        kpe_ref, slots_ref, out_ref, lse_ref = rest
    head_block, row, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    dot_dtype = q_ref.dtype  # matrix products run in q's dtype (bf16 -> tensor cores, f32 -> exact)
    # HIGHEST keeps f32 products in IEEE f32 (Triton's default for f32 is TF32); no effect on bf16.
    dot = functools.partial(pltriton.dot, precision=lax.Precision.HIGHEST)

    # Query tile, loaded once: [block_h, R] latent part and [block_h, rope_pad] rope part.
    # Padded heads (>= H) and padded rope columns (>= P) read as 0, so they add nothing.
    h0 = head_block * block_h
    head_ids = h0 + jnp.arange(block_h)
    head_ok = head_ids < heads  # [block_h]
    rope_cols = jnp.arange(rope_pad)
    rope_ok = rope_cols < rope  # [rope_pad]
    latent_cols = jnp.arange(rank)

    def zero(ref):  # `other=` for masked loads, in the ref's dtype (an int 0 won't cast to fp8)
        return jnp.zeros((), ref.dtype)

    def load_q(cols, col_ok=None):
        # Indices are clamped into the array (the values there are masked to 0 anyway).
        rows_ = jnp.minimum(head_ids, heads - 1)[:, None]
        mask = head_ok[:, None] if col_ok is None else head_ok[:, None] & col_ok[None, :]
        mask = jnp.broadcast_to(mask, (block_h, cols.shape[0]))
        return pltriton.load(q_ref.at[row, rows_, cols[None, :]], mask=mask, other=zero(q_ref))

    q_lat = load_q(latent_cols)
    q_pe = load_q(rank + jnp.minimum(rope_cols, rope - 1), rope_ok)

    def body(block, carry):
        m, l, acc = carry  # m, l: [block_h] f32 (log2 units); acc: [block_h, R] f32
        # Slot ids of this block: [block_k]; entries past K read as -1.
        k0 = block * block_k
        in_range = (k0 + jnp.arange(block_k)) < topk
        idx = pltriton.load(slots_ref.at[row, pl.ds(k0, block_k)], mask=in_range, other=-1)
        valid = idx >= 0
        safe = jnp.where(valid, idx, 0)  # never form an address from -1, even under a mask

        # Gather the selected cache rows: [block_k, R]. The gather uses two broadcast index
        # vectors (rows x columns) rather than `ref[idx, pl.ds(..)]`: the Triton lowering takes
        # both, but interpret mode only handles all-array indexers. Invalid slots are masked
        # off, so they cost no memory traffic.
        c = pltriton.load(latent_ref.at[safe[:, None], latent_cols[None, :]],
                          mask=jnp.broadcast_to(valid[:, None], (block_k, rank)), other=zero(latent_ref))
        if has_scale:
            # fp8: dequantise the gathered tile once (one f32 scale per `tile` values of a row), so
            # both products see one [block_k, R] operand and run as single dots.
            n_tiles = rank // tile
            tile_scale = pltriton.load(scale_ref.at[safe[:, None], jnp.arange(n_tiles)[None, :]],
                                       mask=jnp.broadcast_to(valid[:, None], (block_k, n_tiles)), other=0.0)
            c = (c.astype(jnp.float32).reshape(block_k, n_tiles, tile) * tile_scale[:, :, None]
                 ).reshape(block_k, rank)
        c = c.astype(dot_dtype)
        pe = pltriton.load(kpe_ref.at[safe[:, None], jnp.minimum(rope_cols, rope - 1)[None, :]],
                           mask=valid[:, None] & rope_ok[None, :], other=zero(kpe_ref))
        s = dot(q_lat, c, trans_b=True) + dot(q_pe, pe.astype(dot_dtype), trans_b=True)
        s = jnp.where(valid[None, :], s * qk_scale, -jnp.inf)  # [block_h, block_k]

        # Online softmax. Until a row has seen a valid slot its max is -inf: shift by 0 then,
        # so exp2(-inf - 0) = 0 instead of exp2(-inf + inf) = nan.
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - shift)
        p = jnp.exp2(s - shift[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + dot(p.astype(dot_dtype), c)
        return m_new, l, acc

    m0 = jnp.full((block_h,), -jnp.inf, jnp.float32)
    l0 = jnp.zeros((block_h,), jnp.float32)
    acc0 = jnp.zeros((block_h, rank), jnp.float32)
    num_blocks = pl.cdiv(topk, block_k)
    first = split * blocks_per_split
    last = jnp.minimum(first + blocks_per_split, num_blocks)
    m, l, acc = lax.fori_loop(first, last, body, (m0, l0, acc0))

    empty = l == 0.0
    inv_l = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))
    pltriton.store(out_ref.at[split, row, pl.ds(h0, block_h), :], acc * inv_l[:, None],
                   mask=jnp.broadcast_to(head_ok[:, None], (block_h, rank)))
    lse = jnp.where(empty, -jnp.inf, (m + jnp.log2(jnp.where(empty, 1.0, l))) * _LN2)
    pltriton.store(lse_ref.at[split, row, pl.ds(h0, block_h)], lse, mask=head_ok)


def sparse_mla_attention(q, latent, latent_scale, k_pe, slots, *, scale, interpret=False, backend=None,
                         dequantize="auto", pages=None, page_size=None,
                         block_h=64, block_k=32, num_splits=None, num_warps=None, num_stages=2):
    """Sparse MLA attention as a Pallas GPU kernel; same semantics as `sparse_mla_reference`.

    q: [N, H, R + P] (bf16 | f32); latent: [num_slots, R] (bf16 | f32 | float8_e4m3fn);
    latent_scale: [num_slots, R // 128] f32 (fp8 cache: FlashMLA's per-128-value tile scales) or
    None; k_pe: [num_slots, P]; slots: [N, K] int32 (-1 = skip).
    Returns (out [N, H, R] f32, lse [N, H] f32); rows with no valid slot give out 0, lse +inf.
    `scale` is a static Python number (folded into the kernel).

    backend: "mosaic" (`sparse_attention_mgpu`, Hopper only, bf16 q; see there), "triton", or
    None = "mosaic" on a Hopper GPU when it takes the operands (`unsupported_reason`), else
    "triton". `num_splits` applies to both; the other knobs tune the Triton kernel only.

    fp8 caches (`dequantize_pages`): pages [..] int32 (-1 ignored) lists every cache page the
    slots may name (page_size slots each; e.g. the batch's block tables), None = the whole cache.
    dequantize: "kernel" dequantises each gathered row inside the kernel; "upfront" dequantises
    the listed pages once, to q's dtype (the kernel's rounding), and runs the kernel on that copy
    (a transient [pages * page_size, R] buffer); "auto" = "upfront" when the kernel would
    dequantise at least UPFRONT_MIN_USES rows per row of that copy (prefill: thousands of rows
    over one sequence's pages), else "kernel" (decode). H200, fp8 prefill 4096 rows: see
    docs/benchmarks.md (session 9).

    Keyword-only Triton tuning knobs (defaults are meant for H200 and the real model's shapes):
      block_h    heads per program (the M side of both matrix products), capped at next_pow2(H);
      block_k    selected slots per loop step (the N side of Q.K^T, the K side of P.V);
      num_splits programs per (row, head block) over disjoint parts of the slot list, merged
                 by their lse afterwards (flash-decoding); None picks it from the grid size;
      num_warps / num_stages  Triton's; num_warps None = 4 if block_h <= 16 else 8.

    Why two backends (H200, FlashMLA's FLOP count, bf16 prefill of 1024 rows over 8K slots):
    this Triton kernel runs at ~155 TFLOP/s, the Mosaic GPU kernel at 338 (decode 128 x 2:
    131 vs ~260; fp8 prefill 118 vs 168). Triton lowers the gathers (`ref[idx_vector]`,
    pointer-tensor loads) and the dots, but in one program-wide pipeline; the Mosaic kernel
    specialises warpgroups (a cp.async gather producer, two wgmma consumers). One program over
    all 128 heads, to gather each row once, does not fit either way: its accumulator alone
    (128 x 512 f32 = 256 KiB) is the whole register file. The Triton kernel stays as the
    portable path: it interprets on CPU (the Mosaic kernel's inline-PTX gathers cannot), and
    takes any power-of-two rank, f32 q and f32 caches. (jax 0.11 marks the Pallas Triton
    backend deprecated and warns on each lowering.)
    Triton's rules shape the tiling: every
    loaded/computed block is a power of two and each `tl.dot` dimension is >= 16, so
      * the 576-wide q.k product is split into R (512 | 128) latent columns + P (64 | 8) rope
        columns; rope is padded to max(16, next_pow2(P)) with masked (zero) loads;
      * heads are padded to a power of two >= 16 and masked on store (H=4 or 6 -> 16 rows);
      * the slot list is walked in blocks of `block_k` (>= 16); the tail block and -1 entries
        are masked, and a K smaller than the block just masks more.
    An fp8 latent is dequantised once per gathered tile (e4m3 x its row's per-`tile` f32 scale,
    rounded to q's dtype), so each block runs as the same two dots as a bf16 cache (measured
    118 vs 93 TFLOP/s for scaling scores and probabilities per 128-column chunk instead).
    Softmax runs online in fp32 (exp2, scores pre-multiplied by scale * log2 e); the matrix
    products accumulate in fp32 and take their inputs in q's dtype (bf16 q -> tensor cores;
    f32 q -> exact IEEE products, slow, meant for tests).
    Grid: (head blocks, rows, splits): head blocks vary fastest, so the programs reading the
    same gathered rows run side by side and share them through L2.
    Register budget at the defaults (H=128, R=512): acc 64 x 512 f32 = 128 KiB, i.e. 128
    registers per thread at 8 warps, plus the q tile, hence block_h 64 and block_k 32.
    """
    if dequantize not in DEQUANTIZE:
        raise ValueError(f"dequantize must be one of {DEQUANTIZE}, got {dequantize!r}")
    if latent_scale is None and dequantize == "upfront":
        raise ValueError("dequantize='upfront' needs an fp8 cache (latent_scale)")
    if latent_scale is not None:
        if dequantize == "auto":
            dequantize = dequantize_route(*q.shape[:2], slots.shape[-1], copy_rows(latent.shape[0], pages, page_size))
        if dequantize == "upfront":
            latent, k_pe, slots = dequantize_pages(latent, latent_scale, k_pe, slots, pages,
                                                   page_size=page_size, dtype=q.dtype)
            latent_scale = None
    if backend is None:
        backend = "mosaic" if not interpret and on_hopper() and sparse_attention_mgpu.unsupported_reason(
            q, latent, latent_scale, k_pe) is None else "triton"
    if backend == "mosaic":
        if interpret:
            raise ValueError("the Mosaic GPU kernel has no interpret mode (its gathers are inline PTX)")
        return sparse_attention_mgpu.sparse_mla_attention_mgpu(q, latent, latent_scale, k_pe, slots, scale=scale,
                                                               num_splits=num_splits)
    if backend != "triton":
        raise ValueError(f"backend must be 'mosaic', 'triton' or None, got {backend!r}")
    n_rows, heads, width = q.shape
    num_slots, rank = latent.shape
    rope = k_pe.shape[-1]
    topk = slots.shape[-1]
    if width != rank + rope:
        raise ValueError(f"q width {width} != latent rank {rank} + rope {rope}")
    if rank & (rank - 1) or rank < _MIN_DOT:
        raise ValueError(f"latent rank must be a power of two >= {_MIN_DOT}, got {rank}")
    if latent_scale is not None:
        tile = rank // latent_scale.shape[-1]
        if tile * latent_scale.shape[-1] != rank or tile & (tile - 1):
            raise ValueError(f"latent_scale {latent_scale.shape} does not tile rank {rank}")
    elif latent.dtype == jnp.float8_e4m3fn:
        raise ValueError("an fp8 latent needs latent_scale")
    else:
        tile = None
    if q.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"q must be bf16 or f32, got {q.dtype}")
    if n_rows == 0 or topk == 0:  # nothing to attend: every row is empty
        return (jnp.zeros((n_rows, heads, rank), jnp.float32), jnp.full((n_rows, heads), jnp.inf, jnp.float32))

    block_h = min(next_pow2(block_h, _MIN_DOT), next_pow2(heads, _MIN_DOT))
    block_k = min(next_pow2(block_k, _MIN_DOT), next_pow2(topk, _MIN_DOT))
    rope_pad = next_pow2(rope, _MIN_DOT)
    head_blocks = pl.cdiv(heads, block_h)
    num_blocks = pl.cdiv(topk, block_k)
    if num_splits is None:
        num_splits = auto_num_splits(n_rows, head_blocks, num_blocks)
    num_splits = max(1, min(num_splits, num_blocks))
    blocks_per_split = pl.cdiv(num_blocks, num_splits)
    num_splits = pl.cdiv(num_blocks, blocks_per_split)  # no split left without work
    if num_warps is None:
        num_warps = 4 if block_h <= 16 else 8

    kernel = functools.partial(
        _sparse_mla_kernel, heads=heads, rank=rank, rope=rope, topk=topk, tile=tile,
        block_h=block_h, block_k=block_k, rope_pad=rope_pad,
        blocks_per_split=blocks_per_split, qk_scale=float(scale) * _LOG2E)
    operands = (q, latent) + (() if tile is None else (latent_scale.astype(jnp.float32),)) + (
        k_pe, slots.astype(jnp.int32))
    out, lse = pl.pallas_call(
        kernel,
        grid=(head_blocks, n_rows, num_splits),
        out_shape=(jax.ShapeDtypeStruct((num_splits, n_rows, heads, rank), jnp.float32),
                   jax.ShapeDtypeStruct((num_splits, n_rows, heads), jnp.float32)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="sparse_mla_attention",
    )(*operands)
    return combine_splits(out, lse)
