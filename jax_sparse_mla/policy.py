"""The batch-dependent kernel choices, made on the host when a batch is planned (plan.py).

Python and numpy over static sizes (the prefill route rule also over arrays of lengths): no jax
arrays, nothing from pallas_kernels. Head counts are PER SHARD (the heads one device's kernels
run: num_attention_heads / tensor_parallel). The device-dependent choices (which backend runs
each op) are made once by `kernels.resolve`; the kernels themselves take both as arguments and
decide nothing.
"""

from __future__ import annotations

from typing import Literal, get_args

import numpy as np

# fp8 latent cache: dequantising the pages a group of rows reads once, upfront, into a bf16 copy
# pays when the kernel would otherwise dequantise >= this many gathered rows (rows x topk x one
# program per 64 heads) per copied row; break-even is ~10 on the H200 (docs/design/sparse_mla.md).
UPFRONT_MIN_USES = 12
HEADS_PER_PROGRAM = 64  # heads of one sparse-attention program: each gathers (and dequantises) its rows

# indexer logits: a call is prefill-shaped when it has at least one full Mosaic row tile per
# sequence (docs/design/indexer.md).
MGPU_MIN_ROWS_PER_SEQ = 16

# indexer under tensor parallelism: its weights are replicated (~14M parameters a layer), so each
# tensor shard can score any row with every index head. A group of at least this many rows is
# split by rows over the tensor shards, each scoring and top-k'ing its share and the shards
# all-gathering the slots (rows x topk int32); a smaller group is scored whole on every shard
# (no communication). An estimate, not a measurement: scoring + top-k of a row at 8K context
# costs ~0.19 us on one H200 (1.55 ms for 8K rows), its slots' all-gather ~0.03 us over NVLink,
# plus ~20 us a collective; to be settled on several GPUs (docs/design/sharding.md). Unmeasured
# costs of a split: the Mosaic decode kernel guesses a row's sequence from its index (row i ->
# sequence i, right for a batch of decodes in plan order) and reloads the table row when wrong,
# which every row of a split share is (shard s scores rows s, s + tp, ...).
INDEXER_SPLIT_MIN_ROWS = 256

# indexer scoring: a call's logits, [rows, keys] float32 (keys: the block tables' width times the
# page size, the engine's max_model_len), are computed and top-k'd in chunks of rows, one chunk
# after the other, each chunk's logits at most this many bytes: an 8K-row call over a 128K table
# wrote 4 GB of logits at once, in 2 chunks 2 GB. A chunk costs time (~0.1 ms in a cond program;
# docs/design/topk.md), so the bound keeps 4K-row calls over 128K whole.
SCORING_WORKSPACE_BYTES = 1 << 31

DEQUANTIZE_ROUTES = ("kernel", "upfront")
INDEXER_KERNELS = ("prefill", "decode")


