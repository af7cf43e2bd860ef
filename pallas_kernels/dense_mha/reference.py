"""Dense causal MHA of a packed ragged batch in jnp, float32: the XLA path and the kernel's oracle."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax


def check_inputs(q, k, v, q_start_loc, k_start_loc, dtypes):
    """ValueError unless q, k, v and the start locations have the shapes and one dtype of `dtypes`."""
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise ValueError(f"q, k, v must be [T, H, D]; got shapes {q.shape}, {k.shape}, {v.shape}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k {k.shape} and v {v.shape} must agree on [Tk, H]")
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"q has {q.shape[1]} heads, k and v have {k.shape[1]}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q head dim {q.shape[2]} != k head dim {k.shape[2]}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in dtypes:
        names = ", ".join(jnp.dtype(d).name for d in dtypes)
        raise ValueError(f"q, k, v must share one dtype of ({names}); got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, loc in (("q_start_loc", q_start_loc), ("k_start_loc", k_start_loc)):
        if loc.ndim != 1 or loc.shape[0] < 1 or loc.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32 [S+1]; got {loc.dtype} {loc.shape}")
    if q_start_loc.shape != k_start_loc.shape:
        raise ValueError(f"q_start_loc {q_start_loc.shape} and k_start_loc {k_start_loc.shape} differ")


def check_selection(selection, num_rows: int, max_kv_len):
    """ValueError unless selection is None or int32 [T, K] (K >= 1) for q's T rows, and
    max_kv_len is None or a positive int (given only with a selection)."""
    if selection is None:
        if max_kv_len is not None:
            raise ValueError("max_kv_len bounds a selection's key positions: give it with a selection")
        return
    if not hasattr(selection, "ndim") or not hasattr(selection, "dtype"):
        raise ValueError(f"selection must be an int32 array [T, K], got {type(selection).__name__}")
    if selection.ndim != 2 or selection.shape[0] != num_rows or selection.shape[1] < 1:
        raise ValueError(f"selection must be [T, K] with T = {num_rows} (q's rows) and K >= 1; "
                         f"got {selection.shape}")
    if selection.dtype != jnp.int32:
        raise ValueError(f"selection must be int32, got {selection.dtype}")
    if max_kv_len is not None and (isinstance(max_kv_len, (bool, np.bool_))
                                   or not isinstance(max_kv_len, (int, np.integer)) or max_kv_len < 1):
        raise ValueError(f"max_kv_len must be a positive int, got {max_kv_len!r}")


def _row_segments(start_loc, rows):
    """start_loc [S+1] -> (sequence id [rows] (-1: no sequence owns the row), offset in it [rows])."""
    idx = jnp.arange(rows, dtype=jnp.int32)
    seq = jnp.searchsorted(start_loc, idx, side="right").astype(jnp.int32) - 1
    owned = (seq >= 0) & (seq < start_loc.shape[0] - 1)
    seq = jnp.where(owned, seq, -1)
    return seq, idx - start_loc[jnp.clip(seq, 0, start_loc.shape[0] - 1)]


def dense_mha_reference(q, k, v, q_start_loc, k_start_loc, *, scale, selection=None, max_scores=1 << 27):
    """Causal attention of a packed ragged batch, float32 (the XLA path and the kernel's oracle).

    q: [T, H, Dqk], sequence s owns rows q_start_loc[s]..q_start_loc[s+1]; k: [Tk, H, Dqk] and
    v: [Tk, H, Dv], sequence s owns rows k_start_loc[s]..k_start_loc[s+1]; q_start_loc,
    k_start_loc: [S+1] int32. Query i of sequence s sits at position kv_len_s - q_len_s + i and
    attends that sequence's keys 0..position. Returns [T, H, Dv] float32; rows no sequence owns
    are 0. selection: None or [T, K] int32, as in `api.dense_mha`: a row attends only the causal
    positions it lists (-1 and out-of-range entries ignored); a row listing none gives 0.
    Memory stays bounded: query blocks of at most max_scores scores ([Bq, H, Tk]) each.
    Rows no sequence owns and other sequences' rows never reach a row's output (masked scores
    and values are selected away, never multiplied by 0: NaN / inf there do not leak); a
    sequence's own non-finite values reach its own rows: non-finite q or k through the scores,
    a non-finite v value of a key a query sees makes that query's head all NaN.
    """
    check_inputs(q, k, v, q_start_loc, k_start_loc, (jnp.bfloat16, jnp.float16, jnp.float32))
    check_selection(selection, q.shape[0], None)
    q_start_loc, k_start_loc = jnp.asarray(q_start_loc), jnp.asarray(k_start_loc)  # (host arrays: indexed by traced values)
    num_rows, heads, d_qk = q.shape
    num_keys, d_v = k.shape[0], v.shape[2]
    if num_rows == 0 or num_keys == 0:
        return jnp.zeros((num_rows, heads, d_v), jnp.float32)
    q_seq, q_off = _row_segments(q_start_loc, num_rows)
    k_seq, k_pos = _row_segments(k_start_loc, num_keys)
    ctx = jnp.diff(k_start_loc) - jnp.diff(q_start_loc)
    q_pos = q_off + ctx[jnp.maximum(q_seq, 0)]
    block = max(1, min(num_rows, max_scores // (heads * num_keys)))
    num_blocks = -(-num_rows // block)
    pad = num_blocks * block - num_rows
    q_blocks = jnp.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(num_blocks, block, heads, d_qk)
    seq_blocks = jnp.pad(q_seq, (0, pad), constant_values=-1).reshape(num_blocks, block)
    pos_blocks = jnp.pad(q_pos, (0, pad)).reshape(num_blocks, block)
    if selection is None:
        sel_blocks = jnp.zeros((num_blocks, block, 0), jnp.int32)
    else:
        sel_blocks = jnp.pad(selection, ((0, pad), (0, 0)), constant_values=-1).reshape(num_blocks, block, -1)
    k32, v32 = k.astype(jnp.float32), v.astype(jnp.float32)
    # No 0 * NaN: the P.V product runs on v with its non-finite values zeroed, and a row that
    # sees (causally, in its own sequence) a key whose v has any non-finite value in a head gets
    # NaN in that head (a count of such keys per row: a product [Bq, Tk] x [Tk, H], 1 / Dv of
    # the P.V product's work).
    v_bad = ~jnp.isfinite(v32)
    v32 = jnp.where(v_bad, 0.0, v32)
    key_bad = jnp.any(v_bad, axis=2).astype(jnp.float32)  # [Tk, H]
    hi = lax.Precision.HIGHEST

    def attend(blk):
        qb, seq, pos, sel = blk  # [Bq, H, Dqk], [Bq], [Bq], [Bq, K]
        visible = ((seq[:, None] == k_seq[None, :]) & (seq[:, None] >= 0)
                   & (k_pos[None, :] <= pos[:, None]))  # [Bq, Tk]
        if selection is not None:  # the listed positions of the row's own sequence
            key = jnp.where(sel >= 0, k_start_loc[jnp.maximum(seq, 0)][:, None] + sel, num_keys)
            listed = jnp.zeros(visible.shape, jnp.bool_).at[
                jnp.arange(sel.shape[0])[:, None], key].set(True, mode="drop")
            visible = visible & listed
        s = jnp.einsum("qhd,khd->qhk", qb.astype(jnp.float32), k32, precision=hi) * scale
        s = jnp.where(visible[:, None], s, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
        denom = jnp.sum(p, axis=-1, keepdims=True)
        p = p / jnp.where(denom > 0, denom, 1.0)
        seen_bad = jnp.einsum("qk,kh->qh", visible.astype(jnp.float32), key_bad, precision=hi)
        out = jnp.einsum("qhk,khd->qhd", p, v32, precision=hi)
        return jnp.where(seen_bad[:, :, None] > 0, jnp.nan, out)

    out = lax.map(attend, (q_blocks, seq_blocks, pos_blocks, sel_blocks))
    return out.reshape(num_blocks * block, heads, d_v)[:num_rows]
