"""Serving metrics: per-request (`RequestMetrics`), per-step (`StepRecord`) and per-run (`ServeResult`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np


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

    Steps are pipelined (Engine.run): step N + 1 is scheduled, planned and dispatched while step N
    runs on the device. start_s / duration_s: on the run's clock, from the end of the previous step
    (or the arrival that ended an idle gap) to this step's output being ready; the steps tile the
    run. forward_s: from the step's dispatch to ready. host_s: the host's time for this step
    (scheduling, planning, the one dispatch of every layer), mostly hidden behind the previous step;
    plan_s: its scheduling and planning part; launch_s: its dispatch part (packing the step's
    input and the call of its executable: a program without conditionals returns once its kernels
    are launched, runs of them as CUDA graphs (model.compiler_options); XLA's GPU conditional
    makes the call wait until the device reaches it). device_s: from when the device could start the step
    (its dispatch began and the previous step had ended) to ready, an estimate of its GPU time
    that is exact when the host keeps ahead of the device. route: plan.route
    ("dense" / "sparse" / "cond"); branch: the program that ran ("dense" / "sparse": for a cond
    plan, whether meta.branches ran its dense MHA call). num_tokens: real rows; padded_tokens: plan.num_tokens.
    new_programs: executables of the engine's step program (serving.engine.jit_layer_stack) added
    during this step (0 after a warm-up that covered its plan). plan: the step's BatchPlan.
    dispatch_steps: 1, or the steps of the decode run this step is one of (EngineOptions.decode_steps):
    the run's times (from its scheduling to its output) divided evenly among its steps, its
    new_programs on its first.
    """

    index: int
    start_s: float
    duration_s: float
    forward_s: float
    host_s: float
    plan_s: float
    launch_s: float
    device_s: float
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
    dispatch_steps: int = 1


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
            **_stats_ms([s.host_s for s in self.steps], "host"), **_stats_ms([s.plan_s for s in self.steps], "plan"),
            **_stats_ms([s.launch_s for s in self.steps], "launch"),
            **_stats_ms([s.device_s for s in self.steps], "device"),
            "host_share": (sum(s.host_s for s in self.steps) / dur) if self.steps else None,
            "steps_by_route": routes, "steps_with_scoring": sum(s.has_indexer_scoring for s in self.steps),
            "new_programs": sum(s.new_programs for s in self.steps),
        }

    def to_json(self) -> dict:
        return {"summary": self.summary(), "requests": [r.to_json() for r in self.requests],
                "steps": [{**dataclasses.asdict(s), "plan": str(s.plan)} for s in self.steps]}

