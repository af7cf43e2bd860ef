"""Indexer logits over a paged key cache, every implementation against the jnp reference.

Implementations (`pallas_kernels.indexer_logits.indexer_logits(..., implementation=, kernel=)`):
"xla" (jnp, the XLA path and oracle), "triton" (the portable Pallas kernel) and "mosaic" with
kernel "prefill" or "decode" (the Mosaic GPU kernels); "auto" is the kernel the layer picks
(`ops.indexer_logits_auto`). On CPU the kernels run in Pallas
interpret mode on the tiny config (Hi=4, D=16; the Mosaic GPU kernels in their interpreter,
which poisons fresh buffers with NaN, so every unwritten logit fails); the `gpu` tests compile
them for real dimensions (Hi=64, D=128, page 64). Each (case, kernel) pair below is one the
kernel's limits and the interpreter's speed allow (the Mosaic decode kernel's cases keep their
key rings from wrapping on CPU; see _MGPU_DECODE_CASES). The isolation cases (NaN / inf in
keys no valid logit may read) run on every implementation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sparse_mla.config import MLAConfig
from pallas_kernels.indexer_logits import MosaicConfig, TritonConfig, gather_paged_rows, indexer_logits, layout
from pallas_kernels.indexer_logits.mosaic_decode import choose_decode_tiling
from pallas_kernels.indexer_logits.mosaic_common import TMA_SMEM_ALIGN, meta_width
from pallas_kernels.indexer_logits.mosaic_prefill import _tiles, _weight_rows, choose_prefill_tiling
from pallas_kernels.topk import topk
from tests.support import INTERPRET, ops
from tests.support.cases import FP8, make_indexer_case

OP = "indexer_logits"
param = functools.partial(ops.implementation_param, OP)


def reference(*args, page_size):
    return indexer_logits(*args, page_size=page_size, implementation="xla")


def run(implementation, kernel, *args, page_size, config=None, clean=True, interpret=INTERPRET):
    """indexer_logits by `implementation` (kernel: the Mosaic one; "auto": the kernel
    `ops.indexer_logits_auto` picks for the inputs and device), interpret mode off the GPU."""
    if implementation == "auto":
        implementation, kernel = ops.indexer_logits_auto(args[0], args[2], args[4], interpret=interpret)
    return indexer_logits(*args, page_size=page_size, implementation=implementation, kernel=kernel, config=config,
                          clean=clean, interpret=interpret)


# ------------------------------------------------------------------------------------------------
# checks
# ------------------------------------------------------------------------------------------------

def _check_masked_logits(out, ref):
    """-> (out, ref as numpy, where ref is finite), after checking shape, dtype, and that out is
    finite exactly where ref is and equal to it (-inf) elsewhere."""
    out, ref = np.asarray(out), np.asarray(ref)
    assert out.shape == ref.shape and out.dtype == np.float32
    fin = np.isfinite(ref)
    np.testing.assert_array_equal(np.isfinite(out), fin)
    np.testing.assert_array_equal(out[~fin], ref[~fin])  # -inf exactly
    return out, ref, fin


def check_logits(out, ref, tol):
    out, ref, fin = _check_masked_logits(out, ref)
    if fin.any():
        err = np.linalg.norm(out[fin] - ref[fin]) / max(np.linalg.norm(ref[fin]), 1e-30)
        assert err <= tol, err


# fp8 logits on the GPU. The products q_d * k_d of e4m3 values are exact (4-bit significands), and
# so is the CPU interpreter's f32 sum of them, so there the tight norm tolerance holds. Hopper's fp8
# tensor cores (wgmma with e4m3 operands: the Mosaic GPU kernels; the Triton kernel's fp8 dot with
# max_num_imprecise_acc = 128) do not add them in f32: the accumulator keeps about 14 significant
# bits (DeepSeek-V3 technical report, section 3.3.2: FP8 GEMM accumulation on H800 "limited to
# retaining around 14 bits"; an e8m13 accumulator whose results are truncated, not rounded), so an
# operand aligned to magnitude M loses up to 2^-13 M. One instruction adds K = 32 products to the
# accumulator: D values take S = ceil(D / 32) steps acc_j = acc_(j-1) + g_j, g_j the step's sum of
# products, and counting both operands of each step as truncated at max(|acc_(j-1)|, |g_j|)
# <= sum_(d < 32 j) |p_d| (p_d = q_d k_d),
#     |err(q . k)| <= FP8_ACC_TRUNCATIONS * 2^-13 * sum_j sum_(d < 32 j) |p_d|
#                   = FP8_ACC_TRUNCATIONS * 2^-13 * sum_d (S - d // 32) |p_d|,   FP8_ACC_TRUNCATIONS = 2.
# ReLU is 1-Lipschitz and the rest is f32 (x w, a sum over heads, x k_scale), so per logit
#     |err(I[n, s])| <= 2 * 2^-13 * B[n, s] + (D + 2 Hi + 4) * 2^-24 * B0[n, s],
#     B[n, s] = |k_scale[s]| * sum_h |w[n, h]| * sum_d (S - d // 32) |q[n, h, d] k[s, d]|, B0 the same with
# weights 1 (the 2^-24 term: the f32 sums of kernel and reference). Both are computed in numpy,
# float64, from the same quantised inputs. Measured on the H200 (jax 0.11.2, every fp8 comparison
# of this file, `-m "gpu or not gpu"`): the worst |err| was 0.23 of the bound at the tiny dims
# (D = 16, S = 1) and 0.04 at Hi = 64, D = 128 (norm-relative errors 2.5e-5..5e-5 and 1.0e-4..1.3e-4);
# _hopper_fp8_logits, a numpy model of that accumulator, gives 0.16 and 0.01 (norm-relative 3.1e-5
# and 8.9e-5), while a missing head or one wrong key is 16-2000x past the bound
# (test_fp8_logit_bound_rejects_wrong_logits).
HOPPER_FP8_ACC_ULP = 2.0 ** -13  # 13 fraction bits kept by the fp8 MMA accumulator, truncated
FP8_MMA_K = 32  # e4m3 products per wgmma instruction (k of m64nNk32)
FP8_ACC_TRUNCATIONS = 2  # truncated operands per accumulation step (accumulator, step's products)
F32_ULP = 2.0 ** -24


def fp8_logit_magnitude(args, page_size, depth_weights=None):
    """sum_h |w[n, h]| * sum_d c_d |q[n, h, d] k[s, d]| * |k_scale[s]| over each row's sequence, float64
    [N, W * page_size] (numpy; c_d = depth_weights or 1; sum_h and sum_d commute, all terms >= 0)."""
    q, w, k, k_scale, tables, row_seq, _ = args
    f64 = lambda a: np.abs(np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64))
    qw = np.einsum("nh,nhd->nd", f64(w), f64(q))  # [N, D]
    if depth_weights is not None:
        qw = qw * depth_weights
    tables = np.asarray(tables)
    slots = (np.maximum(tables, 0)[:, :, None] * page_size + np.arange(page_size)).reshape(tables.shape[0], -1)
    listed = np.repeat(tables >= 0, page_size, axis=1)
    k_abs = f64(k)
    ks = np.ones(k_abs.shape[0]) if k_scale is None else f64(k_scale)
    row_seq = np.asarray(row_seq)
    out = np.zeros((len(row_seq), slots.shape[1]))
    for seq in np.unique(row_seq):
        rows = row_seq == seq
        keys = k_abs[slots[seq]] * (ks[slots[seq]] * listed[seq])[:, None]  # [L, D]
        out[rows] = qw[rows] @ keys.T
    return out


def fp8_logit_bound(args, page_size):
    """Elementwise bound on |kernel - reference| for fp8 logits compiled for Hopper (see above)."""
    hi, d = args[0].shape[1], args[0].shape[2]
    steps_left = -(-d // FP8_MMA_K) - np.arange(d) // FP8_MMA_K  # S - d // 32: steps whose operands hold p_d
    return (FP8_ACC_TRUNCATIONS * HOPPER_FP8_ACC_ULP * fp8_logit_magnitude(args, page_size, steps_left)
            + (d + 2 * hi + 4) * F32_ULP * fp8_logit_magnitude(args, page_size))


def check_logits_within(out, ref, bound):
    """As check_logits, with |out - ref| <= bound elementwise where ref is finite."""
    out, ref, fin = _check_masked_logits(out, ref)
    err = np.abs(out[fin].astype(np.float64) - ref[fin])
    over = err > bound[fin]
    if over.any():
        ratio = err / np.maximum(bound[fin], 1e-300)
        raise AssertionError(f"{over.sum()} of {fin.sum()} logits past the fp8 accumulation bound; "
                             f"worst |err| / bound = {ratio.max():.3g}")


def check_fp8_logits(out, ref, args, page_size, *, on_gpu=not INTERPRET):
    """fp8 logits against the f32 reference, per implementation: interpreted on CPU (exact products, f32
    sums) within the tight 1e-5 norm tolerance; compiled for the GPU within fp8_logit_bound."""
    if on_gpu:
        check_logits_within(out, ref, fp8_logit_bound(args, page_size))
    else:
        check_logits(out, ref, 1e-5)


def check_indexer_logits(out, ref, args, page_size, tol):
    """fp8 inputs: check_fp8_logits (per implementation); bf16 / f32: norm-relative tol."""
    if args[0].dtype == FP8:
        check_fp8_logits(out, ref, args, page_size)
    else:
        check_logits(out, ref, tol)


# ------------------------------------------------------------------------------------------------
# kernels against the reference (CPU: interpret mode, tiny dims)
# ------------------------------------------------------------------------------------------------

# (dtype, scaled, tiling) on the ragged batch [37, 1, 90, 12] keys x [5, 1, 7, 3] rows, page 4
_RAGGED_CASES = [
    (jnp.float32, False, dict(block_rows=1, block_keys=16, chunk=32)),   # key axis split, ragged
    (jnp.bfloat16, False, dict(block_rows=4, block_keys=16)),            # multi-row tiles
    (FP8, True, dict()),                                                 # default tiling
    (FP8, True, dict(block_rows=2, block_keys=32, chunk=32)),
]

_MGPU_PREFILL_CASES = [
    # ragged batch with a 1-key sequence; page 4: keys gathered first; 2 row groups a tile, so 2
    # compute warpgroups a key block (owners) and the other 2 on the next block; one key chunk:
    # 5 key blocks through a 4-slot ring; 2 persistent programs for the 7 tiles (SMEM buffers
    # and the ring reused across items)
    (FP8, True, 4, [37, 1, 300, 12], [5, 1, 9, 3], dict(block_rows=4, group=2, stages=4, splits=1, programs=2)),
    # a like batch read straight from 64-token pages, bf16, one row group a tile (1 owner, the 2
    # warpgroups on alternate blocks); 11 key blocks a row: the short sequences' -inf tails of 10
    # blocks take two 4-block stores and two 1-block ones
    (jnp.bfloat16, False, 64, [37, 1, 600, 12], [5, 1, 9, 3], dict(block_rows=4, group=4, splits=1)),
    # decode-like: 1-2 rows per sequence, the key axis split into chunks (default tiling)
    (FP8, True, 64, [400, 130, 1], [1, 2, 1], dict()),
    # the same on 3 programs: 4 warpgroups each on every fourth block of one row, several items
    # a program, ring steps carried from item to item
    (FP8, True, 64, [400, 130, 1], [1, 2, 1], dict(programs=3)),
    # causal prefill of 150 rows (not a multiple of any block), no k_scale, 3 key chunks a tile;
    # 8 row groups: each of the 4 warpgroups owns 2 of every block (weights re-read from SMEM)
    (FP8, False, 64, [150], [150], dict(block_rows=16, group=2, splits=3, stages=4, programs=4)),
    # the fp8 default's shape of work: 8 rows, 4 row groups, each warpgroup owning one (its
    # weights in registers); one chunk of 6 key blocks through a 2-slot ring
    (FP8, True, 64, [330, 20], [70, 20], dict(block_rows=8, group=2, stages=2, splits=1, programs=1)),
    # 2 key chunks of 6 blocks a tile: the -inf tails of the short rows cross the chunk boundary
    (FP8, True, 64, [700, 3], [4, 3], dict(block_rows=4, group=2, stages=4, splits=2, programs=3)),
    # one row a tile (weights of 8 padded heads: 32 bytes, padded to TMA's 128-byte SMEM rows
    # for the second item's buffer), 2 programs taking several items each
    (jnp.bfloat16, True, 64, [200, 70, 1], [3, 2, 1], dict(block_rows=1, group=1, stages=2, programs=2)),
]

# Decode rings deep enough that no slot is refilled: the Mosaic GPU interpreter (jax 0.11.2, this
# 2-core CPU) stalls forever once the key ring wraps (every warpgroup blocked in a barrier wait),
# while the same kernel runs on the H200; the GPU tests below cover refilled slots.
_MGPU_DECODE_CASES = [
    # ragged decode batch: lengths not multiples of 64, rows with end 0, 1 and the full table;
    # 3 key chunks per row
    (FP8, True, 64, [520, 1, 77], [1, 1, 1], dict(chunk=4, step_blocks=2, stages=2)),
    # MTP: 2 rows of a sequence share one wgmma (N = 2 x heads); a tile with an empty row slot
    (FP8, True, 64, [300, 1], [2, 1], dict(chunk=8, step_blocks=2, stages=4)),
    # bf16 without scales; page 4: keys gathered into 64-key pages first; 1 chunk per row
    (jnp.bfloat16, False, 4, [37, 1, 90, 12], [1, 1, 1, 1], dict(chunk=4, step_blocks=1, stages=4)),
    # fp8 without scales, page 128 (split into 64-key pages); the block table padded to 4 chunks
    (FP8, False, 128, [700, 5, 300], [1, 1, 1], dict(chunk=4, step_blocks=1, stages=4)),
    # 3 key blocks per ring slot: the last step of a chunk padded with a repeated block (5 blocks)
    (FP8, True, 64, [300, 130], [2, 2], dict(chunk=8, step_blocks=3, stages=4)),
    (jnp.bfloat16, False, 64, [250, 64, 1], [1, 1, 1], dict(chunk=4, step_blocks=2, stages=2)),
]

_TINY_DIMS = dict(hi=4, d=16)

# implementation and kernel, then make_indexer_case's seed and arguments, and the kernel's config
_KERNEL_CASES = (
    # tiling overrides are the Triton kernel's; without one, the kernel the layer picks by device
    # ("auto": the Triton kernel on CPU, a Mosaic one on Hopper)
    [param("triton" if tiling else "auto", None, 0,
           dict(dtype=dtype, scaled=scaled, page=4, lengths=[37, 1, 90, 12], rows_per_seq=[5, 1, 7, 3]),
           TritonConfig(**tiling) if tiling else None, id=f"{'triton' if tiling else 'auto'}-ragged{i}")
     for i, (dtype, scaled, tiling) in enumerate(_RAGGED_CASES)]
    # one causal sequence, every position a row (prefill); fp8 without k_scale; 3 heads (padded)
    + [param("auto", None, 1, dict(dtype=FP8, scaled=False, hi=3, page=4, lengths=[45], rows_per_seq=[45]), None,
             id="auto-prefill_causal_fp8_unscaled")]
    # the Mosaic GPU kernels (heads 4 -> 8 and D 16 -> 32 padded)
    + [param("mosaic", "prefill", 7, dict(dtype=dtype, scaled=scaled, page=page, lengths=lengths, rows_per_seq=rows),
             MosaicConfig(**tiling), id=f"mosaic_prefill{i}")
       for i, (dtype, scaled, page, lengths, rows, tiling) in enumerate(_MGPU_PREFILL_CASES)]
    + [param("mosaic", "decode", 7, dict(dtype=dtype, scaled=scaled, page=page, lengths=lengths, rows_per_seq=rows),
             MosaicConfig(**tiling), id=f"mosaic_decode{i}")
       for i, (dtype, scaled, page, lengths, rows, tiling) in enumerate(_MGPU_DECODE_CASES)]
)


@pytest.mark.parametrize("implementation,kernel,seed,case,config", _KERNEL_CASES)
def test_logits_match_reference(implementation, kernel, seed, case, config):
    args, page = make_indexer_case(seed, **{**_TINY_DIMS, **case})
    out = run(implementation, kernel, *args, page_size=page, config=config)
    check_indexer_logits(out, reference(*args, page_size=page), args, page, 1e-5)


def test_mosaic_decode_rows_in_sequence_order():
    """One row per sequence, row n of sequence n (the usual decode batch): every CTA's guessed
    block-table row is the right one (the interleaved batches above reload most of them)."""
    args, page = make_indexer_case(8, dtype=FP8, scaled=True, hi=4, d=16, page=64, lengths=[300, 1, 190],
                                   rows_per_seq=[1, 1, 1], interleave_rows=False)
    assert np.array_equal(np.asarray(args[5]), np.arange(3))
    out = run("mosaic", "decode", *args, page_size=page, config=MosaicConfig(chunk=4, stages=2))
    check_indexer_logits(out, reference(*args, page_size=page), args, page, 1e-5)


def test_mosaic_decode_rejects_mixed_dtypes():
    args, page = make_indexer_case(9, dtype=FP8, scaled=True, hi=4, d=16, page=64,
                                   lengths=[70], rows_per_seq=[1])
    q, w, k, *rest = args
    with pytest.raises(ValueError, match="float8_e4m3fn or bfloat16"):
        run("mosaic", "decode", q, w, k.astype(jnp.bfloat16), *rest, page_size=page)


# ------------------------------------------------------------------------------------------------
# GPU: compiled kernels, real dimensions
# ------------------------------------------------------------------------------------------------

_DTYPES = [pytest.param(FP8, True, id="fp8"), pytest.param(jnp.bfloat16, False, id="bf16")]
_REAL_DIMS = dict(hi=64, d=128, page=64)
_REAL_DIM_CASES = (
    # the router: two causal sequences (one with context), many rows each; decode: 1-2 rows per
    # sequence, longer contexts
    [param("auto", None, 3, dict(lengths=[3000, 1100], rows_per_seq=[1200, 1100]), id="auto-prefill"),
     param("auto", None, 3, dict(lengths=[4100, 700, 6000, 1, 2500] * 4, rows_per_seq=[2, 1, 2, 1, 2] * 4),
           id="auto-decode")]
    # both prefill kernels: two causal sequences (one with context, neither a multiple of 64 long),
    # rows of both interleaved, plus a short third sequence
    + [param(implementation, kernel, 6, dict(lengths=[3001, 1100, 70], rows_per_seq=[1203, 1100, 33]),
             id=f"{name}-prefill")
       for implementation, kernel, name in (("mosaic", "prefill", "mosaic_prefill"), ("triton", None, "triton"))]
    # both decode kernels: long ragged contexts (key rings refilled many times), 1 and 2 (MTP)
    # rows per sequence, a 1-key sequence, rows with no valid key
    + [param(implementation, kernel, 10, dict(lengths=[33001, 700, 1, 20000, 4097, 64], rows_per_seq=rows),
             id=f"{implementation}{'_' + kernel if kernel else ''}-decode{i}")
       for i, (implementation, kernel, rows) in enumerate([
           ("mosaic", "decode", [1, 1, 1, 1, 1, 1]),    # one row per tile
           ("mosaic", "decode", [2, 2, 1, 2, 2, 1]),    # MTP: 2 rows a tile, empty slots
           ("triton", None, [1, 2, 1, 2, 1, 1])])]
)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,scaled", _DTYPES)
@pytest.mark.parametrize("implementation,kernel,seed,case", _REAL_DIM_CASES)
def test_logits_match_reference_real_dims_gpu(implementation, kernel, seed, case, dtype, scaled):
    args, page = make_indexer_case(seed, dtype=dtype, scaled=scaled, **_REAL_DIMS, **case)
    out = jax.jit(functools.partial(run, implementation, kernel, page_size=page))(*args)
    ref = jax.jit(functools.partial(reference, page_size=page))(*args)
    check_indexer_logits(out, ref, args, page, 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("implementation,kernel,seed,case,config",
                         [p for p in _KERNEL_CASES if p.values[0] == "mosaic"])
def test_mosaic_cases_compiled_gpu(implementation, kernel, seed, case, config):
    """The interpreter's cases compiled: padded tiny dims and small tiles, where SMEM buffers are
    smallest (TMA alignment faults show only on the GPU)."""
    args, page = make_indexer_case(seed, **{**_TINY_DIMS, **case})
    out = jax.jit(functools.partial(run, implementation, kernel, page_size=page, config=config))(*args)
    check_indexer_logits(out, reference(*args, page_size=page), args, page, 1e-4)  # as the real dims'


# ------------------------------------------------------------------------------------------------
# isolation: NaN / inf in keys no valid logit may read
# ------------------------------------------------------------------------------------------------

def _isolation_case(dtype, scaled, page, seed=1):
    """3 sequences on pages 1.. (page 0 and 3 more never used), one spare -1 column in the block
    table; rows: sequence 0 ends 67..70 (length 70), sequence 1 ends 3 and 5 (length 5), sequence
    2 (the poisoned request) ends 128..130. Poison: NaN / inf in the keys (and scales) of every
    unused page, of sequence 2's pages, and of sequences 0 and 1 at positions >= their lengths.
    Returns (clean args, poisoned args, rows that must not change)."""
    rng = np.random.default_rng(seed)
    lengths, hi, d = [70, 5, 130], 4, 16
    width = max(-(-n // page) for n in lengths) + 1
    num_pages = sum(-(-n // page) for n in lengths) + 4
    pool = iter(rng.permutation(np.arange(1, num_pages)))
    tables = np.full((3, width), -1, np.int32)
    for s, n in enumerate(lengths):
        tables[s, : -(-n // page)] = [next(pool) for _ in range(-(-n // page))]
    row_seq = np.array([0, 1, 2, 0, 0, 2, 1, 0, 2], np.int32)
    row_end = np.array([67, 3, 128, 68, 69, 129, 5, 70, 130], np.int32)
    n = len(row_seq)
    q = rng.standard_normal((n, hi, d)).astype(np.float32)
    k = rng.standard_normal((num_pages * page, d)).astype(np.float32)
    w = rng.standard_normal((n, hi)).astype(np.float32)
    if dtype == FP8:
        q, k = q * 8, k * 8
    k_scale = (2.0 ** rng.integers(-4, 2, num_pages * page)).astype(np.float32) if scaled else None

    bad = np.ones(num_pages * page, bool)  # slots a clean row may read: its sequence's keys < length
    for s in (0, 1):
        for pos in range(lengths[s]):
            bad[tables[s, pos // page] * page + pos % page] = False
    assert bad[:page].all()  # page 0 is poisoned
    k_bad = np.where(bad[:, None], np.where(np.arange(len(bad)) % 2 == 0, np.nan, np.inf)[:, None], k)
    clean = [jnp.asarray(q).astype(dtype), jnp.asarray(w), jnp.asarray(k).astype(dtype),
             None if k_scale is None else jnp.asarray(k_scale), jnp.asarray(tables), jnp.asarray(row_seq),
             jnp.asarray(row_end)]
    poisoned = list(clean)
    poisoned[2] = jnp.asarray(k_bad).astype(dtype)
    if scaled:
        poisoned[3] = jnp.asarray(np.where(bad & (np.arange(len(bad)) % 3 == 0), np.nan, k_scale))
    return clean, poisoned, row_seq != 2


@pytest.mark.parametrize("implementation,kernel,dtype,scaled,page,config", [
    # pages of 4
    param("xla", None, FP8, True, 4, None, id="xla-fp8-page4"),
    param("triton", None, FP8, True, 4, None, id="triton-fp8-page4"),
    param("xla", None, jnp.bfloat16, False, 4, None, id="xla-bf16-page4"),
    param("triton", None, jnp.bfloat16, False, 4, None, id="triton-bf16-page4"),
    param("xla", None, FP8, True, 64, None, id="xla-fp8-page64"),
    # the Mosaic GPU kernels (CPU: their interpreter): keys are the wgmma's M rows and the head sum
    # a row reduction, so a NaN key reaches only its own logit, which the row-end mask drops.
    # Keys read straight from 64-key pages: a -1 table entry reads page 0 (NaN)
    param("mosaic", "prefill", FP8, True, 64, MosaicConfig(block_rows=4, group=2, stages=4),
          id="mosaic_prefill-page64"),
    param("mosaic", "decode", FP8, True, 64, MosaicConfig(block_rows=1, chunk=4, step_blocks=1, stages=4),
          id="mosaic_decode-page64"),
    # pages of 4: keys gathered into 64-key pages first (gather_paged_rows)
    param("mosaic", "decode", jnp.bfloat16, False, 4, MosaicConfig(block_rows=1, chunk=4, step_blocks=1, stages=4),
          id="mosaic_decode-page4"),
])
def test_logits_ignore_other_keys(implementation, kernel, dtype, scaled, page, config):
    clean, poisoned, keep = _isolation_case(dtype, scaled, page)
    logits = functools.partial(run, implementation, kernel, page_size=page, config=config)
    want = np.asarray(logits(*clean))[keep]
    got = np.asarray(logits(*poisoned))[keep]
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    fin = np.isfinite(want)
    np.testing.assert_array_equal(got[~fin], -np.inf)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-6, atol=1e-6)


def test_gather_paged_rows_zeroes_missing_pages():
    cache = jnp.full((16, 3), jnp.nan).at[4:].set(1.0)  # page 0 NaN
    rows = gather_paged_rows(cache, jnp.asarray([[1, -1], [-1, 2]]), 4)
    want = np.zeros((2, 8, 3), np.float32)
    want[0, :4] = want[1, 4:] = 1.0
    np.testing.assert_array_equal(np.asarray(rows), want)


@pytest.mark.parametrize("one_hot", [True, False], ids=["one_hot", "sorted"])
def test_tile_schedule_groups_rows_like_a_stable_sort(monkeypatch, one_hot):
    """Both ways of counting (the one-hot cumsum and, past ONE_HOT_LIMIT, the argsort) give each
    sequence's rows in row order, BR a tile, a sequence's tiles consecutive, the tile end the
    largest clipped row_end; against numpy's stable argsort on shuffled ragged rows (row_seq out
    of range clipped, as the kernels clip it)."""
    if not one_hot:
        monkeypatch.setattr(layout, "ONE_HOT_LIMIT", 0)
    rng = np.random.default_rng(3)
    num_seqs, br, num_keys = 5, 3, 50
    row_seq = rng.permutation(np.repeat(np.arange(-1, num_seqs + 1), [2, 4, 0, 7, 1, 3, 2]))
    row_end = rng.integers(-3, num_keys + 9, row_seq.shape[0])
    tile_rows, tile_meta = map(np.asarray, jax.jit(layout.tile_schedule, static_argnums=(2, 3, 4))(
        jnp.asarray(row_seq, jnp.int32), jnp.asarray(row_end, jnp.int32), num_seqs, num_keys, br))
    seq = np.clip(row_seq, 0, num_seqs - 1)
    want_rows, want_meta = [], []
    for s in range(num_seqs):
        rows = np.flatnonzero(seq == s)  # row order within the sequence
        for i in range(0, rows.size, br):
            tile = rows[i:i + br]
            want_rows.append(np.pad(tile, (0, br - tile.size), constant_values=-1))
            want_meta.append((s, np.clip(row_end[tile], 0, num_keys).max()))
    t = len(want_rows)
    assert tile_rows.shape[0] == layout.max_tiles(row_seq.shape[0], num_seqs, br) >= t
    np.testing.assert_array_equal(tile_rows[:t], np.asarray(want_rows))
    np.testing.assert_array_equal(tile_meta[:t], np.asarray(want_meta))
    assert (tile_rows[t:] == -1).all() and (tile_meta[t:, 1] == 0).all()


def test_prefill_tiles_heaviest_first():
    """The persistent grid's deal: every tile once, by key blocks to compute in non-increasing
    classes, heaviest first; the meta rows carry each tile's row ends."""
    rng = np.random.default_rng(4)
    n, num_seqs, num_keys, br = 300, 4, 64 * 300, 4
    row_seq = rng.integers(0, num_seqs, n)
    row_end = rng.integers(0, num_keys + 1, n)
    args = (jnp.asarray(row_seq, jnp.int32), jnp.asarray(row_end, jnp.int32))
    meta, tile_rows = map(np.asarray, _tiles(*args, num_seqs, num_keys, br))
    base_rows, base_meta = map(np.asarray, layout.tile_schedule(*args, num_seqs, num_keys, br))
    assert sorted(map(tuple, tile_rows)) == sorted(map(tuple, base_rows))
    blocks = -(-meta[:, 1] // 64)
    classes = (300 - blocks) * 128 // 301  # 128 classes of 301 / 128 block counts each
    assert classes[0] == 0 and (np.diff(classes) >= 0).all() and len(set(classes)) > 10
    np.testing.assert_array_equal(meta[:, 2:2 + br], tile_rows)
    ends = np.where(tile_rows >= 0, row_end[np.maximum(tile_rows, 0)], 0)
    np.testing.assert_array_equal(meta[:, 2 + br:2 + 2 * br], ends)


# ------------------------------------------------------------------------------------------------
# the GPU tolerance for fp8 logits, checked on CPU
# ------------------------------------------------------------------------------------------------

def _hopper_fp8_logits(args, page_size):
    """numpy model of the fp8 kernels on Hopper: per (row, head, key), 32-product steps added to the
    accumulator with both operands truncated to 13 fraction bits at their common alignment and the
    result to 14 significant bits; then f32 ReLU, x w, head sum, x k_scale (as the kernels)."""
    q, w, k, k_scale, tables, row_seq, row_end = (np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)
                                                  if a is not None else None for a in args)
    tables, row_seq, row_end = tables.astype(int), row_seq.astype(int), row_end.astype(int)
    slots = (np.maximum(tables, 0)[:, :, None] * page_size + np.arange(page_size)).reshape(tables.shape[0], -1)
    listed = np.repeat(tables >= 0, page_size, axis=1)

    def trunc(x, exp, bits):  # x toward zero to a multiple of 2^(exp - bits)
        step = np.ldexp(1.0, exp - bits)
        return np.trunc(x / step) * step

    def exponent(x):  # floor(log2 |x|), 0 for 0
        return np.frexp(x)[1] - 1

    out = np.full((len(row_seq), slots.shape[1]), -np.inf, np.float32)
    for n in range(len(row_seq)):
        keys = k[slots[row_seq[n]]] * listed[row_seq[n]][:, None]  # [L, D]
        acc = np.zeros((q.shape[1], keys.shape[0]))
        for j in range(0, q.shape[2], FP8_MMA_K):
            g = q[n, :, j:j + FP8_MMA_K] @ keys[:, j:j + FP8_MMA_K].T  # exact: e4m3 products, f64 sum
            e = exponent(np.maximum(np.abs(acc), np.abs(g)))
            acc = trunc(trunc(acc, e, 13) + trunc(g, e, 13), exponent(acc + g), 13)
        scores = np.maximum(acc.astype(np.float32), np.float32(0))
        logit = np.sum(scores * w[n].astype(np.float32)[:, None], axis=0, dtype=np.float32)
        if k_scale is not None:
            logit = logit * k_scale[slots[row_seq[n]]].astype(np.float32)
        valid = np.arange(len(logit)) < row_end[n]
        out[n, valid] = logit[valid]
    return out


