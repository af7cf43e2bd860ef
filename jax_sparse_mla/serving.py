"""A continuous-batching serving loop over a stack of sparse-MLA layers, with latency metrics.

Pieces (each usable alone):
  `Workload`    a vLLM-style random workload: input/output lengths uniform in
                [len * (1 - ratio), len * (1 + ratio)], arrival times (all at once, or Poisson at
                `request_rate`), and a client-side `concurrency` cap -> `RequestSpec`s.
  `PageAllocator` a free list of cache pages; a request reserves every page it will ever need
                when it is admitted and frees them when it finishes (no preemption needed).
  `Engine`      N layers (random weights, one PagedCache each) served step by step: vLLM's
                scheduling policy (running decodes first, then prefill chunks under a per-step
                token budget `max_num_batched_tokens`, at most `max_num_seqs` running), one
                `plan_batch` per step shared by every layer, hidden flowing layer to layer as
                x = x + attn(x).
  `ServeResult` per-request metrics (TTFT, TPOT), per-step records, and a summary.

Time. The loop keeps a clock that starts at 0 and advances by each step's measured wall time
(scheduling + planning + every layer, up to block_until_ready); when nothing is running it jumps
to the next arrival instead of sleeping. A request arrives at max(its arrival time, the moment the
client's concurrency cap lets it be sent). TTFT = end of the step that finished its prefill (which
produces its first output token) - arrival; TPOT = mean time between its output tokens.

Tokens are synthetic: every token's hidden state (a prompt token, or the "next token" a decode
step feeds back) is a row of a seeded random pool kept on the device, picked by a seeded
per-request index sequence, so a step's input is one gather and runs are reproducible.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .cache import init_cache
from .config import MLAConfig
from .kernels import CHOICES as KERNEL_CHOICES
from .model import jit_forward
from .params import init_params
from .plan import DISPATCH_MODES, INT32_MAX, BucketPolicy, Request, _is_int, plan_batch


def _int(value, what: str, minimum: int) -> int:
    """value (a Python or numpy integer, not bool, in [minimum, 2**31)) as an int; ValueError naming `what`."""
    if not _is_int(value):
        raise ValueError(f"{what} must be an integer, got {value!r} ({type(value).__name__})")
    if not minimum <= value <= INT32_MAX:
        raise ValueError(f"{what} must be >= {minimum}" + (", got " if value < minimum else " and < 2**31, got ")
                         + str(value))
    return int(value)


def _real(value, what: str) -> float:
    """value (an int or float, numpy's too, not bool) as a float; ValueError naming `what`."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{what} must be a real number, got {value!r} ({type(value).__name__})")
    return float(value)


def _bool(value, what: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{what} must be a bool, got {value!r}")
    return bool(value)


# ------------------------------------------------------------------------------------------------
# workload
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """One request of a workload: `input_len` prompt tokens, `output_len` tokens to generate
    (the first comes out of the prefill step, the rest from output_len - 1 decode steps), and the
    earliest time (seconds from the start of the run) at which the client sends it."""

    id: int
    input_len: int
    output_len: int
    arrival_s: float = 0.0

    def __post_init__(self):
        if not _is_int(self.id) or not 0 <= self.id <= INT32_MAX:  # (it seeds the request's tokens)
            raise ValueError(f"request id must be an integer in [0, 2**31), got {self.id!r}")
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (numpy -> Python)
        put("id", int(self.id))
        put("input_len", _int(self.input_len, f"request {self.id}: input_len", 1))
        put("output_len", _int(self.output_len, f"request {self.id}: output_len", 1))
        if self.cache_len > INT32_MAX:
            raise ValueError(f"request {self.id}: input_len + output_len - 1 = {self.cache_len} must be < 2**31")
        arrival = _real(self.arrival_s, f"request {self.id}: arrival_s")
        if not 0 <= arrival < math.inf:
            raise ValueError(f"request {self.id}: arrival_s must be finite and >= 0, got {self.arrival_s}")
        put("arrival_s", arrival)

    @property
    def cache_len(self) -> int:
        """Tokens this request ever holds in the cache: the prompt and every output but the last."""
        return self.input_len + self.output_len - 1


def _uniform_lengths(rng, n: int, length: int, ratio: float) -> np.ndarray:
    lo, hi = max(1, int(round(length * (1 - ratio)))), max(1, int(round(length * (1 + ratio))))
    return rng.integers(lo, hi + 1, size=n)


@dataclasses.dataclass(frozen=True)
class Workload:
    """vLLM's random dataset: input lengths uniform in [input_len * (1 - input_range_ratio),
    input_len * (1 + input_range_ratio)] (integers, at least 1), likewise output lengths.

    concurrency: most requests in flight at once on the client side (None: no cap), as vLLM's
      --max-concurrency: a request is sent when an earlier one finishes.
    request_rate: arrivals per second, Poisson (inf: every request is ready at time 0).
    """

    num_requests: int
    input_len: int
    output_len: int
    input_range_ratio: float = 0.0
    output_range_ratio: float = 0.0
    concurrency: int | None = None
    request_rate: float = math.inf
    seed: int = 0

    def __post_init__(self):
        def put(name, value):  # numpy scalars -> Python (hashing, equality, seeding)
            object.__setattr__(self, name, value)

        for name in ("num_requests", "input_len", "output_len"):
            put(name, _int(getattr(self, name), name, 1))
        for name in ("input_range_ratio", "output_range_ratio"):
            value = _real(getattr(self, name), name)
            if not 0 <= value < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
            put(name, value)
        if self.concurrency is not None:
            put("concurrency", _int(self.concurrency, "concurrency (or None)", 1))
        rate = _real(self.request_rate, "request_rate")
        if not rate > 0:  # (NaN too)
            raise ValueError(f"request_rate must be > 0 (inf: all at once), got {self.request_rate}")
        put("request_rate", rate)
        if not _is_int(self.seed) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        put("seed", int(self.seed))

    def requests(self) -> list[RequestSpec]:
        rng = np.random.default_rng(self.seed)
        inputs = _uniform_lengths(rng, self.num_requests, self.input_len, self.input_range_ratio)
        outputs = _uniform_lengths(rng, self.num_requests, self.output_len, self.output_range_ratio)
        if math.isinf(self.request_rate):
            arrivals = np.zeros(self.num_requests)
        else:
            arrivals = np.cumsum(rng.exponential(1.0 / self.request_rate, self.num_requests))
            arrivals -= arrivals[0]
        return [RequestSpec(i, int(a), int(b), float(t)) for i, (a, b, t) in enumerate(zip(inputs, outputs, arrivals))]


# ------------------------------------------------------------------------------------------------
# pages
# ------------------------------------------------------------------------------------------------

class PoolTooSmallError(ValueError):
    """A request needs more pages than the whole cache holds."""


class PageAllocator:
    """A free list over page ids [0, num_pages)."""

    def __init__(self, num_pages: int):
        self.num_pages = _int(num_pages, "num_pages", 1)
        self._free = deque(range(num_pages))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n page ids, or None when fewer than n are free (PoolTooSmallError if n > num_pages)."""
        if n > self.num_pages:
            raise PoolTooSmallError(f"a request needs {n} pages but the cache has only {self.num_pages} "
                                    "(raise num_pages or shorten the requests)")
        if n > len(self._free):
            return None
        pages = [self._free.popleft() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        for p in pages:
            if p not in self._used:
                raise ValueError(f"page {p} is freed but was not allocated")
            self._used.remove(p)
            self._free.append(p)


# ------------------------------------------------------------------------------------------------
# results
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class RequestMetrics:
    """One finished (or, after max_steps, unfinished) request. Times in seconds on the run's clock."""

    id: int
    input_len: int
    output_len: int
    arrival_s: float
    token_times_s: list[float] = dataclasses.field(default_factory=list)

    @property
    def output_tokens(self) -> int:
        return len(self.token_times_s)

    @property
    def finished(self) -> bool:
        return self.output_tokens == self.output_len

    @property
    def ttft_s(self) -> float:
        return self.token_times_s[0] - self.arrival_s if self.token_times_s else math.nan

    @property
    def tpot_s(self) -> float:
        """Mean time between output tokens (nan with fewer than two)."""
        t = self.token_times_s
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else math.nan

    @property
    def finish_s(self) -> float:
        return self.token_times_s[-1] if self.finished else math.nan

    def to_json(self) -> dict:
        return {"id": self.id, "input_len": self.input_len, "output_len": self.output_len,
                "arrival_s": self.arrival_s, "ttft_s": _nan_none(self.ttft_s), "tpot_s": _nan_none(self.tpot_s),
                "finish_s": _nan_none(self.finish_s), "output_tokens": self.output_tokens}


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One served step.

    start_s / duration_s: on the run's clock (duration: scheduling, planning and every layer up to
    block_until_ready). forward_s: from the first layer's dispatch to ready. route: plan.route
    ("dense" / "sparse" / "cond"); branch: the program that ran ("dense" / "sparse": for a cond
    plan, the branch meta.dense_flag picks). num_tokens: real rows; padded_tokens: plan.num_tokens.
    new_programs: executables jit_forward compiled during this step. plan: the step's BatchPlan.
    """

    index: int
    start_s: float
    duration_s: float
    forward_s: float
    route: str
    branch: str
    has_indexer_scoring: bool
    num_scored_tokens: int | None
    num_tokens: int
    padded_tokens: int
    num_decodes: int
    num_prefills: int
    prefill_tokens: int
    new_programs: int
    plan: object = None


def _nan_none(x: float):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


def _stats_ms(values: Sequence[float], prefix: str) -> dict:
    v = np.asarray([x for x in values if not math.isnan(x)], np.float64) * 1e3
    if v.size == 0:
        return {f"mean_{prefix}_ms": None, f"median_{prefix}_ms": None, f"p99_{prefix}_ms": None}
    return {f"mean_{prefix}_ms": float(v.mean()), f"median_{prefix}_ms": float(np.median(v)),
            f"p99_{prefix}_ms": float(np.percentile(v, 99))}


@dataclasses.dataclass
class ServeResult:
    """Everything a run measured. duration_s: clock at the end of the last step."""

    requests: list[RequestMetrics]
    steps: list[StepRecord]
    duration_s: float
    wall_s: float
    outputs: dict[int, np.ndarray] | None = None  # collect_outputs: id -> [cache_len, hidden] last layer's x

    def summary(self) -> dict:
        done = [r for r in self.requests if r.finished]
        dur = self.duration_s if self.duration_s > 0 else math.nan
        out_tokens = sum(r.output_tokens for r in self.requests)
        in_tokens = sum(r.input_len for r in done)
        routes: dict[str, int] = {}
        for s in self.steps:
            routes[s.branch] = routes.get(s.branch, 0) + 1
        return {
            "completed": len(done), "num_requests": len(self.requests), "steps": len(self.steps),
            "duration_s": self.duration_s, "wall_s": self.wall_s,
            "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
            "request_throughput": len(done) / dur, "output_throughput": out_tokens / dur,
            "total_token_throughput": (in_tokens + out_tokens) / dur,
            **_stats_ms([r.ttft_s for r in done], "ttft"), **_stats_ms([r.tpot_s for r in done], "tpot"),
            **_stats_ms([s.duration_s for s in self.steps], "step"),
            "steps_by_route": routes, "steps_with_scoring": sum(s.has_indexer_scoring for s in self.steps),
            "new_programs": sum(s.new_programs for s in self.steps),
        }

    def to_json(self) -> dict:
        return {"summary": self.summary(), "requests": [r.to_json() for r in self.requests],
                "steps": [{**dataclasses.asdict(s), "plan": str(s.plan)} for s in self.steps]}


# ------------------------------------------------------------------------------------------------
# engine
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """Scheduling and program options. Any of them can be overridden per run (Engine.run(**kw)).

    max_num_batched_tokens: token budget of one step (decode tokens + prefill chunk tokens).
    max_num_seqs: most requests running (holding pages and being scheduled) at once.
    skip_indexer, force_sparse, buckets, dispatch: passed to plan_batch; kernels: to jit_forward.
    """

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    skip_indexer: bool = True
    force_sparse: bool = False
    dispatch: str = "static"
    kernels: str = "auto"
    buckets: BucketPolicy = BucketPolicy()

    def __post_init__(self):
        def put(name, value):
            object.__setattr__(self, name, value)

        for name in ("max_num_batched_tokens", "max_num_seqs"):
            put(name, _int(getattr(self, name), name, 1))
        for name in ("skip_indexer", "force_sparse"):
            put(name, _bool(getattr(self, name), name))
        if not isinstance(self.dispatch, str) or self.dispatch not in DISPATCH_MODES:
            raise ValueError(f"dispatch must be one of {DISPATCH_MODES}, got {self.dispatch!r}")
        if not isinstance(self.kernels, str) or self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {self.kernels!r}")
        if not isinstance(self.buckets, BucketPolicy):
            raise ValueError(f"buckets must be a BucketPolicy, got {type(self.buckets).__name__}")

    def with_overrides(self, overrides: dict) -> EngineOptions:
        """These options with `overrides` (EngineOptions fields, checked); ValueError naming an unknown one."""
        names = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(overrides) - set(names))
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}: EngineOptions has {names}")
        return dataclasses.replace(self, **overrides)

    def plan_kwargs(self) -> dict:
        return dict(skip_indexer=self.skip_indexer, force_sparse=self.force_sparse, buckets=self.buckets,
                    dispatch=self.dispatch)


@dataclasses.dataclass
class _Running:
    spec: RequestSpec
    pages: list[int]
    token_rows: np.ndarray  # [cache_len] pool row of each token this request feeds
    metrics: RequestMetrics
    computed: int = 0  # tokens in the cache

    @property
    def prefilling(self) -> bool:
        return self.computed < self.spec.input_len


@jax.jit
def _gather_rows(pool, rows):
    """pool [P + 1, hidden] (last row zeros), rows [T] int32 -> [T, hidden]."""
    return pool[rows]


class Engine:
    """N sparse-MLA layers with their paged caches, served by a continuous-batching loop.

    params: list of N per-layer param dicts (default: init_params with keys fold_in(seed, layer)).
    caches: one PagedCache of num_pages pages per layer (donated and replaced every step).
    pool: [pool_size + 1, hidden_size] seeded random token hidden states (the last row is zeros,
      used for padding rows).
    """

    def __init__(self, config: MLAConfig, *, num_layers: int = 2, num_pages: int = 1024, seed: int = 0,
                 pool_size: int = 4096, params: Sequence[dict] | None = None, **options):
        if not isinstance(config, MLAConfig):
            raise ValueError(f"config must be an MLAConfig, got {type(config).__name__}")
        num_layers = _int(num_layers, "num_layers", 1)
        num_pages, pool_size = _int(num_pages, "num_pages", 1), _int(pool_size, "pool_size", 1)
        if num_pages * config.page_size - 1 > INT32_MAX:
            raise ValueError(f"num_pages = {num_pages} pages of {config.page_size} tokens: slot numbers would "
                             "overflow int32")
        if not _is_int(seed) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        self.config, self.num_pages, self.seed, self.pool_size = config, num_pages, int(seed), pool_size
        self.options = EngineOptions().with_overrides(options)
        key = jax.random.key(seed)
        if params is None:
            params = [init_params(config, jax.random.fold_in(key, layer)) for layer in range(num_layers)]
        elif len(params) != num_layers:
            raise ValueError(f"got {len(params)} layers of params for num_layers={num_layers}")
        self.params = list(params)
        self.caches = [init_cache(config, num_pages) for _ in range(num_layers)]
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
    def _forward(self, plan, meta, x, kernels: str):
        """x [plan.num_tokens, hidden] through every layer (residual) -> x, caches updated."""
        for layer, params in enumerate(self.params):
            out, self.caches[layer] = jit_forward(params, x, self.caches[layer], meta, plan=plan,
                                                  config=self.config, kernels=kernels)
            x = x + out
        return x

    def compile_batches(self, batches: Iterable[Sequence[Request]], **overrides) -> int:
        """Compiles the program of each batch's plan (once per distinct plan, with the step's
        gather and residual adds) by running it through the layers on zero hidden states. Writes
        junk into the cache slots named by the batches' block tables: harmless, a request writes
        every slot before reading it. Returns the number of executables jit_forward compiled."""
        opts = self.options.with_overrides(overrides)
        before, seen = jit_forward._cache_size(), set()
        for requests in batches:
            plan, meta = plan_batch(self.config, list(requests), num_pages=self.num_pages, **opts.plan_kwargs())
            if plan in seen:
                continue
            seen.add(plan)
            rows = jnp.full((plan.num_tokens,), self.pool_size, jnp.int32)  # the zero row
            self._forward(plan, meta, _gather_rows(self.pool, rows), opts.kernels).block_until_ready()
        return jit_forward._cache_size() - before

    def forward_batch(self, requests: Sequence[Request], **overrides):
        """One batch through the layer stack outside the scheduler (benchmarks: time it, repeat it;
        a repeat rewrites the same slots with the same values). Token hidden states are pool rows
        picked by position. Returns (x [plan.num_tokens, hidden] after the last layer, plan)."""
        opts = self.options.with_overrides(overrides)
        plan, meta = plan_batch(self.config, list(requests), num_pages=self.num_pages, **opts.plan_kwargs())
        rows = np.full(plan.num_tokens, self.pool_size, np.int32)
        n = sum(r.query_len for r in requests)
        rows[:n] = np.arange(n) % self.pool_size
        return self._forward(plan, meta, _gather_rows(self.pool, jnp.asarray(rows)), opts.kernels), plan

    def warmup(self, workload: Workload | Sequence[RequestSpec], **overrides) -> int:
        """Compiles every program a run of this workload will need: a dry run of the scheduler
        (no device work, zero step times) collects the batches, then compile_batches. Exact when
        arrivals do not depend on timing (request_rate=inf); otherwise best effort."""
        batches: list[list[Request]] = []
        self.run(workload, progress=False, _dry_run=batches, **overrides)
        return self.compile_batches(batches, **overrides)

    # ---- the loop -------------------------------------------------------------------------
    def run(self, workload: Workload | Sequence[RequestSpec], *, max_steps: int | None = None,
            progress: bool = True, collect_outputs: bool = False, desc: str = "serving",
            _dry_run: list | None = None, **overrides) -> ServeResult:
        """Serves a workload to completion (or max_steps) and returns its metrics.

        overrides: EngineOptions fields for this run (e.g. skip_indexer=False).
        collect_outputs: keep each request's last-layer x rows ([cache_len, hidden] float32 in
          token order; costs a device->host copy per step).
        Raises PoolTooSmallError when a request can never fit the cache.
        """
        opts = self.options.with_overrides(overrides)
        if max_steps is not None:
            max_steps = _int(max_steps, "max_steps (or None)", 0)
        progress, collect_outputs = _bool(progress, "progress"), _bool(collect_outputs, "collect_outputs")
        concurrency = workload.concurrency if isinstance(workload, Workload) else None
        specs = workload.requests() if isinstance(workload, Workload) else _specs(workload)
        page = self.config.page_size
        for s in specs:  # fail before any work
            if s.cache_len > self.config.max_position_embeddings:
                raise ValueError(f"request {s.id}: input_len + output_len - 1 = {s.cache_len} tokens exceeds "
                                 f"max_position_embeddings = {self.config.max_position_embeddings}")
            if -(-s.cache_len // page) > self.num_pages:
                raise PoolTooSmallError(f"request {s.id} ({s.input_len} in + {s.output_len} out) needs "
                                        f"{-(-s.cache_len // page)} pages of {page} tokens, the cache has "
                                        f"{self.num_pages}")
        dry = _dry_run is not None
        pending = deque(sorted(specs, key=lambda s: (s.arrival_s, s.id)))
        waiting: deque[RequestMetrics] = deque()
        by_id = {s.id: s for s in specs}
        running: list[_Running] = []
        allocator = PageAllocator(self.num_pages)
        metrics: list[RequestMetrics] = []
        steps: list[StepRecord] = []
        outputs = {} if collect_outputs else None
        clock, wall0 = 0.0, time.perf_counter()
        bar = _progress_bar(progress and not dry, max_steps, desc)
        try:
            while pending or waiting or running:
                if max_steps is not None and len(steps) >= max_steps:
                    break
                # client: send what has arrived, under the concurrency cap
                if not waiting and not running and pending and pending[0].arrival_s > clock:
                    clock = pending[0].arrival_s  # idle: jump to the next arrival
                while pending and pending[0].arrival_s <= clock and (
                        concurrency is None or len(waiting) + len(running) < concurrency):
                    s = pending.popleft()
                    m = RequestMetrics(s.id, s.input_len, s.output_len, arrival_s=clock)
                    metrics.append(m)
                    waiting.append(m)
                t0 = time.perf_counter()
                work = self._schedule(running, waiting, allocator, by_id, opts)
                if not work:
                    raise RuntimeError("scheduler made no progress (this is a bug)")
                requests = [Request(r.computed, n, r.pages) for r, n in work]
                plan, meta = plan_batch(self.config, requests, num_pages=self.num_pages, **opts.plan_kwargs())
                n_real = sum(n for _, n in work)
                before = 0 if dry else jit_forward._cache_size()
                if dry:
                    _dry_run.append(requests)
                    t_fwd = t1 = t0
                else:
                    rows = np.full(plan.num_tokens, self.pool_size, np.int32)
                    rows[:n_real] = np.concatenate([r.token_rows[r.computed:r.computed + n] for r, n in work])
                    t_fwd = time.perf_counter()
                    x = self._forward(plan, meta, _gather_rows(self.pool, jnp.asarray(rows)), opts.kernels)
                    x.block_until_ready()
                    t1 = time.perf_counter()
                    if collect_outputs:
                        host = np.asarray(x.astype(jnp.float32))
                        row = 0
                        for r, n in work:
                            outputs.setdefault(r.spec.id, []).append(host[row:row + n])
                            row += n
                clock += t1 - t0
                n_dec = sum(1 for r, n in work if not r.prefilling)
                steps.append(StepRecord(
                    index=len(steps), start_s=clock - (t1 - t0), duration_s=t1 - t0, forward_s=t1 - t_fwd,
                    route=plan.route, branch=_branch(plan, meta), has_indexer_scoring=bool(plan.has_indexer_scoring),
                    num_scored_tokens=plan.num_scored_tokens, num_tokens=n_real,
                    padded_tokens=plan.num_tokens, num_decodes=n_dec, num_prefills=len(work) - n_dec,
                    prefill_tokens=sum(n for r, n in work if r.prefilling),
                    new_programs=0 if dry else jit_forward._cache_size() - before, plan=plan))
                for r, n in work:  # advance; a finished prefill or a decode yields one output token
                    r.computed += n
                    if not r.prefilling:
                        r.metrics.token_times_s.append(clock)
                    if r.metrics.finished:
                        allocator.free(r.pages)
                        running.remove(r)
                bar.update(1)
                if len(steps) % 16 == 0:
                    bar.set_postfix(done=sum(m.finished for m in metrics), running=len(running), refresh=False)
        finally:
            bar.close()
        if outputs is not None:
            outputs = {k: np.concatenate(v) for k, v in outputs.items()}
        return ServeResult(requests=sorted(metrics, key=lambda m: m.id), steps=steps, duration_s=clock,
                           wall_s=time.perf_counter() - wall0, outputs=outputs)

    def _schedule(self, running: list[_Running], waiting: deque, allocator: PageAllocator, by_id: dict,
                  opts: EngineOptions) -> list[tuple[_Running, int]]:
        """vLLM's policy: one token per running decode, then prefill chunks of running requests
        (admission order), then newly admitted requests, all within the token budget."""
        budget = opts.max_num_batched_tokens
        work = []
        for r in running:
            if not r.prefilling and budget > 0:
                work.append((r, 1))
                budget -= 1
        for r in running:
            if r.prefilling and budget > 0:
                n = min(r.spec.input_len - r.computed, budget)
                work.append((r, n))
                budget -= n
        while waiting and budget > 0 and len(running) < opts.max_num_seqs:
            m = waiting[0]
            spec = by_id[m.id]
            pages = allocator.allocate(-(-spec.cache_len // self.config.page_size))
            if pages is None:  # wait for a running request to free its pages
                if not running:
                    raise PoolTooSmallError(f"request {spec.id} does not fit an empty cache")  # unreachable
                break
            waiting.popleft()
            r = _Running(spec, pages, self.token_rows(spec), m)
            running.append(r)
            n = min(spec.input_len, budget)
            work.append((r, n))
            budget -= n
        return work


def _specs(workload) -> list[RequestSpec]:
    """A sequence of RequestSpecs as a list; ValueError for another entry or a repeated id."""
    if isinstance(workload, (str, bytes)) or not isinstance(workload, Iterable):
        raise ValueError(f"workload must be a Workload or a sequence of RequestSpecs, got {type(workload).__name__}")
    specs, seen = list(workload), {}
    for k, s in enumerate(specs):
        if not isinstance(s, RequestSpec):
            raise ValueError(f"workload entry {k}: expected a RequestSpec, got {type(s).__name__}")
        if s.id in seen:
            raise ValueError(f"request {s.id}: the id is used twice (workload entries {seen[s.id]} and {k}); "
                             "request ids must be unique")
        seen[s.id] = k
    return specs


def _branch(plan, meta) -> str:
    if plan.route != "cond":
        return plan.route
    return "dense" if int(np.asarray(meta.dense_flag)) else "sparse"


def _progress_bar(enabled: bool, total: int | None, desc: str):
    if not enabled:
        return _NoBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is a dependency, but the loop does not need it
        return _NoBar()
    return tqdm(total=total, desc=desc, unit="step", leave=False)


class _NoBar:
    def update(self, n=1):
        pass

    def set_postfix(self, **kw):
        pass

    def close(self):
        pass


def reference_outputs(engine: Engine, spec: RequestSpec) -> tuple[np.ndarray, np.ndarray]:
    """The oracle for one request served alone: its tokens through every layer of
    `reference.sequence_forward` with the residual. Returns (x [cache_len, hidden] float32 after the
    last layer, ambiguous [cache_len] bool: a row whose top-k set hinged on a near-tie in any layer)."""
    from . import reference
    x = engine.token_hidden(spec)
    ambiguous = np.zeros(len(x), bool)
    for params in engine.params:
        out, amb = reference.sequence_forward(params, x, engine.config)
        x, ambiguous = x + out, ambiguous | amb
    return x, ambiguous
