"""The planner's semantics written out as the per-request Python loop it once was: the slow
reference tests compare plan_batch / plan_arrays against (checks, routes, plan and metadata).

Independent of plan.py's validation and metadata code (it uses only its dataclasses and the
BucketPolicy rounding); the route cost model is restated here with Python ints.
"""

from __future__ import annotations

import collections.abc

import numpy as np

from jax_sparse_mla import policy
from jax_sparse_mla.plan import BatchMeta, BatchPlan, BucketPolicy, PlanConfig, Request, _alias_error

INT32_MIN, INT32_MAX = -2 ** 31, 2 ** 31 - 1


def _is_int(v):
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _as_int(v, what, minimum):
    if not _is_int(v):
        raise ValueError(f"{what} must be an integer, got {v!r} ({type(v).__name__})")
    if not minimum <= v <= INT32_MAX:
        raise ValueError(f"{what} must be >= {minimum}" + (", got " if v < minimum else " and < 2**31, got ") + str(v))
    return int(v)


def _page_ids(i, table):
    where = f"request {i}: block_table"
    if isinstance(table, np.ndarray):
        if table.ndim != 1:
            raise ValueError(f"{where} must be 1-D, got a numpy array of shape {table.shape}")
        if table.dtype.kind not in "iu":
            raise ValueError(f"{where} must hold integer page ids, got a numpy array of dtype {table.dtype}")
        values = table.tolist()
    elif isinstance(table, (str, bytes)) or not isinstance(table, collections.abc.Sequence):
        raise ValueError(f"{where} must be a list, tuple or 1-D numpy integer array of page ids (on the host), "
                         f"got {type(table).__name__}")
    else:
        values = list(table)
        for k, v in enumerate(values):
            if not _is_int(v):
                raise ValueError(f"{where}[{k}] must be an integer page id, got {v!r} ({type(v).__name__})")
        values = [int(v) for v in values]
    for k, v in enumerate(values):
        if not INT32_MIN <= v <= INT32_MAX:
            raise ValueError(f"{where}[{k}] = {v} is outside int32")
    return values


def _alias(i, k, writes, page, j, kj, j_writes):
    return str(_alias_error(i, k, writes, page, j, kj, j_writes))  # the message text is the library's