@pytest.mark.parametrize("hi,d,page,lengths,rows", [
    (4, 16, 4, [37, 1, 90, 12], [5, 1, 7, 3]),   # the CPU tests' tiny dims (one 32-product step)
    (64, 128, 64, [300, 130, 1], [4, 2, 1]),     # DeepSeek-V3.2's dims (four steps)
])
def test_fp8_logit_bound_rejects_wrong_logits(hi, d, page, lengths, rows):
    """The GPU tolerance for fp8 logits (fp8_logit_bound), checked on CPU: the exact reference and a
    numpy model of Hopper's truncating accumulator pass, the model within a quarter of the bound;
    a missing head, one wrong key or a missing k_scale fail."""
    args, page = make_indexer_case(11, dtype=FP8, scaled=True, hi=hi, d=d, page=page, lengths=lengths,
                                   rows_per_seq=rows)
    ref = np.asarray(reference(*args, page_size=page))
    check = functools.partial(check_fp8_logits, ref=ref, args=args, page_size=page, on_gpu=True)
    check(ref)
    modelled = _hopper_fp8_logits(args, page)
    check(modelled)
    fin = np.isfinite(ref)
    worst = (np.abs(modelled[fin] - ref[fin].astype(np.float64)) / fp8_logit_bound(args, page)[fin]).max()
    assert 0 < worst < 0.25, worst

    q, w, k, k_scale, tables, row_seq, row_end = args
    missing_head = reference(q, w.at[:, hi // 2].set(0.0), *args[2:], page_size=page)
    key_0, key_1 = np.asarray(tables)[0, 0] * page + 1, np.asarray(tables)[0, 0] * page + 2  # sequence 0's
    wrong_key = reference(q, w, k.at[key_0].set(k[key_1]), *args[3:], page_size=page)
    no_scale = reference(q, w, k, None, *args[4:], page_size=page)
    for wrong in (missing_head, wrong_key, no_scale):
        assert not np.array_equal(np.asarray(wrong), ref)
        with pytest.raises(AssertionError, match="past the fp8 accumulation bound"):
            check(wrong)


# ------------------------------------------------------------------------------------------------
# the Mosaic GPU kernels: tiling choice, and lowering at real dimensions (CPU twins of the GPU runs)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_rows,num_seqs,key_blocks,want", [
    (32, 32, 512, (1, 128)),     # B=32, 32K keys: 4 chunks a row, 128 CTAs (one wave of 132 SMs)
    (1, 1, 2048, (1, 16)),       # B=1, 128K keys: 128 chunks of 16 blocks
    (128, 128, 2048, (1, 256)),  # B=128: chunks of 256 blocks (one TMA of the block table)
    (64, 32, 512, (2, 128)),     # MTP: 2 rows per tile
])
def test_choose_decode_tiling(num_rows, num_seqs, key_blocks, want):
    t = choose_decode_tiling(num_rows, num_seqs, key_blocks, FP8, 64, 128, num_sms=132)
    step_blocks = 2 // want[0]  # 16 KiB of fp8 keys per slot and row
    stages = 4 if want[1] // step_blocks <= 8 else 12 // step_blocks  # a short chunk: at most 4 in flight
    assert (t.block_rows, t.chunk, t.step_blocks, t.stages) == want + (step_blocks, stages)
    t = choose_decode_tiling(num_rows, num_seqs, key_blocks, jnp.bfloat16, 64, 128, num_sms=132)
    assert (t.block_rows, t.chunk, t.step_blocks, t.stages) == want + (1, 4 if want[1] <= 8 else 6)
    for chunk in (6, 260):
        with pytest.raises(ValueError, match="multiple of 4"):
            choose_decode_tiling(num_rows, num_seqs, key_blocks, FP8, 64, 128, chunk=chunk)
    with pytest.raises(ValueError, match="at most 32"):
        choose_decode_tiling(num_rows, num_seqs, key_blocks, FP8, 64, 128, stages=34)
    with pytest.raises(ValueError, match="wgmma N"):
        choose_decode_tiling(num_rows, num_seqs, key_blocks, FP8, 64, 128, block_rows=8)


