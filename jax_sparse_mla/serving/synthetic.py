"""Synthetic sequences served step by step and checked against the reference.

The demo and the tests both use `Harness`: it owns random params, a paged cache and pages from
the harness's one allocator (allocator.PageAllocator, in a seeded shuffled order), runs steps of
caller-chosen (sequence, new tokens) work through plan_batch + jit_forward (one layer, no
scheduler: the scheduling loop is engine.Engine.run), and compares each step's rows with
`reference.sequence_forward` of the whole sequence so far.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from .. import reference
from ..cache import init_cache
from ..model import jit_forward
from ..params import init_params
from ..plan import Request, plan_batch
from .allocator import PageAllocator


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


class Harness:
    """Sequences with known hidden states [length, hidden_size], served in steps."""

    def __init__(self, config, *, num_pages=64, seed=0, kernels="auto"):
        self.config, self.num_pages, self.kernels = config, num_pages, kernels
        self.params = init_params(config, jax.random.key(seed))
        self.cache = init_cache(config, num_pages)
        self.rng = np.random.default_rng(seed)
        self.allocator = PageAllocator(num_pages, order=self.rng.permutation(num_pages))  # tables not contiguous
        self.hidden, self.done, self.tables = {}, {}, {}

    def add(self, seq_id, length):
        """A new sequence of `length` random hidden states, with its pages allocated."""
        self.hidden[seq_id] = self.rng.standard_normal((length, self.config.hidden_size)).astype(np.float32)
        self.done[seq_id] = 0
        pages = -(-length // self.config.page_size)
        table = self.allocator.allocate(pages)
        if table is None:
            raise ValueError(f"sequence {seq_id} needs {pages} pages, {self.allocator.num_free} are free")
        self.tables[seq_id] = table

    def step(self, work, *, timed=False, **plan_options):
        """Runs one step of work [(seq_id, n_new)].

        Returns ({seq_id: out rows [n_new, hidden]}, plan, timing). timing (None unless timed) is
        (first call ms, compilation included; median ms of 5 re-runs). A re-run writes the same
        values to the same slots, so it leaves the cache as it was.
        """
        reqs, rows = [], []
        for sid, n in work:
            start = self.done[sid]
            if start + n > len(self.hidden[sid]):
                raise ValueError(f"sequence {sid} has only {len(self.hidden[sid])} tokens")
            reqs.append(Request(start, n, self.tables[sid]))
            rows.append(self.hidden[sid][start:start + n])
        rows = np.concatenate(rows)
        plan, meta = plan_batch(self.config, reqs, num_pages=self.num_pages, **plan_options)
        x = self.rng.standard_normal((plan.num_tokens, self.config.hidden_size)).astype(np.float32)
        x[: len(rows)] = rows  # padding rows hold junk: they must not matter
        x = jnp.asarray(x, self.config.jnp_dtype)
        run = functools.partial(jit_forward, self.params, x, meta=meta, plan=plan, config=self.config,
                                kernels=self.kernels)
        t0 = time.perf_counter()
        out, self.cache = run(cache=self.cache)
        out.block_until_ready()
        first_ms = 1e3 * (time.perf_counter() - t0)
        timing = None
        if timed:
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                out, self.cache = run(cache=self.cache)
                out.block_until_ready()
                times.append(1e3 * (time.perf_counter() - t0))
            timing = (first_ms, float(np.median(times)))
        out = np.asarray(out.astype(jnp.float32))
        if np.any(out[len(rows):] != 0):
            raise AssertionError("padding rows must give 0")
        result, row = {}, 0
        for sid, n in work:
            result[sid] = out[row:row + n]
            self.done[sid] += n
            row += n
        return result, plan, timing

    @functools.cache
    def reference(self, seq_id, length, dense=False):
        """(out [length, hidden], ambiguous [length]) of the first `length` tokens of a sequence."""
        return reference.sequence_forward(self.params, self.hidden[seq_id][:length], self.config, dense=dense)

    def errors(self, result) -> dict:
        """{seq_id: relative error of this step's rows against the reference}.

        Rows whose reference top-k set hinges on a near-tie (reference.TIE_TOLERANCE) are left
        out: at working precision either set is correct. A sequence whose rows are all left out
        has no entry.
        """
        errs = {}
        for sid, out in result.items():
            end = self.done[sid]
            ref, ambiguous = self.reference(sid, end)
            rows = slice(end - len(out), end)
            decided = ~ambiguous[rows]
            if decided.any():  # a step of one tied decode row has nothing to compare
                errs[sid] = rel_err(out[decided], ref[rows][decided])
        return errs

    def check(self, result, tol):
        for sid, err in self.errors(result).items():
            assert err < tol, f"sequence {sid}: rel err {err:.2e} >= {tol}"