def _scan_pages(requests, limit, bound, ps):
    """The first page problem of requests (Python int lengths, list tables), or None."""
    owner = {}
    for i, (ctx, q, table) in enumerate(requests):
        first_written = ctx // ps
        mine = {}
        for k in range(-(-(ctx + q) // ps)):
            page, writes = table[k], k >= first_written
            if not 0 <= page < limit:
                return f"request {i}: page id {page} is outside {bound} (block_table[{k}])"
            if page in mine:
                return _alias(i, k, writes, page, i, *mine[page])
            mine[page] = (k, writes)
            if page in owner:
                j, kj, j_writes = owner[page]
                if writes or j_writes:
                    return _alias(i, k, writes, page, j, kj, j_writes)
            else:
                owner[page] = (i, k, writes)
    return None


def first_problem(config, requests, num_pages, *, arrays=False):
    """The message of the batch's first problem in request order (None if it has none).
    arrays: the wording of plan_arrays (its block_tables' width in place of a table's length)."""
    ps = config.page_size
    slot_pages = (INT32_MAX + 1) // ps
    limit = slot_pages if num_pages is None else num_pages
    bound = (f"[0, {num_pages})" if num_pages is not None else
             f"[0, {slot_pages}), the pages of {ps} tokens whose slot numbers fit int32")
    out = []
    width = max(len(r.block_table) for r in requests) if arrays else None  # (-1 padded to it)
    for i, r in enumerate(requests):
        try:
            if not isinstance(r, Request):
                raise ValueError(f"request {i}: expected a Request, got {type(r).__name__}")
            ctx = _as_int(r.context_len, f"request {i}: context_len", 0)
            q = _as_int(r.query_len, f"request {i}: query_len", 1)
            table = _page_ids(i, r.block_table)
            if arrays:
                table += [-1] * (width - len(table))
            total = ctx + q
            if total > config.max_position_embeddings:
                raise ValueError(f"request {i}: context_len + query_len = {total} tokens exceeds "
                                 f"max_position_embeddings = {config.max_position_embeddings}")
            needed = -(-total // ps)
            if (width if arrays else len(table)) < needed:
                what = f"block_tables has {width} columns" if arrays else f"block_table has {len(table)} pages"
                raise ValueError(f"request {i}: {what}, but context_len + query_len = {total} tokens need "
                                 f"{needed} pages of {ps}")
        except ValueError as e:
            return _scan_pages(out, limit, bound, ps) or str(e)
        out.append((ctx, q, table))
    return _scan_pages(out, limit, bound, ps)


def route(config, ctx, q, force_sparse, prefill_route):
    """A request's route ("sparse", "dense" or "masked"), with the cost model in Python ints."""
    if force_sparse or (q == 1 and ctx > 0):
        return "sparse"
    if ctx + q <= config.index_topk:
        return "dense"
    if prefill_route != "auto":
        return prefill_route
    topk, end = config.index_topk, ctx + q

    def upto(n, cap=None):
        if cap is None or n <= cap:
            return n * (n + 1) // 2
        return cap * (cap + 1) // 2 + (n - cap) * cap
    sparse = policy.SPARSE_NS_PER_KEY * (upto(end, topk) - upto(ctx, topk)) + policy.ABSORB_NS_PER_ROW * q
    masked = policy.MASKED_NS_PER_KEY * (upto(end) - upto(ctx)) + policy.UP_NS_PER_KEY * end
    return "masked" if masked < sparse else "sparse"


def plan_reference(config, requests, *, num_pages=None, force_sparse=False, skip_indexer=True,
                   buckets=BucketPolicy(), dispatch="static", tensor_parallel=1, prefill_route="auto"):
    """(BatchPlan, host BatchMeta) of a valid batch of Requests, request by request."""
    page = config.page_size
    cond = dispatch == "cond"
    reqs = [(int(r.context_len), int(r.query_len), [int(p) for p in r.block_table]) for r in requests]
    routes = [route(config, c, q, force_sparse, prefill_route) for c, q, _ in reqs]
    num_tokens = buckets.round_up(sum(q for _, q, _ in reqs), buckets.min_tokens)
    if cond:  # from the first dense / masked request whose keys pass the largest key size: sparse
        cap, keys = max(4 * num_tokens, 16), 0
        for i, (c, q, _) in enumerate(reqs):
            keys += c + q if routes[i] != "sparse" else 0
            if keys > cap:
                routes[i:] = ["sparse"] * (len(reqs) - i)
                break
    dense = [rt != "sparse" for rt in routes]
    num_seqs = buckets.round_up(len(reqs), buckets.min_seqs)
    width = buckets.round_up(max(-(-(c + q) // page) for c, q, _ in reqs), buckets.min_pages_per_seq)
    dense_keys = sum(c + q for (c, q, _), d in zip(reqs, dense) if d)
    static_dense_keys = buckets.round_up(dense_keys, buckets.min_dense_keys) if any(dense) else 0

    positions, slot_mapping, row_seq = [-1] * num_tokens, [-1] * num_tokens, [0] * num_tokens
    block_tables = [[-1] * width for _ in range(num_seqs)]
    dq, dk = [0] * num_seqs, [0] * num_seqs
    sparse_rows, masked_flags, dense_rows, dense_key_slots = [], [], [], []
    upfront_rows, kernel_rows, upfront_pages = [], [], []
    row = 0
    for i, ((ctx, q, table), rt) in enumerate(zip(reqs, routes)):
        table = table[: -(-(ctx + q) // page)]
        block_tables[i][:len(table)] = table
        for p in range(ctx, ctx + q):
            positions[row + p - ctx] = p
            slot_mapping[row + p - ctx] = table[p // page] * page + p % page
            row_seq[row + p - ctx] = i
        rows = list(range(row, row + q))
        if rt != "sparse":
            dq[i], dk[i] = q, ctx + q
            dense_rows += rows
            dense_key_slots += [table[p // page] * page + p % page for p in range(ctx + q)]
        else:
            (kernel_rows if q == 1 and ctx > 0 else upfront_rows).extend(rows)
            if not (q == 1 and ctx > 0):
                upfront_pages += table
        if rt != "dense":
            sparse_rows += rows
            masked_flags += [int(rt == "masked")] * q
        row += q

    if cond:  # the rows attending sparsely first, then the masked ones
        order = [k for k, f in enumerate(masked_flags) if not f] + [k for k, f in enumerate(masked_flags) if f]
        sparse_rows, masked_flags = [sparse_rows[k] for k in order], [masked_flags[k] for k in order]
        # the program's stages: a dense call for dense / masked requests, scoring for scored rows
        use_dense, num_sparse = None, num_tokens if sparse_rows else 0
        num_dense_keys = max(4 * num_tokens, 16) if any(dense) else 0
    else:
        use_dense = any(dense)
        num_sparse = buckets.round_up(len(sparse_rows), 1) if use_dense and sparse_rows else 0
        num_dense_keys = static_dense_keys
    split = (0, 0, 0)
    if dispatch == "static" and config.kv_cache_dtype == "fp8" and upfront_rows:
        sizes = (buckets.round_up(len(upfront_rows), 1), buckets.round_up(len(kernel_rows), 1) if kernel_rows else 0,
                 buckets.round_up(len(upfront_pages), buckets.min_pages_per_seq))
        if policy.dequantize_route(sizes[0], config.num_attention_heads // tensor_parallel, config.index_topk,
                                   sizes[2] * page) == "upfront":
            split = sizes
    if not split[0]:
        upfront_rows, kernel_rows, upfront_pages = [], [], []
    plan = BatchPlan(num_tokens=num_tokens, num_seqs=num_seqs, pages_per_seq=width, use_dense_mha=use_dense,
                     num_sparse_tokens=num_sparse, num_dense_keys=num_dense_keys,
                     skip_indexer=skip_indexer or use_dense is False, num_pages=num_pages,
                     num_upfront_rows=split[0], num_kernel_rows=split[1], num_upfront_pages=split[2],
                     config=PlanConfig.of(config),
                     masked=("some" if num_sparse and num_dense_keys and prefill_route != "sparse" else "none") if cond else
                     "none" if "masked" not in routes else "all" if "sparse" not in routes else "some",
                     tensor_parallel=tensor_parallel)

    def ids(values, size):
        return np.array(list(values) + [-1] * (size - len(values)), np.int32)

    def starts(lens):
        return np.array([sum(lens[:s]) for s in range(num_seqs + 1)], np.int32)
    flags = masked_flags if num_sparse else []
    meta = BatchMeta(
        positions=np.array(positions, np.int32), slot_mapping=np.array(slot_mapping, np.int32),
        row_seq=np.array(row_seq, np.int32), block_tables=np.array(block_tables, np.int32).reshape(num_seqs, width),
        sparse_rows=ids(sparse_rows if num_sparse else [], num_sparse), dense_rows=ids(dense_rows, num_tokens),
        dense_query_start=starts(dq), dense_key_slots=ids(dense_key_slots, num_dense_keys),
        dense_key_start=starts(dk), upfront_rows=ids(upfront_rows, split[0]),
        kernel_rows=ids(kernel_rows, split[1]), upfront_pages=ids(upfront_pages, split[2]),
        masked_flags=ids(flags, num_sparse).clip(0),
        branches=_branches(plan, sparse_rows, row_seq, masked_flags, len(dense_key_slots), routes, row) if cond else None)
    return plan, meta


def _branches(plan, scored, row_seq, masked_flags, num_keys, routes, num_rows):
    """A cond plan's meta.branches, by scanning each stage's sizes for the first that holds it."""
    def pick(sizes, count):
        return next((i for i, size in enumerate(sizes) if size >= count), 0)
    keys = plan.key_sizes[pick(plan.key_sizes, num_keys)] if plan.key_sizes else 0
    dense = plan.dense_calls.index((keys, "masked" in routes)) if plan.key_sizes else 0
    score = 0
    if len(plan.score_calls) > 1:  # the size that holds the scored rows, prefill-shaped at >= 16 rows a sequence
        n = plan.score_sizes[pick(plan.score_sizes, len(scored))]
        shards = policy.indexer_shards(n, plan.tensor_parallel)
        per_shard = (len(scored) + shards - 1) // shards  # a shard's share of the real rows
        seqs = len(set(row_seq[r] for r in scored))
        shape = ("prefill" if per_shard and per_shard >= policy.MGPU_MIN_ROWS_PER_SEQ * min(max(seqs, 1), per_shard)
                 else "decode")
        score = next(i for i, call in enumerate(plan.score_calls) if call == (n, shape))
    return np.array([score, dense, pick(plan.attend_sizes, masked_flags.count(0)), pick(plan.row_sizes, num_rows)],
                    np.int32)