@pytest.mark.parametrize("hi", [8, 16, 24, 40, 64, 128])
def test_double_buffered_entries_are_tma_aligned(hi):
    """The prefill kernel keeps two tiles' metadata and weights, the second at one entry's
    bytes: TMA writes SMEM at 128-byte aligned addresses only (the GPU faults otherwise; the
    interpreter does not check), so each entry is a multiple of 128 bytes, padded no more than
    that needs."""
    for rows in range(1, 33):
        assert meta_width(rows) * 4 % TMA_SMEM_ALIGN == 0 and meta_width(rows) >= 2 + 2 * rows
        assert meta_width(rows) * 4 - TMA_SMEM_ALIGN < (2 + 2 * rows) * 4
        padded = _weight_rows(rows, hi)
        assert padded * hi * 4 % TMA_SMEM_ALIGN == 0 and padded >= rows
        assert not any(r * hi * 4 % TMA_SMEM_ALIGN == 0 for r in range(rows, padded))  # whole rows


def test_choose_prefill_tiling():
    """fp8 runs four compute warpgroups of N <= 128 (2 rows of 64 heads a wgmma), bf16 two of
    N <= 256 (4 rows), which are 2 or 4; a warpgroup per row group computes each key block (4 of
    them at 8 fp8 rows, 1 at 4 bf16 rows or 2 fp8 rows), the ring must be a multiple of the key
    blocks' phases (compute_wgs // owners), and two tiles' q and the ring must fit SMEM."""
    t = choose_prefill_tiling(8192, 1, 128, FP8, 64, 128)
    assert (t.block_rows, t.group, t.stages, t.splits, t.compute_wgs, t.owners) == (8, 2, 8, 1, 4, 4)
    t = choose_prefill_tiling(8192, 1, 128, jnp.bfloat16, 64, 128)
    assert (t.block_rows, t.group, t.compute_wgs, t.owners) == (4, 4, 2, 1)  # 2 x 4 rows of bf16 q: 128 KiB
    assert choose_prefill_tiling(8192, 1, 128, FP8, 64, 128, compute_wgs=2).group == 4
    assert choose_prefill_tiling(8192, 1, 128, FP8, 64, 128, stages=6).owners == 4  # one key phase
    assert choose_prefill_tiling(8192, 1, 128, FP8, 64, 128, block_rows=6, group=1, stages=6).owners == 2
    with pytest.raises(ValueError, match="multiple of compute_wgs=4 // gcd.* = 4"):
        choose_prefill_tiling(8192, 1, 128, FP8, 64, 128, block_rows=2, stages=6)
    with pytest.raises(ValueError, match="at most 32"):  # Mosaic's mbarriers a group (small dims)
        choose_prefill_tiling(8192, 1, 128, FP8, 8, 32, stages=36)
    with pytest.raises(ValueError, match="block_rows=8 and stages=4 need .* bytes of shared memory"):
        choose_prefill_tiling(8192, 1, 128, jnp.bfloat16, 64, 128, block_rows=8)  # 2 x 128 KiB of q
    # bf16 with four warpgroups: a ring of 8 stages leaves room for two tiles of 2 rows
    assert choose_prefill_tiling(8192, 1, 128, jnp.bfloat16, 64, 128, compute_wgs=4).block_rows == 2
    # the persistent grid: one CTA an SM (the default device's count; HOPPER_SMS where it has
    # none, as on CPU), at most one a work item
    assert choose_prefill_tiling(8192, 1, 128, FP8, 64, 128).programs == 132
    assert choose_prefill_tiling(16, 1, 1, FP8, 64, 128).programs == 2
    assert choose_prefill_tiling(8192, 1, 128, FP8, 64, 128, programs=7).programs == 7
    with pytest.raises(ValueError, match="programs=0 must be at least 1"):
        choose_prefill_tiling(8192, 1, 128, FP8, 64, 128, programs=0)
    with pytest.raises(ValueError, match="compute_wgs=3 must be one of"):
        choose_prefill_tiling(8192, 1, 128, FP8, 64, 128, compute_wgs=3)
    with pytest.raises(ValueError, match="at most 128 with compute_wgs=4"):  # N = 256 would spill
        choose_prefill_tiling(8192, 1, 128, FP8, 64, 128, group=4)
    assert choose_prefill_tiling(8192, 1, 128, FP8, 64, 128, group=4, compute_wgs=2).group == 4
    with pytest.raises(ValueError, match="multiple of group=3"):
        choose_prefill_tiling(8192, 1, 128, jnp.bfloat16, 64, 128, group=3)


