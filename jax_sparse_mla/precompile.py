"""Bounded warm-up: every program a serving loop can need, enumerated and compiled ahead of time.

A serving loop compiles one `jit_forward` executable per distinct BatchPlan. Under a BucketPolicy
and a loop's limits (max_num_seqs, max_num_batched_tokens, max_model_len, num_pages) the plans
form a bounded set: `enumerate_plans` lists it (a superset of the plans plan_batch makes for
batches within the limits, exactly that set for a bf16 cache at small limits; not covered:
requests sharing prefix pages), `count_programs` counts it per route (no compile), and
`precompile` compiles each plan ahead of time. A dispatch="cond" plan's sizes are its shape
buckets only: under BucketPolicy.for_limits (the Engine's default) up to three plans per row
bucket (its stage sets: the dense call, the sparse stages, both).

`precompile(method=...)`: "call" (the default) runs each program once on zero-filled inputs
(nothing left for the first real call of jit_forward), "aot" lowers and compiles each plan on
ShapeDtypeStructs in worker threads and returns the compiled executables, loading them from and
writing them to an executable store (`store=`, executables.ExecutableStore) when given. A caller
with its own program over the plans (the serving Engine's one program for all its layers)
passes `program`.

Why: one program takes 6-15 s to compile at real dimensions on an H200, too long to meet in a
serving step, and lowering its Mosaic GPU kernels is seconds of Python that only a store skips
on a restart. How the enumeration bounds each size, and what AOT relies on (every kernel lowers
to the same module every time: pallas_kernels.compat): docs/design/dispatch.md ("Warm-up").
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import os
import threading
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from . import kernels as kernel_ops
from . import policy
from .cache import init_cache
from .config import MLAConfig, check_config_type
from .executables import ExecutableStore, program_name
from .model import jit_forward
from .params import init_params
from .plan import (MASKED, BatchMeta, BatchPlan, BucketPolicy, Dispatch, PlanConfig, check_options, cond_plan,
                   key_ladder)
from .progress import progress_bar
from .validate import as_int


def _values(hi: int, minimum: int, lo: int = 1) -> list[int]:
    """The bucket values BucketPolicy.round_up(x, minimum) takes for x in [lo, hi] (ascending)."""
    if hi < lo:
        return []
    out, v = [], BucketPolicy.round_up(lo, minimum)
    while True:
        out.append(v)
        if v >= BucketPolicy.round_up(hi, minimum):
            return out
        v = BucketPolicy.round_up(max(v, 1) + 1, minimum)


def _interval(v: int, minimum: int) -> tuple[int, int]:
    """The raw values x >= 1 with round_up(x, minimum) == v: [lo, hi]."""
    if v == BucketPolicy.round_up(1, minimum):
        hi = 1
        while BucketPolicy.round_up(hi * 2, minimum) == v:
            hi *= 2
        return 1, hi
    return v // 2 + 1, v


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def enumerate_plans(config: MLAConfig, buckets: BucketPolicy = BucketPolicy(), *, num_pages: int,
                    max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int | None = None,
                    dispatch: Dispatch = "static", skip_indexer: bool = True, force_sparse: bool = False,
                    tensor_parallel: int = 1, prefill_route: policy.PrefillRoute = "auto") -> list[BatchPlan]:
    """Every BatchPlan plan_batch(config, batch, num_pages=num_pages, buckets=buckets, dispatch=...,
    skip_indexer=..., force_sparse=..., tensor_parallel=..., prefill_route=...) can return for a batch of at most
    max_num_seqs requests, at most max_num_batched_tokens new tokens, each request at most
    max_model_len tokens long (context + new) and all holding at most num_pages pages (a superset:
    see the module docstring). Sorted by (route, sizes). The options plan_batch takes too are
    checked as it checks them (plan.check_options; num_pages is required here), the limits as
    positive integers: ValueError naming the argument."""
    if num_pages is None:
        raise ValueError("num_pages must be a positive int (the cache's page count bounds the plans), got None")
    P = check_options(config, num_pages, force_sparse, skip_indexer, buckets, dispatch, tensor_parallel,
                      prefill_route)
    skip_indexer, force_sparse, tp = bool(skip_indexer), bool(force_sparse), int(tensor_parallel)
    S_max = as_int(max_num_seqs, "max_num_seqs", 1)
    B = as_int(max_num_batched_tokens, "max_num_batched_tokens", 1)
    L = config.max_position_embeddings
    if max_model_len is not None:
        L = min(L, as_int(max_model_len, "max_model_len", 1))
    ps, K, bp = config.page_size, config.index_topk, buckets
    n_max = min(S_max, B, P)  # each request has >= 1 row and >= 1 page
    m_max = min(_cdiv(L, ps), P)  # a request's pages
    dense_m_max = min(_cdiv(min(K, L), ps), P)  # a dense request has <= index_topk tokens
    long_ok = L > K  # a scored prefill (more than one row) needs total_len > index_topk
    sparse_long = long_ok and (force_sparse or prefill_route != "masked")  # one that may attend sparsely
    common = dict(num_pages=P, config=PlanConfig.of(config), tensor_parallel=tp)
    heads = config.num_attention_heads // tp

    T_vals = _values(B, bp.min_tokens)
    S_vals = _values(n_max, bp.min_seqs)
    W_vals = _values(m_max, bp.min_pages_per_seq)
    plans: set[BatchPlan] = set()

    def clip(v, minimum, hi):
        lo, top = _interval(v, minimum)
        return lo, min(top, hi)

    for T, S in itertools.product(T_vals, S_vals):
        qlo, qhi = clip(T, bp.min_tokens, B)
        nlo, nhi = clip(S, bp.min_seqs, n_max)
        if nlo > qhi or nlo > nhi or qlo > qhi:
            continue
        if dispatch == "cond":
            # the stage sets a batch of the bucket may need: (dense call, sparse stages)
            decodes = max(nlo, qlo) <= min(nhi, qhi) and L >= 2
            # a prefill attending sparsely: forced, a long one routed so, or any past the largest dense key size
            long_sparse = force_sparse or (long_ok and prefill_route != "masked") or L > key_ladder(T)[-1]
            stage_sets = [(False, True)] if decodes or (long_sparse and qlo <= nhi * L) else []
            if not force_sparse:
                if qlo <= nhi * min(K, L):  # short prefills only
                    stage_sets.append((True, False))
                if qhi >= 2 and (nhi >= 2 or (long_ok and prefill_route != "sparse")):  # both, or a masked prefill
                    stage_sets.append((True, True))
            for W in W_vals:
                wlo, whi = clip(W, bp.min_pages_per_seq, m_max)
                if wlo > whi or nlo - 1 + wlo > P or qlo > nhi * min(L, whi * ps):
                    continue
                for dense, sparse in stage_sets:
                    plans.add(cond_plan(config, T, S, W, num_pages=P, skip_indexer=skip_indexer, dense=dense,
                                        sparse=sparse, prefill_route=prefill_route, tensor_parallel=tp))
            continue
        # the sparse program: no dense request (decodes; prefills longer than index_topk, or any with force_sparse)
        # rows == requests: every request a decode (or, forced, a one-token first prefill)
        all_decodes = max(nlo, qlo) <= min(nhi, qhi) and (force_sparse or L >= 2)
        if force_sparse or all_decodes or sparse_long:
            prefill_needed = not all_decodes  # more rows than requests: some request is a prefill
            if not (prefill_needed and not force_sparse and not sparse_long) and qlo <= nhi * L:
                m_lo = 1 if (force_sparse or not prefill_needed) else _cdiv(K + 1, ps)
                for W in W_vals:
                    wlo, whi = clip(W, bp.min_pages_per_seq, m_max)
                    # each request's rows <= its tokens <= the widest request's pages
                    if whi < m_lo or wlo > whi or nlo - 1 + wlo > P or qlo > nhi * min(L, whi * ps):
                        continue
                    base = BatchPlan(num_tokens=T, num_seqs=S, pages_per_seq=W, use_dense_mha=False,
                                     num_sparse_tokens=0, num_dense_keys=0, skip_indexer=True, **common)
                    plans.update(_with_splits(base, config, bp, heads, rows=qhi, nhi=nhi, P=P,
                                              prefill_pages_lo=1 if force_sparse else _cdiv(K + 1, ps),
                                              prefills_ok=force_sparse or sparse_long))
        if force_sparse:
            continue
        if prefill_route != "sparse" and long_ok:
            plans.update(_masked_plans(config, bp, heads, T, S, qlo, qhi, nhi, nlo, L, P, m_max, W_vals,
                                       skip_indexer=skip_indexer, splits=prefill_route == "auto", common=common))
        # the dense program: >= 1 dense request (a prefill of <= index_topk tokens, rows <= keys)
        for NS in [0] + _values(qhi - 1, 1):
            if NS:
                slo, shi = _interval(NS, 1)
                shi = min(shi, qhi - 1)
                if slo > shi or nhi < 2:
                    continue
                if slo > (nhi - 1) * L:
                    continue
                if slo > nhi - 1 and not sparse_long:  # more sparse rows than sparse requests: a long prefill
                    continue
                nd_hi = nhi - 1
                qd_lo = max(1, qlo - shi)
                if qd_lo > nd_hi * K:
                    continue
            else:
                nd_hi, qd_lo = nhi, max(qlo, nlo)
            k_hi = min(nd_hi * min(K, L), P * ps)
            for DK in _values(k_hi, bp.min_dense_keys, lo=qd_lo):
                klo, khi = _interval(DK, bp.min_dense_keys)
                khi = min(khi, k_hi)
                if max(klo, qd_lo) > khi or _cdiv(max(klo, qd_lo), ps) + (1 if NS else 0) > P:
                    continue
                w_hi = m_max if NS else dense_m_max
                # more sparse rows than sparse requests: a long prefill, > index_topk tokens
                w_lo = _cdiv(K + 1, ps) if NS and slo > nhi - 1 else 1
                for W in W_vals:
                    wlo, whi = clip(W, bp.min_pages_per_seq, w_hi)
                    if max(wlo, w_lo) > whi or qlo > nhi * min(L, whi * ps):
                        continue
                    # a dense request's keys: <= min(index_topk, the widest request's pages); with no
                    # sparse request, the widest request is dense
                    k_lo = max(klo, qd_lo, (wlo - 1) * ps + 1 if not NS else 1)
                    if k_lo > min(khi, nd_hi * min(K, L, whi * ps)):
                        continue
                    base = BatchPlan(num_tokens=T, num_seqs=S, pages_per_seq=W, use_dense_mha=True,
                                     num_sparse_tokens=NS, num_dense_keys=DK, skip_indexer=skip_indexer, **common)
                    if NS:
                        plans.update(_with_splits(base, config, bp, heads, rows=shi, nhi=nhi - 1, P=P - 1,
                                                  prefill_pages_lo=_cdiv(K + 1, ps), prefills_ok=sparse_long))
                    else:
                        plans.add(base)
    order = {"dense": 0, "sparse": 1, "cond": 2}
    return sorted(plans, key=lambda p: (order[p.route], MASKED.index(p.masked), p.num_tokens, p.num_seqs, p.pages_per_seq,
                                        p.num_sparse_tokens, p.num_dense_keys, p.num_upfront_rows,
                                        p.num_kernel_rows, p.num_upfront_pages))


def _masked_plans(config: MLAConfig, bp: BucketPolicy, heads: int, T: int, S: int, qlo: int, qhi: int, nhi: int,
                  nlo: int, L: int, P: int, m_max: int, W_vals: list[int], *, skip_indexer: bool, splits: bool,
                  common: dict) -> list[BatchPlan]:
    """The dense programs with masked rows (BatchPlan.masked) of the T, S buckets (rows
    [qlo, qhi], requests [nlo, nhi]): >= 1 masked prefill (> index_topk tokens, >= 2 rows: a
    one-row request with context is a decode), so >= 2 scored rows (NS) and > index_topk dense
    keys (DK) on its >= cdiv(index_topk + 1, page_size) pages, the widest request that long;
    the other rows are short prefills (<= index_topk rows each) or scored. A superset (see the
    module docstring): masked "all", and "some" (>= 1 more scored row, attending sparsely) with,
    given splits, the fp8 split's variants over the sparse prefills beside it."""
    ps, K = config.page_size, config.index_topk
    long_pages = _cdiv(K + 1, ps)
    out = []
    if qhi < 2 or long_pages > min(P, m_max):
        return out
    # "all": every request a masked or short prefill; "some": one at least attends sparsely
    for masked, others in (("all", nhi - 1), ("some", nhi - 2)):
        if others < 0:
            continue
        k_top = min((others + 1) * L, P * ps)  # the dense call's keys: the masked and short prefills'
        for NS in _values(qhi, 1, lo=2 if masked == "all" else 3):
            slo, shi = _interval(NS, 1)
            shi = min(shi, qhi)
            if max(slo, 2) > shi or qlo > shi + others * min(K, L):  # short prefills: <= index_topk rows
                continue
            for DK in _values(k_top, bp.min_dense_keys, lo=K + 1):
                klo, khi = _interval(DK, bp.min_dense_keys)
                if max(klo, K + 1) > min(khi, k_top) or _cdiv(max(klo, K + 1), ps) > P:
                    continue
                for W in W_vals:
                    wlo, whi = _interval(W, bp.min_pages_per_seq)
                    whi = min(whi, m_max)
                    if wlo > whi or whi < long_pages or nlo - 1 + max(wlo, long_pages) > P:
                        continue
                    base = BatchPlan(num_tokens=T, num_seqs=S, pages_per_seq=W, use_dense_mha=True,
                                     num_sparse_tokens=NS, num_dense_keys=DK, skip_indexer=skip_indexer,
                                     masked=masked, **common)
                    if masked == "all":
                        out.append(base)
                    else:
                        out += _with_splits(base, config, bp, heads, rows=shi - 2, nhi=nhi - 1, P=P - long_pages,
                                            prefill_pages_lo=long_pages, prefills_ok=splits)
    return out


