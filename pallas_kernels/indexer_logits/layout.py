"""Layout of the indexer's work shared by its kernels (Triton, Mosaic GPU prefill and decode):
query rows grouped by sequence into row tiles, and keys read through a paged cache."""

from __future__ import annotations

import jax.numpy as jnp

FP8_E4M3 = jnp.dtype(jnp.float8_e4m3fn)


def gather_paged_rows(cache, block_tables, page_size):
    """cache: [num_slots, ...], block_tables: [S, W] -> [S, W * page_size, ...]; entries < 0 give
    zero rows (selected, not multiplied: page 0, which they address, may hold another request's NaN)."""
    listed = block_tables >= 0
    pages = jnp.where(listed, block_tables, 0)
    slots = (pages[:, :, None] * page_size + jnp.arange(page_size)).reshape(block_tables.shape[0], -1)
    rows = cache[slots]
    listed = jnp.repeat(listed, page_size, axis=1).reshape(listed.shape[0], -1, *(1,) * (rows.ndim - 2))
    return jnp.where(listed, rows, jnp.zeros((), rows.dtype))


def max_tiles(num_rows, num_seqs, block_rows):
    # sum over non-empty sequences of ceil(rows_s / BR) <= (N + nonempty * (BR - 1)) / BR
    return max(1, (num_rows + min(num_seqs, num_rows) * (block_rows - 1)) // block_rows)


def tile_schedule(row_seq, row_end, num_seqs, num_keys, block_rows):
    """Group the rows by sequence into tiles of <= block_rows rows (jnp, runs under jit).

    Returns tile_rows [T, BR] int32 (row ids, -1 = empty slot) and tile_meta [T, 2] int32
    (sequence, max row_end of the tile clipped to [0, L]); T = max_tiles(...), unused tiles empty.
    """
    n = row_seq.shape[0]
    br = block_rows
    t_max = max_tiles(n, num_seqs, br)
    seq = jnp.clip(row_seq.astype(jnp.int32), 0, num_seqs - 1)
    order = jnp.argsort(seq, stable=True).astype(jnp.int32)
    counts = jnp.zeros((num_seqs,), jnp.int32).at[seq].add(1)
    seq_start = jnp.cumsum(counts) - counts
    tiles_per_seq = (counts + br - 1) // br
    tile_stop = jnp.cumsum(tiles_per_seq)
    tile_first = tile_stop - tiles_per_seq
    t = jnp.arange(t_max, dtype=jnp.int32)
    tile_seq = jnp.minimum(jnp.searchsorted(tile_stop, t, side="right"), num_seqs - 1).astype(jnp.int32)
    used = t < tile_stop[-1]
    first_row = (t - tile_first[tile_seq]) * br  # index of the tile's first row within its sequence
    r = jnp.arange(br, dtype=jnp.int32)
    within = first_row[:, None] + r[None, :]
    ok = used[:, None] & (within < counts[tile_seq][:, None])
    pos = jnp.where(ok, seq_start[tile_seq][:, None] + within, 0)
    tile_rows = jnp.where(ok, order[pos], -1).astype(jnp.int32)
    ends = jnp.where(ok, jnp.clip(row_end.astype(jnp.int32)[jnp.maximum(tile_rows, 0)], 0, num_keys), 0)
    tile_meta = jnp.stack([tile_seq, ends.max(axis=1)], axis=1).astype(jnp.int32)
    return tile_rows, tile_meta