def _lowers_to_mosaic_gpu(kernel, args, page_size):
    fn = jax.jit(functools.partial(indexer_logits, page_size=page_size, implementation="mosaic", kernel=kernel))
    return "mosaic_gpu" in fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("dtype,scaled", _DTYPES)
def test_mosaic_prefill_lowers_for_the_gpu(dtype, scaled):
    """CPU twin of the hardware run: the prefill kernel lowers to a Mosaic GPU module at real
    dimensions (64 heads x 128, pages of 64; the interpreter does not check layouts)."""
    sd = jax.ShapeDtypeStruct
    args = (sd((4096, 64, 128), dtype), sd((4096, 64), jnp.float32), sd((64 * 256, 128), dtype),
            sd((64 * 256,), jnp.float32) if scaled else None, sd((2, 128), jnp.int32),
            sd((4096,), jnp.int32), sd((4096,), jnp.int32))
    assert _lowers_to_mosaic_gpu("prefill", args, 64)


@pytest.mark.parametrize("dtype,scaled,rows", [(FP8, True, 1), (jnp.bfloat16, False, 1), (FP8, True, 2)])
def test_mosaic_decode_lowers_for_the_gpu(dtype, scaled, rows):
    """CPU twin of the hardware run: the decode kernel lowers to a Mosaic GPU module at real
    dimensions (B=32 sequences of 32K keys, 64 heads x 128, pages of 64; 1 or 2 rows each)."""
    sd = jax.ShapeDtypeStruct
    n, slots = 32 * rows, 32 * 32768
    args = (sd((n, 64, 128), dtype), sd((n, 64), jnp.float32), sd((slots, 128), dtype),
            sd((slots,), jnp.float32) if scaled else None, sd((32, 512), jnp.int32),
            sd((n,), jnp.int32), sd((n,), jnp.int32))
    assert _lowers_to_mosaic_gpu("decode", args, 64)