def _with_splits(base: BatchPlan, config: MLAConfig, bp: BucketPolicy, heads: int, *, rows: int, nhi: int, P: int,
                 prefill_pages_lo: int, prefills_ok: bool) -> list[BatchPlan]:
    """base and, for an fp8 latent cache, its fp8-split variants (plan._upfront_split): upfront
    rows U (sparse prefill rows, >= 1), kernel rows (decodes, 0 or more), upfront pages (the
    prefills' pages), kept where policy.dequantize_route of the bucketed sizes says "upfront"."""
    out = [base]
    if config.kv_cache_dtype != "fp8" or not prefills_ok:
        return out
    for U in _values(rows, 1):
        ulo = _interval(U, 1)[0]
        for KR in [0] + _values(min(rows - ulo, nhi - 1), 1):
            krlo = _interval(KR, 1)[0] if KR else 0
            if ulo + krlo > rows or krlo + 1 > nhi:
                continue
            for PG in _values(P - krlo, bp.min_pages_per_seq, lo=prefill_pages_lo):
                if _interval(PG, bp.min_pages_per_seq)[0] + krlo > P:
                    continue
                if policy.dequantize_route(U, heads, config.index_topk, PG * config.page_size) != "upfront":
                    continue
                out.append(dataclasses.replace(base, num_upfront_rows=U, num_kernel_rows=KR, num_upfront_pages=PG))
    return out


