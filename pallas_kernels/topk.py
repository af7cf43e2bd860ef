"""Top-k selection of indexer logits: the k highest finite entries of each row, -1 padded."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def topk_reference(logits, k: int):
    """logits: [N, L] float32 with -inf for invalid keys -> [N, k] int32 key indices.

    Entries beyond the row's count of finite logits are -1 (also every entry past L when k > L).
    Order within a row is unspecified by contract; here it is descending.
    """
    kk = min(k, logits.shape[1])
    values, index = jax.lax.top_k(logits, kk)
    index = jnp.where(values > -jnp.inf, index, -1).astype(jnp.int32)
    return jnp.pad(index, ((0, 0), (0, k - kk)), constant_values=-1)


# ----------------------------------------------------------------------------------------------
# Pallas kernel (Triton backend): radix select with tensor-core histograms, then compaction
# ----------------------------------------------------------------------------------------------

_SIGN = -(1 << 31)  # 0x80000000 as int32
_LOW31 = (1 << 31) - 1


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _ordered_key(x):
    """float32 -> int32 whose signed order is the float order (-0 < +0; NaN ignored by callers)."""
    b = jax.lax.bitcast_convert_type(x, jnp.int32)
    return b ^ ((b >> 31) & _LOW31)


def _topk_kernel(x_ref, out_ref, *, k, num_keys, block):
    n = pl.program_id(0)
    lane = jnp.arange(block, dtype=jnp.int32)
    nibble = jnp.arange(16, dtype=jnp.int32)
    digit_grid = nibble[:, None] * 16 + nibble[None, :]  # [16, 16]: digit hi*16+lo
    n_blocks = _cdiv(num_keys, block)

    def load_block(i):
        cols = i * block + lane
        x = pltriton.load(x_ref.at[n, pl.ds(i * block, block)], mask=cols < num_keys, other=-jnp.inf)
        valid = x > -jnp.inf  # False for -inf, padding and NaN
        return cols, valid, _ordered_key(x)

    def histogram_pass(level, prefix, n_blk):
        """[16, 16] f32 counts of the valid keys whose top 8*level bits (unsigned order) equal
        `prefix`, binned by the next 8 bits (hi nibble x lo nibble), via a one-hot MMA; plus
        the last column holding a valid key (pass 0 only)."""
        shift = 24 - 8 * level

        def body(i, carry):
            hist, last = carry
            cols, valid, skey = load_block(i)
            ukey = skey ^ _SIGN  # unsigned-order bit pattern
            member = valid
            if level > 0:
                member = member & (jax.lax.shift_right_logical(ukey, 32 - 8 * level) == prefix)
            digit = jax.lax.shift_right_logical(ukey, shift) & 255
            hi = jnp.where(member, digit >> 4, -1)
            lo = digit & 15
            oh_hi = (hi[:, None] == nibble[None, :]).astype(jnp.float16)  # [B, 16]
            oh_lo = (lo[:, None] == nibble[None, :]).astype(jnp.float16)  # [B, 16]
            hist = hist + jax.lax.dot_general(oh_hi, oh_lo, (((0,), (0,)), ((), ())),
                                              preferred_element_type=jnp.float32)
            if level == 0:
                last = jnp.maximum(last, jnp.max(jnp.where(valid, cols, -1)))
            return hist, last

        return jax.lax.fori_loop(0, n_blk, body, (jnp.zeros((16, 16), jnp.float32), jnp.int32(-1)))

    def pick_digit(hist, k_rem):
        """Digit holding the k_rem-th largest member, and how many members lie above it."""
        hist = hist.astype(jnp.int32)
        rows = jnp.sum(hist, axis=1)  # [16]
        above_row = jnp.sum(rows) - jnp.cumsum(rows)  # members with a larger hi nibble
        in_row_ge = rows[:, None] - jnp.cumsum(hist, axis=1) + hist  # same hi, lo' >= lo
        count_ge = above_row[:, None] + in_row_ge  # members with digit >= d; non-increasing in d
        d_star = jnp.sum(jnp.sum((count_ge >= k_rem).astype(jnp.int32), axis=1)) - 1
        above = jnp.sum(jnp.sum(jnp.where(digit_grid == d_star, count_ge - hist, 0), axis=1))
        return d_star, above

    # Pass 0: counts of all valid entries by their top 8 bits, the valid count and the last valid column.
    hist, last = histogram_pass(0, None, n_blocks)
    total = jnp.sum(jnp.sum(hist, axis=1)).astype(jnp.int32)
    take_all = total <= k
    n_used = (last + block) // block  # blocks up to the last valid entry
    n_radix = jnp.where(take_all, 0, n_used)
    prefix = jnp.int32(0)
    k_rem = jnp.int32(k)
    for level in range(4):
        if level > 0:
            hist, _ = histogram_pass(level, prefix, n_radix)
        d_star, above = pick_digit(hist, k_rem)
        prefix = (prefix << 8) | d_star
        k_rem = k_rem - above
    # prefix is now the unsigned-order pattern of the k-th largest key; k_rem of its ties are taken.
    threshold = jnp.where(take_all, jnp.int32(_SIGN), prefix ^ _SIGN)
    take_eq = jnp.where(take_all, 0, k_rem)
    n_sel = jnp.minimum(total, k)
    n_gt = n_sel - take_eq
    spare = k  # masked-out lanes aim at [k, k + block): distinct from every real slot

    def compact(i, carry):
        c_gt, c_eq = carry
        cols, valid, skey = load_block(i)
        gt = valid & (skey > threshold)
        eq = valid & (skey == threshold)
        gt_i, eq_i = gt.astype(jnp.int32), eq.astype(jnp.int32)
        pos_gt = c_gt + jnp.cumsum(gt_i) - gt_i
        rank_eq = c_eq + jnp.cumsum(eq_i) - eq_i
        take = gt | (eq & (rank_eq < take_eq))
        pos = jnp.where(gt, pos_gt, n_gt + rank_eq)
        pos = jnp.where(take, pos, spare + lane)
        pltriton.store(out_ref.at[n, pos], cols, mask=take)
        return c_gt + jnp.sum(gt_i), c_eq + jnp.sum(eq_i)

    jax.lax.fori_loop(0, n_used, compact, (jnp.int32(0), jnp.int32(0)))

    def pad(j, carry):
        cols = j * block + lane
        pltriton.store(out_ref.at[n, pl.ds(j * block, block)], jnp.full((block,), -1, jnp.int32),
                       mask=(cols >= n_sel) & (cols < k))
        return carry

    jax.lax.fori_loop(n_sel // block, _cdiv(k, block), pad, 0)


def topk(logits, k: int, *, interpret=False, block=None, num_warps=None, num_stages=None):
    """[N, L] f32 (-inf = invalid) -> [N, k] int32: indices of the k largest finite entries per
    row, -1 padded. Same contract as `topk_reference` (order within a row unspecified; among
    equal values at the threshold any choice is valid; NaN counts as invalid).

    Pallas (Triton backend), one program per row, exact radix select on the float bits:
      * keys: float32 bits mapped to an int32 whose order is the float order;
      * 4 passes over the row, 8 bits each (MSB first); each pass histograms the current digit
        of the keys that match the prefix found so far into 256 bins. Pallas-Triton has no
        shared-memory atomics, so the histogram of a [B] block is the MMA
        onehot(hi nibble)^T [16, B] x onehot(lo nibble) [B, 16] (f16 0/1, f32 accumulation:
        exact), i.e. 32 compares per element instead of 256;
      * from the 256 counts (cumsums) it picks the digit holding the k-th largest and how many
        keys lie above it; after 4 passes the exact k-th largest key T and the number of ties
        at T to take are known;
      * a compaction pass writes the indices of keys > T and the first ties == T to their
        output slots (cumsum within the block + running counters), a last loop writes -1 to
        [min(k, count valid), k).
    Pass 0 also counts valid entries and finds the last valid column: rows with <= k valid
    entries skip the radix passes, and later passes stop at the last valid block (causal
    prefill rows are mostly -inf towards the end). The row is read 5 times (from L2 when it
    fits), against a full sort of the row in `lax.top_k`.
    """
    n, num_keys = logits.shape
    if n == 0 or k == 0:
        return jnp.zeros((n, k), jnp.int32)
    if num_keys == 0:
        return jnp.full((n, k), -1, jnp.int32)
    if block is None:
        block = 1024
    block = max(16, min(_next_pow2(block), _next_pow2(num_keys)))
    # Interpret mode carries out a masked-out scatter lane as a write of the old value: give
    # those lanes `block` spare columns of their own. On the GPU masked lanes store nothing.
    out_cols = k + block if interpret else k
    kernel = functools.partial(_topk_kernel, k=k, num_keys=num_keys, block=block)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n, out_cols), jnp.int32),
        grid=(n,),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps or 8, num_stages=num_stages or 3),
        interpret=interpret,
        name="indexer_topk",
    )(logits.astype(jnp.float32))
    return out if out_cols == k else out[:, :k]
