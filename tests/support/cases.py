"""Input builders shared by more than one op's suite."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

FP8 = jnp.float8_e4m3fn


def requests_on_fresh_pages(config, specs):
    """Requests [(context_len, query_len)] on consecutive pages from 0, each holding the pages its
    context and queries fill -> (the Requests, the page count they use)."""
    from jax_sparse_mla import Request

    requests, start = [], 0
    for context, query in specs:
        pages = -(-(context + query) // config.page_size)
        requests.append(Request(context, query, list(range(start, start + pages))))
        start += pages
    return requests, start


def make_indexer_case(seed, *, dtype, scaled, hi, d, page, lengths, rows_per_seq, extra_pages=3,
                      interleave_rows=True):
    """A ragged batch: sequence s has lengths[s] keys (pages shuffled over a shared pool) and
    rows_per_seq[s] query rows; rows are interleaved across sequences (else in sequence order);
    row ends are a causal run ending at the sequence length plus a few odd ones (0, 1, full)."""
    rng = np.random.default_rng(seed)
    num_seqs = len(lengths)
    width = max(-(-l // page) for l in lengths) + 1  # one spare (unused, -1) page column
    num_pages = num_seqs * width + extra_pages
    pool = rng.permutation(num_pages).astype(np.int32)
    tables = np.full((num_seqs, width), -1, np.int32)
    used = 0
    for s, l in enumerate(lengths):
        n_p = -(-l // page)
        tables[s, :n_p] = pool[used:used + n_p]
        used += n_p
    row_seq, row_end = [], []
    for s, (l, r) in enumerate(zip(lengths, rows_per_seq)):
        ends = list(range(max(1, l - r + 1), l + 1))[-r:]
        ends = ends + [l] * (r - len(ends))
        row_seq += [s] * r
        row_end += ends
    row_seq, row_end = np.array(row_seq, np.int32), np.array(row_end, np.int32)
    n = len(row_seq)
    if n >= 3:  # odd ends: no valid key, exactly one, the whole table width
        row_end[0], row_end[1], row_end[2] = 0, 1, min(lengths[row_seq[2]], width * page)
    if interleave_rows:  # rows of different sequences interleaved
        perm = rng.permutation(n)
        row_seq, row_end = row_seq[perm], row_end[perm]

    q = rng.standard_normal((n, hi, d)).astype(np.float32)
    k = rng.standard_normal((num_pages * page, d)).astype(np.float32)
    w = rng.standard_normal((n, hi)).astype(np.float32)  # negative weights included
    if dtype == FP8:
        q, k = q * 8, k * 8
    q, k = jnp.asarray(q).astype(dtype), jnp.asarray(k).astype(dtype)
    k_scale = None
    if scaled:
        k_scale = jnp.asarray((2.0 ** rng.integers(-6, 2, num_pages * page)).astype(np.float32))
    return (q, jnp.asarray(w), k, k_scale, jnp.asarray(tables), jnp.asarray(row_seq),
            jnp.asarray(row_end)), page
