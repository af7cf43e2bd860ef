"""Top-k selection of indexer logits: the k highest finite entries of each row, -1 padded (the
Pallas kernels of `triton`, with `mosaic`'s write sweep on Hopper; `reference.topk_reference` is
the jnp oracle)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ..config import TuningConfig, check_implementation
from .reference import topk_reference
from .triton import topk_stages


@dataclasses.dataclass(frozen=True)
class TritonConfig(TuningConfig):
    """Tuning of the Pallas kernels, "triton" and "mosaic" alike (the Mosaic write sweep runs
    inside the Triton kernels' plan): None is the kernels' choice (see `triton.topk_stages`)."""

    block: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    sample: int | None = None
    capacity: int | None = None
    slices: int | None = None


CONFIGS = {"xla": None, "triton": TritonConfig, "mosaic": TritonConfig}  # implementation -> its config class
IMPLEMENTATIONS = tuple(CONFIGS)


def topk(logits, k: int, *, lengths=None, implementation, config=None, interpret=False):
    """[N, L] f32 (-inf = invalid) -> [N, k] int32: indices of the k largest finite entries per
    row, -1 padded. Same contract as `reference.topk_reference` (order within a row unspecified;
    among equal values at the threshold any choice is valid; NaN counts as invalid).
    lengths: [N] int (optional): row n's keys are its first lengths[n] columns, the rest ignored
    whatever they hold (clipped to [0, L]). The kernels read only those columns, and each row's
    sample and slices follow its length at run time, not L: a causal prefill's rows cost their
    own keys in logits of any width, a padding row (length 0) next to nothing.
    Deterministic: the definite keys, then the band's selected keys, each in column order.

    Keys: float32 bits mapped to an int32 whose order is the float order. Exact whatever the
    data; Pallas kernels on the Triton backend (integer compares, block scans, per-lane scatter
    stores and a few atomics, no matrix work; backend "mosaic" replaces step 2 and the band
    path of step 3, below):
      1. thresholds (one program per row): a sample of the row's own keys, `sample` of them
         (default its length / 32, a power of two in [1024, 4096]; runs of 8 adjacent columns at
         a jittered stride over the row; the whole row if no longer: exact thresholds), the
         ranks below from the row's stride at run time; t_lo, with ~k + 5 sigma row keys
         expected >= it, and t_hi, with ~k - 5 sigma, found together: one pass at 16 fixed
         float thresholds (the lowest counts the valid keys), then 16-way count passes that
         stop once an interval holds ~sqrt(k / stride) / 4 sampled keys;
      2. write: definite keys (>= t_hi) have their columns written straight to the output,
         band keys (in [t_lo, t_hi)) go (key, column) to a per-row band buffer of `capacity`
         entries, both in column order (one block cumsum of two packed 16-bit counters per
         chunk). With >= 1024 rows, one program per row counts as it writes (one read of the
         row); with fewer rows, `slices` programs per row (default ~4096 programs, slices >=
         4096 keys; a row's slices cut from its own length, those past its end idle): each
         counts its slice, publishes the counts (f32 atomics), waits for the earlier slices'
         and writes at their offsets (the second read hits L2);
      3. select (one program per row): if the definite keys number <= min(k, valid) <=
         definite + band (and the band fits), the (min(k, valid) - definite)-th largest band
         key by 16-way count passes over the band only (~2.8K keys at L = 32K; ~3.5 passes: a
         search stops as soon as the keys >= its lower bound are exactly the ones needed), and
         those band keys are appended (ties at the boundary: the first in column order);
         otherwise (unlucky sample, massive ties, adversarial order) the same over the whole
         row: correct either way, only slower. -1 padding.
    With several slices a row, loads go 4 chunks at a time (one memory latency per 4); with
    >= 1024 rows, singly (it cost more than it saved).
    Latency-bound at few rows (three launches and ~3.5 dependent passes); docs/design/topk.md.
    implementation: "xla": `reference.topk_reference` (lax.top_k; interpret ignored); "triton":
      the three kernels above; "mosaic": step 2 by `mosaic.topk_write` (Mosaic GPU,
      a warp a row, shuffle scans in registers: no interpreter) where it applies, one slice a row
      and L, capacity multiples of 4, else as "triton"; the same warp then selects the row's band
      when it holds the answer (radix select, 8 bits a pass, in shared memory), and the select
      kernel only takes the other rows. Same index sets as "triton"; its band keys come as those
      above the boundary value, then those equal to it, each in column order.
    config: a TritonConfig (the Pallas implementations; "xla" takes none) or None: block,
      num_warps, num_stages, sample, capacity, slices (see `topk_stages`; without num_warps each
      kernel takes its own count for the row count, `triton._kernel_plan`).
    """
    check_implementation("topk", implementation, config, CONFIGS)
    if implementation == "mosaic" and interpret:
        raise ValueError("topk: implementation 'mosaic' has no interpret mode (its write sweep is inline PTX); "
                         "use implementation='triton' with interpret=True")
    if logits.ndim != 2:
        raise ValueError(f"topk: logits must be 2-D [N, L], got shape {logits.shape}")
    if k < 0:
        raise ValueError(f"topk: k must be >= 0, got {k}")
    n, num_keys = logits.shape
    if lengths is not None and (getattr(lengths, "shape", None) != (n,)
                                or not jnp.issubdtype(jnp.asarray(lengths).dtype, jnp.integer)):
        raise ValueError(f"topk: lengths must be an integer array of shape [N] = ({n},), got "
                         f"{getattr(lengths, 'shape', type(lengths).__name__)} "
                         f"{getattr(lengths, 'dtype', '')}")
    if implementation == "xla":
        return topk_reference(logits, k, lengths)
    if n == 0 or k == 0:
        return jnp.zeros((n, k), jnp.int32)
    if num_keys == 0:
        return jnp.full((n, k), -1, jnp.int32)
    config = config or TritonConfig()
    return topk_stages(logits, k, lengths=lengths, interpret=interpret, block=config.block,
                       num_warps=config.num_warps, num_stages=config.num_stages, sample=config.sample,
                       capacity=config.capacity, slices=config.slices, backend=implementation)["out"]
