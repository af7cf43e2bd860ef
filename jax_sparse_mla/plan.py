"""The batch plan: static program choice (BatchPlan) plus traced per-token metadata (BatchMeta).

A batch is a list of `Request`s, each adding `query_len` new tokens after `context_len` cached
ones. Rows of `hidden` are the new tokens, request after request in the given order, then padding.

Routing. A request is a *decode* when it adds one token to a non-empty context, otherwise a
*prefill*. A prefill whose total length (context + new) is <= index_topk would have top-k select
every causal position, so it runs as dense causal MHA: its rows are neither scored nor top-k'd
(DeepSeek-V3.2 / vLLM's short-prefill skip). A longer prefill is scored and top-k'd, then
attends either as *masked* MHA (dense causal attention over its sequence's keys, each row
restricted to its top-k positions: DeepSeek-V3.2's prefill mode, the same result in the MHA
form) or sparsely (absorbed attention over the gathered latent rows), whichever
policy.prefill_route's cost model says is cheaper for its context and length (`prefill_route`
forces one). Decodes attend sparsely. Each prefill is routed by its own lengths, and only the
rows that need top-k (decodes, long prefills) are scored; vLLM and SGLang instead score every
row as soon as one row needs it. A batch with no dense or masked prefill runs the all-sparse
program. `skip_indexer=False` is the baseline that scores every row whatever the route. The
indexer key cache is written for every row either way.

Dispatch. `dispatch="static"`: the route is a static plan field, one executable per plan, chosen
on the host. `dispatch="cond"`: one executable per shape bucket holds both programs and picks
one at run time with lax.cond on a traced flag (meta.dense_flag), for engines that keep a
single captured program per shape. Cond plans keep those two programs only: their long
prefills attend sparsely (a masked route's keys and bitmask are sized by its sequences,
which a shape bucket does not bound).
"""

from __future__ import annotations

import collections.abc
import dataclasses
from typing import Sequence

import jax
import numpy as np

from . import policy
from .config import MLAConfig, check_config_type
from .validate import INT32_MAX, as_bool, as_int, as_page_ids, is_int


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

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not is_int(value) or not 1 <= value <= INT32_MAX:
                raise ValueError(f"invalid BucketPolicy: {f.name} must be a positive int below 2**31, got {value!r}")
            object.__setattr__(self, f.name, int(value))  # numpy integers -> int (hashing, bit_length)

    @staticmethod
    def round_up(n: int, minimum: int) -> int:
        return max(minimum, 1 << int(max(n - 1, 0)).bit_length())


DISPATCH_MODES = ("static", "cond")
MASKED = ("none", "some", "all")  # BatchPlan.masked


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """The MLAConfig fields a plan depends on (BatchPlan.config): page_size (every slot number),
    index_topk (the routes; a cond plan's num_dense_keys), kv_cache_dtype and num_attention_heads
    (the fp8 split, over BatchPlan.tensor_parallel shards), max_position_embeddings (the bound its lengths were validated against).
    forward refuses a plan whose fields differ from its config's."""

    page_size: int
    index_topk: int
    kv_cache_dtype: str
    num_attention_heads: int
    max_position_embeddings: int

    @classmethod
    def of(cls, config: MLAConfig) -> PlanConfig:
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True)
class RowGroup:
    """One list of rows the forward scores (indexer logits + top-k) or attends sparsely in one call,
    and the kernel choices made for it on the host (policy.py), so that no kernel re-decides.

    name: "all" (every row: the sparse program, the skip_indexer=False baseline's scoring),
      "sparse" (meta.sparse_rows: the dense program's scored rows, which attend sparsely or,
      where meta.masked_flags says so, as masked MHA), "upfront" (meta.upfront_rows) or
      "kernel" (meta.kernel_rows), the fp8 split's two groups.
    num_rows: the call's padded row count.
    indexer_shards: tensor shards that split the group's scoring by rows (policy.indexer_shards:
      each scores num_rows / indexer_shards rows and the shards all-gather the slots; 1: every
      shard scores every row, as one device does).
    indexer_kernel: "prefill" | "decode", the Mosaic indexer kernel shape for the rows one shard
      scores over the plan's num_seqs sequences (policy.indexer_kernel; used where the indexer
      runs Mosaic).
    dequantize: "upfront" | "kernel", how an fp8 latent cache is dequantised for the group's
      sparse attention (policy.dequantize_route over the per-shard heads and the pages the group
      reads: meta.upfront_pages for "upfront", every block table otherwise); "kernel" for
      other caches.
    """

    name: str
    num_rows: int
    indexer_shards: int
    indexer_kernel: str
    dequantize: str


