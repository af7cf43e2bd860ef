"""The engine: N sparse-MLA layers and their paged caches served by a continuous-batching loop
(`Engine`; its pages from allocator.PageAllocator), its options (`EngineOptions`) and the oracle
of one request served alone (`reference_outputs`). See the package docstring for the loop."""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections import deque
from typing import Callable, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..cache import init_cache
from ..config import MLAConfig, check_config_type
from ..kernels import check_kernels
from ..model import PlanJit, advance_decodes, forward
from ..params import check_finite, check_params, init_params
from ..plan import (DISPATCH_MODES, BatchMeta, BatchPlan, BucketPolicy, Request, check_arrays, check_batch,
                    check_slot_range, plan_host)
from ..policy import check_prefill_route
from ..progress import progress_bar, show_progress
from ..validate import as_bool, as_int, is_int
from . import block as _block
from .allocator import PageAllocator, PoolTooSmallError
from .block import BLOCKS, MoEConfig
from .metrics import RequestMetrics, ServeResult, StepRecord
from .workload import RequestSpec, Workload, specs_of


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """Scheduling and program options. Any of them can be overridden per run (Engine.run(**kw)).

    max_num_batched_tokens: token budget of one step (decode tokens + prefill chunk tokens).
    max_num_seqs: most requests running (holding pages and being scheduled) at once.
    max_model_len: the longest request (prompt + output tokens) the engine serves; None: the
      config's max_position_embeddings. A longer request is refused before the run starts.
    skip_indexer, force_sparse, dispatch, prefill_route: the planning options (plan_batch's);
      dispatch "cond" (the default) is the serving program: one program per row bucket and
      stage set.
    buckets: the plans' BucketPolicy; None (the default): BucketPolicy.for_limits of this
      engine's max_num_seqs, max_model_len and num_pages (sequence count and table width fixed
      at the limits: with dispatch "cond", 30 programs at DeepSeek-V3.2 serving limits).
    kernels: the layers' (model.forward's).
    decode_steps: decode steps one dispatch runs when every request a step schedules decodes,
      none waits to be admitted and each has at least that many tokens left to output (a decode run: the
      program advances the batch on the device, model.advance_decodes; vLLM's multi-step
      scheduling). Why: a step's host part (scheduling, planning, the dispatch of a program of
      dozens of arguments) is a fixed ~1 ms, a quarter of a 4-layer decode step; a run of
      decode_steps pays it once. A request that arrives during a run waits for its end, and a
      run's tokens reach the host together. 1 (the default): every step is planned and dispatched.
    """

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int | None = None
    skip_indexer: bool = True
    force_sparse: bool = False
    dispatch: str = "cond"
    kernels: str = "auto"
    buckets: BucketPolicy | None = None
    prefill_route: str = "auto"
    decode_steps: int = 1

    def __post_init__(self):
        def put(name, value):
            object.__setattr__(self, name, value)

        for name in ("max_num_batched_tokens", "max_num_seqs", "decode_steps"):
            put(name, as_int(getattr(self, name), name, 1))
        if self.max_model_len is not None:
            put("max_model_len", as_int(self.max_model_len, "max_model_len", 1))
        for name in ("skip_indexer", "force_sparse"):
            put(name, as_bool(getattr(self, name), name))
        if not isinstance(self.dispatch, str) or self.dispatch not in DISPATCH_MODES:
            raise ValueError(f"dispatch must be one of {DISPATCH_MODES}, got {self.dispatch!r}")
        check_kernels(self.kernels)
        if self.buckets is not None and not isinstance(self.buckets, BucketPolicy):
            raise ValueError(f"buckets must be a BucketPolicy or None, got {type(self.buckets).__name__}")
        check_prefill_route(self.prefill_route)

    def with_overrides(self, overrides: dict) -> EngineOptions:
        """These options with `overrides` (EngineOptions fields, checked); ValueError naming an unknown one."""
        names = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(overrides) - set(names))
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}: EngineOptions has {names}")
        return dataclasses.replace(self, **overrides)

    def model_len(self, config: MLAConfig) -> int:
        """max_model_len, or the config's max_position_embeddings. ValueError if it exceeds them,
        or if no decode run could ever be taken: a run of decode_steps needs that many tokens left
        to output after the prefill's, at most model_len - 1."""
        model_len = config.max_position_embeddings if self.max_model_len is None else self.max_model_len
        if model_len > config.max_position_embeddings:
            raise ValueError(f"max_model_len = {self.max_model_len} exceeds the config's max_position_embeddings = "
                             f"{config.max_position_embeddings}")
        if self.decode_steps > max(model_len - 1, 1):
            raise ValueError(f"decode_steps = {self.decode_steps}: a decode run needs that many tokens left to "
                             f"output, and a request of max_model_len = {model_len} has at most {model_len - 1}")
        return model_len

    def plan_kwargs(self, config: MLAConfig, num_pages: int | None) -> dict:
        """plan_batch's options for an engine of this config and cache size (buckets resolved;
        num_pages None: tables as wide as max_model_len)."""
        buckets = self.buckets or BucketPolicy.for_limits(config, max_num_seqs=self.max_num_seqs,
                                                           max_model_len=self.model_len(config), num_pages=num_pages)
        return dict(skip_indexer=self.skip_indexer, force_sparse=self.force_sparse, buckets=buckets,
                    dispatch=self.dispatch, prefill_route=self.prefill_route)

    def program_set(self, config: MLAConfig, num_pages: int) -> list[BatchPlan]:
        """Every plan a run under these options on a cache of num_pages pages can need
        (precompile.enumerate_plans of plan_kwargs under the options' limits)."""
        from ..precompile import enumerate_plans

        kw = self.plan_kwargs(config, num_pages)
        return enumerate_plans(config, kw.pop("buckets"), num_pages=num_pages, max_num_seqs=self.max_num_seqs,
                               max_num_batched_tokens=self.max_num_batched_tokens,
                               max_model_len=self.model_len(config), **kw)

    def decode_run_plans(self, config: MLAConfig, num_pages: int) -> list[BatchPlan]:
        """The plans of the decode runs (decode_steps > 1; none otherwise) a run under these
        options can dispatch: the plan of n decodes at the longest length for each row bucket n.
        Every decode run's plan under dispatch "cond" with the default buckets (a cond plan's
        sizes follow the rows alone: sequence count and table width are fixed at the limits);
        otherwise the widest table's only (a run with another compiles its program)."""
        if self.decode_steps == 1:
            return []
        kw = self.plan_kwargs(config, num_pages)
        buckets = kw["buckets"]
        most = min(self.max_num_seqs, self.max_num_batched_tokens, num_pages)
        counts = sorted({min(buckets.round_up(n, buckets.min_tokens), most) for n in range(1, most + 1)})
        longest = self.model_len(config) - 1  # a decode's context: its pages cover the model length
        width = -(-self.model_len(config) // config.page_size)
        plans = {}
        for n in counts:
            if n * width > num_pages:  # n sequences of the longest length would not fit: shorter ones
                width = num_pages // n
                longest = width * config.page_size - 1
            tables = np.arange(n * width, dtype=np.int32).reshape(n, width)
            plan, _ = plan_host(config, check_arrays(config, np.full(n, longest), np.ones(n, np.int64), tables,
                                                     num_pages=num_pages, **kw)[0], num_pages=num_pages, **kw)
            plans[plan] = None
        return list(plans)


STEP_ANNOTATION = "Engine step"  # the name of each step's host part in a profiler trace (its arg: step)


@dataclasses.dataclass
class _InFlight:
    """A step dispatched to the device and not yet waited for (Engine.run): what recording it needs."""

    work: tuple[list[int], list[int]] | None  # (request ids, their rows in order) with collect_outputs
    plan: BatchPlan
    meta: BatchMeta  # host (numpy) metadata (a decode run's last step's: layer_stack)
    x: jax.Array | None  # the last layer's output (None in a dry run; [steps, ...] for a decode run)
    emitters: list[list[RequestMetrics]]  # of each step: the requests that output a token in it
    steps: int  # 1, or a decode run's steps (EngineOptions.decode_steps)
    num_requests: int
    num_tokens: int
    num_decodes: int
    prefill_tokens: int
    new_programs: int
    begin_s: float  # the run's clock: scheduling began
    planned_s: float  # planned (plan_host returned)
    dispatch_s: float  # the step's dispatch (packing its input, the call of jit_layer_stack) began
    dispatched_s: float  # the step's dispatch returned


class _Slots:
    """The running requests of Engine.run as arrays over slots [max_num_seqs]: a request holds a
    slot from its admission to its last token, so that a step's batch (lengths, block tables, pool
    rows) and its bookkeeping are array operations, not a pass over Python objects per request.

    order: the running slots in admission order (the scheduler's order); computed: tokens in the
    cache; emitted: output tokens of the steps dispatched so far; tables [S, W] int32: each slot's
    pages (-1 past them); rows [S, R] int32: the pool row of each token a request feeds
    (R: the workload's longest cache_len)."""

    def __init__(self, max_num_seqs: int, max_pages: int, max_tokens: int):
        self.order = np.zeros(0, np.int64)
        self._free = list(range(max_num_seqs - 1, -1, -1))  # pop() hands out slot 0 first
        self.computed, self.emitted, self.input_len, self.output_len = (np.zeros(max_num_seqs, np.int64)
                                                                        for _ in range(4))
        self.num_pages = np.zeros(max_num_seqs, np.int64)
        self.tables = np.full((max_num_seqs, max_pages), -1, np.int32)
        self.rows = np.zeros((max_num_seqs, max_tokens), np.int32)
        self.pages: list[list[int] | None] = [None] * max_num_seqs
        self.metrics: list[RequestMetrics | None] = [None] * max_num_seqs

    def __len__(self) -> int:
        return len(self.order)

    def admit(self, spec: RequestSpec, metrics: RequestMetrics, pages: list[int], rows: np.ndarray) -> int:
        """A slot for a request with its pages and its tokens' pool rows [cache_len] -> the slot."""
        slot = self._free.pop()
        self.order = np.append(self.order, slot)
        self.computed[slot] = self.emitted[slot] = 0
        self.input_len[slot], self.output_len[slot] = spec.input_len, spec.output_len
        self.num_pages[slot] = len(pages)
        self.tables[slot] = -1
        self.tables[slot, :len(pages)] = pages
        self.rows[slot, :len(rows)] = rows
        self.pages[slot], self.metrics[slot] = pages, metrics
        return slot

    def schedule(self, waiting: deque[tuple[RequestSpec, RequestMetrics]], allocator: PageAllocator, *, budget: int,
                 max_num_seqs: int, page_size: int, token_rows: Callable[[RequestSpec], np.ndarray]
                 ) -> tuple[np.ndarray, np.ndarray, int]:
        """vLLM's policy: one token per running decode, then prefill chunks of running requests
        (admission order), then newly admitted requests, all within the token budget (`budget`
        tokens; at most max_num_seqs running). Admitting a request moves it from `waiting` to a
        slot with its pages from `allocator`. -> (slots [B], tokens this step [B], the number of
        decodes: the first of them)."""
        prefilling = self.computed[self.order] < self.input_len[self.order]
        decodes = self.order[~prefilling][:budget]
        budget -= len(decodes)
        slots, counts = [decodes], [np.ones(len(decodes), np.int64)]
        for slot in self.order[prefilling].tolist():  # a few: the chunked prefills
            if budget <= 0:
                break
            n = min(int(self.input_len[slot] - self.computed[slot]), budget)
            slots.append([slot])
            counts.append([n])
            budget -= n
        while waiting and budget > 0 and len(self) < max_num_seqs:
            spec, m = waiting[0]
            pages = allocator.allocate(-(-spec.cache_len // page_size))
            if pages is None:  # wait for a running request to free its pages
                if not len(self):
                    raise PoolTooSmallError(f"request {spec.id} does not fit an empty cache")  # unreachable
                break
            waiting.popleft()
            n = min(spec.input_len, budget)
            slots.append([self.admit(spec, m, pages, token_rows(spec))])
            counts.append([n])
            budget -= n
        return np.concatenate(slots).astype(np.int64), np.concatenate(counts).astype(np.int64), len(decodes)

    def batch(self, slots: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The step's batch as plan_arrays takes it and its pool rows: (context_lens [B],
        query_lens [B], block_tables [B, W] (W: the batch's most pages), pool rows [sum(counts)]
        in batch order)."""
        context = self.computed[slots]
        tables = self.tables[slots, :int(self.num_pages[slots].max())]
        starts = np.cumsum(counts) - counts
        cols = np.arange(int(counts.sum())) + np.repeat(context - starts, counts)
        return context, counts, tables, self.rows[np.repeat(slots, counts), cols]

    def decode_run(self, slots: np.ndarray, steps: int) -> np.ndarray | None:
        """The pool rows [steps, B] of a decode run of `steps` over these slots (all decoding), or
        None where one of them has fewer than `steps` tokens left to output (its pages, allocated
        for its whole length at admission, then cover every position the run writes)."""
        if (self.output_len[slots] - self.emitted[slots]).min() < steps:
            return None
        cols = self.computed[slots][None, :] + np.arange(steps)[:, None]
        return self.rows[slots[None, :], cols]

    def advance(self, slots: np.ndarray, counts: np.ndarray, allocator: PageAllocator) -> list[RequestMetrics]:
        """Books a dispatched step: its tokens are in the cache, a finished prefill or a decode
        yields one output token, a request whose last token this step computes gives its pages
        back to `allocator` (a later step that reuses them runs after this one) and its slot.
        -> the metrics of the requests that output a token."""
        self.computed[slots] += counts
        emitting = slots[self.computed[slots] >= self.input_len[slots]]
        self.emitted[emitting] += 1
        metrics = self.metrics
        emitters = [metrics[s] for s in emitting.tolist()]
        done = emitting[self.emitted[emitting] == self.output_len[emitting]]
        if len(done):
            for s in done.tolist():
                allocator.free(self.pages[s])
                self.pages[s] = self.metrics[s] = None
                self._free.append(s)
            self.order = self.order[~np.isin(self.order, done)]
        return emitters


# ---- the step's program: every layer in one dispatch ------------------------------------------

def _layout(plan: BatchPlan) -> list[tuple[str, tuple[int, ...] | None]]:
    """(name, shape) of every BatchMeta field in field order; shape None for a field the plan has
    none of (not in BatchMeta.shapes(plan): e.g. a static plan's branches)."""
    shapes = BatchMeta.shapes(plan)
    return [(f.name, shapes.get(f.name)) for f in dataclasses.fields(BatchMeta)]


def packed_size(plan: BatchPlan, steps: int = 1) -> int:
    """The length of pack_step's buffer for `plan` and a program of `steps` decode steps:
    steps x num_tokens row ids plus every meta field's size."""
    return steps * plan.num_tokens + sum(math.prod(shape) for _, shape in _layout(plan) if shape is not None)


def pack_step(plan: BatchPlan, meta: BatchMeta, rows: np.ndarray) -> np.ndarray:
    """A step's host inputs as one int32 buffer [packed_size(plan, steps)], so that they reach the
    device in one transfer: rows (the pool row of each of the plan.num_tokens hidden rows, int32
    [T], or [steps, T] for a decode run: each step's), then every field of `meta` that is not None,
    in BatchMeta's field order, each flattened. meta: host (numpy) metadata of the plan
    (plan_host; a decode run's last step: layer_stack); each field must be int32 of the shape
    BatchMeta.shapes(plan) gives it, and None exactly where that has no entry for it. ValueError
    naming the argument or field otherwise. unpack_step inverts it."""
    rows = np.asarray(rows)
    if rows.ndim not in (1, 2) or rows.shape[-1] != plan.num_tokens or rows.dtype != np.int32:
        raise ValueError(f"rows must be int32 [plan.num_tokens] = [{plan.num_tokens}] (or [steps, "
                         f"{plan.num_tokens}]), got {rows.dtype} {rows.shape}")
    parts = [rows.ravel()]
    for name, shape in _layout(plan):
        value = getattr(meta, name)
        if shape is None or value is None:
            if (shape is None) != (value is None):
                raise ValueError(f"meta.{name} is {'set' if shape is None else 'None'}, but BatchMeta.shapes(plan) "
                                 f"{'has no' if shape is None else 'has an'} entry for it (was meta planned for "
                                 "this plan?)")
            continue
        value = np.asarray(value)
        if value.shape != shape or value.dtype != np.int32:
            raise ValueError(f"meta.{name} is {value.dtype} {value.shape}, expected int32 {shape} for this plan")
        parts.append(value.ravel())
    return np.concatenate(parts)


def unpack_step(packed, plan: BatchPlan, steps: int = 1) -> tuple[jax.Array, BatchMeta]:
    """pack_step's buffer [packed_size(plan, steps)] int32 (a device array under jit, or numpy) ->
    (rows [plan.num_tokens], or [steps, plan.num_tokens] when steps > 1; meta: a BatchMeta whose
    fields are views of it with the shapes of BatchMeta.shapes(plan), None where the plan has
    none). Static offsets: slices and reshapes, no gather."""
    size = packed_size(plan, steps)
    if packed.shape != (size,):
        raise ValueError(f"packed has shape {packed.shape}, expected [packed_size(plan, steps={steps})] = [{size}]")
    offset = steps * plan.num_tokens
    fields = {}
    for name, shape in _layout(plan):
        if shape is None:
            fields[name] = None
            continue
        size = math.prod(shape)
        fields[name] = packed[offset:offset + size].reshape(shape)
        offset += size
    rows = packed[:steps * plan.num_tokens]
    return (rows if steps == 1 else rows.reshape(steps, plan.num_tokens)), BatchMeta(**fields)


def layer_stack(pool, packed, params, block_params, caches, *, plan: BatchPlan, config: MLAConfig, kernels: str,
                moe: MoEConfig | None, steps: int = 1):
    """One engine step through every layer (the Engine's program: jit_layer_stack), or a decode
    run of `steps` of them.

    pool: [P + 1, hidden_size] config dtype, the token hidden states (last row zeros: padding);
    packed: int32 [packed_size(plan, steps)], pack_step's buffer of the step's pool row ids and its
    BatchMeta; params: list of N layer param dicts; caches: list of N PagedCaches (donated under
    jit); block_params: None for attention layers, x = x + forward(x), or a list of N decoder
    block param dicts (serving.block), x = x + forward(attn_input(x)); x = ffn_residual(x) with
    `moe`. plan, config, kernels, moe, steps: static. Each layer is model.forward on the step's
    plan and metadata. steps > 1: a decode-only batch (EngineOptions.decode_steps) run `steps`
    times in a loop; the packed meta is the run's last step's (planned at the run's final lengths,
    so that its block tables hold, and its checks cover, every page the run writes), step k runs
    on it moved by k - (steps - 1) tokens (model.advance_decodes) with the pool rows of its row k.
    Returns (x [plan.num_tokens, hidden_size] config dtype after the last layer, or [steps,
    plan.num_tokens, hidden_size]: each step's; the N updated caches)."""
    if (block_params is None) != (moe is None):
        raise ValueError("block_params and moe go together: both for decoder blocks, neither for attention layers")
    rows, meta = unpack_step(packed, plan, steps)

    def step(x, meta, caches):
        new_caches = []
        for layer, (p, cache) in enumerate(zip(params, caches, strict=True)):
            if block_params is None:
                out, cache = forward(p, x, cache, meta, plan=plan, config=config, kernels=kernels)
                x = x + out
            else:
                bp = block_params[layer]
                out, cache = forward(p, _block.attn_input(bp, x, config=config), cache, meta, plan=plan,
                                     config=config, kernels=kernels)
                x = _block.ffn_residual(bp, x + out, config=config, moe=moe)
            new_caches.append(cache)
        return x, new_caches

    if steps == 1:
        return step(pool[rows], meta, caches)

    def body(k, carry):
        xs, caches = carry
        x, caches = step(pool[rows[k]], advance_decodes(meta, k - (steps - 1), config.page_size), caches)
        return jax.lax.dynamic_update_index_in_dim(xs, x, k, 0), caches

    xs = jnp.zeros((steps, plan.num_tokens, config.hidden_size), config.jnp_dtype)
    return jax.lax.fori_loop(0, steps, body, (xs, list(caches)))


jit_layer_stack = PlanJit(layer_stack, static_argnames=("plan", "config", "kernels", "moe", "steps"),
                          donate_argnames=("caches",))


class Engine:
    """N sparse-MLA layers with their paged caches, served by a continuous-batching loop.

    block: "attention" (default): each layer is x = x + attn(x); "decoder": each layer is a
      DeepSeek-V3.2 decoder block, x = x + attn(RMSNorm(x)); x = x + moe(RMSNorm(x)), with the
      MoE FFN stand-in of serving.block (random routing and experts through grouped_matmul).
    moe: the decoder block's MoEConfig (default MoEConfig.for_config(config): DeepSeek-V3.2's 256
      experts, 8 active, intermediate 2048, one shared expert at hidden 7168; 8/2/32 otherwise).
    params: list of N per-layer param dicts (default: init_params with keys fold_in(seed, layer)).
    block_params: list of N per-layer decoder-block param dicts (norms, router, experts; default
      serving.block.init_block_params with keys fold_in(seed, 2**21 + layer)); decoder only.
    Given params and block_params are checked here, every layer before any step runs: each
    tensor present, an array of the right shape, floating (params.check_params,
    block.check_block_params) and finite (params.check_finite); ValueError naming the layer and
    the tensor (`layer 1: block_params['ffn_norm.weight'] has dtype int32, ...`).
    caches: one PagedCache of num_pages pages per layer (donated and replaced every step).
    pool: [pool_size + 1, hidden_size] seeded random token hidden states (the last row is zeros,
      used for padding rows).
    """

    def __init__(self, config: MLAConfig, *, num_layers: int = 2, num_pages: int = 1024, seed: int = 0,
                 pool_size: int = 4096, params: Sequence[dict] | None = None, block: str = "attention",
                 moe: MoEConfig | None = None, block_params: Sequence[dict] | None = None, **options):
        check_config_type(config)
        num_layers = as_int(num_layers, "num_layers", 1)
        num_pages, pool_size = as_int(num_pages, "num_pages", 1), as_int(pool_size, "pool_size", 1)
        check_slot_range(config, num_pages)
        if not is_int(seed) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        self.config, self.num_pages, self.seed, self.pool_size = config, num_pages, int(seed), pool_size
        if not isinstance(block, str) or block not in BLOCKS:
            raise ValueError(f"block must be one of {BLOCKS}, got {block!r}")
        if moe is not None and not isinstance(moe, MoEConfig):
            raise ValueError(f"moe must be a MoEConfig or None, got {type(moe).__name__}")
        if block == "attention" and (moe is not None or block_params is not None):
            raise ValueError('moe and block_params are for block="decoder"')
        self.options = EngineOptions().with_overrides(options)
        key = jax.random.key(seed)
        self.block = block
        self.moe = (moe or MoEConfig.for_config(config)) if block == "decoder" else None
        if params is None:
            params = [init_params(config, jax.random.fold_in(key, layer)) for layer in range(num_layers)]
        else:
            _check_layers(params, num_layers, "params", lambda p, what: check_params(p, config, what))
        if block == "decoder":
            if block_params is None:
                block_params = [_block.init_block_params(config, self.moe, jax.random.fold_in(key, (1 << 21) + layer))
                                for layer in range(num_layers)]
            else:
                _check_layers(block_params, num_layers, "block_params",
                              lambda p, what: _block.check_block_params(p, config, self.moe, what))
        self.params = list(params)
        self.block_params = list(block_params) if block_params is not None else None
        self.caches = [init_cache(config, num_pages) for _ in range(num_layers)]
        # (plan, kernels, steps) -> the step's (steps 1) or decode run's jax.stages.Compiled (precompile)
        self._executables: dict[tuple[BatchPlan, str, int], jax.stages.Compiled] = {}
        pool = jax.random.normal(jax.random.fold_in(key, 1 << 20), (pool_size, config.hidden_size), jnp.float32)
        self.pool = jnp.concatenate([pool, jnp.zeros((1, config.hidden_size))]).astype(config.jnp_dtype)

    @property
    def num_layers(self) -> int:
        return len(self.params)

    # ---- tokens ---------------------------------------------------------------------------
    def token_rows(self, spec: RequestSpec) -> np.ndarray:
        """[cache_len] pool rows of a request's tokens (seeded by engine seed and request id)."""
        return np.random.default_rng([self.seed, spec.id]).integers(self.pool_size, size=spec.cache_len)

    def token_hidden(self, spec: RequestSpec) -> np.ndarray:
        """[cache_len, hidden_size] float32: the hidden states a request feeds the first layer."""
        return np.asarray(self.pool[self.token_rows(spec)].astype(jnp.float32))

    # ---- one step -------------------------------------------------------------------------
    def _plan(self, check: Callable, kw: dict, *batch) -> tuple[BatchPlan, BatchMeta]:
        """A batch's plan and host (numpy) metadata under the planning options kw
        (EngineOptions.plan_kwargs, resolved once a run): check(config, *batch, num_pages=...,
        **kw) is plan.check_batch (batch: the Requests) or plan.check_arrays (batch:
        context_lens, query_lens, block_tables), every check plan_batch / plan_arrays make, then
        plan.plan_host. The metadata stays on the host: _forward packs it into the step's one
        transfer."""
        checked, num_pages = check(self.config, *batch, num_pages=self.num_pages, **kw)
        return plan_host(self.config, checked, num_pages=num_pages, **kw)

    def _step_call(self, plan: BatchPlan, meta: BatchMeta, rows: np.ndarray | Sequence, kernels: str,
                   steps: int = 1) -> tuple[tuple, dict]:
        """The (args, kwargs) of jit_layer_stack for one step (or a decode run of `steps`): this
        engine's pool, params and caches; the step's input packed (pack_step) from `meta` (host, of
        `plan`) and the pool rows `rows` (host ints, at most plan.num_tokens; [steps, B] for a
        run) followed by padding rows (the pool's zero row)."""
        rows = np.asarray(rows, np.int32).reshape(steps, -1)
        ids = np.full((steps, plan.num_tokens), self.pool_size, np.int32)
        ids[:, :rows.shape[1]] = rows
        return ((self.pool, pack_step(plan, meta, ids if steps > 1 else ids[0]), self.params, self.block_params,
                 self.caches), dict(plan=plan, config=self.config, kernels=kernels, moe=self.moe, steps=steps))

    def _forward(self, plan: BatchPlan, meta: BatchMeta, rows: np.ndarray | Sequence, kernels: str,
                 steps: int = 1) -> jax.Array:
        """One step through every layer (or a decode run of `steps`): a single dispatch of the
        plan's precompiled executable, or of jit_layer_stack without one (_step_call's arguments:
        one transfer of the packed input), the caches donated and replaced. Returns x
        [plan.num_tokens, hidden_size] config dtype after the last layer ([steps, ...] for a run)."""
        args, kwargs = self._step_call(plan, meta, rows, kernels, steps)
        executable = self._executables.get((plan, kernels, steps))
        x, self.caches = executable(*args) if executable is not None else jit_layer_stack(*args, **kwargs)
        return x

    def compile_batches(self, batches: Iterable[Sequence[Request]], *,
                        decode_runs: Iterable[Sequence[Request]] = (), **overrides) -> int:
        """Compiles the program of each batch's plan that has no executable yet (precompile's
        plans= and decode_plans=: ahead of time, kept for run). batches: each a step's Requests,
        compiled as one step; decode_runs: each a decode run's batch as run plans it (its last
        step's lengths), compiled as a run of decode_steps (ValueError with decode_steps 1).
        Returns the number of programs compiled."""
        opts = self.options.with_overrides(overrides)
        kw = opts.plan_kwargs(self.config, self.num_pages)
        decode_runs = list(decode_runs)
        if decode_runs and opts.decode_steps == 1:
            raise ValueError("decode_runs needs decode_steps > 1 (EngineOptions.decode_steps)")
        programs = {}  # (plan, steps) -> None: distinct, in order
        for group, steps in ((batches, 1), (decode_runs, opts.decode_steps)):
            for requests in group:
                plan, _ = self._plan(check_batch, kw, list(requests))
                if (plan, opts.kernels, steps) not in self._executables:
                    programs[plan, steps] = None
        if programs:
            self.precompile(plans=[p for p, k in programs if k == 1],
                            decode_plans=[p for p, k in programs if k > 1], progress=False, **overrides)
        return len(programs)

    def precompile(self, *, store: str | os.PathLike | None = None, workers: int | None = None,
                   progress: bool | None = None, plans: Sequence[BatchPlan] | None = None,
                   decode_plans: Sequence[BatchPlan] | None = None, **overrides):
        """Compiles every step program a run under these options can need, whatever the workload:
        jit_layer_stack for the plans of EngineOptions.program_set for this engine's num_pages
        (overrides: EngineOptions fields, as for run), and with decode_steps > 1 its decode-run
        program for those of EngineOptions.decode_run_plans, each lowered on this engine's pool,
        params and caches and compiled ahead of time (precompile's "aot"). The engine keeps the
        executables: a run's step with a precompiled plan calls its executable, so it neither
        traces nor compiles. store: an ExecutableStore directory (load what it holds, write what
        is compiled: a restarted engine loads its programs in seconds). workers: compiling
        threads (precompile's). progress: a bar over the plans (None: only when stderr is a
        terminal). plans, decode_plans: these only (default: with plans None, every one of both
        sets; with plans given, decode_plans None is none; decode_plans with decode_steps 1:
        ValueError). Returns the PrecompileReport (its plans: the step programs', then the
        decode runs')."""
        from ..precompile import PrecompileReport, precompile

        opts = self.options.with_overrides(overrides)
        if decode_plans and opts.decode_steps == 1:
            raise ValueError("decode_plans needs decode_steps > 1 (EngineOptions.decode_steps): with 1 there are "
                             "no decode runs")
        buckets = opts.plan_kwargs(self.config, self.num_pages)["buckets"]
        if plans is None:
            plans = opts.program_set(self.config, self.num_pages)
            if decode_plans is None:
                decode_plans = opts.decode_run_plans(self.config, self.num_pages)
        programs = [(list(plans), 1)] + ([(list(decode_plans), opts.decode_steps)] if decode_plans else [])
        reports = []
        for group, steps in programs:
            def program(plan, steps=steps):
                rows = np.zeros((steps, 0), np.int32)  # every row padding
                args, static = self._step_call(plan, BatchMeta.empty(plan), rows, opts.kernels, steps)
                return jit_layer_stack, args, static

            report = precompile(self.config, buckets, num_pages=self.num_pages, max_num_seqs=opts.max_num_seqs,
                                max_num_batched_tokens=opts.max_num_batched_tokens, kernels=opts.kernels,
                                method="aot", store=store, workers=workers, plans=group, program=program,
                                progress=progress)
            self._executables.update(((p, opts.kernels, steps), e) for p, e in zip(report.plans, report.executables))
            reports.append(report)
        return PrecompileReport.combine(reports)

    def forward_batch(self, requests: Sequence[Request], **overrides):
        """One batch through the layer stack outside the scheduler (benchmarks: time it, repeat it;
        a repeat rewrites the same slots with the same values). Token hidden states are pool rows
        picked by position. Returns (x [plan.num_tokens, hidden] after the last layer, plan)."""
        opts = self.options.with_overrides(overrides)
        plan, meta = self._plan(check_batch, opts.plan_kwargs(self.config, self.num_pages), list(requests))
        rows = np.arange(sum(r.query_len for r in requests)) % self.pool_size
        return self._forward(plan, meta, rows, opts.kernels), plan

    def warmup(self, workload: Workload | Sequence[RequestSpec], *, max_steps: int | None = None,
               **overrides) -> int:
        """Compiles every program a run of this workload (stopped after max_steps, as run's) will
        need: a dry run of the scheduler (no device work, zero step times) collects the batches,
        then compile_batches compiles each distinct plan's step program ahead of time (kept: the
        run calls it), so that the run compiles nothing at all. Returns the number of programs
        compiled. Exact when arrivals do not depend on timing (request_rate=inf); otherwise best
        effort."""
        batches: list[tuple[list[Request], int]] = []  # (a step's or decode run's batch, its steps)
        self.run(workload, max_steps=max_steps, progress=False, _dry_run=batches, **overrides)
        return self.compile_batches([b for b, k in batches if k == 1], decode_runs=[b for b, k in batches if k > 1],
                                    **overrides)

    # ---- the loop -------------------------------------------------------------------------
    def run(self, workload: Workload | Sequence[RequestSpec], *, max_steps: int | None = None,
            progress: bool | None = None, collect_outputs: bool = False, desc: str = "serving",
            _dry_run: list | None = None, **overrides) -> ServeResult:
        """Serves a workload to completion (or max_steps) and returns its metrics.

        overrides: EngineOptions fields for this run (e.g. skip_indexer=False).
        progress: a bar over the steps, titled desc (None: only when stderr is a terminal).
        collect_outputs: keep each request's last-layer x rows ([cache_len, hidden] float32 in
          token order; costs a device->host copy per step).
        Raises PoolTooSmallError when a request can never fit the cache.
        """
        opts = self.options.with_overrides(overrides)
        if max_steps is not None:
            max_steps = as_int(max_steps, "max_steps (or None)", 0)
        progress, collect_outputs = show_progress(progress), as_bool(collect_outputs, "collect_outputs")
        concurrency = workload.concurrency if isinstance(workload, Workload) else None
        specs = specs_of(workload)
        page = self.config.page_size
        max_len = opts.model_len(self.config)
        plan_kw = opts.plan_kwargs(self.config, self.num_pages)  # once: the same for every step
        for s in specs:  # fail before any work
            if s.cache_len > max_len:
                raise ValueError(f"request {s.id}: input_len + output_len - 1 = {s.cache_len} tokens exceeds "
                                 f"max_model_len = {max_len}")
            if -(-s.cache_len // page) > self.num_pages:
                raise PoolTooSmallError(f"request {s.id} ({s.input_len} in + {s.output_len} out) needs "
                                        f"{-(-s.cache_len // page)} pages of {page} tokens, the cache has "
                                        f"{self.num_pages}")
        dry = _dry_run is not None
        pending = deque(sorted(specs, key=lambda s: (s.arrival_s, s.id)))
        waiting: deque[tuple[RequestSpec, RequestMetrics]] = deque()  # sent, not yet admitted
        slots = _Slots(opts.max_num_seqs, max(-(-s.cache_len // page) for s in specs) if specs else 1,
                       max((s.cache_len for s in specs), default=1))
        allocator = PageAllocator(self.num_pages)
        metrics: list[RequestMetrics] = []
        steps: list[StepRecord] = []
        outputs = {} if collect_outputs else None
        wall0 = time.perf_counter()
        skipped = 0.0  # idle time jumped over (no request in the engine until the next arrival)
        last_end = 0.0  # the run's clock when the last recorded step ended

        def now() -> float:  # the run's clock (a dry run's stands still between arrivals)
            return skipped + (0.0 if dry else time.perf_counter() - wall0)

        def finish(step: _InFlight) -> None:  # waits for a dispatched step (or run), then records it
            nonlocal last_end
            if step.x is not None:
                step.x.block_until_ready()
            end = now()
            k = step.steps  # a decode run's times are shared evenly by its steps
            if collect_outputs and step.x is not None:
                host = np.asarray(step.x).astype(np.float32).reshape(k, -1, step.x.shape[-1])  # (no cast program)
                for out in host:
                    row = 0
                    for i, n in zip(*step.work):
                        outputs.setdefault(i, []).append(out[row:row + n])
                        row += n
            for emitters in step.emitters:
                for m in emitters:
                    m.token_times_s.append(end)
            plan = step.plan
            for j in range(k):
                steps.append(StepRecord(
                    index=len(steps), start_s=last_end + j * (end - last_end) / k, duration_s=(end - last_end) / k,
                    forward_s=(end - step.dispatch_s) / k, host_s=(step.dispatched_s - step.begin_s) / k,
                    plan_s=(step.planned_s - step.begin_s) / k, launch_s=(step.dispatched_s - step.dispatch_s) / k,
                    device_s=(end - max(last_end, step.dispatch_s)) / k,
                    route=plan.route, branch=_branch(plan, step.meta.branches),
                    has_indexer_scoring=bool(plan.has_indexer_scoring), num_scored_tokens=plan.num_scored_tokens,
                    num_tokens=step.num_tokens, padded_tokens=plan.num_tokens, num_decodes=step.num_decodes,
                    num_prefills=step.num_requests - step.num_decodes, prefill_tokens=step.prefill_tokens,
                    new_programs=step.new_programs if j == 0 else 0, plan=plan, dispatch_steps=k))
            last_end = end
            bar.update(k)
            if len(steps) % 16 < k:
                bar.set_postfix(done=sum(m.finished for m in metrics), running=len(slots), refresh=False)

        inflight: _InFlight | None = None  # dispatched, not yet waited for
        bar = progress_bar(total=max_steps, progress=progress and not dry, desc=desc, unit="step", leave=False)
        try:
            while pending or waiting or len(slots):
                dispatched = len(steps) + (inflight.steps if inflight is not None else 0)
                if max_steps is not None and dispatched >= max_steps:
                    break
                # client: send what has arrived, under the concurrency cap
                if not waiting and not len(slots) and pending and pending[0].arrival_s > now():
                    if inflight is not None:
                        finish(inflight)
                        inflight = None
                    skipped += pending[0].arrival_s - now()  # idle: jump to the next arrival
                    last_end = now()
                while pending and pending[0].arrival_s <= now() and (
                        concurrency is None or len(waiting) + len(slots) < concurrency):
                    s = pending.popleft()
                    # arrival: the spec's time (the loop reaches it only after the step or decode run in
                    # flight, a wait its TTFT includes); under a concurrency cap, when it is sent
                    m = RequestMetrics(s.id, s.input_len, s.output_len,
                                       arrival_s=s.arrival_s if concurrency is None else now())
                    metrics.append(m)
                    waiting.append((s, m))
                # step N + 1 is scheduled, planned and dispatched while step N runs on the device:
                # what it needs of step N is host bookkeeping (token counts, pages), not its output
                # a profiler trace shows each step's host part (scheduling, planning, dispatch) by index
                with jax.profiler.TraceAnnotation(STEP_ANNOTATION, step=dispatched):
                    begin = now()
                    work, counts, num_decodes = slots.schedule(
                        waiting, allocator, budget=opts.max_num_batched_tokens, max_num_seqs=opts.max_num_seqs,
                        page_size=page, token_rows=self.token_rows)
                    if not len(work):
                        raise RuntimeError("scheduler made no progress (this is a bug)")
                    # the batch as arrays (plan_arrays's checks: vectorised, no Request objects)
                    context_lens, query_lens, tables, rows = slots.batch(work, counts)
                    run = opts.decode_steps
                    if (run > 1 and num_decodes == len(work) and not waiting  # a decode run: see EngineOptions
                            and (max_steps is None or dispatched + run <= max_steps)
                            and (run_rows := slots.decode_run(work, run)) is not None):
                        rows = run_rows
                    else:
                        run = 1
                    # a run is planned as its last step: the pages it writes are in that batch's tables and checks
                    plan, meta = self._plan(check_arrays, plan_kw, context_lens + (run - 1), query_lens, tables)
                    planned = now()
                    prefill_tokens = int(counts[num_decodes:].sum())
                    ids = ([slots.metrics[s].id for s in work.tolist()], counts.tolist()) if collect_outputs else None
                    if dry:
                        _dry_run.append(([Request(c + run - 1, n, slots.pages[s]) for s, c, n in
                                          zip(work.tolist(), context_lens.tolist(), counts.tolist())], run))
                    emitters = [slots.advance(work, counts, allocator) for _ in range(run)]
                    dispatch = now()
                    if dry:
                        x, new_programs = None, 0
                    else:
                        before = jit_layer_stack._cache_size()
                        x = self._forward(plan, meta, rows, opts.kernels, run)
                        new_programs = jit_layer_stack._cache_size() - before
                step = _InFlight(ids, plan, meta, x, emitters, run, len(work), int(counts.sum()), num_decodes,
                                 prefill_tokens, new_programs,
                                 begin_s=begin, planned_s=planned, dispatch_s=dispatch, dispatched_s=now())
                if inflight is not None:
                    finish(inflight)
                inflight = step
            if inflight is not None:
                finish(inflight)
        finally:
            bar.close()
        clock = last_end
        if outputs is not None:
            outputs = {k: np.concatenate(v) for k, v in outputs.items()}
        return ServeResult(requests=sorted(metrics, key=lambda m: m.id), steps=steps, duration_s=clock,
                           wall_s=time.perf_counter() - wall0, outputs=outputs)


def _check_layers(layers, num_layers: int, what: str, check: Callable[[dict, str], None]) -> None:
    """Per-layer dicts of arrays (the Engine argument `what`): one per layer, each passing
    check(layer's dict, what) and params.check_finite; ValueError naming the layer and the tensor."""
    if isinstance(layers, (Mapping, str, bytes)) or not isinstance(layers, Sequence):
        raise ValueError(f"{what} must be a list of per-layer dicts, got {type(layers).__name__}")
    if len(layers) != num_layers:
        raise ValueError(f"got {len(layers)} layers of {what} for num_layers={num_layers}")
    for layer, arrays in enumerate(layers):
        try:
            check(arrays, what)
            check_finite(arrays, what)
        except ValueError as e:
            raise ValueError(f"layer {layer}: {e}") from None


def _branch(plan: BatchPlan, branches) -> str:
    """The program a step ran: its plan's route, or for a cond plan "dense" when meta.branches
    picked a dense MHA call over some keys, else "sparse"."""
    if plan.route != "cond":
        return plan.route
    return "dense" if plan.dense_keys_picked(np.asarray(branches)[1]) else "sparse"


def reference_outputs(engine: Engine, spec: RequestSpec, *, route_margin: float = 1e-5
                      ) -> tuple[np.ndarray, np.ndarray]:
    """The oracle for one request served alone: its tokens through every layer of
    `reference.sequence_forward` with the residual (a decoder engine: through the norms and the
    dense per-token MoE loop of serving.block.reference_moe too). Returns (x [cache_len, hidden]
    float32 after the last layer, ambiguous [cache_len] bool: a row whose top-k set hinged on a
    near-tie in any layer, the indexer's or, decoder only, the router's: a gap below route_margin
    between the k-th and (k+1)-th expert score)."""
    from .. import reference
    x = engine.token_hidden(spec)
    ambiguous = np.zeros(len(x), bool)
    for layer, params in enumerate(engine.params):
        if engine.block == "decoder":
            bp, c = engine.block_params[layer], engine.config
            out, amb = reference.sequence_forward(params, _block.reference_norm(bp, "attn_norm.weight", x, c)
                                                  .astype(np.float32), c)
            x = x + out
            ffn, margin = _block.reference_moe(bp, _block.reference_norm(bp, "ffn_norm.weight", x, c), engine.moe)
            x, ambiguous = (x + ffn).astype(np.float32), ambiguous | amb | (margin < route_margin)
            continue
        out, amb = reference.sequence_forward(params, x, engine.config)
        x, ambiguous = x + out, ambiguous | amb
    return x, ambiguous

