"""The batch plan: static program choice (BatchPlan) plus traced per-token metadata (BatchMeta).

A batch is a list of `Request`s, each adding `query_len` new tokens after `context_len` cached
ones. Rows of `hidden` are the new tokens, request after request in the given order, then padding.

Routing. A request is a *decode* when it adds one token to a non-empty context, otherwise a
*prefill*. A prefill whose total length (context + new) is <= index_topk would have top-k select
every causal position, so it runs as dense causal MHA: its rows are neither scored nor top-k'd
(DeepSeek-V3.2 / vLLM's short-prefill skip). Each prefill is routed by its own length, and only
the rows that attend sparsely (decodes and long prefills) are scored; vLLM and SGLang instead
score every row as soon as one row needs it. A batch with no short prefill runs the all-sparse
program. `skip_indexer=False` is the baseline that scores every row whatever the route. The
indexer key cache is written for every row either way.

Dispatch. `dispatch="static"`: the route is a static plan field, one executable per plan, chosen
on the host. `dispatch="cond"`: one executable per shape bucket holds both programs and picks
one at run time with lax.cond on a traced flag (meta.dense_flag), for engines that keep a
single captured program per shape.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from .config import MLAConfig
from .kernels import dequantize_route


@dataclasses.dataclass(frozen=True)
class Request:
    """One sequence's work in a step. block_table: page ids covering context + query tokens."""

    context_len: int
    query_len: int
    block_table: Sequence[int]

    @property
    def total_len(self) -> int:
        return self.context_len + self.query_len

    @property
    def is_decode(self) -> bool:
        return self.query_len == 1 and self.context_len > 0


@dataclasses.dataclass(frozen=True)
class BucketPolicy:
    """Padding of the plan's sizes to powers of two, each at least its minimum, so that a serving
    loop compiles a bounded set of programs (one per combination of buckets and routes)."""

    min_tokens: int = 16
    min_seqs: int = 4
    min_pages_per_seq: int = 4
    min_dense_keys: int = 16

    @staticmethod
    def round_up(n: int, minimum: int) -> int:
        return max(minimum, 1 << max(n - 1, 0).bit_length())


DISPATCH_MODES = ("static", "cond")


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """Static description of one compiled program (hashable; a jit static argument).

    num_tokens: padded rows of hidden.
    num_seqs: padded sequence count.
    pages_per_seq: block-table width W; each sequence sees W * page_size key positions.
    use_dense_mha: True: the dense program (short prefills run dense MHA, the rows in
      meta.sparse_rows attend sparsely); False: the all-sparse program; None: both, picked at
      run time by meta.dense_flag (dispatch="cond").
    num_sparse_tokens: padded count of meta.sparse_rows, the dense program's sparsely attending
      rows (decodes and long prefills); 0 when there are none or use_dense_mha is False.
    num_dense_keys: padded count of the key rows of the sequences run as dense MHA (their context
      and new tokens, packed sequence after sequence); 0 when use_dense_mha is False.
    skip_indexer: the dense program scores only meta.sparse_rows (False: every row, the
      baseline without the skip). Always True where it changes nothing (the sparse program).
    num_pages: the cache size the page ids were validated against (None: not validated);
      forward refuses a cache of another size.
    num_upfront_rows, num_kernel_rows, num_upfront_pages: an fp8 latent cache's split of the
      sparsely attending rows (static dispatch; all 0 otherwise). The prefill rows
      (meta.upfront_rows) attend over a bf16 copy of their sequences' pages
      (meta.upfront_pages, dequantised once), the decode rows (meta.kernel_rows) over the fp8
      cache, dequantised in the kernel. Split when dequantising those pages upfront pays
      (kernels.dequantize_route): a prefill gathers each row of its sequence many times. The
      three sizes are power-of-two buckets, so an fp8 cache compiles more programs.
    In a cond plan, num_sparse_tokens is num_tokens and num_dense_keys num_seqs * index_topk
    (padded): sizes that fit any batch of the bucket.
    """

    num_tokens: int
    num_seqs: int
    pages_per_seq: int
    use_dense_mha: bool | None
    num_sparse_tokens: int
    num_dense_keys: int
    skip_indexer: bool = True
    num_pages: int | None = None
    num_upfront_rows: int = 0
    num_kernel_rows: int = 0
    num_upfront_pages: int = 0

    @property
    def num_scored_tokens(self) -> int | None:
        """Rows the indexer scores (0: no scoring and no top-k in the program; None: decided at run time)."""
        if self.use_dense_mha is None:
            return None
        if self.use_dense_mha and self.skip_indexer:
            return self.num_sparse_tokens
        return self.num_tokens

    @property
    def has_indexer_scoring(self) -> bool:
        """Whether the program contains indexer scoring (a cond program always holds the sparse branch)."""
        return self.num_scored_tokens != 0

    @property
    def route(self) -> str:
        return {True: "dense", False: "sparse", None: "cond"}[self.use_dense_mha]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BatchMeta:
    """Per-token and per-sequence int32 arrays of one batch (traced).

    positions [T]: position of each row in its sequence (-1 for padding rows).
    slot_mapping [T]: cache slot each row writes (-1: writes nowhere).
    row_seq [T]: sequence index of each row (0 for padding rows, whose position is -1).
    query_start_loc [S + 1]: first row of each sequence (padding sequences are empty).
    seq_lens [S]: context + query length (0 for padding sequences).
    block_tables [S, W]: page ids (-1 past each sequence's pages).
    sparse_rows [num_sparse_tokens]: rows that attend sparsely in the dense program (-1 padding).
    dense_rows [T]: rows of the sequences run as dense MHA, sequence after sequence (-1 padding).
    dense_query_start [S + 1]: where each sequence's rows start in dense_rows (a sequence that is
      not run dense owns none).
    dense_key_slots [num_dense_keys]: cache slots of those sequences' keys (positions 0 ..
      seq_len - 1), sequence after sequence (-1 padding).
    dense_key_start [S + 1]: where each sequence's keys start in dense_key_slots.
    upfront_rows [num_upfront_rows], kernel_rows [num_kernel_rows]: the sparsely attending rows
      of the fp8 split (prefills, then decodes; -1 padding); upfront_pages [num_upfront_pages]:
      the prefills' pages, sequence after sequence (-1 padding). Empty without the split.
    dense_flag: int32 scalar, 1 when the cond program should take its dense branch
      (dispatch="cond" only; None otherwise).
    """

    positions: jax.Array
    slot_mapping: jax.Array
    row_seq: jax.Array
    query_start_loc: jax.Array
    seq_lens: jax.Array
    block_tables: jax.Array
    sparse_rows: jax.Array
    dense_rows: jax.Array
    dense_query_start: jax.Array
    dense_key_slots: jax.Array
    dense_key_start: jax.Array
    upfront_rows: jax.Array
    kernel_rows: jax.Array
    upfront_pages: jax.Array
    dense_flag: jax.Array | None = None


