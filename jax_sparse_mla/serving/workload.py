"""Workloads: vLLM's random dataset (`Workload`) of `RequestSpec`s."""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable

import numpy as np

from ..validate import INT32_MAX, as_int, as_real, is_int


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
        if not is_int(self.id) or not 0 <= self.id <= INT32_MAX:  # (it seeds the request's tokens)
            raise ValueError(f"request id must be an integer in [0, 2**31), got {self.id!r}")
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (numpy -> Python)
        put("id", int(self.id))
        put("input_len", as_int(self.input_len, f"request {self.id}: input_len", 1))
        put("output_len", as_int(self.output_len, f"request {self.id}: output_len", 1))
        if self.cache_len > INT32_MAX:
            raise ValueError(f"request {self.id}: input_len + output_len - 1 = {self.cache_len} must be < 2**31")
        arrival = as_real(self.arrival_s, f"request {self.id}: arrival_s")
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
            put(name, as_int(getattr(self, name), name, 1))
        for name in ("input_range_ratio", "output_range_ratio"):
            value = as_real(getattr(self, name), name)
            if not 0 <= value < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
            put(name, value)
        if self.concurrency is not None:
            put("concurrency", as_int(self.concurrency, "concurrency (or None)", 1))
        rate = as_real(self.request_rate, "request_rate")
        if not rate > 0:  # (NaN too)
            raise ValueError(f"request_rate must be > 0 (inf: all at once), got {self.request_rate}")
        put("request_rate", rate)
        if not is_int(self.seed) or self.seed < 0:
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


def specs_of(workload) -> list[RequestSpec]:
    """A Workload's requests, or a sequence of RequestSpecs as a list (ValueError for another
    entry or a repeated id)."""
    if isinstance(workload, Workload):
        return workload.requests()
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

