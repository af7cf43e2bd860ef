"""The batch plan: static program choice (BatchPlan) plus traced per-token metadata (BatchMeta).

A batch is a list of `Request`s, each adding `query_len` new tokens after `context_len` cached
ones. Rows of `hidden` are the new tokens, request after request in the given order, then padding.

Routing (DeepSeek-V3.2 / vLLM's short-prefill skip): a request is a *decode* when it adds one
token to a non-empty context, otherwise a *prefill*. When every prefill's total length
(context + new) is <= index_topk, top-k would select every causal position, so the prefills run
as dense causal MHA (`use_dense_mha`). Indexer scoring and top-k are then left out of the
program unless decode rows need them (only those rows are scored) or `skip_indexer=False`
asks for the unoptimised baseline (every row scored, as vLLM does without the skip).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from .config import MLAConfig


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
    min_query_len: int = 16

    @staticmethod
    def round_up(n: int, minimum: int) -> int:
        return max(minimum, 1 << max(n - 1, 0).bit_length())


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """Static description of one compiled program (hashable; a jit static argument).

    num_tokens: padded rows of hidden.
    num_seqs: padded sequence count.
    pages_per_seq: block-table width W; each sequence sees W * page_size key positions.
    num_decode_tokens: padded count of decode rows that a dense-route program sends through the
      sparse path (0 when use_dense_mha is False: there every row is sparse).
    max_query_len: padded query length of the dense layout (0 when use_dense_mha is False).
    use_dense_mha: prefills run dense causal MHA instead of indexer + sparse attention.
    num_scored_tokens: rows the indexer scores: num_tokens, num_decode_tokens, or 0 when the
      program contains no indexer scoring and no top-k at all.
    """

    num_tokens: int
    num_seqs: int
    pages_per_seq: int
    num_decode_tokens: int
    max_query_len: int
    use_dense_mha: bool
    num_scored_tokens: int

    @property
    def has_indexer_scoring(self) -> bool:
        return self.num_scored_tokens > 0

    @property
    def route(self) -> str:
        return "dense" if self.use_dense_mha else "sparse"


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
    decode_rows [num_decode_tokens]: rows of the decode tokens (-1 padding), dense route only.
    dense_query_len [S]: query length of sequences that run dense MHA (0 for the others).
    """

    positions: jax.Array
    slot_mapping: jax.Array
    row_seq: jax.Array
    query_start_loc: jax.Array
    seq_lens: jax.Array
    block_tables: jax.Array
    decode_rows: jax.Array
    dense_query_len: jax.Array


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


def plan_batch(config: MLAConfig, requests: Sequence[Request], *, num_pages: int | None = None,
               force_sparse: bool = False, skip_indexer: bool = True,
               buckets: BucketPolicy = BucketPolicy()) -> tuple[BatchPlan, BatchMeta]:
    """Validates a batch on the host and returns its static plan and traced metadata.

    force_sparse: route short prefills through the indexer and sparse attention anyway.
    skip_indexer: leave scoring out of a dense-route program (False: the baseline that scores
      every row even though no prefill reads the result).
    Raises ValueError naming the request and the problem before anything touches a device.
    """
    _validate(config, requests, num_pages)
    page = config.page_size
    prefills = [r for r in requests if not r.is_decode]
    use_dense = (not force_sparse and bool(prefills)
                 and all(r.total_len <= config.index_topk for r in prefills))

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
    decode_rows = []
    row = 0
    for i, r in enumerate(requests):
        pos = np.arange(r.context_len, r.total_len)
        table = np.asarray(list(r.block_table)[: -(-r.total_len // page)], np.int32)
        positions[row:row + r.query_len] = pos
        slot_mapping[row:row + r.query_len] = table[pos // page] * page + pos % page
        row_seq[row:row + r.query_len] = i
        query_start_loc[i] = row
        seq_lens[i] = r.total_len
        block_tables[i, :len(table)] = table
        if use_dense and r.is_decode:
            decode_rows.append(row)
        elif use_dense:
            dense_query_len[i] = r.query_len
        row += r.query_len

    num_decode = buckets.round_up(len(decode_rows), 1) if decode_rows else 0
    max_query_len = buckets.round_up(int(dense_query_len.max()), buckets.min_query_len) if use_dense else 0
    if not use_dense:
        scored = num_tokens
    elif not skip_indexer:
        scored = num_tokens
    else:
        scored = num_decode
    plan = BatchPlan(num_tokens=num_tokens, num_seqs=num_seqs, pages_per_seq=width,
                     num_decode_tokens=num_decode, max_query_len=max_query_len,
                     use_dense_mha=use_dense, num_scored_tokens=scored)
    meta = BatchMeta(
        positions=positions, slot_mapping=slot_mapping, row_seq=row_seq,
        query_start_loc=query_start_loc, seq_lens=seq_lens, block_tables=block_tables,
        decode_rows=np.asarray(decode_rows + [-1] * (num_decode - len(decode_rows)), np.int32),
        dense_query_len=dense_query_len)
    return plan, jax.tree.map(jax.numpy.asarray, meta)
