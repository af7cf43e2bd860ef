"""Sparse MLA attention: the Pallas Triton-backend kernel (the portable path: any GPU, CPU
interpret mode, f32). Semantics: `reference.sparse_mla_reference`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ..device import LN2, LOG2E, next_pow2
from .splits import auto_num_splits, combine_splits, live_blocks

_MIN_DOT = 16  # Triton's tl.dot needs every matrix dimension >= 16


def _sparse_mla_kernel(q_ref, latent_ref, *rest, heads, rank, rope, topk, tile, block_h, block_k,
                       rope_pad, blocks_per_split, qk_scale):
    """One program: one query row, `block_h` heads, one split of the row's slot blocks.

    Refs are whole arrays (raw pointers on Triton): q [N, H, R+P], latent [S, R],
    latent_scale [S, R // tile] (fp8 only), k_pe [S, P], slots [N, K], live [N] (the row's slot
    blocks up to its last valid slot, `splits.live_blocks`); outputs out [splits, N, H, R] f32 and
    lse [splits, N, H] f32 (natural log, -inf if empty). Only the row's live blocks are walked,
    and a program with none loads nothing (its q loads are masked off).
    """
    has_scale = tile is not None
    if has_scale:
        scale_ref, kpe_ref, slots_ref, live_ref, out_ref, lse_ref = rest
    else:
        scale_ref = None
        kpe_ref, slots_ref, live_ref, out_ref, lse_ref = rest
    head_block, row, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    first = split * blocks_per_split
    last = jnp.minimum(first + blocks_per_split, live_ref[row])  # <= first: nothing to do
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
        ok = head_ok & (last > first)
        mask = ok[:, None] if col_ok is None else ok[:, None] & col_ok[None, :]
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
    m, l, acc = lax.fori_loop(first, jnp.maximum(first, last), body, (m0, l0, acc0))

    empty = l == 0.0
    inv_l = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))
    pltriton.store(out_ref.at[split, row, pl.ds(h0, block_h), :], acc * inv_l[:, None],
                   mask=jnp.broadcast_to(head_ok[:, None], (block_h, rank)))
    lse = jnp.where(empty, -jnp.inf, (m + jnp.log2(jnp.where(empty, 1.0, l))) * LN2)
    pltriton.store(lse_ref.at[split, row, pl.ds(h0, block_h)], lse, mask=head_ok)


def sparse_mla_triton(q, latent, latent_scale, k_pe, slots, *, scale, interpret=False,
                      block_h=64, block_k=32, num_splits=None, num_warps=None, num_stages=2):
    """Sparse MLA attention, Pallas (Triton backend) kernel: `api.sparse_mla`'s contract with the
    cache as given (an fp8 latent dequantised per gathered row; `interpret=True` runs on CPU).

    Keyword-only Triton tuning knobs (defaults are meant for H200 and the real model's shapes):
      block_h    heads per program (the M side of both matrix products), capped at next_pow2(H);
      block_k    selected slots per loop step (the N side of Q.K^T, the K side of P.V);
      num_splits programs per (row, head block) over disjoint parts of the slot list, merged
                 by their lse afterwards (flash-decoding); None picks it from the grid size;
      num_warps / num_stages  Triton's; num_warps None = 4 if block_h <= 16 else 8.

    Triton's rules shape the tiling: every
    loaded/computed block is a power of two and each `tl.dot` dimension is >= 16, so
      * the 576-wide q.k product is split into R (512 | 128) latent columns + P (64 | 8) rope
        columns; rope is padded to max(16, next_pow2(P)) with masked (zero) loads;
      * heads are padded to a power of two >= 16 and masked on store (H=4 or 6 -> 16 rows);
      * the slot list is walked in blocks of `block_k` (>= 16) up to the row's last valid slot
        (a row of -1 does no work); the tail block and -1 entries are masked, and a K smaller
        than the block just masks more.
    An fp8 latent is dequantised once per gathered tile (e4m3 x its row's per-`tile` f32 scale,
    rounded to q's dtype), so each block runs as the same two dots as a bf16 cache (faster than
    scaling scores and probabilities per 128-column chunk).
    Softmax runs online in fp32 (exp2, scores pre-multiplied by scale * log2 e); the matrix
    products accumulate in fp32 and take their inputs in q's dtype (bf16 q -> tensor cores;
    f32 q -> exact IEEE products, slow, meant for tests).
    Grid: (head blocks, rows, splits): head blocks vary fastest, so the programs reading the
    same gathered rows run side by side and share them through L2.
    Register budget at the defaults (H=128, R=512): acc 64 x 512 f32 = 128 KiB, i.e. 128
    registers per thread at 8 warps, plus the q tile, hence block_h 64 and block_k 32.
    """
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
    # no split past the slot list (a split past a row's live blocks writes 0 and lse -inf)
    num_splits = pl.cdiv(num_blocks, blocks_per_split)
    if num_warps is None:
        num_warps = 4 if block_h <= 16 else 8

    kernel = functools.partial(
        _sparse_mla_kernel, heads=heads, rank=rank, rope=rope, topk=topk, tile=tile,
        block_h=block_h, block_k=block_k, rope_pad=rope_pad,
        blocks_per_split=blocks_per_split, qk_scale=float(scale) * LOG2E)
    slots = slots.astype(jnp.int32)
    operands = (q, latent) + (() if tile is None else (latent_scale.astype(jnp.float32),)) + (
        k_pe, slots, live_blocks(slots, block_k))
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