def count_programs(config: MLAConfig, buckets: BucketPolicy = BucketPolicy(), *, num_pages: int,
                   max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int | None = None,
                   dispatch: Dispatch = "static", skip_indexer: bool = True, force_sparse: bool = False,
                   tensor_parallel: int = 1, prefill_route: policy.PrefillRoute = "auto") -> dict[str, int]:
    """{"total": n, route: n per route} of enumerate_plans with the same arguments (its docstring:
    the limits and options); compiles nothing. The limits are required: without them the set of
    plans is unbounded."""
    plans = enumerate_plans(config, buckets, num_pages=num_pages, max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                            dispatch=dispatch, skip_indexer=skip_indexer, force_sparse=force_sparse,
                            tensor_parallel=tensor_parallel, prefill_route=prefill_route)
    counts = collections.Counter(p.route for p in plans)
    return {"total": sum(counts.values()), **dict(sorted(counts.items()))}


@dataclasses.dataclass(frozen=True)
class PrecompileReport:
    """num_programs: plans compiled; compile_s: total wall time; per_route: programs per route;
    plans: the plans, in order; seconds: each plan's own time (tracing and lowering, then its
    compile or load; with workers > 1 compiles overlap, so they add up to more than compile_s);
    method: "call" or "aot"; executables: "aot": each plan's jax.stages.Compiled (same order as
    plans), () for "call"; loaded: how many of them came from the store (the rest compiled);
    cache_dir: the persistent compilation cache used (None: none)."""

    num_programs: int
    compile_s: float
    per_route: dict[str, int]
    plans: tuple[BatchPlan, ...]
    seconds: tuple[float, ...]
    method: str
    executables: tuple[jax.stages.Compiled, ...]
    loaded: int
    cache_dir: str | None

    @staticmethod
    def combine(reports: Sequence[PrecompileReport]) -> PrecompileReport:
        """One report of several precompile calls of one method run one after the other (an
        engine's step programs, then its decode runs'): counts and times added, plans,
        seconds and executables in order."""
        per_route = collections.Counter()
        for r in reports:
            per_route.update(r.per_route)
        first = reports[0]
        return PrecompileReport(num_programs=sum(r.num_programs for r in reports),
                                compile_s=sum(r.compile_s for r in reports), per_route=dict(sorted(per_route.items())),
                                plans=sum((r.plans for r in reports), ()), seconds=sum((r.seconds for r in reports), ()),
                                method=first.method, executables=sum((r.executables for r in reports), ()),
                                loaded=sum(r.loaded for r in reports), cache_dir=first.cache_dir)

    def __str__(self):
        routes = ", ".join(f"{k} {v}" for k, v in self.per_route.items())
        loaded = f", {self.loaded} loaded from the store" if self.loaded else ""
        return f"{self.num_programs} programs ({routes}) in {self.compile_s:.1f} s ({self.method}{loaded})"