def _validate(config: MLAConfig, requests: Sequence[Request], num_pages: int | None) -> None:
    if len(requests) == 0:
        raise ValueError("empty batch: plan_batch needs at least one request")
    written: dict[int, int] = {}
    for i, r in enumerate(requests):
        if not isinstance(r, Request):
            raise ValueError(f"request {i}: expected a Request, got {type(r).__name__}")
        if r.context_len < 0:
            raise ValueError(f"request {i}: context_len must be >= 0, got {r.context_len}")
        if r.query_len < 1:
            raise ValueError(f"request {i}: query_len must be >= 1, got {r.query_len}")
        needed = -(-r.total_len // config.page_size)
        table = list(r.block_table)
        if len(table) < needed:
            raise ValueError(f"request {i}: block_table has {len(table)} pages, but context_len + query_len = "
                             f"{r.total_len} tokens need {needed} pages of {config.page_size}")
        for page in table[:needed]:
            if page < 0 or (num_pages is not None and page >= num_pages):
                bound = f"[0, {num_pages})" if num_pages is not None else ">= 0"
                raise ValueError(f"request {i}: page id {page} is outside {bound}")
        first, last = r.context_len // config.page_size, (r.total_len - 1) // config.page_size
        for page in table[first:last + 1]:  # pages this step writes: sharing one would corrupt it
            if page in written:
                raise ValueError(f"request {i}: page {page} is written by this step more than once "
                                 f"(also by request {written[page]})")
            written[page] = i


def _upfront_split(config: MLAConfig, requests: Sequence[Request], attends_sparsely, row_starts, tables, buckets):
    """(upfront rows, kernel rows, upfront pages, their bucketed sizes) of the fp8 split (see
    BatchPlan), or None when the cache is not fp8, no prefill attends sparsely, or dequantising
    its pages would not pay. tables[i]: request i's pages that its tokens fill."""
    if config.kv_cache_dtype != "fp8":
        return None
    upfront_rows, kernel_rows, pages = [], [], []
    for i, r in enumerate(requests):
        if not attends_sparsely[i]:
            continue
        rows = range(row_starts[i], row_starts[i] + r.query_len)
        if r.is_decode:
            kernel_rows.extend(rows)
        else:
            upfront_rows.extend(rows)
            pages.extend(tables[i].tolist())
    if not upfront_rows:
        return None
    sizes = (buckets.round_up(len(upfront_rows), 1), buckets.round_up(len(kernel_rows), 1) if kernel_rows else 0,
             buckets.round_up(len(pages), buckets.min_pages_per_seq))
    route = dequantize_route(sizes[0], config.num_attention_heads, config.index_topk, sizes[2] * config.page_size)
    return (upfront_rows, kernel_rows, pages, sizes) if route == "upfront" else None


def pad_ids(values, size: int):
    """values as int32 [size], -1 padded."""
    out = np.full(size, -1, np.int32)
    out[: len(values)] = values
    return out


def plan_batch(config: MLAConfig, requests: Sequence[Request], *, num_pages: int | None = None,
               force_sparse: bool = False, skip_indexer: bool = True,
               buckets: BucketPolicy = BucketPolicy(), dispatch: str = "static") -> tuple[BatchPlan, BatchMeta]:
    """Validates a batch on the host and returns its static plan and traced metadata.

    force_sparse: route short prefills through the indexer and sparse attention too.
    skip_indexer: score only the rows that attend sparsely (False: every row, the baseline).
    num_pages: the cache's page count; page ids outside [0, num_pages) are rejected. Without
      it page ids are only checked to be >= 0 (an id past the cache would read clamped slots and
      write nowhere), so engines should pass it.
    dispatch: "static" (the route is in the plan) or "cond" (in meta.dense_flag; the plan's
      sizes then depend on the shape buckets only).
    Raises ValueError naming the request and the problem before anything touches a device.
    """
    if dispatch not in DISPATCH_MODES:
        raise ValueError(f"dispatch must be one of {DISPATCH_MODES}, got {dispatch!r}")
    _validate(config, requests, num_pages)
    page = config.page_size
    dense = [not force_sparse and not r.is_decode and r.total_len <= config.index_topk for r in requests]

    n_real = sum(r.query_len for r in requests)
    num_tokens = buckets.round_up(n_real, buckets.min_tokens)
    num_seqs = buckets.round_up(len(requests), buckets.min_seqs)
    width = buckets.round_up(max(-(-r.total_len // page) for r in requests), buckets.min_pages_per_seq)

    positions = np.full(num_tokens, -1, np.int32)
    slot_mapping = np.full(num_tokens, -1, np.int32)
    row_seq = np.zeros(num_tokens, np.int32)
    query_start_loc = np.full(num_seqs + 1, n_real, np.int32)
    seq_lens = np.zeros(num_seqs, np.int32)
    block_tables = np.full((num_seqs, width), -1, np.int32)
    dense_query_len = np.zeros(num_seqs, np.int32)
    dense_key_len = np.zeros(num_seqs, np.int32)
    sparse_rows, dense_rows, dense_key_slots, row_starts, tables = [], [], [], [], []
    row = 0
    for i, r in enumerate(requests):
        pos = np.arange(r.context_len, r.total_len)
        table = np.asarray(list(r.block_table)[: -(-r.total_len // page)], np.int32)
        row_starts.append(row)
        tables.append(table)
        positions[row:row + r.query_len] = pos
        slot_mapping[row:row + r.query_len] = table[pos // page] * page + pos % page
        row_seq[row:row + r.query_len] = i
        query_start_loc[i] = row
        seq_lens[i] = r.total_len
        block_tables[i, :len(table)] = table
        if dense[i]:
            dense_query_len[i], dense_key_len[i] = r.query_len, r.total_len
            dense_rows.extend(range(row, row + r.query_len))
            all_pos = np.arange(r.total_len)
            dense_key_slots.extend(table[all_pos // page] * page + all_pos % page)
        else:
            sparse_rows.extend(range(row, row + r.query_len))
        row += r.query_len

    if dispatch == "cond":  # sizes from the buckets alone: one program per shape bucket
        use_dense = None
        num_sparse = num_tokens
        num_dense_keys = buckets.round_up(num_seqs * config.index_topk, buckets.min_dense_keys)
    else:
        use_dense = any(dense)
        num_sparse = buckets.round_up(len(sparse_rows), 1) if use_dense and sparse_rows else 0
        num_dense_keys = buckets.round_up(len(dense_key_slots), buckets.min_dense_keys) if use_dense else 0
    split = None if dispatch == "cond" else _upfront_split(config, requests, [not d for d in dense], row_starts,
                                                             tables, buckets)
    upfront_rows, kernel_rows, upfront_pages, (num_upfront_rows, num_kernel_rows, num_upfront_pages) = (
        split or ([], [], [], (0, 0, 0)))
    plan = BatchPlan(num_tokens=num_tokens, num_seqs=num_seqs, pages_per_seq=width, use_dense_mha=use_dense,
                     num_sparse_tokens=num_sparse, num_dense_keys=num_dense_keys,
                     skip_indexer=skip_indexer or use_dense is False, num_pages=num_pages,
                     num_upfront_rows=num_upfront_rows, num_kernel_rows=num_kernel_rows,
                     num_upfront_pages=num_upfront_pages)
    meta = BatchMeta(
        positions=positions, slot_mapping=slot_mapping, row_seq=row_seq,
        query_start_loc=query_start_loc, seq_lens=seq_lens, block_tables=block_tables,
        sparse_rows=pad_ids(sparse_rows if num_sparse else [], num_sparse),  # unused by the sparse program
        dense_rows=pad_ids(dense_rows, num_tokens),
        dense_query_start=np.concatenate([[0], np.cumsum(dense_query_len)]).astype(np.int32),
        dense_key_slots=pad_ids(dense_key_slots, num_dense_keys),
        dense_key_start=np.concatenate([[0], np.cumsum(dense_key_len)]).astype(np.int32),
        upfront_rows=pad_ids(upfront_rows, num_upfront_rows), kernel_rows=pad_ids(kernel_rows, num_kernel_rows),
        upfront_pages=pad_ids(upfront_pages, num_upfront_pages),
        dense_flag=np.int32(any(dense)) if dispatch == "cond" else None)
    return plan, jax.tree.map(jax.numpy.asarray, meta)
