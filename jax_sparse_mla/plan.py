"""The batch plan: static program choice (BatchPlan) plus traced per-token metadata (BatchMeta).

A batch is a list of `Request`s, each adding `query_len` new tokens after `context_len` cached
ones. Rows of `hidden` are the new tokens, request after request in the given order, then padding.
`plan_batch` takes the Requests; `plan_arrays` the same batch as host arrays (context_lens,
query_lens, block_tables), what an engine keeps. Both check and plan it on one numpy path.

Routes: a *decode* (one token after a non-empty context) attends sparsely; a prefill whose total
length is <= index_topk runs as dense causal MHA and is neither scored nor top-k'd (the
short-prefill skip); a longer prefill is scored and top-k'd, then attends as *masked* MHA or
sparsely, whichever policy.prefill_route's cost model finds cheaper (`prefill_route` forces one).
`skip_indexer=False` scores every row whatever its route. Dispatch: `dispatch="static"` gives one
exact program per plan (the reference); `dispatch="cond"`, the serving program, keeps only the
shape buckets static and picks each stage's size at run time from a ladder (BatchPlan.score_sizes,
key_sizes, attend_sizes; meta.branches), so that a step pays for the rows it has.

Why a plan: every choice a step needs (routes, sizes, kernel shapes) is made once, on the host,
and `model.forward` only interprets it. Routing and planning: docs/design/plan.md; the programs
and what choosing one costs: docs/design/dispatch.md.
"""

from __future__ import annotations

import bisect
import collections.abc
import dataclasses
import functools
from typing import Literal, Sequence, get_args

import jax
import numpy as np

from . import policy
from .config import MLAConfig, check_config_type
from .validate import INT32_MAX, as_bool, as_int, as_page_ids, is_int, range_message