def dequantize_route(rows: int, heads: int, topk: int, copy_rows: int) -> str:
    """"upfront" if the kernel would dequantise rows x topk x cdiv(heads, 64) gathered rows (one
    64-head program each) >= UPFRONT_MIN_USES x copy_rows, the rows an upfront copy holds (its
    pages x page_size); else "kernel". heads: per shard."""
    programs = -(-heads // HEADS_PER_PROGRAM)
    return "upfront" if rows * topk * programs >= UPFRONT_MIN_USES * copy_rows else "kernel"


def indexer_shards(rows: int, tensor_parallel: int) -> int:
    """Tensor shards that split a scoring call of `rows` rows between them: tensor_parallel for
    >= INDEXER_SPLIT_MIN_ROWS rows that divide evenly, else 1 (every shard scores every row)."""
    if tensor_parallel > 1 and rows >= INDEXER_SPLIT_MIN_ROWS and rows % tensor_parallel == 0:
        return tensor_parallel
    return 1


def score_chunks(rows: int, keys: int) -> int:
    """Row chunks of a scoring call of `rows` rows (one shard's) over `keys` key positions: the
    fewest whose f32 logits [ceil(rows / chunks), keys] fit SCORING_WORKSPACE_BYTES (1: the call
    whole), at least 1 and at most max(rows, 1)."""
    most_rows = max(SCORING_WORKSPACE_BYTES // max(4 * keys, 1), 1)
    return max(min(-(-rows // most_rows), rows), 1)


def indexer_kernel(rows: int, seqs: int) -> str:
    """The Mosaic indexer kernel shape for a scoring call of `rows` query rows over `seqs`
    sequences (block-table rows): "prefill" with >= MGPU_MIN_ROWS_PER_SEQ rows per sequence
    (min(seqs, rows) sequences can hold rows), else "decode" (1-2 rows per sequence; a single
    sequence too, where both kernels are latency-bound)."""
    return "prefill" if rows >= MGPU_MIN_ROWS_PER_SEQ * min(seqs, rows) else "decode"


# Prefills longer than index_topk: masked MHA (dense causal attention over the sequence's keys,
# each row restricted to its top-k positions; DeepSeek-V3.2's prefill mode) or absorbed sparse
# attention. Both score and top-k the rows; they differ in the attention and its projections.
# Cost per shard head, in ns (scripts/calibrate_routes.py measures and fits these on a GPU):
#   sparse: SPARSE_NS_PER_KEY x sum over rows of min(position + 1, topk) (the gathered rows,
#           576 + 512 values each) + ABSORB_NS_PER_ROW x rows (q into the latent and the output
#           out of it: 2 x 128 x 512 x 2 FLOPs a row);
#   masked: MASKED_NS_PER_KEY x sum over rows of (position + 1) (every causal key of a live tile
#           is computed, 192 + 128 values each) + UP_NS_PER_KEY x (context + rows) (k_nope and v
#           up-projected from the latent: 512 x 256 x 2 FLOPs a key).
# Fitted on one H200 (2026-12-01, bf16, 128 heads; docs/benchmarks-archive.md, "masked MHA: the third
# route"): each route's times of fresh prefills of 2K-16K tokens and of 4K chunks after 4K and 12K of context
# lie within 5% of the fit from 4K up (9-12% at 2K). Fresh prefills route masked up to 15,340
# tokens; a 4K chunk after up to ~5K of context.
SPARSE_NS_PER_KEY = 5.2e-3
ABSORB_NS_PER_ROW = 1.68
MASKED_NS_PER_KEY = 1.34e-3
UP_NS_PER_KEY = 1.34
PrefillRoute = Literal["auto", "masked", "sparse"]  # the prefill_route option (plan_batch, the engine, ...)
PREFILL_ROUTES = get_args(PrefillRoute)


def check_prefill_route(value) -> None:
    """ValueError unless value is one of PREFILL_ROUTES (the prefill_route option of the plan,
    the enumeration and the engine)."""
    if not isinstance(value, str) or value not in PREFILL_ROUTES:
        raise ValueError(f"prefill_route must be one of {PREFILL_ROUTES}, got {value!r}")


def _positions_sum(start, end, cap=None):
    """sum of min(p + 1, cap) for p in [start, end) (cap None: no cap); ints or int64 arrays."""
    def upto(n):  # sum of min(i, cap) for i in 1..n
        if cap is None:
            return n * (n + 1) // 2
        m = np.minimum(n, cap)
        return m * (m + 1) // 2 + (n - m) * cap
    return upto(end) - upto(start)


def route_costs(context_len, query_len, topk: int) -> dict:
    """{"sparse": ns, "masked": ns} per shard head of a prefill's attention (see the constants):
    floats for int lengths, float64 arrays for arrays of them (int64 arithmetic: exact)."""
    context_len = np.asarray(context_len, np.int64)
    query_len = np.asarray(query_len, np.int64)
    end = context_len + query_len
    costs = {"sparse": SPARSE_NS_PER_KEY * _positions_sum(context_len, end, topk) + ABSORB_NS_PER_ROW * query_len,
             "masked": MASKED_NS_PER_KEY * _positions_sum(context_len, end) + UP_NS_PER_KEY * end}
    return costs if end.ndim else {name: float(cost) for name, cost in costs.items()}


def masked_cheaper(context_lens, query_lens, topk: int):
    """Whether masked MHA is the cheaper route of each prefill (total length > topk) by
    route_costs (ties: sparse): the rule of prefill_route, over arrays of lengths (bool array)."""
    costs = route_costs(context_lens, query_lens, topk)
    return np.less(costs["masked"], costs["sparse"])


def prefill_route(context_len: int, query_len: int, topk: int) -> str:
    """"masked" or "sparse" for a prefill whose total length exceeds topk: the cheaper by
    route_costs (ties: sparse; masked_cheaper over one prefill)."""
    return "masked" if masked_cheaper(context_len, query_len, topk) else "sparse"
