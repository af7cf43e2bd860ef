"""Lightning-indexer logits over a paged key cache: the public router.

For each scored row n (a query token), over the keys of its own sequence:
    logits[n, s] = sum_h weights[n, h] * relu(q[n, h] . k[s]) * k_scale[s]   for s < row_end[n]
and -inf elsewhere. Keys are addressed by position s of the row's sequence through its block
table: slot = block_tables[seq, s // page_size] * page_size + s % page_size.
Isolation (every implementation, the Mosaic GPU kernels included): a key enters only its own
logit (q . k contracts D, the head sum runs per key), and a logit at s >= row_end is replaced by
-inf (select), so NaN / inf in keys past row_end, on -1 table entries (which read page 0, or
zeros where keys are gathered first) or in other sequences' pages reach no valid logit.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..device import on_hopper
from .layout import FP8_E4M3
from .mosaic_decode import indexer_logits_mosaic_decode
from .mosaic_prefill import indexer_logits_mosaic_prefill
from .triton import FP8_IMPRECISE_ACC, indexer_logits_triton

MGPU_MIN_ROWS_PER_SEQ = 16  # prefill-shaped: at least one full Mosaic row tile per sequence


def dequantize_index_keys(keys, scale):
    """keys: [..., D] (e4m3 | bf16 | f32); scale: [...] f32 (fp8 keys) or None -> [..., D] f32."""
    keys = keys.astype(jnp.float32)
    return keys if scale is None else keys * scale[..., None]


def indexer_logits(q, weights, k_cache, k_scale, block_tables, row_seq, row_end, *, page_size,
                   interpret=False, fp8_imprecise_acc=FP8_IMPRECISE_ACC, **tiling_overrides):
    """Indexer logits, Pallas kernels. Same contract as `reference.indexer_logits_reference`.

    Route, for e4m3 or bf16 q and keys on a Hopper GPU:
      * prefill-shaped batches (>= MGPU_MIN_ROWS_PER_SEQ rows per sequence on average) go to
        the Mosaic GPU prefill kernel (`mosaic_prefill.indexer_logits_mosaic_prefill`: wgmma +
        TMA, warp-specialised; MMA-bound; several times the Triton kernel);
      * everything else (decode: 1-2 rows per sequence) goes to the Mosaic GPU decode kernel
        (`mosaic_decode.indexer_logits_mosaic_decode`: a TMA stream of the key pages through a
        deep SMEM ring; bandwidth-bound), single sequences (B = 1) too, where both kernels are
        latency-bound (docs/design/indexer.md).
    Interpret mode, f32, other GPUs and any tiling override go to the Triton-backend kernel
    `triton.indexer_logits_triton`, whose arguments these are.
    """
    if (not interpret and not tiling_overrides and fp8_imprecise_acc == FP8_IMPRECISE_ACC
            and on_hopper() and q.dtype == k_cache.dtype and q.dtype in (FP8_E4M3, jnp.bfloat16)):
        if q.shape[0] >= MGPU_MIN_ROWS_PER_SEQ * min(block_tables.shape[0], q.shape[0]):
            return indexer_logits_mosaic_prefill(q, weights, k_cache, k_scale, block_tables, row_seq, row_end,
                                                 page_size=page_size)
        return indexer_logits_mosaic_decode(q, weights, k_cache, k_scale, block_tables, row_seq, row_end,
                                            page_size=page_size)
    return indexer_logits_triton(q, weights, k_cache, k_scale, block_tables, row_seq, row_end,
                                 page_size=page_size, interpret=interpret,
                                 fp8_imprecise_acc=fp8_imprecise_acc, **tiling_overrides)