def is_decode(context_len, query_len):
    """Whether a request is a decode: one token after a non-empty context (ints or arrays of them)."""
    return (query_len == 1) & (context_len > 0)


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
        return bool(is_decode(self.context_len, self.query_len))


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

    @classmethod
    def for_limits(cls, config: MLAConfig, *, max_num_seqs: int, max_model_len: int | None = None,
                   num_pages: int | None = None) -> BucketPolicy:
        """The policy of a serving engine: sequence count and block-table width fixed at its
        limits (every batch of at most max_num_seqs requests, each at most max_model_len tokens,
        default the config's max_position_embeddings, on a cache of num_pages pages gets
        num_seqs = min(max_num_seqs, num_pages) and pages_per_seq = min(ceil(max_model_len /
        page_size), num_pages), each rounded up to a power of two: a request holds at least one
        page and at most all of them), so that only the row count is bucketed. The kernels' work follows the real sequences and lengths, not these sizes
        (fixing them cost 0-3% a layer step on an H100: docs/design/dispatch.md); a dispatch="cond"
        plan then compiles one program per row bucket and stage set (up to three)."""
        seqs = as_int(max_num_seqs, "max_num_seqs", 1)
        length = config.max_position_embeddings if max_model_len is None else as_int(max_model_len, "max_model_len", 1)
        pages = -(-length // config.page_size)
        if num_pages is not None:
            num_pages = as_int(num_pages, "num_pages", 1)
            seqs, pages = min(seqs, num_pages), min(pages, num_pages)
        return cls(min_seqs=cls.round_up(seqs, 1), min_pages_per_seq=cls.round_up(pages, 1))


Dispatch = Literal["static", "cond"]  # the dispatch option (plan_batch, the engine, ...)
DISPATCH_MODES = get_args(Dispatch)
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
        return cls(page_size=config.page_size, index_topk=config.index_topk, kv_cache_dtype=config.kv_cache_dtype,
                   num_attention_heads=config.num_attention_heads,
                   max_position_embeddings=config.max_position_embeddings)


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
    score_chunks: the row chunks one shard scores the group in (policy.score_chunks over its
      rows and the block tables' key positions): each chunk's logits and top-k before the next
      chunk's, so that one chunk's logits exist at a time; 1: the call whole.
    """

    name: str
    num_rows: int
    indexer_shards: int
    indexer_kernel: str
    dequantize: str
    score_chunks: int


ROW_LADDER_STEPS = 5  # a cond plan's row sizes: num_tokens, / 2, ..., / 16
LADDER_MIN_TOKENS = 512  # below this many rows a cond plan runs its row stages at num_tokens
PROJECTION_STEPS = (8, 4)  # a cond plan's projection sizes per halving of the bucket: (the top halving, each below)
KEY_LADDER = (-3, 2)  # a cond plan's dense key sizes: num_tokens x 2**e for e in [-3, 2]
MIN_LADDER_SIZE = 16


def row_ladder(num_tokens: int) -> tuple[int, ...]:
    """A cond plan's sizes for its scored and its sparsely attending rows (ascending): num_tokens
    halved ROW_LADDER_STEPS - 1 times, none below MIN_LADDER_SIZE, from LADDER_MIN_TOKENS rows
    up; else (num_tokens,). Rows past a stage's real ones cost little in its kernels; the halving
    bounds what they cost in its dense matmuls (the indexer queries, q / o latent projections) to
    the real rows'. Below LADDER_MIN_TOKENS those matmuls cost less than the conditional that
    would pick a size (XLA's GPU conditional waits for the host to read its index)."""
    if num_tokens < LADDER_MIN_TOKENS:
        return (num_tokens,)
    return tuple(sorted({max(MIN_LADDER_SIZE, -(-num_tokens // 2 ** j)) for j in range(ROW_LADDER_STEPS)}))


def projection_ladder(num_tokens: int) -> tuple[int, ...]:
    """A cond plan's sizes for its dense matmuls over every row (the projections, o_proj;
    ascending), from LADDER_MIN_TOKENS rows up, else (num_tokens,): each of the row ladder's
    halvings (T / 2**(k + 1), T / 2**k] split into s even steps, s = PROJECTION_STEPS[0] for the
    top one and [1] below (those raised to MIN_LADDER_SIZE at least), and T / 16 (T = num_tokens).
    So the rows those matmuls run exceed the real ones by at most 1/8 of them at the top (a
    batch's usual place: more than half its bucket) and 1/4 below (a bucket a policy's minimum or
    an engine's coarser buckets hold open), not up to the bucket: at 8K rows a padding row costs
    ~0.34 GFLOP."""
    if num_tokens < LADDER_MIN_TOKENS:
        return (num_tokens,)
    top, below = PROJECTION_STEPS
    sizes = {-(-num_tokens * (top + j) // (2 * top)) for j in range(1, top + 1)}
    sizes |= {max(MIN_LADDER_SIZE, -(-num_tokens // 2 ** (ROW_LADDER_STEPS - 1)))}
    for k in range(1, ROW_LADDER_STEPS - 1):
        sizes |= {max(MIN_LADDER_SIZE, -(-num_tokens * (below + j) // (2 * below << k))) for j in range(1, below + 1)}
    return tuple(sorted(sizes))


def key_ladder(num_tokens: int) -> tuple[int, ...]:
    """A cond plan's sizes for the keys of its dense / masked MHA call (ascending; the
    up-projection of k and v is a dense matmul over them): num_tokens x 2**e for e in KEY_LADDER,
    none below MIN_LADDER_SIZE."""
    lo, hi = KEY_LADDER
    return tuple(sorted({max(MIN_LADDER_SIZE, num_tokens << e if e >= 0 else -(-num_tokens >> -e))
                         for e in range(lo, hi + 1)}))


def stage_sizes(ladder: tuple[int, ...]) -> tuple[int, ...]:
    """A cond plan's run-time sizes for a stage that a step may leave out: 0 (the stage does not
    run) and the ladder, where a conditional picks among several sizes anyway; a ladder of one
    size runs every step (its rows past the real ones select nothing)."""
    return ladder if len(ladder) == 1 else (0, *ladder)


def _row_groups(plan: BatchPlan) -> tuple[RowGroup, ...]:
    """Every RowGroup the plan's program(s) call, in call order (BatchPlan.groups)."""
    c = plan.config
    if not isinstance(c, PlanConfig) or not is_int(plan.tensor_parallel) or plan.tensor_parallel < 1:
        return ()  # refused by check_config / forward
    heads = c.num_attention_heads // plan.tensor_parallel
    table_rows = plan.num_seqs * plan.pages_per_seq * c.page_size

    def group(name: str, num_rows: int, kernel: str | None = None) -> RowGroup:
        copy_rows = plan.num_upfront_pages * c.page_size if name == "upfront" else table_rows
        route = (policy.dequantize_route(num_rows, heads, c.index_topk, copy_rows) if c.kv_cache_dtype == "fp8"
                 else "kernel")
        shards = policy.indexer_shards(num_rows, plan.tensor_parallel)
        kernel = kernel or policy.indexer_kernel(num_rows // shards, plan.num_seqs)
        chunks = policy.score_chunks(num_rows // shards, plan.pages_per_seq * c.page_size)
        return RowGroup(name, num_rows, shards, kernel, route, chunks)

    if plan.use_dense_mha is None:  # the cond program: each scoring call and attending size of its ladders
        calls = ([] if plan.skip_indexer else [("all", plan.num_tokens, None)])
        calls += [("sparse", n, k) for n, k in plan.score_calls if n and plan.skip_indexer]
        calls += [("sparse", n, None) for n in plan.attend_sizes if n and not plan.skip_indexer]
        return tuple(group(*call) for call in calls)
    split = [("upfront", plan.num_upfront_rows)] + ([("kernel", plan.num_kernel_rows)] if plan.num_kernel_rows else [])
    calls = []
    if plan.use_dense_mha is False:  # the sparse program
        calls += split if plan.num_upfront_rows else [("all", plan.num_tokens)]
    else:  # the dense program
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
      meta.sparse_rows attend sparsely or, with `masked`, as masked MHA); False: the all-sparse
      program; None: the cond program (dispatch="cond"), whose stages' sizes meta.branches picks
      at run time from score_sizes, key_sizes and attend_sizes.
    num_sparse_tokens: padded count of meta.sparse_rows, the dense program's scored rows (decodes
      and long prefills, attending sparsely or as masked MHA); 0 when there are none or
      use_dense_mha is False.
    num_dense_keys: padded count of the key rows of the sequences run as dense or masked MHA
      (their context and new tokens, packed sequence after sequence); 0 when use_dense_mha is
      False.
    skip_indexer: the dense program scores only meta.sparse_rows (False: every row, the
      baseline without the skip). Always True where it changes nothing (the sparse program).
    num_pages: the cache size the page ids were validated against (None: not validated);
      forward refuses a plan with None (an unchecked id past the cache would read clamped slots
      and write nowhere) and a cache of another size.
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
      MHA: the rows of meta.sparse_rows that meta.masked_flags marks): "none", "some" (the other
      scored rows attend sparsely) or "all" (every scored row: the program has no sparse
      attention). A cond plan: "some" when its program holds the masked MHA calls (a batch's
      long prefills may attend masked), "none" when they attend sparsely.
    tensor_parallel: the tensor-axis size the plan was made for (its fp8 split decided with
      num_attention_heads / tensor_parallel heads per shard, its indexer split per group).
      Keyword-only; forward requires the size of the tensor axis it runs under (1 without one;
      sharding.sharded_forward refuses a plan made for another tensor size).
    groups: every RowGroup the program calls the indexer or sparse attention on, with the
      kernel shape and fp8 route decided for it (computed from the other fields: not an
      argument, and recomputed by dataclasses.replace).
    A cond plan's num_sparse_tokens (num_tokens, or 0) and num_dense_keys (key_ladder's
    largest, or 0) are the sizes of meta's arrays, which fit any batch of the bucket, and say
    which stages its program holds: a batch whose every row attends sparsely (decodes, say)
    runs a program with no dense call, one with no scored row a program with no scoring or
    sparse attention (the dense-vs-sparse decision is the plan's: up to three programs a bucket).
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
        allowed = {True: MASKED, False: ("none",), None: ("none", "some")}.get(self.use_dense_mha, ())
        if self.masked not in allowed:
            raise ValueError(f"BatchPlan.masked must be one of {MASKED} ('none' with use_dense_mha False, 'none' or "
                             f"'some' with None), got {self.masked!r} with use_dense_mha={self.use_dense_mha!r}")
        object.__setattr__(self, "groups", _row_groups(self))

    def group(self, name: str, num_rows: int | None = None, kernel: str | None = None) -> RowGroup:
        """The RowGroup called `name` (of num_rows rows and indexer kernel shape `kernel`, where a
        cond plan has one per scoring call); ValueError if the plan's program has no such call."""
        for g in self.groups:
            if g.name == name and num_rows in (None, g.num_rows) and kernel in (None, g.indexer_kernel):
                return g
        raise ValueError(f"the plan has no {name!r} row group of {num_rows} rows, kernel {kernel} "
                         f"(it has {[(g.name, g.num_rows, g.indexer_kernel) for g in self.groups]})")

    @property
    def attend_sizes(self) -> tuple[int, ...]:
        """A cond plan's sizes for its sparsely attending rows (ascending; 0: none attend):
        stage_sizes(row_ladder(num_tokens)); () without the stage (num_sparse_tokens 0) and for
        a static plan."""
        return stage_sizes(row_ladder(self.num_tokens)) if self.use_dense_mha is None and self.num_sparse_tokens else ()

    @property
    def score_sizes(self) -> tuple[int, ...]:
        """A cond plan's sizes for its scored rows: attend_sizes, or (num_tokens,) without
        skip_indexer (every row scored). () for a static plan."""
        if self.use_dense_mha is not None:
            return ()
        return self.attend_sizes if self.skip_indexer else (self.num_tokens,)

    @property
    def score_calls(self) -> tuple[tuple[int, str], ...]:
        """A cond plan's scoring calls, (rows, Mosaic indexer kernel shape), meta.branches[0]
        picks one: each of score_sizes, a size of a ladder of several with both shapes where one
        shard's rows can fill a prefill tile (whether a step's rows come one or many to a sequence
        is the step's: the plan's num_seqs is the engine's limit, so the shape is picked at run
        time, in the conditional that picks the size); a ladder of one size with the shape
        policy.indexer_kernel gives for num_seqs (no conditional). () for a static plan."""
        sizes = self.score_sizes
        if len(sizes) == 1:
            n = sizes[0]
            return ((n, policy.indexer_kernel(n // policy.indexer_shards(n, self.tensor_parallel), self.num_seqs)),)
        return tuple((n, k) for n in sizes for k in (
            ("decode", "prefill") if n // policy.indexer_shards(n, self.tensor_parallel) >= policy.MGPU_MIN_ROWS_PER_SEQ
            else ("decode",)))

    @property
    def row_sizes(self) -> tuple[int, ...]:
        """A cond plan's sizes for the matmuls over every row (projections, o_proj):
        projection_ladder(num_tokens). () for a static plan (they run over num_tokens rows)."""
        return projection_ladder(self.num_tokens) if self.use_dense_mha is None else ()

    @property
    def key_sizes(self) -> tuple[int, ...]:
        """A cond plan's sizes for the keys of its dense / masked MHA call (0: no call):
        stage_sizes(key_ladder(num_tokens)); () without the call (num_dense_keys 0) and for a
        static plan."""
        return stage_sizes(key_ladder(self.num_tokens)) if self.use_dense_mha is None and self.num_dense_keys else ()

    @property
    def dense_calls(self) -> tuple[tuple[int, bool], ...]:
        """A cond plan's dense MHA calls, (keys, with masked rows), meta.branches[1] picks one:
        each of key_sizes without masked rows, then (masked != "none") each one past index_topk
        with: a masked row's request is longer than index_topk, so its call holds more keys (and a
        masked call at a size no step can reach would only be one more kernel to compile)."""
        topk = self.config.index_topk
        masked = () if self.masked == "none" else tuple((k, True) for k in self.key_sizes if k > topk)
        return tuple((k, False) for k in self.key_sizes) + masked

    @functools.cached_property
    def has_conditionals(self) -> bool:
        """Whether the plan's program picks a stage's size at run time: a cond plan with a stage
        of several sizes or calls, each an XLA conditional (model._switch). Row stages that
        row_matmul runs (kernels.row_kernel) have none, but those buckets' score, dense or attend
        stages have several sizes too, so the answer holds for them; score_calls has several
        exactly where score_sizes has. A decode bucket's (fewer than LADDER_MIN_TOKENS rows, no
        dense call) has none, nor has a static plan. Cached: the dispatch asks for it every call
        (model.compiler_options)."""
        return any(len(sizes) > 1 for sizes in (self.score_sizes, self.dense_calls, self.attend_sizes, self.row_sizes))

    def dense_keys_picked(self, branch) -> int:
        """The keys of the dense MHA call that a cond plan's meta.branches[1] (`branch`) picks:
        0 where the step runs none (the plan has no dense call, or its size-0 branch)."""
        return self.dense_calls[int(branch)][0] if self.dense_calls else 0

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
        if self.use_dense_mha is None:  # a cond plan scores at run time where it holds the sparse stages
            return self.num_tokens if not self.skip_indexer else None if self.num_sparse_tokens else 0
        if self.use_dense_mha and self.skip_indexer:
            return self.num_sparse_tokens
        return self.num_tokens

    @property
    def has_indexer_scoring(self) -> bool:
        """Whether the program contains indexer scoring."""
        return self.num_scored_tokens != 0

    @property
    def route(self) -> str:
        return {True: "dense", False: "sparse", None: "cond"}[self.use_dense_mha]

    @property
    def program(self) -> str:
        """The program's name in benches and reports: "masked" for a static dense program whose
        MHA call restricts rows to their top-k positions (`masked` "some" or "all"), else `route`."""
        return "masked" if self.masked != "none" and self.use_dense_mha else self.route


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
    # [num_sparse_tokens]: the dense program's scored rows (attending sparsely or as masked MHA);
    # in a cond plan every scored row, those attending sparsely first [-1]
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
    # [4]: a cond plan's run-time picks (cond_branches), each an index into a tuple of sizes or
    # calls whose size 0 means the stage does not run: (scoring: score_calls[i], its rows of
    # sparse_rows; the dense call: dense_calls[i]; sparse attention: i attends
    # sparse_rows[:attend_sizes[i]]; the row matmuls: i projects the first row_sizes[i] rows)
    # [0]. None unless dispatch="cond".
    branches: jax.Array | None = None

    @staticmethod
    def shapes(plan: BatchPlan) -> dict[str, tuple[int, ...]]:
        """The shape of each field for `plan` (branches only for a cond plan; None otherwise)."""
        T, S = plan.num_tokens, plan.num_seqs
        shapes = {"positions": (T,), "slot_mapping": (T,), "row_seq": (T,), "block_tables": (S, plan.pages_per_seq),
                  "sparse_rows": (plan.num_sparse_tokens,), "dense_rows": (T,), "dense_query_start": (S + 1,),
                  "dense_key_slots": (plan.num_dense_keys,), "dense_key_start": (S + 1,),
                  "upfront_rows": (plan.num_upfront_rows,), "kernel_rows": (plan.num_kernel_rows,),
                  "upfront_pages": (plan.num_upfront_pages,), "masked_flags": (plan.num_sparse_tokens,)}
        if plan.use_dense_mha is None:
            shapes["branches"] = (4,)
        return shapes

    @staticmethod
    def empty(plan: BatchPlan) -> BatchMeta:
        """Host (numpy) metadata of a batch with no work for `plan`: every row padding, every
        sequence empty (the padding values above; a cond plan's branches 0: each stage at its
        first size, 0 (not run) where a stage has several, else over padding rows only)."""
        zero = ("row_seq", "dense_query_start", "dense_key_start", "branches", "masked_flags")
        return BatchMeta(**{name: np.full(shape, 0 if name in zero else -1, np.int32)
                            for name, shape in BatchMeta.shapes(plan).items()})


# ---- validation ----------------------------------------------------------------------------------
#
# One implementation for both entry points: plan_arrays checks its arrays (shapes, dtypes) and
# hands them to _validate; plan_batch converts its Requests to the same arrays (_from_requests,
# which checks what only a Python object can get wrong: types) and hands them over too. _validate
# finds the first problem in request order with numpy: each request's length checks as masks over
# the batch (its first failing one is its problem), then the page checks of the requests before
# the first one with a length problem (an earlier request's pages come first, as a loop over the
# requests would report them).

INT64_MIN, INT64_MAX = -2 ** 63, 2 ** 63 - 1
# A request's checks, in the order the first failing one is reported. _from_requests reports
# the type problems (the "request", "context_len", "query_len" and "block_table" stages) of the
# first request that has one; the others are masks over the batch.
_STAGES = ("request", "context_len", "context_len range", "query_len", "query_len range", "block_table",
           "block_table int32", "max_position_embeddings", "pages")


@dataclasses.dataclass(frozen=True, eq=False)
class Batch:
    """A batch that passed the checks (check_batch / check_arrays), as host arrays.

    context_lens, query_lens: [B] int64. block_tables: [B, W] integer page ids, W the most pages
    a request's tokens occupy (ceil(total_len / page_size)); row i holds request i's pages where
    occupied[i] is True (its first ceil(total_len / page_size) entries), anything past them.
    """

    context_lens: np.ndarray
    query_lens: np.ndarray
    block_tables: np.ndarray
    occupied: np.ndarray  # [B, W] bool

    def __len__(self) -> int:
        return len(self.context_lens)


def _int64(value, what: str, minimum: int) -> int:
    """value as an int, for the arrays: ValueError unless it is an integer (not bool), or when
    it does not fit int64 (as_int's range message; the range itself is checked on the arrays)."""
    if type(value) is not int:
        if not is_int(value):
            as_int(value, what, minimum)  # raises its type message
        value = int(value)
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(range_message(what, minimum, value))
    return value


def _from_requests(requests: list):
    """Requests -> (context_lens, query_lens [B'] int64, block_tables [B', W] int64 -1 padded,
    table_lens [B'], problem): problem is (request, stage, message) for the first request with
    a type problem (then B' stops at it, its fields from that stage on placeholders), else None."""
    ctx, q, tables = [], [], []
    problem = None
    for i, r in enumerate(requests):
        stage, values = "request", [0, 1, np.zeros(0, np.int64)]  # placeholders: pass the checks before
        try:
            if not isinstance(r, Request):
                raise ValueError(f"request {i}: expected a Request, got {type(r).__name__}")
            stage = "context_len"
            values[0] = _int64(r.context_len, f"request {i}: context_len", 0)
            stage = "query_len"
            values[1] = _int64(r.query_len, f"request {i}: query_len", 1)
            stage = "block_table"
            values[2] = as_page_ids(r.block_table, f"request {i}: block_table")
        except ValueError as e:
            problem = (i, stage, str(e))
        ctx.append(values[0])
        q.append(values[1])
        tables.append(values[2])
        if problem:
            break
    lens = np.array([len(t) for t in tables], np.int64)
    out = np.full((len(tables), int(lens.max(initial=0))), -1, np.int64)
    out[np.arange(out.shape[1]) < lens[:, None]] = np.concatenate(tables)
    return np.array(ctx, np.int64), np.array(q, np.int64), out, lens, problem


def _array_arg(value, name: str, ndim: int) -> np.ndarray:
    """plan_arrays's argument `name` as a numpy integer array of ndim dimensions (ValueError naming it)."""
    if not isinstance(value, (np.ndarray, list, tuple)):
        raise ValueError(f"{name} must be a {ndim}-D numpy integer array (on the host), got {type(value).__name__}")
    try:
        array = np.asarray(value)
    except (ValueError, TypeError, OverflowError) as e:  # e.g. ragged nested lists
        raise ValueError(f"{name} must be a {ndim}-D integer array, got a {type(value).__name__} numpy cannot "
                         f"convert ({e})") from None
    if array.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {array.shape}")
    if array.dtype.kind not in "iu" or array.dtype.itemsize > 8:
        raise ValueError(f"{name} must hold integers, got dtype {array.dtype}")
    return array


def _wider_than_int32(dtype) -> bool:
    """Whether an integer dtype holds values outside int32."""
    return dtype.itemsize > 4 or (dtype.kind == "u" and dtype.itemsize == 4)


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


def _first_alias(pages: np.ndarray, hi: int, starts: np.ndarray, first_written: np.ndarray) -> int | None:
    """The first entry of `pages` (every request's occupied pages, request after request, each
    in [0, hi)) that holds a page an earlier entry holds while one of the two is written this
    step or both are the same request's; None if there is none. starts: where each request's
    entries start; first_written: each request's first written table index.

    A page held once is fine, so only the pages held more than once are looked at. Whether there
    are any: where hi is not far past the entry count, by marking each entry's page in a byte
    array of hi (O(entries + hi), no sort), else by sorting the ids. The holders of the pages
    held more than once, sorted by page (stable: in entry order), are fine exactly when every two
    neighbours are two different requests that both read the page; the first bad one is the
    second of a bad neighbour pair."""
    if hi <= 32 * pages.size:
        ids = pages.astype(np.intp)  # (numpy's fancy indexing is fastest with intp)
        seen = np.zeros(hi, np.uint8)
        seen[ids] = 1
        if np.count_nonzero(seen) == pages.size:
            return None
        held = np.flatnonzero(np.bincount(ids, minlength=hi)[ids] > 1)
    else:
        ids = np.sort(pages)
        again = ids[1:] == ids[:-1]
        if not again.any():
            return None
        held = np.flatnonzero(np.isin(pages, ids[1:][again]))
    held = held[np.argsort(pages[held], kind="stable")]  # by page, then entry
    req = np.searchsorted(starts, held, side="right") - 1
    writes = held - starts[req] >= first_written[req]
    page = pages[held]
    bad = (page[1:] == page[:-1]) & (writes[1:] | writes[:-1] | (req[1:] == req[:-1]))
    return int(held[1:][bad].min()) if bad.any() else None


def _page_problem(pages, starts, ctx, ps: int, limit: int, bound: str) -> ValueError | None:
    """The first page problem (in request, then table order: a page outside [0, limit), or
    aliased, see plan_batch) of requests whose occupied pages, request after request, are
    `pages` (request r's from starts[r]); None if there is none."""
    lo, hi = int(pages.min()), int(pages.max())
    outside = (pages < 0) | (pages >= limit) if lo < 0 or hi >= limit else None
    first_outside = int(np.argmax(outside)) if outside is not None else pages.size
    first_written = ctx // ps  # a request's pages from its first_written-th on are written
    if outside is not None and first_outside:
        hi = int(pages[:first_outside].max())
    alias = _first_alias(pages[:first_outside], hi + 1, starts, first_written) if first_outside else None
    if alias is None and outside is None:
        return None
    e = first_outside if alias is None else alias

    def entry(e):  # (request, table index, written this step)
        r = int(np.searchsorted(starts, e, side="right") - 1)
        return r, int(e - starts[r]), bool(e - starts[r] >= first_written[r])
    i, k, writes = entry(e)
    page = int(pages[e])
    if alias is None:
        return ValueError(f"request {i}: page id {page} is outside {bound} (block_table[{k}])")
    earlier = [entry(f) for f in np.flatnonzero(pages[:e] == page)]
    j, kj, j_writes = next((h for h in earlier if h[0] == i), earlier[0])  # its own holding, else the first
    return _alias_error(i, k, writes, page, j, kj, j_writes)


def _validate(config: MLAConfig, ctx: np.ndarray, q: np.ndarray, tables: np.ndarray, num_pages: int | None, *,
              table_lens: np.ndarray | None = None, problem=None) -> Batch:
    """Checks a batch given as arrays (see plan_batch) and returns it as a Batch; raises
    ValueError for its first problem in request order.

    ctx, q: [B] integer arrays; tables: [B, W] integer array. table_lens: [B] entries of each
    request's table (plan_batch; None: W each, plan_arrays, whose block_tables' width is named).
    problem: (request, stage, message), a type problem _from_requests found (the arrays stop at
    that request)."""
    ps = config.page_size
    slot_pages = max_slot_pages(config)
    limit = slot_pages if num_pages is None else num_pages

    # each request's length checks, masks over the batch
    bad = {"context_len range": ctx < 0, "query_len range": q < 1}
    if _wider_than_int32(ctx.dtype):
        bad["context_len range"] |= ctx > INT32_MAX
    if _wider_than_int32(q.dtype):
        bad["query_len range"] |= q > INT32_MAX
    if _wider_than_int32(tables.dtype):
        bad["block_table int32"] = ((tables < -INT32_MAX - 1) | (tables > INT32_MAX)).any(axis=1)
    ctx64, q64 = ctx.astype(np.int64), q.astype(np.int64)  # (a uint64 past int64 wraps: flagged above)
    total = ctx64 + q64
    needed = -(-total // ps)  # the pages a request's tokens occupy
    bad["max_position_embeddings"] = total > config.max_position_embeddings
    bad["pages"] = (tables.shape[1] if table_lens is None else table_lens) < needed
    any_bad = functools.reduce(np.logical_or, bad.values())
    if problem is not None:
        any_bad[problem[0]] = True
    first = int(np.argmax(any_bad)) if any_bad.any() else len(ctx)  # the first request with a length problem

    # the page checks of the requests before it (their lengths are valid)
    batch = None
    if first:
        n = needed[:first]
        w = int(n.max())
        occupied = np.arange(w) < n[:, None]
        block_tables = tables[:first, :w]
        bound = (f"[0, {num_pages})" if num_pages is not None else
                 f"[0, {slot_pages}), the pages of {ps} tokens whose slot numbers fit int32")
        error = _page_problem(block_tables[occupied], np.cumsum(n) - n, ctx64[:first], ps, limit, bound)
        if error is not None:
            raise error
        batch = Batch(ctx64[:first], q64[:first], block_tables, occupied)
    if first == len(ctx):
        return batch

    # the first request with a length problem: its first failing check
    i = first
    stage = next(s for s in _STAGES if (problem is not None and problem[:2] == (i, s)) or (s in bad and bad[s][i]))
    if problem is not None and problem[:2] == (i, stage):
        raise ValueError(problem[2])
    what = f"request {i}: context_len + query_len = {total[i]} tokens"
    if stage == "context_len range":
        message = range_message(f"request {i}: context_len", 0, ctx[i].item())
    elif stage == "query_len range":
        message = range_message(f"request {i}: query_len", 1, q[i].item())
    elif stage == "block_table int32":
        k = int(np.argmax((tables[i] < -INT32_MAX - 1) | (tables[i] > INT32_MAX)))
        message = f"request {i}: block_table[{k}] = {tables[i, k]} is outside int32"
    elif stage == "max_position_embeddings":
        message = f"{what} exceeds max_position_embeddings = {config.max_position_embeddings}"
    elif table_lens is not None:
        message = (f"request {i}: block_table has {table_lens[i]} pages, but context_len + query_len = {total[i]} "
                   f"tokens need {needed[i]} pages of {ps}")
    else:
        message = (f"request {i}: block_tables has {tables.shape[1]} columns, but context_len + query_len = "
                   f"{total[i]} tokens need {needed[i]} pages of {ps}")
    raise ValueError(message)


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


def check_batch(config, requests, num_pages, force_sparse, skip_indexer, buckets, dispatch, tensor_parallel=1,
                prefill_route="auto") -> tuple[Batch, int | None]:
    """plan_batch's checks: -> (the batch as arrays, num_pages as an int or None). Raises
    ValueError for the first problem."""
    num_pages = check_options(config, num_pages, force_sparse, skip_indexer, buckets, dispatch, tensor_parallel,
                              prefill_route)
    if isinstance(requests, (str, bytes, Request)) or not isinstance(requests, collections.abc.Iterable):
        raise ValueError(f"requests must be a sequence of Requests, got {type(requests).__name__}")
    requests = list(requests)
    if not requests:
        raise ValueError("empty batch: plan_batch needs at least one request")
    ctx, q, tables, table_lens, problem = _from_requests(requests)
    return _validate(config, ctx, q, tables, num_pages, table_lens=table_lens, problem=problem), num_pages


def check_arrays(config, context_lens, query_lens, block_tables, num_pages, force_sparse, skip_indexer, buckets,
                 dispatch, tensor_parallel=1, prefill_route="auto") -> tuple[Batch, int | None]:
    """plan_arrays's checks: -> (the batch, num_pages as an int or None). Raises ValueError for
    the first problem (an argument's shape or dtype, naming it; then the requests')."""
    num_pages = check_options(config, num_pages, force_sparse, skip_indexer, buckets, dispatch, tensor_parallel,
                              prefill_route)
    ctx = _array_arg(context_lens, "context_lens", 1)
    q = _array_arg(query_lens, "query_lens", 1)
    tables = _array_arg(block_tables, "block_tables", 2)
    if q.shape != ctx.shape:
        raise ValueError(f"query_lens has shape {q.shape}, context_lens {ctx.shape}: one length each per request")
    if tables.shape[0] != ctx.shape[0]:
        raise ValueError(f"block_tables has {tables.shape[0]} rows for {ctx.shape[0]} requests (context_lens): "
                         "one row each")
    if not ctx.size:
        raise ValueError("empty batch: plan_arrays needs at least one request")
    return _validate(config, ctx, q, tables, num_pages), num_pages


# ---- routes and sizes ----------------------------------------------------------------------------

ROUTES = ("sparse", "dense", "masked")  # a request's route, by its code in route_codes
SPARSE, DENSE, MASKED_ROUTE = 0, 1, 2


def _lengths(requests) -> tuple[np.ndarray, np.ndarray]:
    """(context_lens, query_lens) int64 of a Batch or a sequence of Requests."""
    if isinstance(requests, Batch):
        return requests.context_lens, requests.query_lens
    return (np.array([r.context_len for r in requests], np.int64), np.array([r.query_len for r in requests], np.int64))


def route_codes(config: MLAConfig, context_lens, query_lens, force_sparse: bool,
                prefill_route: str = "auto") -> np.ndarray:
    """Each request's route in a static plan, as an int8 code into ROUTES: "dense" (a prefill of
    <= index_topk tokens: dense MHA, not scored), "masked" (a longer prefill: scored, then masked
    MHA) or "sparse" (decodes, longer prefills the cost model or prefill_route sends there,
    everything under force_sparse)."""
    policy.check_prefill_route(prefill_route)
    ctx, q = np.asarray(context_lens, np.int64), np.asarray(query_lens, np.int64)
    codes = np.zeros(ctx.shape, np.int8)
    if force_sparse:
        return codes
    prefill = ~is_decode(ctx, q)
    if not prefill.any():  # decodes only (most serving steps): every request sparse
        return codes
    short = prefill & (ctx + q <= config.index_topk)
    codes[short] = DENSE
    long_ = np.flatnonzero(prefill & ~short)
    if prefill_route == "masked":
        codes[long_] = MASKED_ROUTE
    elif prefill_route == "auto" and long_.size:
        codes[long_[policy.masked_cheaper(ctx[long_], q[long_], config.index_topk)]] = MASKED_ROUTE
    return codes


def request_routes(config: MLAConfig, requests, force_sparse: bool, prefill_route: str = "auto") -> list[str]:
    """Each request's route name (route_codes) for a Batch or a sequence of Requests."""
    return [ROUTES[c] for c in route_codes(config, *_lengths(requests), force_sparse, prefill_route).tolist()]


def _dense(routes) -> np.ndarray:
    """Which requests the dense program's MHA call runs (route "dense" or "masked"), from route
    names or codes."""
    routes = np.asarray(routes)
    return routes != ("sparse" if routes.dtype.kind in "US" else SPARSE)


def padded_sizes(config: MLAConfig, requests, routes, buckets: BucketPolicy) -> tuple[int, int, int, int]:
    """(num_tokens, num_seqs, pages_per_seq, num_dense_keys) of a static plan of the requests (a
    Batch or Requests), routed as `routes` says (names from request_routes or route_codes)."""
    ctx, q = _lengths(requests)
    return _padded_sizes(config, ctx, q, _dense(routes), buckets)


def _padded_sizes(config, ctx, q, dense, buckets) -> tuple[int, int, int, int]:
    total = ctx + q
    return (buckets.round_up(int(q.sum()), buckets.min_tokens),
            buckets.round_up(len(ctx), buckets.min_seqs),
            buckets.round_up(int(-(-total.max() // config.page_size)), buckets.min_pages_per_seq),
            buckets.round_up(int(total[dense].sum()), buckets.min_dense_keys) if dense.any() else 0)


# ---- the plan ------------------------------------------------------------------------------------

def pad_ids(values, size: int):
    """values as int32 [size], -1 padded."""
    out = np.full(size, -1, np.int32)
    out[: len(values)] = values
    return out


def _upfront_split(config: MLAConfig, batch: Batch, block_tables, attends_sparsely, row_seq, buckets,
                   tensor_parallel: int):
    """(upfront rows, kernel rows, upfront pages, their bucketed sizes) of the fp8 split (see
    BatchPlan), or None when the cache is not fp8, no prefill attends sparsely, or dequantising
    its pages would not pay (policy.dequantize_route, per-shard heads). block_tables: the
    batch's, -1 past each request's pages; row_seq: each real row's request."""
    if config.kv_cache_dtype != "fp8":
        return None
    decode = is_decode(batch.context_lens, batch.query_lens)
    upfront = attends_sparsely & ~decode
    if not upfront.any():
        return None
    upfront_rows = np.flatnonzero(upfront[row_seq])
    kernel_rows = np.flatnonzero((attends_sparsely & decode)[row_seq])
    tables = block_tables[:len(batch)][upfront]
    pages = tables[tables >= 0]  # the upfront requests' pages, sequence after sequence
    sizes = (buckets.round_up(len(upfront_rows), 1), buckets.round_up(len(kernel_rows), 1) if len(kernel_rows) else 0,
             buckets.round_up(len(pages), buckets.min_pages_per_seq))
    route = policy.dequantize_route(sizes[0], config.num_attention_heads // tensor_parallel, config.index_topk,
                                    sizes[2] * config.page_size)
    return (upfront_rows, kernel_rows, pages, sizes) if route == "upfront" else None


def _slots(block_tables: np.ndarray, seq: np.ndarray, pos: np.ndarray, page_size: int) -> np.ndarray:
    """The cache slot of position pos[t] of sequence seq[t] (int32 block tables: int32)."""
    return block_tables[seq, pos // page_size] * page_size + (pos % page_size).astype(np.int32)


def _ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """The concatenated ranges [starts[i], starts[i] + lens[i]) (int64)."""
    offsets = np.cumsum(lens) - lens
    return np.arange(int(lens.sum())) + np.repeat(starts - offsets, lens)


def plan_host(config: MLAConfig, batch: Batch, *, num_pages: int | None, force_sparse: bool,
              skip_indexer: bool, buckets: BucketPolicy, dispatch: str,
              tensor_parallel: int = 1, prefill_route: str = "auto",
              stages: tuple[bool, bool] | None = None) -> tuple[BatchPlan, BatchMeta]:
    """plan_batch for a batch and options that passed `check_batch` / `check_arrays`; the
    metadata is numpy, on the host. Numpy over the batch's arrays: no loop over its requests.
    stages: a cond plan's (dense call, sparse stages) when a data-parallel step's shards share
    one program (each the union of theirs; None: the batch's own)."""
    page = config.page_size
    cond = dispatch == "cond"
    ctx, q = batch.context_lens, batch.query_lens
    B, w = batch.block_tables.shape
    codes = route_codes(config, ctx, q, force_sparse, prefill_route)
    if cond and (codes != SPARSE).any():  # dense and masked requests past the largest key size attend sparsely
        keys = key_ladder(buckets.round_up(int(q.sum()), buckets.min_tokens))
        over = np.flatnonzero(np.cumsum(np.where(codes != SPARSE, ctx + q, 0)) > keys[-1])
        if over.size:
            codes[over[0]:] = SPARSE
    dense = codes != SPARSE  # run in the dense program's dense MHA call
    num_tokens, num_seqs, width, static_dense_keys = _padded_sizes(config, ctx, q, dense, buckets)

    block_tables = np.full((num_seqs, width), -1, np.int32)
    tables = block_tables[:B, :w]  # its pages, -1 past them
    np.copyto(tables, batch.block_tables, casting="unsafe", where=batch.occupied)  # (int32 range checked)

    # rows: request after request
    row_seq = np.repeat(np.arange(B, dtype=np.int32), q)
    pos = _ranges(ctx, q)
    n = len(row_seq)
    positions = np.full(num_tokens, -1, np.int32)
    positions[:n] = pos
    slot_mapping = np.full(num_tokens, -1, np.int32)
    slot_mapping[:n] = _slots(tables, row_seq, pos, page)
    row_seq_out = np.zeros(num_tokens, np.int32)
    row_seq_out[:n] = row_seq

    # the dense MHA call: its requests' rows and keys (none in a batch without dense requests)
    dense_query_start = np.zeros(num_seqs + 1, np.int32)
    dense_key_start = np.zeros(num_seqs + 1, np.int32)
    dense_rows = dense_key_slots = ()
    if dense.any():
        dense_query_start[1:B + 1] = np.where(dense, q, 0).cumsum()
        dense_query_start[B + 1:] = dense_query_start[B]
        dense_key_start[1:B + 1] = np.where(dense, ctx + q, 0).cumsum()
        dense_key_start[B + 1:] = dense_key_start[B]
        dense_rows = dense[row_seq].nonzero()[0]
        dense_seqs = dense.nonzero()[0]
        key_lens = (ctx + q)[dense_seqs]
        key_pos = _ranges(np.zeros_like(key_lens), key_lens)
        dense_key_slots = _slots(tables, np.repeat(dense_seqs, key_lens), key_pos, page)
    row_codes = codes[row_seq]
    if cond:  # the scored rows, those attending sparsely first (each stage takes a prefix)
        attending = (row_codes == SPARSE).nonzero()[0]
        scored = np.concatenate([attending, (row_codes == MASKED_ROUTE).nonzero()[0]])
    else:
        scored = (row_codes != DENSE).nonzero()[0]  # attends sparsely or as masked MHA

    branches = None
    upfront_rows = kernel_rows = upfront_pages = []
    if cond:  # sizes from the buckets alone, the stages the batch needs (or a data-parallel step's)
        needs_dense, needs_sparse = stages or (bool(dense.any()), len(scored) > 0)
        plan = cond_plan(config, num_tokens, num_seqs, width, num_pages=num_pages, skip_indexer=skip_indexer,
                         dense=needs_dense, sparse=needs_sparse, prefill_route=prefill_route,
                         tensor_parallel=tensor_parallel)
    else:
        use_dense = bool(dense.any())
        has_masked = bool((codes == MASKED_ROUTE).any())
        split = _upfront_split(config, batch, block_tables, ~dense, row_seq, buckets, tensor_parallel)
        upfront_rows, kernel_rows, upfront_pages, (num_upfront_rows, num_kernel_rows, num_upfront_pages) = (
            split or ([], [], [], (0, 0, 0)))
        plan = BatchPlan(num_tokens=num_tokens, num_seqs=num_seqs, pages_per_seq=width, use_dense_mha=use_dense,
                         num_sparse_tokens=buckets.round_up(len(scored), 1) if use_dense and len(scored) else 0,
                         num_dense_keys=static_dense_keys, skip_indexer=skip_indexer or not use_dense,
                         num_pages=num_pages, num_upfront_rows=num_upfront_rows, num_kernel_rows=num_kernel_rows,
                         num_upfront_pages=num_upfront_pages, config=PlanConfig.of(config),
                         masked="none" if not has_masked else "all" if dense.all() else "some",
                         tensor_parallel=tensor_parallel)
    num_sparse = plan.num_sparse_tokens
    masked_flags = np.zeros(num_sparse, np.int32)
    if num_sparse:
        masked_flags[:len(scored)] = row_codes[scored] == MASKED_ROUTE
    if cond:
        branches = cond_branches(plan, len(scored), np.count_nonzero(np.bincount(row_seq[scored], minlength=1)),
                                 len(dense_key_slots), bool((codes == MASKED_ROUTE).any()), len(attending), n)
    meta = BatchMeta(
        positions=positions, slot_mapping=slot_mapping, row_seq=row_seq_out, block_tables=block_tables,
        sparse_rows=pad_ids(scored if num_sparse else [], num_sparse),  # unused by the sparse program
        dense_rows=pad_ids(dense_rows, num_tokens), dense_query_start=dense_query_start,
        dense_key_slots=pad_ids(dense_key_slots, plan.num_dense_keys), dense_key_start=dense_key_start,
        upfront_rows=pad_ids(upfront_rows, plan.num_upfront_rows), kernel_rows=pad_ids(kernel_rows, plan.num_kernel_rows),
        upfront_pages=pad_ids(upfront_pages, plan.num_upfront_pages), masked_flags=masked_flags, branches=branches)
    return plan, meta


def cond_plan(config: MLAConfig, num_tokens: int, num_seqs: int, pages_per_seq: int, *, num_pages: int | None,
              skip_indexer: bool, dense: bool, sparse: bool, prefill_route: str, tensor_parallel: int = 1) -> BatchPlan:
    """The dispatch="cond" plan of a shape bucket and the stages a batch needs (the one statement
    of it: plan_host and precompile.enumerate_plans build cond plans here): dense, a dense / masked
    MHA call; sparse, scoring and sparse attention (at least one). Sizes from the bucket alone,
    the stages' ladders from num_tokens (BatchPlan.score_sizes, key_sizes, attend_sizes,
    row_sizes); masked calls where both stages are there and the largest key size holds a request
    longer than index_topk (a masked row's), unless long prefills attend sparsely."""
    if not (dense or sparse):
        raise ValueError("a cond plan holds the dense call, the sparse stages or both")
    keys = key_ladder(num_tokens)[-1]  # the dense call's largest key size
    return BatchPlan(num_tokens=num_tokens, num_seqs=num_seqs, pages_per_seq=pages_per_seq, use_dense_mha=None,
                     num_sparse_tokens=num_tokens if sparse else 0, num_dense_keys=keys if dense else 0,
                     skip_indexer=skip_indexer, num_pages=num_pages, config=PlanConfig.of(config),
                     masked="some" if (dense and sparse and prefill_route != "sparse"
                                       and keys > config.index_topk) else "none",
                     tensor_parallel=tensor_parallel)


def _pick_size(sizes: tuple[int, ...], count: int) -> int:
    """A cond plan's branch for a stage of `count` items: the index of the smallest of `sizes`
    (ascending; stage_sizes) that holds them; 0 where the stage is not in the program."""
    return bisect.bisect_left(sizes, count) if sizes else 0


def cond_branches(plan: BatchPlan, num_scored: int, num_scored_seqs: int, num_keys: int, masked: bool,
                  num_attending: int, num_rows: int) -> np.ndarray:
    """A cond plan's meta.branches [4] int32 for a step of num_scored scored rows of
    num_scored_seqs sequences (ignored without skip_indexer: every row), num_keys dense keys
    (with masked rows or not), num_attending sparsely attending rows and num_rows real rows. The
    scoring call: the size that holds the rows, with the kernel shape policy.indexer_kernel
    gives for one shard's share of the real rows over those sequences."""
    score = 0
    if len(plan.score_calls) > 1:
        n = plan.score_sizes[_pick_size(plan.score_sizes, num_scored)]
        rows = -(-num_scored // policy.indexer_shards(n, plan.tensor_parallel))
        shape = policy.indexer_kernel(rows, max(num_scored_seqs, 1)) if rows else "decode"
        score = plan.score_calls.index((n, shape if (n, shape) in plan.score_calls else "decode"))
    dense = _pick_size(plan.key_sizes, num_keys)
    if masked:
        dense = plan.dense_calls.index((plan.key_sizes[dense], True))
    return np.array([score, dense, _pick_size(plan.attend_sizes, num_attending), _pick_size(plan.row_sizes, num_rows)],
                    np.int32)


def _plan(config, batch, num_pages, force_sparse, skip_indexer, buckets, dispatch, tensor_parallel, prefill_route):
    plan, meta = plan_host(config, batch, num_pages=num_pages, force_sparse=bool(force_sparse),
                           skip_indexer=bool(skip_indexer), buckets=buckets, dispatch=dispatch,
                           tensor_parallel=int(tensor_parallel), prefill_route=prefill_route)
    return plan, jax.device_put(meta)  # one batched transfer of the whole pytree


def plan_arrays(config: MLAConfig, context_lens, query_lens, block_tables, *, num_pages: int | None = None,
                force_sparse: bool = False, skip_indexer: bool = True,
                buckets: BucketPolicy = BucketPolicy(), dispatch: Dispatch = "static",
                tensor_parallel: int = 1, prefill_route: policy.PrefillRoute = "auto") -> tuple[BatchPlan, BatchMeta]:
    """plan_batch for a batch given as host arrays (an engine's own state, no Request objects):
    the same checks, the same plan and metadata, planned with numpy ops over the batch (no loop
    over its requests or pages).

    context_lens, query_lens: [B] integer arrays; block_tables: [B, W] integer array (int32),
    row i request i's page ids, -1 past its pages (entries past the ceil(total_len / page_size)
    pages its tokens occupy are ignored; W must cover those). Lists and tuples are converted.
    Raises ValueError naming the argument (shape, dtype) or the request and field, as
    plan_batch does. Options as plan_batch's.
    """
    batch, num_pages = check_arrays(config, context_lens, query_lens, block_tables, num_pages, force_sparse,
                                    skip_indexer, buckets, dispatch, tensor_parallel, prefill_route)
    return _plan(config, batch, num_pages, force_sparse, skip_indexer, buckets, dispatch, tensor_parallel,
                 prefill_route)


def plan_batch(config: MLAConfig, requests: Sequence[Request], *, num_pages: int | None = None,
               force_sparse: bool = False, skip_indexer: bool = True,
               buckets: BucketPolicy = BucketPolicy(), dispatch: Dispatch = "static",
               tensor_parallel: int = 1, prefill_route: policy.PrefillRoute = "auto") -> tuple[BatchPlan, BatchMeta]:
    """Validates a batch on the host and returns its static plan and traced metadata.

    requests: context_len, query_len and page ids are Python or numpy integers (not bool);
      block tables are lists, tuples or 1-D numpy integer arrays (entries past the
      ceil(total_len / page_size) pages a request's tokens occupy are ignored). Those pages
      must be distinct within a request, and a page this step writes (from the one holding
      position context_len on) must not be read or written by another request; two requests
      may read one page (a shared prefix). context_len + query_len <= max_position_embeddings.
      The requests are converted to arrays and planned as plan_arrays plans them.
    force_sparse: route every prefill through the indexer and sparse attention (no dense or
      masked MHA).
    prefill_route: how prefills longer than index_topk attend: "auto" (policy.prefill_route's
      cost model, per request), "masked" or "sparse" (every such prefill).
    skip_indexer: score only the rows that need top-k (False: every row, the baseline).
    num_pages: the cache's page count; page ids outside [0, num_pages) are rejected. Without
      it page ids are only checked to be >= 0 and to have int32 slot numbers (an id past the
      cache would read clamped slots and write nowhere): such a plan only plans (forward
      refuses it), so pass num_pages=cache.num_pages for a batch that runs.
    dispatch: "static" (the exact program: sizes and route in the plan) or "cond" (the serving
      program: the plan's sizes depend on the shape buckets only, each stage's size is picked
      at run time by meta.branches; see the module docstring).
    tensor_parallel: the tensor-axis size the batch will run under (a positive divisor of
      num_attention_heads): the kernel choices are made for the heads of one shard, and the
      indexer's split over the shards (RowGroup.indexer_shards). Plans for more than 1 run
      through sharding.sharded_forward.
    Raises ValueError naming the request and the problem before anything touches a device.
    """
    batch, num_pages = check_batch(config, requests, num_pages, force_sparse, skip_indexer, buckets, dispatch,
                                   tensor_parallel, prefill_route)
    return _plan(config, batch, num_pages, force_sparse, skip_indexer, buckets, dispatch, tensor_parallel,
                 prefill_route)