def _row_groups(plan: BatchPlan) -> tuple[RowGroup, ...]:
    """Every RowGroup the plan's program(s) call, in call order (BatchPlan.groups)."""
    c = plan.config
    if not isinstance(c, PlanConfig) or not is_int(plan.tensor_parallel) or plan.tensor_parallel < 1:
        return ()  # refused by check_config / forward
    heads = c.num_attention_heads // plan.tensor_parallel
    table_rows = plan.num_seqs * plan.pages_per_seq * c.page_size

    def group(name: str, num_rows: int) -> RowGroup:
        copy_rows = plan.num_upfront_pages * c.page_size if name == "upfront" else table_rows
        route = (policy.dequantize_route(num_rows, heads, c.index_topk, copy_rows) if c.kv_cache_dtype == "fp8"
                 else "kernel")
        shards = policy.indexer_shards(num_rows, plan.tensor_parallel)
        return RowGroup(name, num_rows, shards, policy.indexer_kernel(num_rows // shards, plan.num_seqs), route)

    split = [("upfront", plan.num_upfront_rows)] + ([("kernel", plan.num_kernel_rows)] if plan.num_kernel_rows else [])
    calls = []
    if plan.use_dense_mha is not True:  # the sparse program
        calls += split if plan.num_upfront_rows else [("all", plan.num_tokens)]
    if plan.use_dense_mha is not False:  # the dense program
        if not plan.skip_indexer:
            calls.append(("all", plan.num_tokens))
        if plan.num_sparse_tokens:
            if plan.masked != "none" and plan.skip_indexer:  # every scored row in one call
                calls.append(("sparse", plan.num_sparse_tokens))
            if plan.masked != "all":  # the sparse attention's calls
                calls += split if plan.num_upfront_rows else [("sparse", plan.num_sparse_tokens)]
    return tuple(group(name, n) for name, n in dict(calls).items())


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """Static description of one compiled program (hashable; a jit static argument).

    num_tokens: padded rows of hidden.
    num_seqs: padded sequence count.
    pages_per_seq: block-table width W; each sequence sees W * page_size key positions.
    use_dense_mha: True: the dense program (short prefills run dense MHA, the rows in
      meta.sparse_rows attend sparsely or, with `masked`, as masked MHA); False: the all-sparse program; None: both, picked at
      run time by meta.dense_flag (dispatch="cond").
    num_sparse_tokens: padded count of meta.sparse_rows, the dense program's scored rows (decodes
      and long prefills, attending sparsely or as masked MHA); 0 when there are none or
      use_dense_mha is False.
    num_dense_keys: padded count of the key rows of the sequences run as dense or masked MHA
      (their context and new tokens, packed sequence after sequence); 0 when use_dense_mha is
      False.
    skip_indexer: the dense program scores only meta.sparse_rows (False: every row, the
      baseline without the skip). Always True where it changes nothing (the sparse program).
    num_pages: the cache size the page ids were validated against (None: not validated);
      forward refuses a cache of another size.
    config: the fields of the MLAConfig it was planned for that it depends on (PlanConfig);
      forward refuses a config that differs in one (check_config). Keyword-only.
    num_upfront_rows, num_kernel_rows, num_upfront_pages: an fp8 latent cache's split of the
      sparsely attending rows (static dispatch; all 0 otherwise). The prefill rows
      (meta.upfront_rows) attend over a bf16 copy of their sequences' pages
      (meta.upfront_pages, dequantised once), the decode rows (meta.kernel_rows) over the fp8
      cache, dequantised in the kernel. Split when dequantising those pages upfront pays
      (policy.dequantize_route): a prefill gathers each row of its sequence many times. The
      three sizes are power-of-two buckets, so an fp8 cache compiles more programs.
    masked: whether the dense program's MHA call restricts rows to their top-k positions (masked
      MHA: the rows of meta.sparse_rows that meta.masked_flags marks; static dispatch): "none",
      "some" (the other scored rows attend sparsely) or "all" (every scored row: the program
      has no sparse attention).
    tensor_parallel: the tensor-axis size the plan was made for (its fp8 split decided with
      num_attention_heads / tensor_parallel heads per shard, its indexer split per group).
      Keyword-only; forward requires the size of the tensor axis it runs under (1 without one;
      sharding.sharded_forward refuses a plan made for another tensor size).
    groups: every RowGroup the program calls the indexer or sparse attention on, with the
      kernel shape and fp8 route decided for it (computed from the other fields: not an
      argument, and recomputed by dataclasses.replace).
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
    masked: str = "none"
    config: PlanConfig = dataclasses.field(kw_only=True)
    tensor_parallel: int = dataclasses.field(default=1, kw_only=True)
    groups: tuple[RowGroup, ...] = dataclasses.field(init=False)

    def __post_init__(self):
        if self.masked not in MASKED or (self.masked != "none" and self.use_dense_mha is not True):
            raise ValueError(f"BatchPlan.masked must be one of {MASKED} ('none' unless use_dense_mha is True), "
                             f"got {self.masked!r} with use_dense_mha={self.use_dense_mha!r}")
        object.__setattr__(self, "groups", _row_groups(self))

    def group(self, name: str) -> RowGroup:
        """The RowGroup called `name` (ValueError if the plan's program has no such call)."""
        for g in self.groups:
            if g.name == name:
                return g
        raise ValueError(f"the plan has no {name!r} row group (it has {[g.name for g in self.groups]})")

    def check_config(self, config: MLAConfig, shards: int = 1) -> None:
        """Raises ValueError naming each field in which `config` differs from the one planned for.
        shards: config is one of this many tensor shards' (sharding.shard_config: its attention
        heads count 1 / shards of the layer's)."""
        check_config_type(config)
        if not isinstance(self.config, PlanConfig):
            raise ValueError(f"plan.config must be a PlanConfig (make plans with plan_batch), got {self.config!r}")
        layer = dataclasses.replace(PlanConfig.of(config), num_attention_heads=config.num_attention_heads * shards)

        def has(name):  # what the config gives for a field (heads: per shard x shards)
            if name == "num_attention_heads" and shards > 1:
                return f"{config.num_attention_heads} a shard x {shards} shards"
            return repr(getattr(config, name))
        diff = [f"{f.name}={getattr(self.config, f.name)!r} (the config has {has(f.name)})"
                for f in dataclasses.fields(PlanConfig) if getattr(self.config, f.name) != getattr(layer, f.name)]
        if diff:
            raise ValueError(f"the plan was made for a config with {', '.join(diff)}: plan the batch with the "
                             "config it runs under")

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

    @property
    def program(self) -> str:
        """The program's name in benches and reports: "masked" for a dense program whose MHA call
        restricts rows to their top-k positions (`masked` "some" or "all"), else `route`."""
        return "masked" if self.masked != "none" else self.route


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BatchMeta:
    """Per-token and per-sequence int32 arrays of one batch (traced).

    Shapes in terms of the BatchPlan (T = num_tokens, S = num_seqs, W = pages_per_seq) are on
    each field below and in `BatchMeta.shapes(plan)`, the one statement of them that forward
    and the sharding code check against; padding values in brackets (`BatchMeta.empty(plan)`:
    a batch whose rows and sequences are all padding).
    """

    positions: jax.Array  # [T]: position of each row in its sequence [-1]
    slot_mapping: jax.Array  # [T]: cache slot each row writes [-1: writes nowhere]
    row_seq: jax.Array  # [T]: sequence index of each row [0; a padding row's position is -1]
    block_tables: jax.Array  # [S, W]: page ids [-1 past each sequence's pages]
    # [num_sparse_tokens]: the dense program's scored rows (attending sparsely or as masked MHA) [-1]
    sparse_rows: jax.Array
    # [T]: rows of the sequences run as dense or masked MHA, sequence after sequence [-1]
    dense_rows: jax.Array
    # [S + 1]: where each sequence's rows start in dense_rows (a sequence not run there owns none) [0]
    dense_query_start: jax.Array
    # [num_dense_keys]: cache slots of the dense sequences' keys (positions 0 .. seq_len - 1),
    # sequence after sequence [-1]
    dense_key_slots: jax.Array
    dense_key_start: jax.Array  # [S + 1]: where each sequence's keys start in dense_key_slots [0]
    # The fp8 split (BatchPlan.num_upfront_rows; empty without it): the sparsely attending rows,
    # prefills then decodes, and the prefills' pages, sequence after sequence [-1].
    upfront_rows: jax.Array  # [num_upfront_rows]
    kernel_rows: jax.Array  # [num_kernel_rows]
    upfront_pages: jax.Array  # [num_upfront_pages]
    # [num_sparse_tokens]: 1 where that row of sparse_rows attends as masked MHA, else 0 [0]
    masked_flags: jax.Array
    # []: 1 when the cond program should take its dense branch; None unless dispatch="cond"
    # (plan.use_dense_mha is None).
    dense_flag: jax.Array | None = None

    @staticmethod
    def shapes(plan: BatchPlan) -> dict[str, tuple[int, ...]]:
        """The shape of each field for `plan` (dense_flag only for a cond plan; None otherwise)."""
        T, S = plan.num_tokens, plan.num_seqs
        shapes = {"positions": (T,), "slot_mapping": (T,), "row_seq": (T,), "block_tables": (S, plan.pages_per_seq),
                  "sparse_rows": (plan.num_sparse_tokens,), "dense_rows": (T,), "dense_query_start": (S + 1,),
                  "dense_key_slots": (plan.num_dense_keys,), "dense_key_start": (S + 1,),
                  "upfront_rows": (plan.num_upfront_rows,), "kernel_rows": (plan.num_kernel_rows,),
                  "upfront_pages": (plan.num_upfront_pages,), "masked_flags": (plan.num_sparse_tokens,)}
        if plan.use_dense_mha is None:
            shapes["dense_flag"] = ()
        return shapes

    @staticmethod
    def empty(plan: BatchPlan) -> BatchMeta:
        """Host (numpy) metadata of a batch with no work for `plan`: every row padding, every
        sequence empty (the padding values above; a cond plan's dense_flag 0)."""
        zero = ("row_seq", "dense_query_start", "dense_key_start", "dense_flag", "masked_flags")
        return BatchMeta(**{name: np.full(shape, 0 if name in zero else -1, np.int32)
                            for name, shape in BatchMeta.shapes(plan).items()})


def _alias_error(i: int, k: int, writes: bool, page: int, j: int, kj: int, j_writes: bool) -> ValueError:
    """Request i's block_table[k] names `page`, which request j (maybe i) already holds as its
    block_table[kj]; `writes`, `j_writes`: whether this step writes that entry's page."""
    if j == i:
        if writes and j_writes:
            what = f"is written by this step more than once (block_table[{kj}] and block_table[{k}])"
        elif writes:
            what = f"is written by this step (block_table[{k}]) and is also its context page block_table[{kj}]"
        else:
            what = f"holds two ranges of its context (block_table[{kj}] and block_table[{k}])"
        return ValueError(f"request {i}: page {page} {what}: the pages a request's tokens occupy must be distinct")
    if writes and j_writes:
        return ValueError(f"request {i}: page {page} is written by this step more than once (block_table[{k}]; "
                          f"also by request {j}, its block_table[{kj}])")
    if writes:
        return ValueError(f"request {i}: page {page} is written by this step (block_table[{k}]), but request {j} "
                          f"reads it as context (its block_table[{kj}])")
    return ValueError(f"request {i}: page {page} is read as context (block_table[{k}]), but request {j} writes it "
                      f"in this step (its block_table[{kj}])")


def _scan_pages(requests: Sequence[Request], limit: int, bound: str, page_size: int) -> None:
    """Raises for the first page (in request, then table order) outside [0, limit) or aliased
    (see plan_batch); requests hold Python int lengths and list tables of enough pages."""
    owner: dict[int, tuple[int, int, bool]] = {}  # page -> (request, table index, written this step)
    for i, r in enumerate(requests):
        first_written = r.context_len // page_size  # pages first_written .. needed - 1 are written
        mine: dict[int, tuple[int, bool]] = {}
        for k in range(-(-r.total_len // page_size)):
            page, writes = r.block_table[k], k >= first_written
            if not 0 <= page < limit:
                raise ValueError(f"request {i}: page id {page} is outside {bound} (block_table[{k}])")
            if page in mine:
                raise _alias_error(i, k, writes, page, i, *mine[page])
            mine[page] = (k, writes)
            if page in owner:
                j, kj, j_writes = owner[page]
                if writes or j_writes:  # (two readers: a shared prefix page, fine)
                    raise _alias_error(i, k, writes, page, j, kj, j_writes)
            else:
                owner[page] = (i, k, writes)


def _pages_ok(requests: Sequence[Request], limit: int, page_size: int) -> bool:
    """Whether _scan_pages would pass, vectorised: every occupied page in [0, limit), and a page
    held twice only by two different requests that both read it."""
    if not requests:
        return True
    needed = [-(-r.total_len // page_size) for r in requests]
    pages = np.concatenate([np.asarray(r.block_table[:n], np.int64) for r, n in zip(requests, needed)])
    if pages.size and (pages.min() < 0 or pages.max() >= limit):
        return False
    owner = np.repeat(np.arange(len(requests)), needed)
    writes = np.concatenate([np.arange(n) >= r.context_len // page_size for r, n in zip(requests, needed)])
    order = np.argsort(pages, kind="stable")  # a page's holders in request order
    pages, owner, writes = pages[order], owner[order], writes[order]
    again = pages[1:] == pages[:-1]
    return not np.any(again & (writes[1:] | writes[:-1] | (owner[1:] == owner[:-1])))


def _validate(config: MLAConfig, requests, num_pages: int | None) -> list[Request]:
    """Checks the batch (see plan_batch) and returns it with Python int lengths and list tables.
    Raises for the first problem in request order."""
    if len(requests) == 0:
        raise ValueError("empty batch: plan_batch needs at least one request")
    ps = config.page_size
    slot_pages = max_slot_pages(config)
    limit = slot_pages if num_pages is None else num_pages
    bound = (f"[0, {num_pages})" if num_pages is not None else
             f"[0, {slot_pages}), the pages of {ps} tokens whose slot numbers fit int32")
    max_len = config.max_position_embeddings  # < 2**31 (MLAConfig checks it)
    out: list[Request] = []

    def refuse(message: str):  # a problem of request len(out); an earlier request's pages come first
        if not _pages_ok(out, limit, ps):
            _scan_pages(out, limit, bound, ps)
        raise ValueError(message)

    for i, r in enumerate(requests):
        if not isinstance(r, Request):
            refuse(f"request {i}: expected a Request, got {type(r).__name__}")
        try:
            context_len = as_int(r.context_len, f"request {i}: context_len", 0)
            query_len = as_int(r.query_len, f"request {i}: query_len", 1)
            table = as_page_ids(r.block_table, f"request {i}: block_table")
        except ValueError as e:
            refuse(str(e))
        total = context_len + query_len
        if total > max_len:
            refuse(f"request {i}: context_len + query_len = {total} tokens exceeds max_position_embeddings "
                   f"= {config.max_position_embeddings}")
        needed = -(-total // ps)
        if len(table) < needed:
            refuse(f"request {i}: block_table has {len(table)} pages, but context_len + query_len = "
                   f"{total} tokens need {needed} pages of {ps}")
        out.append(Request(context_len, query_len, table))
    if not _pages_ok(out, limit, ps):
        _scan_pages(out, limit, bound, ps)
        raise AssertionError("_pages_ok and _scan_pages disagree")  # unreachable
    return out


def max_slot_pages(config: MLAConfig) -> int:
    """The most pages a cache can have: its slot numbers (page * page_size + offset) are int32."""
    return (INT32_MAX + 1) // config.page_size


def check_slot_range(config: MLAConfig, num_pages: int) -> None:
    """ValueError unless every slot number of a cache of num_pages pages fits int32 (the caches
    and every slot list are int32)."""
    slot_pages = max_slot_pages(config)
    if num_pages > slot_pages:
        raise ValueError(f"num_pages = {num_pages} pages of {config.page_size} tokens: slot numbers would overflow "
                         f"int32 (at most {slot_pages} pages)")


def check_options(config, num_pages, force_sparse, skip_indexer, buckets, dispatch,
                  tensor_parallel=1, prefill_route="auto") -> int | None:
    """Checks plan_batch's arguments other than the requests (the one statement of them: the
    planners and precompile.enumerate_plans share it); returns num_pages as an int (or None)."""
    check_config_type(config)
    if not is_int(tensor_parallel) or tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be a positive int, got {tensor_parallel!r}")
    if config.num_attention_heads % tensor_parallel:
        raise ValueError(f"tensor_parallel={tensor_parallel} does not divide num_attention_heads="
                         f"{config.num_attention_heads}")
    if not isinstance(dispatch, str) or dispatch not in DISPATCH_MODES:
        raise ValueError(f"dispatch must be one of {DISPATCH_MODES}, got {dispatch!r}")
    policy.check_prefill_route(prefill_route)
    for name, value in (("force_sparse", force_sparse), ("skip_indexer", skip_indexer)):
        as_bool(value, name)
    if not isinstance(buckets, BucketPolicy):
        raise ValueError(f"buckets must be a BucketPolicy, got {type(buckets).__name__}")
    if num_pages is None:
        return None
    if not is_int(num_pages) or num_pages < 1:
        raise ValueError(f"num_pages must be a positive int or None, got {num_pages!r}")
    check_slot_range(config, num_pages)
    return int(num_pages)


def _upfront_split(config: MLAConfig, requests: Sequence[Request], attends_sparsely, row_starts, tables, buckets,
                   tensor_parallel: int):
    """(upfront rows, kernel rows, upfront pages, their bucketed sizes) of the fp8 split (see
    BatchPlan), or None when the cache is not fp8, no prefill attends sparsely, or dequantising
    its pages would not pay (policy.dequantize_route, per-shard heads). tables[i]: request i's
    pages that its tokens fill."""
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
    route = policy.dequantize_route(sizes[0], config.num_attention_heads // tensor_parallel, config.index_topk,
                                    sizes[2] * config.page_size)
    return (upfront_rows, kernel_rows, pages, sizes) if route == "upfront" else None


def pad_ids(values, size: int):
    """values as int32 [size], -1 padded."""
    out = np.full(size, -1, np.int32)
    out[: len(values)] = values
    return out


def plan_batch(config: MLAConfig, requests: Sequence[Request], *, num_pages: int | None = None,
               force_sparse: bool = False, skip_indexer: bool = True,
               buckets: BucketPolicy = BucketPolicy(), dispatch: str = "static",
               tensor_parallel: int = 1, prefill_route: str = "auto") -> tuple[BatchPlan, BatchMeta]:
    """Validates a batch on the host and returns its static plan and traced metadata.

    force_sparse: route every prefill through the indexer and sparse attention (no dense or
      masked MHA).
    prefill_route: how prefills longer than index_topk attend: "auto" (policy.prefill_route's
      cost model, per request), "masked" or "sparse" (every such prefill). Static dispatch only
      (cond plans attend them sparsely).
    skip_indexer: score only the rows that need top-k (False: every row, the baseline).
    num_pages: the cache's page count; page ids outside [0, num_pages) are rejected. Without
      it page ids are only checked to be >= 0 and to have int32 slot numbers (an id past the
      cache would read clamped slots and write nowhere), so engines should pass it.
    requests: context_len, query_len and page ids are Python or numpy integers (not bool);
      block tables are lists, tuples or 1-D numpy integer arrays (entries past the
      ceil(total_len / page_size) pages a request's tokens occupy are ignored). Those pages
      must be distinct within a request, and a page this step writes (from the one holding
      position context_len on) must not be read or written by another request; two requests
      may read one page (a shared prefix). context_len + query_len <= max_position_embeddings.
    dispatch: "static" (the route is in the plan) or "cond" (in meta.dense_flag; the plan's
      sizes then depend on the shape buckets only).
    tensor_parallel: the tensor-axis size the batch will run under (a positive divisor of
      num_attention_heads): the kernel choices are made for the heads of one shard, and the
      indexer's split over the shards (RowGroup.indexer_shards). Plans for more than 1 run
      through sharding.sharded_forward.
    Raises ValueError naming the request and the problem before anything touches a device.
    """
    requests, num_pages = check_batch(config, requests, num_pages, force_sparse, skip_indexer, buckets, dispatch,
                                      tensor_parallel, prefill_route)
    plan, meta = plan_host(config, requests, num_pages=num_pages, force_sparse=bool(force_sparse),
                           skip_indexer=bool(skip_indexer), buckets=buckets, dispatch=dispatch,
                           tensor_parallel=int(tensor_parallel), prefill_route=prefill_route)
    return plan, jax.device_put(meta)  # one batched transfer of the whole pytree


def check_batch(config, requests, num_pages, force_sparse, skip_indexer, buckets, dispatch, tensor_parallel=1,
                prefill_route="auto"):
    """plan_batch's checks: -> (the requests with Python int lengths and list tables, num_pages as
    an int or None). Raises ValueError for the first problem."""
    num_pages = check_options(config, num_pages, force_sparse, skip_indexer, buckets, dispatch, tensor_parallel,
                              prefill_route)
    if isinstance(requests, (str, bytes, Request)) or not isinstance(requests, collections.abc.Iterable):
        raise ValueError(f"requests must be a sequence of Requests, got {type(requests).__name__}")
    return _validate(config, list(requests), num_pages), num_pages


def request_routes(config: MLAConfig, requests: Sequence[Request], force_sparse: bool,
                   prefill_route: str = "auto") -> list[str]:
    """Each request's route in a static plan: "dense" (a prefill of <= index_topk tokens: dense
    MHA, not scored), "masked" (a longer prefill: scored, then masked MHA) or "sparse" (decodes,
    longer prefills the cost model or prefill_route sends there, everything under force_sparse)."""
    policy.check_prefill_route(prefill_route)

    def route(r: Request) -> str:
        if force_sparse or r.is_decode:
            return "sparse"
        if r.total_len <= config.index_topk:
            return "dense"
        if prefill_route != "auto":
            return prefill_route
        return policy.prefill_route(r.context_len, r.query_len, config.index_topk)
    return [route(r) for r in requests]


def padded_sizes(config: MLAConfig, requests: Sequence[Request], routes: Sequence[str],
                 buckets: BucketPolicy) -> tuple[int, int, int, int]:
    """(num_tokens, num_seqs, pages_per_seq, num_dense_keys) of a static plan of the requests,
    routed as request_routes says."""
    page = config.page_size
    dense = [route != "sparse" for route in routes]
    dense_keys = sum(r.total_len for r, d in zip(requests, dense) if d)
    return (buckets.round_up(sum(r.query_len for r in requests), buckets.min_tokens),
            buckets.round_up(len(requests), buckets.min_seqs),
            buckets.round_up(max(-(-r.total_len // page) for r in requests), buckets.min_pages_per_seq),
            buckets.round_up(dense_keys, buckets.min_dense_keys) if any(dense) else 0)


def plan_host(config: MLAConfig, requests: Sequence[Request], *, num_pages: int | None, force_sparse: bool,
              skip_indexer: bool, buckets: BucketPolicy, dispatch: str,
              tensor_parallel: int = 1, prefill_route: str = "auto") -> tuple[BatchPlan, BatchMeta]:
    """plan_batch for requests and options that passed `check_batch`; the metadata is numpy, on the host."""
    page = config.page_size
    if dispatch == "cond":
        prefill_route = "sparse"
    routes = request_routes(config, requests, force_sparse, prefill_route)
    dense = [route != "sparse" for route in routes]  # run in the dense program's dense MHA call
    num_tokens, num_seqs, width, static_dense_keys = padded_sizes(config, requests, routes, buckets)

    positions = np.full(num_tokens, -1, np.int32)
    slot_mapping = np.full(num_tokens, -1, np.int32)
    row_seq = np.zeros(num_tokens, np.int32)
    block_tables = np.full((num_seqs, width), -1, np.int32)
    dense_query_len = np.zeros(num_seqs, np.int32)
    dense_key_len = np.zeros(num_seqs, np.int32)
    sparse_rows, masked_flags, dense_rows, dense_key_slots, row_starts, tables = [], [], [], [], [], []
    row = 0
    for i, r in enumerate(requests):
        pos = np.arange(r.context_len, r.total_len)
        table = np.asarray(list(r.block_table)[: -(-r.total_len // page)], np.int32)
        row_starts.append(row)
        tables.append(table)
        positions[row:row + r.query_len] = pos
        slot_mapping[row:row + r.query_len] = table[pos // page] * page + pos % page
        row_seq[row:row + r.query_len] = i
        block_tables[i, :len(table)] = table
        if dense[i]:
            dense_query_len[i], dense_key_len[i] = r.query_len, r.total_len
            dense_rows.extend(range(row, row + r.query_len))
            all_pos = np.arange(r.total_len)
            dense_key_slots.extend(table[all_pos // page] * page + all_pos % page)
        if routes[i] != "dense":  # scored: attends sparsely or as masked MHA
            sparse_rows.extend(range(row, row + r.query_len))
            masked_flags.extend([int(routes[i] == "masked")] * r.query_len)
        row += r.query_len

    if dispatch == "cond":  # sizes from the buckets alone: one program per shape bucket
        use_dense = None
        num_sparse = num_tokens
        num_dense_keys = buckets.round_up(num_seqs * config.index_topk, buckets.min_dense_keys)
    else:
        use_dense = any(dense)
        num_sparse = buckets.round_up(len(sparse_rows), 1) if use_dense and sparse_rows else 0
        num_dense_keys = static_dense_keys
    split = None if dispatch == "cond" else _upfront_split(config, requests, [not d for d in dense], row_starts,
                                                             tables, buckets, tensor_parallel)
    upfront_rows, kernel_rows, upfront_pages, (num_upfront_rows, num_kernel_rows, num_upfront_pages) = (
        split or ([], [], [], (0, 0, 0)))
    plan = BatchPlan(num_tokens=num_tokens, num_seqs=num_seqs, pages_per_seq=width, use_dense_mha=use_dense,
                     num_sparse_tokens=num_sparse, num_dense_keys=num_dense_keys,
                     skip_indexer=skip_indexer or use_dense is False, num_pages=num_pages,
                     num_upfront_rows=num_upfront_rows, num_kernel_rows=num_kernel_rows,
                     num_upfront_pages=num_upfront_pages, config=PlanConfig.of(config),
                     masked=("none" if "masked" not in routes else "all" if "sparse" not in routes else "some"),
                     tensor_parallel=tensor_parallel)
    meta = BatchMeta(
        positions=positions, slot_mapping=slot_mapping, row_seq=row_seq, block_tables=block_tables,
        sparse_rows=pad_ids(sparse_rows if num_sparse else [], num_sparse),  # unused by the sparse program
        dense_rows=pad_ids(dense_rows, num_tokens),
        dense_query_start=np.concatenate([[0], np.cumsum(dense_query_len)]).astype(np.int32),
        dense_key_slots=pad_ids(dense_key_slots, num_dense_keys),
        dense_key_start=np.concatenate([[0], np.cumsum(dense_key_len)]).astype(np.int32),
        upfront_rows=pad_ids(upfront_rows, num_upfront_rows), kernel_rows=pad_ids(kernel_rows, num_kernel_rows),
        upfront_pages=pad_ids(upfront_pages, num_upfront_pages),
        masked_flags=np.maximum(pad_ids(masked_flags if num_sparse else [], num_sparse), 0),
        dense_flag=np.int32(any(dense)) if dispatch == "cond" else None)
    return plan, meta
