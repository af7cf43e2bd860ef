"""Dense causal attention for short prefills (MHA form: qk head dim 192, v head dim 128 real),
and masked MHA: the same attention restricted to each row's selected keys.

`dense_mha` runs the Pallas Mosaic GPU flash attention of `mosaic` over a packed ragged batch of
causal prefills; `reference.dense_mha_reference` is the float32 XLA path and oracle.
Design and measurements: docs/design/dense_mha.md.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ..config import TuningConfig, check_implementation, overrides
from .mosaic import CONSUMER_WGS, dense_mha_mosaic
from .reference import check_inputs, check_selection, dense_mha_reference

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


@dataclasses.dataclass(frozen=True)
class XlaConfig(TuningConfig):
    """Tuning of the jnp path: max_scores bounds the scores it holds at once (None: its default;
    see `reference.dense_mha_reference`)."""

    max_scores: int | None = None


@dataclasses.dataclass(frozen=True)
class MosaicConfig(TuningConfig):
    """Tuning of the Mosaic GPU kernel (None: its choice; see `mosaic.dense_mha_mosaic`)."""

    block_kv: int | None = None
    num_stages: int | None = None
    num_programs: int | None = None


CONFIGS = {"xla": XlaConfig, "mosaic": MosaicConfig}  # implementation -> its config class
IMPLEMENTATIONS = tuple(CONFIGS)


def dense_mha(q, k, v, q_start_loc, k_start_loc, *, scale, selection=None, max_kv_len=None, implementation,
              config=None, interpret=False):
    """Causal flash attention of a packed ragged batch of prefills.

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
    implementation: "xla" (`reference.dense_mha_reference`, float32, any float dtype and head
    dims; it ignores max_kv_len) or "mosaic" (`mosaic.dense_mha_mosaic`, Pallas Mosaic GPU, Hopper:
    bf16 or f16 wgmma operands, f32 softmax; Dqk and Dv multiples of 64, <= 256; ValueError
    otherwise). config: CONFIGS[implementation] (XlaConfig | MosaicConfig) or None.
    interpret=True runs the Mosaic kernel in Mosaic GPU interpret mode (CPU); "xla" ignores it.
    """
    check_implementation("dense_mha", implementation, config, CONFIGS)
    if implementation == "xla":
        return dense_mha_reference(q, k, v, q_start_loc, k_start_loc, scale=scale, selection=selection,
                                   **overrides(config))
    check_inputs(q, k, v, q_start_loc, k_start_loc, KERNEL_DTYPES)
    check_selection(selection, q.shape[0], max_kv_len)
    reason = unsupported_reason(q.dtype, q.shape[2], v.shape[2])
    if reason:
        raise ValueError(reason)
    if selection is not None and max_kv_len is None:
        max_kv_len = max(k.shape[0], 1)
    return dense_mha_mosaic(q, k, v, q_start_loc, k_start_loc, scale=scale, selection=selection,
                            max_kv_len=max_kv_len, interpret=interpret, **overrides(config))