def enable_persistent_cache(cache_dir: str | None, *, min_compile_time_s: float = 0.0,
                            min_entry_size_bytes: int = 0) -> None:
    """Points jax's persistent compilation cache at cache_dir (process-wide; None: off); the
    minimums default to 0 so that even small CPU programs are written (jax's defaults: 1 s, 0)."""
    jax.config.update("jax_compilation_cache_dir", None if cache_dir is None else str(cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", int(min_entry_size_bytes))
    try:  # jax initialises the cache once, on first use: re-point it if it was already set up
        from jax._src import compilation_cache
        compilation_cache.reset_cache()
    except Exception:  # noqa: BLE001 (a private helper; the config update alone is enough on first use)
        pass


def _abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


Program = tuple[Callable, tuple, dict]  # a jitted function, its positional arguments, its static keywords


def precompile(config: MLAConfig, buckets: BucketPolicy = BucketPolicy(), *, num_pages: int, max_num_seqs: int,
               max_num_batched_tokens: int, max_model_len: int | None = None, dispatch: Dispatch = "static",
               kernels: kernel_ops.Kernels = "auto", skip_indexer: bool = True, force_sparse: bool = False,
               prefill_route: policy.PrefillRoute = "auto", params=None, hidden_dtype=None, method: str = "call",
               cache_dir: str | None = None, min_compile_time_s: float = 0.0, min_entry_size_bytes: int = 0,
               store: str | os.PathLike | None = None, workers: int | None = None,
               plans: Sequence[BatchPlan] | None = None, program: Callable[[BatchPlan], Program] | None = None,
               progress: bool | None = None) -> PrecompileReport:
    """Compiles jit_forward (or the caller's `program`) for every plan of enumerate_plans (or
    `plans`) ahead of time.

    params: a param dict (arrays or ShapeDtypeStructs) whose shapes and dtypes the serving loop
      passes (default: init_params's). hidden_dtype: the dtype of hidden (default config's, as the
      Engine feeds).
    method: "call" (jit_forward run once a plan on zero-filled inputs, which fills jit's dispatch
      cache: the first real call neither traces nor compiles; allocates params and a cache of
      num_pages pages) or "aot" (each plan's program lowered on ShapeDtypeStructs and compiled,
      allocating nothing: report.executables holds the jax.stages.Compiled to call; calling
      jit_forward instead would trace and lower again).
    program: for "aot", program(plan) -> (jitted function, positional args, static keywords) to
      compile instead of jit_forward's (e.g. the Engine's one program over all its layers).
    store: for "aot", an executables.ExecutableStore directory: a plan's executable is loaded
      from it when present (no tracing, lowering or compiling) and written to it when compiled,
      so a restarted process loads every program. The program's function must be one defined at
      module level in this library (ValueError otherwise: a lambda's or closure's name does not
      tell its program apart).
    workers: for "aot", threads compiling programs while the next plans are traced and lowered
      (default: min(8, CPUs)); lowering is Python and runs one plan at a time.
    cache_dir: also write jax's persistent compilation cache there (enable_persistent_cache, with
      min_compile_time_s / min_entry_size_bytes), so another process loads instead of compiling
      (after tracing and lowering: a store skips those too).
    progress: a bar over the plans (None: only when stderr is a terminal, progress.show_progress).
    """
    check_config_type(config)
    if method not in ("aot", "call"):
        raise ValueError(f"method must be 'call' or 'aot', got {method!r}")
    if method == "call" and (store is not None or workers is not None or program is not None):
        raise ValueError("store, workers and program are for method='aot' (a \"call\" runs jit_forward once a plan)")
    workers = min(8, os.cpu_count() or 1) if workers is None else as_int(workers, "workers", 1)
    if plans is None:
        plans = enumerate_plans(config, buckets, num_pages=num_pages, max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                                dispatch=dispatch, skip_indexer=skip_indexer, force_sparse=force_sparse,
                                prefill_route=prefill_route)
    plans = tuple(plans)
    if cache_dir is not None:
        enable_persistent_cache(cache_dir, min_compile_time_s=min_compile_time_s,
                                min_entry_size_bytes=min_entry_size_bytes)
    hidden_dtype = config.jnp_dtype if hidden_dtype is None else jnp.dtype(hidden_dtype)
    if program is None:  # jit_forward's arguments
        if params is None:
            params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
        abstract_params = _abstract(params)
        abstract_cache = jax.eval_shape(lambda: init_cache(config, num_pages))
    t_all = time.perf_counter()
    bar = progress_bar(total=len(plans), progress=progress, desc="precompile", unit="program")
    try:
        if method == "call":
            zeros = lambda t: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), t)  # noqa: E731
            params_zero, cache = zeros(abstract_params), zeros(abstract_cache)
            seconds = []
            for plan in plans:
                t0 = time.perf_counter()
                meta = jax.tree.map(jnp.asarray, BatchMeta.empty(plan))  # every row padding: writes nowhere
                x = jnp.zeros((plan.num_tokens, config.hidden_size), hidden_dtype)
                out, cache = jit_forward(params_zero, x, cache, meta, plan=plan, config=config, kernels=kernels)
                out.block_until_ready()
                seconds.append(time.perf_counter() - t0)
                bar.update(1)
            executables, loaded = (), 0
        else:
            if program is None:
                def program(plan):
                    meta = BatchMeta(**{k: jax.ShapeDtypeStruct(s, jnp.int32)
                                        for k, s in BatchMeta.shapes(plan).items()})
                    x = jax.ShapeDtypeStruct((plan.num_tokens, config.hidden_size), hidden_dtype)
                    return jit_forward, (abstract_params, x, abstract_cache, meta), dict(plan=plan, config=config,
                                                                                          kernels=kernels)
            executables, seconds, loaded = _aot(plans, program, None if store is None else ExecutableStore(store),
                                                workers, bar)
    finally:
        bar.close()
    counts = collections.Counter(p.route for p in plans)
    return PrecompileReport(num_programs=len(plans), compile_s=time.perf_counter() - t_all,
                            per_route=dict(sorted(counts.items())), plans=plans, seconds=tuple(seconds),
                            method=method, executables=executables, loaded=loaded,
                            cache_dir=None if cache_dir is None else str(cache_dir))


