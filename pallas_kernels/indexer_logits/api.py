"""Lightning-indexer logits over a paged key cache: the public entry (the caller names the implementation).

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

import dataclasses

from ..config import TuningConfig, check_implementation, overrides
from .mosaic_decode import indexer_logits_mosaic_decode
from .mosaic_prefill import indexer_logits_mosaic_prefill
from .reference import indexer_logits_reference
from .triton import indexer_logits_triton


@dataclasses.dataclass(frozen=True)
class TritonConfig(TuningConfig):
    """Tuning of the Triton kernel (None: its choice, `triton.choose_tiling`); fp8_imprecise_acc:
    see `triton.indexer_logits_triton` (0 allowed: exact f32 accumulation)."""

    block_rows: int | None = None
    block_keys: int | None = None
    chunk: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    fp8_imprecise_acc: int | None = None

    ZERO_OK = ("fp8_imprecise_acc",)


PREFILL_FIELDS = ("group", "splits", "compute_wgs", "programs")  # the prefill kernel's alone
DECODE_FIELDS = ("chunk", "step_blocks", "num_sms")  # the decode kernel's alone


@dataclasses.dataclass(frozen=True)
class MosaicConfig(TuningConfig):
    """Tuning of the Mosaic GPU kernels (None: their choice): block_rows and stages for either;
    PREFILL_FIELDS for the prefill kernel only (`mosaic_prefill.PrefillTiling`), DECODE_FIELDS for
    the decode kernel only (`mosaic_decode.choose_decode_tiling`); a field of the other kernel is
    a ValueError at the call."""

    block_rows: int | None = None
    stages: int | None = None
    group: int | None = None
    splits: int | None = None
    compute_wgs: int | None = None
    programs: int | None = None
    chunk: int | None = None
    step_blocks: int | None = None
    num_sms: int | None = None


CONFIGS = {"xla": None, "triton": TritonConfig, "mosaic": MosaicConfig}  # implementation -> its config class
IMPLEMENTATIONS = tuple(CONFIGS)
MOSAIC_KERNELS = {"prefill": (indexer_logits_mosaic_prefill, DECODE_FIELDS),  # kernel -> (it, the fields it refuses)
                  "decode": (indexer_logits_mosaic_decode, PREFILL_FIELDS)}


def indexer_logits(q, weights, k_cache, k_scale, block_tables, row_seq, row_end, *, page_size, implementation,
                   config=None, kernel=None, clean=True, interpret=False):
    """Indexer logits. Contract: `reference.indexer_logits_reference` (with clean=True; clean=False below).

    q: [N, Hi, D]; weights [N, Hi] f32; k_cache [num_slots, D]; k_scale [num_slots] f32 or None;
    block_tables [S, W] int32; row_seq, row_end [N] int32 -> [N, W * page_size] f32.
    implementation (named by the caller: jax_sparse_mla.kernels.resolve for the layer):
      "xla": `reference.indexer_logits_reference`, jnp (any dtypes; the oracle);
      "triton": `triton.indexer_logits_triton`, the portable kernel (e4m3 | bf16 | f32; other
        GPUs; interpret=True on CPU);
      "mosaic": a Mosaic GPU kernel (Hopper; e4m3 or bf16 q and keys of one dtype), `kernel`:
        "prefill": `mosaic_prefill.indexer_logits_mosaic_prefill`, for many rows per sequence
          (wgmma + TMA, warp-specialised; MMA-bound);
        "decode": `mosaic_decode.indexer_logits_mosaic_decode`, for 1-2 rows per sequence (a
          TMA stream of the key pages through a deep SMEM ring; bandwidth-bound).
      Which suits a batch is the caller's: jax_sparse_mla.policy.indexer_kernel, through the
      plan's RowGroup.indexer_kernel (docs/design/indexer.md); other implementations ignore it.
    config: CONFIGS[implementation] (TritonConfig | MosaicConfig; "xla" takes none) or None (the
      kernel's own tiling).
    clean: False lets the Mosaic kernels leave a row's columns unwritten past the last key block
      its row tile computes (anything may be there; columns in [0, row_end) and -inf in computed
      blocks as ever), as DeepGEMM's clean_logits=False: for a consumer that reads only each
      row's first row_end columns (topk with lengths=row_end, as the layer does). It spares the
      -inf fill of causal tails and padding rows (one 256-byte store per row per 64-key block).
      The other implementations write -inf there either way.
    interpret: run a Pallas kernel in its interpreter (CPU); "xla" ignores it.
    """
    check_implementation("indexer_logits", implementation, config, CONFIGS)
    args = (q, weights, k_cache, k_scale, block_tables, row_seq, row_end)
    if implementation == "xla":
        return indexer_logits_reference(*args, page_size=page_size)
    tuning = overrides(config)
    if implementation == "triton":
        return indexer_logits_triton(*args, page_size=page_size, interpret=interpret, **tuning)
    if kernel not in MOSAIC_KERNELS:
        raise ValueError(f"indexer_logits: kernel must be one of {tuple(MOSAIC_KERNELS)} for implementation "
                         f"'mosaic', got {kernel!r}")
    fn, refused = MOSAIC_KERNELS[kernel]
    wrong = sorted(set(tuning) & set(refused))
    if wrong:
        raise ValueError(f"indexer_logits: the {kernel} Mosaic kernel takes no MosaicConfig.{', '.join(wrong)}")
    return fn(*args, page_size=page_size, clean=clean, interpret=interpret, **tuning)