@pytest.mark.parametrize("rows_per_seq", [1, 6, 13])
def test_mosaic_decode_lowers_at_tiny_dims(rows_per_seq):
    """CPU twin of the hardware failure in test_forward's bf16 TINY config (one decode row beside
    prefill chunks of < 16 rows per sequence): tiny key blocks made a ring of 48 slots, more
    mbarriers than Mosaic GPU initialises in one group (32)."""
    cfg = MLAConfig.tiny(dtype="bfloat16")
    hi, d, page = cfg.index_n_heads, cfg.index_head_dim, cfg.page_size
    n, num_seqs, width = 3 * rows_per_seq, 3, 8
    sd = jax.ShapeDtypeStruct
    args = (sd((n, hi, d), jnp.bfloat16), sd((n, hi), jnp.float32), sd((page * num_seqs * width, d), jnp.bfloat16),
            None, sd((num_seqs, width), jnp.int32), sd((n,), jnp.int32), sd((n,), jnp.int32))
    assert _lowers_to_mosaic_gpu("decode", args, page)


@pytest.mark.parametrize("implementation,kernel,case,config", [
    param("mosaic", "prefill",
          dict(dtype=FP8, scaled=True, page=4, lengths=[37, 1, 300, 12], rows_per_seq=[5, 1, 9, 3]),
          MosaicConfig(block_rows=4, group=2, stages=4), id="mosaic_prefill-ragged"),
    param("mosaic", "prefill", dict(dtype=FP8, scaled=False, page=64, lengths=[150], rows_per_seq=[150]),
          MosaicConfig(block_rows=16, splits=3, stages=4), id="mosaic_prefill-causal"),
    param("mosaic", "decode", dict(dtype=FP8, scaled=True, page=64, lengths=[520, 1, 77], rows_per_seq=[1, 1, 1]),
          MosaicConfig(chunk=4, step_blocks=2, stages=2), id="mosaic_decode-ragged"),
    param("triton", None, dict(dtype=FP8, scaled=True, page=4, lengths=[37, 1, 90, 12], rows_per_seq=[5, 1, 7, 3]),
          TritonConfig(block_rows=2, block_keys=32, chunk=32), id="triton"),
])
def test_unclean_logits_agree_within_each_row(implementation, kernel, case, config):
    """clean=False (the layer's call: top-k reads each row's first row_end columns only): the
    columns [0, row_end) equal the clean call's bit for bit, and top-k with lengths=row_end picks
    the same keys from either."""
    args, page = make_indexer_case(3, **{**_TINY_DIMS, **case})
    row_end = np.asarray(args[6])
    clean = np.asarray(run(implementation, kernel, *args, page_size=page, config=config))
    unclean = np.asarray(run(implementation, kernel, *args, page_size=page, config=config, clean=False))
    inside = np.arange(clean.shape[1])[None, :] < row_end[:, None]
    np.testing.assert_array_equal(unclean[inside], clean[inside])
    if implementation == "mosaic":
        if INTERPRET:  # the fill was skipped: the interpreter leaves unwritten memory NaN (on a
            assert np.isnan(unclean[~inside]).any()  # GPU it holds what the buffer held before)
    else:  # the Triton kernel fills either way
        np.testing.assert_array_equal(unclean, clean)
    k = 8
    lengths = jnp.asarray(row_end, jnp.int32)
    want = np.sort(np.asarray(topk(jnp.asarray(clean), k, implementation="xla")), 1)
    for topk_implementation in ("xla", "triton"):
        got = topk(jnp.asarray(unclean), k, lengths=lengths, implementation=topk_implementation, interpret=INTERPRET)
        np.testing.assert_array_equal(np.sort(np.asarray(got), 1), want, err_msg=topk_implementation)