def _aot(plans: tuple[BatchPlan, ...], program: Callable[[BatchPlan], Program], store: ExecutableStore | None,
         workers: int, bar) -> tuple[tuple[jax.stages.Compiled, ...], list[float], int]:
    """precompile's "aot": each plan's program loaded from the store, or traced and lowered here
    (one at a time: Python) and compiled by a pool of `workers` threads (XLA and the Mosaic GPU
    runtime compile outside the GIL), then written to the store. -> (executables, seconds, loaded)."""
    executables: list = [None] * len(plans)
    seconds = [0.0] * len(plans)
    loaded = 0
    bar_lock = threading.Lock()  # tqdm's counter is not thread-safe

    def done() -> None:
        with bar_lock:
            bar.update(1)

    def compile_(i: int, lowered: jax.stages.Lowered, key: str | None, lower_s: float) -> None:
        t0 = time.perf_counter()
        executables[i] = lowered.compile()
        if store is not None:
            store.save(key, executables[i])
        seconds[i] = lower_s + time.perf_counter() - t0
        done()

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = []
        try:
            for i, plan in enumerate(plans):
                t0 = time.perf_counter()
                fn, args, static = program(plan)
                key = None if store is None else store.key(program_name(fn), static, args)
                if key is not None and (compiled := store.load(key)) is not None:
                    executables[i], seconds[i] = compiled, time.perf_counter() - t0
                    loaded += 1
                    done()
                    continue
                lowered = fn.lower(*args, **static)
                futures.append(pool.submit(compile_, i, lowered, key, time.perf_counter() - t0))
        except BaseException:
            pool.shutdown(cancel_futures=True)  # a plan failed to lower: do not compile the rest first
            raise
        for f in futures:
            f.result()  # raises a compile's error here
    return tuple(executables), seconds, loaded
