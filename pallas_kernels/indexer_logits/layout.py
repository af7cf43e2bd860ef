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


# Up to this many [N, V] entries `ranks_within` counts through a one-hot matrix; past it, it sorts.
ONE_HOT_LIMIT = 1 << 22


def ranks_within(keys, num_values):
    """keys [N] int32 in [0, num_values) -> (ranks [N] int32: entries before n with n's key,
    counts [num_values] int32): a stable counting sort's positions, start[key] + rank.

    Counted by a cumsum over the one-hot [N, num_values] where that is at most ONE_HOT_LIMIT
    entries (a few fused XLA ops), else by a stable argsort: XLA's sort of a few thousand
    entries is several kernels and tens of us on the GPU, in front of every indexer call."""
    n = keys.shape[0]
    if n * num_values <= ONE_HOT_LIMIT:
        onehot = (keys[:, None] == jnp.arange(num_values, dtype=jnp.int32)[None, :]).astype(jnp.int32)
        seen = jnp.cumsum(onehot, axis=0)
        ranks = jnp.take_along_axis(seen, keys[:, None], axis=1)[:, 0] - 1
        return ranks.astype(jnp.int32), seen[-1].astype(jnp.int32)
    order = jnp.argsort(keys, stable=True).astype(jnp.int32)
    counts = jnp.zeros((num_values,), jnp.int32).at[keys].add(1)
    start = jnp.cumsum(counts) - counts
    ranks = jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32) - start[keys[order]])
    return ranks, counts


def tile_schedule(row_seq, row_end, num_seqs, num_keys, block_rows):
    """Group the rows by sequence into tiles of <= block_rows rows (jnp, runs under jit).

    Returns tile_rows [T, BR] int32 (row ids, -1 = empty slot; a sequence's rows in row order)
    and tile_meta [T, 2] int32 (sequence, max row_end of the tile clipped to [0, L]);
    T = max_tiles(...), a sequence's tiles consecutive in sequence order, unused tiles empty.
    """
    n = row_seq.shape[0]
    br = block_rows
    t_max = max_tiles(n, num_seqs, br)
    seq = jnp.clip(row_seq.astype(jnp.int32), 0, num_seqs - 1)
    rank, counts = ranks_within(seq, num_seqs)
    tiles_per_seq = (counts + br - 1) // br
    tile_stop = jnp.cumsum(tiles_per_seq)
    tile_first = tile_stop - tiles_per_seq
    # row n: slot rank % BR of its sequence's tile rank // BR (unique, and < t_max by max_tiles)
    tile_rows = jnp.full((t_max, br), -1, jnp.int32).at[tile_first[seq] + rank // br, rank % br].set(
        jnp.arange(n, dtype=jnp.int32), unique_indices=True)
    t = jnp.arange(t_max, dtype=jnp.int32)
    # compare_all: one fused kernel (the default scan is a loop of small kernels in the program)
    tile_seq = jnp.minimum(jnp.searchsorted(tile_stop, t, side="right", method="compare_all"),
                           num_seqs - 1).astype(jnp.int32)
    ends = jnp.where(tile_rows >= 0, jnp.clip(row_end.astype(jnp.int32)[jnp.maximum(tile_rows, 0)], 0, num_keys), 0)
    tile_meta = jnp.stack([tile_seq, ends.max(axis=1)], axis=1).astype(jnp.int32)
    return tile_rows, tile_meta
