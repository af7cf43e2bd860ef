"""A small serving harness for tests: sequences with known hidden states, run step by step
through plan_batch + jit_forward, and compared against the whole-sequence reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_sparse_mla import Request, init_cache, init_params, jit_forward, plan_batch, reference


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


class Harness:
    def __init__(self, config, *, num_pages=64, seed=0, kernels="auto"):
        self.config, self.num_pages, self.kernels = config, num_pages, kernels
        self.params = init_params(config, jax.random.key(seed))
        self.cache = init_cache(config, num_pages)
        self.rng = np.random.default_rng(seed)
        self.free_pages = list(self.rng.permutation(num_pages))  # shuffled: tables are not contiguous
        self.hidden, self.done, self.tables = {}, {}, {}

    def add(self, seq_id, length):
        self.hidden[seq_id] = self.rng.standard_normal((length, self.config.hidden_size)).astype(np.float32)
        self.done[seq_id] = 0
        pages = -(-length // self.config.page_size)
        self.tables[seq_id] = [int(self.free_pages.pop()) for _ in range(pages)]

    def batch(self, work):
        """work: [(seq_id, n_new)] -> (requests, hidden rows [n, hidden])."""
        reqs, rows = [], []
        for sid, n in work:
            start = self.done[sid]
            reqs.append(Request(start, n, self.tables[sid]))
            rows.append(self.hidden[sid][start:start + n])
        return reqs, np.concatenate(rows)

    def step(self, work, **plan_options):
        """Runs one step; returns ({seq_id: out rows}, plan)."""
        reqs, rows = self.batch(work)
        plan, meta = plan_batch(self.config, reqs, num_pages=self.num_pages, **plan_options)
        x = np.zeros((plan.num_tokens, self.config.hidden_size), np.float32)
        x[: len(rows)] = rows
        x[len(rows):] = self.rng.standard_normal(x[len(rows):].shape)  # padding rows hold junk
        out, self.cache = jit_forward(self.params, jnp.asarray(x, self.config.jnp_dtype), self.cache, meta,
                                      plan=plan, config=self.config, kernels=self.kernels)
        out = np.asarray(out.astype(jnp.float32))
        result, row = {}, 0
        for sid, n in work:
            result[sid] = out[row:row + n]
            self.done[sid] += n
            row += n
        assert np.all(out[row:] == 0), "padding rows must give 0"
        return result, plan

    @functools.cache
    def reference(self, seq_id, length, dense=False):
        return reference.sequence_forward(self.params, self.hidden[seq_id][:length], self.config, dense=dense)

    def check(self, result, tol):
        """Compares each sequence's rows of one step against the reference."""
        for sid, out in result.items():
            end = self.done[sid]
            ref = self.reference(sid, end)[end - len(out):end]
            assert ref.shape == out.shape, f"sequence {sid} has only {len(self.hidden[sid])} tokens"
            err = rel_err(out, ref)
            assert err < tol, f"sequence {sid}: rows {end - len(out)}..{end}: rel err {err:.2e} >= {tol}"
