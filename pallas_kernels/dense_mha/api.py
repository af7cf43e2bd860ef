"""Dense causal attention for short prefills (MHA form: qk head dim 192, v head dim 128 real),
and masked MHA: the same attention restricted to each row's selected keys.

`dense_mha` runs the Pallas Mosaic GPU flash attention of `mosaic` over a packed ragged batch of
causal prefills; `reference.dense_mha_reference` is the float32 XLA path and oracle.
Design and measurements: docs/design/dense_mha.md.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .mosaic import CONSUMER_WGS, dense_mha_mosaic

# Mosaic GPU's interpreter runs a kernel's warpgroups as concurrent callbacks on XLA's CPU thread
# pool; with fewer threads than warpgroups they wait on each other forever (measured inside the
# forward's jit on CPU: a pool of 2 threads hangs, 3 and 4 pass).
INTERPRET_MIN_CPU_THREADS = CONSUMER_WGS + 1
KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)  # wgmma operands; the softmax is float32


def unsupported_reason(dtype, d_qk: int, d_v: int) -> str | None:
    """Why the Mosaic kernel cannot take inputs of this dtype and head dims (None: it can)."""
    if jnp.dtype(dtype) not in KERNEL_DTYPES:
        return f"dtype {jnp.dtype(dtype).name} is not one of (bfloat16, float16)"
    for name, d in (("Dqk", d_qk), ("Dv", d_v)):
        if d % 64 or d > 256:
            return f"{name}={d} must be a multiple of 64 and <= 256"
    return None


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


BACKENDS = ("mosaic",)


def dense_mha(q, k, v, q_start_loc, k_start_loc, *, scale, selection=None, max_kv_len=None, backend="mosaic",
              interpret=False, block_kv=None, num_stages=None, num_programs=None):
    """Causal flash attention of a packed ragged batch of prefills (Pallas Mosaic GPU, Hopper).

    q: [T, H, Dqk] packed queries, sequence s owns rows q_start_loc[s]..q_start_loc[s+1]
    (q_start_loc[0] = 0); k: [Tk, H, Dqk], v: [Tk, H, Dv] packed keys, sequence s owns rows
    k_start_loc[s]..k_start_loc[s+1]; q_start_loc, k_start_loc: [S+1] int32, non-decreasing,
    kv_len_s >= q_len_s. Query i of sequence s sits at position ctx_s + i (ctx_s = kv_len_s -
    q_len_s, the cached context) and attends keys 0..ctx_s + i of its own sequence.
    Returns [T, H, Dv] in q.dtype; rows q_start_loc[S].. (padding) are 0.
    Rows no sequence owns and other sequences' rows never reach a row's output (NaN / inf there
    included); a sequence's own non-finite values reach its own rows (a non-finite v of a key
    in a diagonal key tile also reaches the sequence's earlier queries in that tile: P = 0
    times it).
    selection: None, or [T, K] int32 (masked MHA): row r attends only the key positions it lists
    (positions in its own sequence, context included; -1 pads; entries < 0 or past the row's
    position are ignored, a position listed twice counts once). A row listing none of its keys
    gives 0. Key tiles no row of a 128-row block selects are skipped. DeepSeek-V3.2's masked
    prefill: with selection = the indexer's top-k positions this equals sparse attention over
    the same keys in the MHA form.
    max_kv_len: with a selection, a bound on every sequence's kv_len (static; default Tk): it
    sizes the selection's bitmask ([T, max_kv_len / 8] bytes and a [T, max_kv_len] boolean
    scatter). A 128-row block of a sequence longer than that whose last position + (k_start % 8)
    passes max_kv_len + 7 rounded up to a key tile comes out NaN (never partly attended); the
    reference takes no bound. A position listed twice in a row is harmless (it sets one bit).
    dtypes: bf16 or f16 (wgmma operands), f32 softmax. Dqk and Dv: multiples of 64, <= 256.
    block_kv, num_stages, num_programs: the kernel's tiling (see `mosaic.dense_mha_mosaic`).
    interpret=True runs the same kernel in Mosaic GPU interpret mode (CPU).
    backend: "mosaic", the one backend (a keyword for symmetry with the other ops' apis; the
    layer runs `reference.dense_mha_reference` where the kernel does not take its config).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    check_inputs(q, k, v, q_start_loc, k_start_loc, KERNEL_DTYPES)
    check_selection(selection, q.shape[0], max_kv_len)
    reason = unsupported_reason(q.dtype, q.shape[2], v.shape[2])
    if reason:
        raise ValueError(reason)
    if selection is not None and max_kv_len is None:
        max_kv_len = max(k.shape[0], 1)
    return dense_mha_mosaic(q, k, v, q_start_loc, k_start_loc, scale=scale, selection=selection,
                            max_kv_len=max_kv_len, interpret=interpret, block_kv=block_kv,
                            num_stages=num_stages, num_programs=num_programs)
