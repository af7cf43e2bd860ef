"""Lightning-indexer logits over a paged key cache: the public entry (the caller names the kernel).

For each scored row n (a query token), over the keys of its own sequence:
    logits[n, s] = sum_h weights[n, h] * relu(q[n, h] . k[s]) * k_scale[s]   for s < row_end[n]
and -inf elsewhere (with clean=True, the default; clean=False: see `indexer_logits`). Keys are
addressed by position s of the row's sequence through its block table:
slot = block_tables[seq, s // page_size] * page_size + s % page_size.
Isolation (every implementation, the Mosaic GPU kernels included): a key enters only its own
logit (q . k contracts D, the head sum runs per key), and a logit at s >= row_end is replaced by
-inf (select) or left unwritten (clean=False), so NaN / inf in keys past row_end, on -1 table
entries (which read page 0, or zeros where keys are gathered first) or in other sequences'
pages reach no valid logit.
"""

from __future__ import annotations

import jax.numpy as jnp

from .mosaic_decode import indexer_logits_mosaic_decode
from .mosaic_prefill import indexer_logits_mosaic_prefill
from .triton import indexer_logits_triton

# backend -> (its kernel, the keyword tuning it takes)
BACKENDS = {
    "triton": (indexer_logits_triton,  # see triton.choose_tiling; fp8_imprecise_acc: see the kernel
               ("block_rows", "block_keys", "chunk", "num_warps", "num_stages", "fp8_imprecise_acc")),
    "mosaic_prefill": (indexer_logits_mosaic_prefill,  # see mosaic_prefill.PrefillTiling
                       ("block_rows", "group", "stages", "splits", "compute_wgs", "programs")),
    "mosaic_decode": (indexer_logits_mosaic_decode,  # see mosaic_decode.choose_decode_tiling
                      ("block_rows", "chunk", "step_blocks", "stages", "num_sms")),
}


def dequantize_index_keys(keys, scale):
    """keys: [..., D] (e4m3 | bf16 | f32); scale: [...] f32 (fp8 keys) or None -> [..., D] f32."""
    keys = keys.astype(jnp.float32)
    return keys if scale is None else keys * scale[..., None]


def indexer_logits(q, weights, k_cache, k_scale, block_tables, row_seq, row_end, *, page_size, backend,
                   clean=True, interpret=False, **tuning):
    """Indexer logits, Pallas kernels. Same contract as `reference.indexer_logits_reference`
    (with clean=True; clean=False below).

    q: [N, Hi, D]; weights [N, Hi] f32; k_cache [num_slots, D]; k_scale [num_slots] f32 or None;
    block_tables [S, W] int32; row_seq, row_end [N] int32 -> [N, W * page_size] f32.
    backend (named by the caller: jax_sparse_mla.kernels.resolve and the plan's
    RowGroup.indexer_kernel for the layer):
      "triton": `triton.indexer_logits_triton`, the portable kernel (e4m3 | bf16 | f32; other
        GPUs; interpret=True on CPU);
      "mosaic_prefill": `mosaic_prefill.indexer_logits_mosaic_prefill`, Mosaic GPU (Hopper;
        e4m3 or bf16 q and keys of one dtype), for many rows per sequence (wgmma + TMA,
        warp-specialised; MMA-bound);
      "mosaic_decode": `mosaic_decode.indexer_logits_mosaic_decode`, Mosaic GPU, for 1-2 rows
        per sequence (a TMA stream of the key pages through a deep SMEM ring; bandwidth-bound).
    Which Mosaic kernel suits a batch: jax_sparse_mla.policy.indexer_kernel (docs/design/indexer.md).
    clean: False lets the Mosaic kernels leave a row's columns unwritten past the last key block
      its row tile computes (anything may be there; columns in [0, row_end) and -inf in computed
      blocks as ever), as DeepGEMM's clean_logits=False: for a consumer that reads only each
      row's first row_end columns (topk with lengths=row_end, as the layer does). It spares the
      -inf fill of causal tails and padding rows (one 256-byte store per row per 64-key block).
      The Triton kernel writes -inf there either way.
    tuning: keyword overrides the backend's kernel takes (BACKENDS[backend][1]); another name is
    a ValueError.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {tuple(BACKENDS)}, got {backend!r}")
    kernel, takes = BACKENDS[backend]
    unknown = sorted(set(tuning) - set(takes))
    if unknown:
        raise ValueError(f"the {backend} indexer kernel takes no {', '.join(unknown)} (its tuning: {', '.join(takes)})")
    if backend != "triton":
        tuning = dict(tuning, clean=clean)
    return kernel(q, weights, k_cache, k_scale, block_tables, row_seq, row_end, page_size=page_size,
                  interpret=interpret, **tuning)
