"""The address formulas of the Mosaic GPU kernels' inline code (`pallas_kernels.mosaic_inline`),
on a CPU: the kernels themselves run only on a GPU (inline PTX has no interpreter), so the
formulas are checked here twice over.

  * On numpy integers, against independent statements of what they address: the shared-memory
    swizzle as CUTLASS / the PTX ISA state it on byte addresses, over a tiling done by numpy
    reshapes; the kernels' thread -> data maps against what their docstrings claim (every row and
    unit copied once, a wavefront's 8 lanes on 8 distinct bank groups, loads inside the row).
  * As MLIR: the same functions applied to `Int` constants emit the `arith` ops the kernels emit,
    and MLIR's canonicalizer folds them to the integers numpy computed (so the operator mapping,
    unsigned division included, is the one the formulas assume).
"""

import functools
import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.interpreters import mlir as jax_mlir
from jaxlib.mlir import ir, passmanager
from jaxlib.mlir.dialects import func

from pallas_kernels import mosaic_inline as mi
from pallas_kernels.sparse_mla import mosaic as sparse_mosaic
from pallas_kernels.topk import mosaic as topk_mosaic

BLOCK_K = sparse_mosaic.BLOCK_K  # rows a stage
SWIZZLE = sparse_mosaic._SWIZZLE  # the stage ring's swizzle
LOADS, BINS = topk_mosaic._LOADS, topk_mosaic._BINS  # top-k: loads a lane an iteration, histogram bins
# (latent rank, bf16 columns of a stage row: rank + rope padded to 32) of the sparse kernel's
# cases: DeepSeek's (rope 64), the odd shapes of its GPU tests (rope 8) and rank 256
STAGES = [(512, 576), (128, 160), (256, 320)]


def reference_swizzle(rows, row_bytes, swizzle):
    """[rows, row_bytes] int: the physical byte offset of each logical byte of a 2-D array under
    Mosaic's TilingTransform((8, swizzle bytes)) + SwizzleTransform(swizzle), stated independently
    of the kernels' formula: the tiles by numpy reshape (tile-major, a tile's 8 rows of swizzle
    bytes each contiguous), then the swizzle on the byte address as CUTLASS's Swizzle<B, 4, 3>
    (B = log2(swizzle / 16)) states the PTX ISA's 32 / 64 / 128-byte swizzling modes: bits
    [4, 4 + B) XOR bits [7, 7 + B)."""
    logical = np.arange(rows * row_bytes).reshape(rows // 8, 8, row_bytes // swizzle, swizzle)
    tiled = logical.transpose(0, 2, 1, 3).reshape(-1)  # tiled[p] = logical byte at address p
    unswizzled = np.empty_like(tiled)
    unswizzled[tiled] = np.arange(tiled.size)
    mask = (swizzle // 16 - 1) << 4
    return (unswizzled ^ ((unswizzled >> 3) & mask)).reshape(rows, row_bytes)


def bank_groups(addresses):
    """The 16-byte bank group (of 8: 32 banks x 4 bytes) of each 16-byte shared access."""
    return np.asarray(addresses) // 16 % 8


def test_reference_swizzle_is_the_documented_128_byte_one():
    """The reference itself, at 128 bytes: 16-byte chunk c of row r sits at chunk c XOR (r % 8)."""
    rows, row_bytes = 32, 256
    phys = reference_swizzle(rows, row_bytes, 128)
    r, b = np.meshgrid(np.arange(rows), np.arange(row_bytes), indexing="ij")
    tile = (r // 8) * (row_bytes // 128) + b // 128
    want = tile * 1024 + r % 8 * 128 + ((b % 128 // 16) ^ (r % 8)) * 16 + b % 16
    np.testing.assert_array_equal(phys, want)


def test_the_stage_ring_is_declared_with_the_swizzle_the_gathers_assume():
    tiling, swizzle = sparse_mosaic._swizzled(jnp.bfloat16)
    assert tuple(tiling.tiling) == (mi.TILE_ROWS, SWIZZLE // 2)
    assert swizzle.swizzle == SWIZZLE


@pytest.mark.parametrize("swizzle,row_bytes", [(64, 2 * width) for _, width in STAGES]
                         + [(32, 64), (128, 256), (128, 1152)])
def test_swizzled_offset_matches_the_swizzle(swizzle, row_bytes):
    ref = reference_swizzle(BLOCK_K, row_bytes, swizzle)
    rows, units = np.meshgrid(np.arange(BLOCK_K), np.arange(row_bytes // 16), indexing="ij")
    got = mi.swizzled_offset(rows, units, row_bytes=row_bytes, swizzle=swizzle)
    np.testing.assert_array_equal(got, ref[rows, units * 16])


@pytest.mark.parametrize("swizzle", [32, 64, 128])
def test_unit_stride_is_the_distance_in_the_swizzle(swizzle):
    row_bytes = 16 * swizzle
    ref = reference_swizzle(BLOCK_K, row_bytes, swizzle)
    per = swizzle // 16
    for units in range(per, row_bytes // 16, per):
        x = np.arange(row_bytes // 16 - units)
        np.testing.assert_array_equal(ref[:, (x + units) * 16] - ref[:, x * 16],
                                      mi.unit_stride(units, swizzle=swizzle))


@pytest.mark.parametrize("rank,width", STAGES)
def test_gather_units_cover_the_block_once_without_bank_conflicts(rank, width):
    """Every (row, unit) of a gather is copied by exactly one flat index, and each wavefront (8
    consecutive lanes, a thread's flat indices being its id + multiples of 128) writes 8 distinct
    bank groups."""
    ref = reference_swizzle(BLOCK_K, 2 * width, SWIZZLE)
    for per_row, first in [(rank // 8, 0), ((width - rank) // 8, rank // 8)]:  # the latent's, k_pe's
        g = np.arange(BLOCK_K * per_row)
        rows, units = mi.gather_unit(g, per_row)
        assert sorted(zip(rows.tolist(), units.tolist())) == list(itertools.product(range(BLOCK_K), range(per_row)))
        groups = bank_groups(ref[rows, (units + first) * 16]).reshape(-1, mi.WAVEFRONT_LANES)
        assert all(len(set(w)) == mi.WAVEFRONT_LANES for w in groups.tolist())


def fp8_accesses(rank):
    """(tid, row, chunk, unit) of every bf16 unit an fp8 producer thread converts, as
    `_fp8_per_thread` walks them: rows fp8_row(warp, r8, g), g < BLOCK_K / 32, chunks
    4 u + octet, u < rank / 64, units 2 chunk + h."""
    tid = np.arange(128)
    r8, octet, warp = mi.fp8_lane(tid)
    out = []
    for g, u, h in itertools.product(range(BLOCK_K // 32), range(rank // 64), range(2)):
        chunk = 4 * u + octet
        out.append((tid, mi.fp8_row(warp, r8, g), chunk, 2 * chunk + h))
    return out


@pytest.mark.parametrize("rank,width", STAGES)
def test_fp8_threads_convert_every_unit_once_without_bank_conflicts(rank, width):
    ref = reference_swizzle(BLOCK_K, 2 * width, SWIZZLE)
    owned = {}
    for tid, rows, chunks, units in fp8_accesses(rank):
        for t, j, c in zip(tid.tolist(), rows.tolist(), chunks.tolist()):
            owned.setdefault((j, c), set()).add(t)
        # a wavefront: lanes 8 q .. 8 q + 7 of a warp, tids in order
        assert all(len(set(w)) == 8 for w in bank_groups(ref[rows, units * 16]).reshape(-1, 8).tolist())
        # the kernel's shortcut: unit 8 u + 2 o + h at unit_stride(8 u) from unit 2 o + h
        u = units // 8
        np.testing.assert_array_equal(ref[rows, units * 16],
                                      ref[rows, (units % 8) * 16] + mi.unit_stride(8 * u, swizzle=SWIZZLE))
    assert set(owned) == set(itertools.product(range(BLOCK_K), range(rank // 16)))
    assert all(len(t) == 1 for t in owned.values())  # one thread a chunk


@pytest.mark.parametrize("rank,tile", [(512, 128), (512, 64), (512, 256), (512, 512), (128, 128), (256, 64)])
def test_fp8_scales_land_apart_from_every_raw_chunk(rank, tile):
    """A row's scales: 4 bytes each, disjoint, inside the row's latent units, none in a raw
    landing unit (2 c + 1) of any chunk; a copy's scales contiguous from a 16-byte (or 4-byte)
    aligned start; the copies of the two octet parities cover every scale."""
    n_scales = rank // tile
    ref = reference_swizzle(BLOCK_K, 2 * (rank + 64), SWIZZLE)  # rope 64
    k = np.arange(n_scales)
    unit, byte = mi.fp8_scale_unit(k), mi.fp8_scale_byte(k)
    assert (unit % 2 == 0).all() and (unit < rank // 8).all() and (byte + 4 <= 16).all()
    for row in range(BLOCK_K):
        at = ref[row, unit * 16] + byte
        assert len(set((at[:, None] + np.arange(4)).ravel().tolist())) == 4 * n_scales
        raw = ref[row, (2 * np.arange(rank // 16) + 1) * 16]
        assert not set((at // 16 * 16).tolist()) & set(raw.tolist())
    piece = mi.fp8_scale_copy_bytes(n_scales)
    n_pieces, per_piece = n_scales * 4 // piece, piece // 4
    firsts = {int(mi.fp8_scale_piece(half, i, n_pieces=n_pieces, scales_per_piece=per_piece))
              for half in (0, 1) for i in range(-(-n_pieces // 2))}
    assert firsts == set(range(0, n_scales, per_piece))
    for k0 in firsts:
        at = ref[:, mi.fp8_scale_unit(k0) * 16] + mi.fp8_scale_byte(k0)
        assert (at % piece == 0).all()
        for m in range(per_piece):
            k = k0 + m
            np.testing.assert_array_equal(ref[:, mi.fp8_scale_unit(k) * 16] + mi.fp8_scale_byte(k), at + 4 * m)


@pytest.mark.parametrize("n_pieces", range(1, 7))
def test_fp8_scale_pieces_alternate_between_the_octet_parities(n_pieces):
    """Parity h copies pieces h, h + 2, ... (the last again where n_pieces is odd): together every
    piece (the kernel's shapes have n_pieces <= 2; the formula is general)."""
    copies = [[int(mi.fp8_scale_piece(h, i, n_pieces=n_pieces, scales_per_piece=4))
               for i in range(-(-n_pieces // 2))] for h in (0, 1)]
    for h in (0, 1):
        assert copies[h] == [4 * min(p, n_pieces - 1) for p in range(h, n_pieces + 1, 2)][:len(copies[h])]
    assert set(copies[0] + copies[1]) == set(range(0, 4 * n_pieces, 4))


def test_lane_and_warp():
    tid = np.arange(512)
    lane, warp = mi.lane_and_warp(tid)
    np.testing.assert_array_equal(lane, tid % 32)
    np.testing.assert_array_equal(warp, tid // 32)


@pytest.mark.parametrize("vec", [1, 4])
def test_lane_vectors_cover_the_row_once_coalesced(vec):
    iters = 3
    it, j, lane = np.meshgrid(np.arange(iters), np.arange(LOADS), np.arange(32), indexing="ij")
    start = mi.lane_vector(it, j, lane * vec, vec=vec, loads=LOADS)
    elems = (start[..., None] + np.arange(vec)).ravel()
    np.testing.assert_array_equal(np.sort(elems), np.arange(iters * LOADS * 32 * vec))
    # a load of a warp: 32 vec consecutive elements, lane by lane
    np.testing.assert_array_equal(start - start[..., :1], np.broadcast_to(np.arange(32) * vec, start.shape))


@pytest.mark.parametrize("row_len", [0, 1, 3, 4, 5, 1023, 1024, 1025, 2047, 2048, 4093, 4096])
def test_sweep_loads_stay_in_the_row(row_len):
    """The top-k sweep's clamped loads (LOADS float4 a lane an iteration): 16-byte aligned, inside
    the row's float4s (the first one where the row is empty), and the float4 that holds its
    columns wherever they start inside the row."""
    iters = max(1, -(-row_len // (32 * 4 * LOADS)))
    it, j, lane = np.meshgrid(np.arange(iters), np.arange(LOADS), np.arange(32), indexing="ij")
    c0 = mi.lane_vector(it, j, lane * 4, vec=4, loads=LOADS)
    at = mi.smax(mi.smin(c0, mi.last_float4(row_len)), 0)
    assert (at % 4 == 0).all() and (at >= 0).all()
    assert (at + 4 <= max(4, -(-row_len // 4) * 4)).all()
    np.testing.assert_array_equal(at[c0 < row_len], c0[c0 < row_len])


def test_histogram_bins_descend_with_the_lane():
    """Lane L reads bins [first, first + 8): the lanes partition the bins, lane 0 the top ones,
    so an exclusive scan over lanes counts the keys above a lane's digits."""
    first = mi.first_bin(np.arange(32), BINS)
    np.testing.assert_array_equal(np.sort((first[:, None] + np.arange(8)).ravel()), np.arange(BINS))
    assert first[0] == BINS - 8 and (np.diff(first) == -8).all()


def fold(formula, samples):
    """formula applied to `Int`s (i32 constants: each sample's operands), its ops folded by MLIR's
    canonicalizer -> [len(samples), results] int: what the emitted arith ops compute."""
    with jax_mlir.make_ir_context(), ir.Location.unknown():
        module = ir.Module.create()
        with ir.InsertionPoint(module.body):
            f = func.FuncOp("f", ir.FunctionType.get([], []))
            with ir.InsertionPoint(f.add_entry_block()):
                results = []
                for args in samples:
                    out = formula(*(mi.Int(mi.c32(a)) for a in args))
                    results += [o.value for o in (out if isinstance(out, tuple) else (out,))]
                func.ReturnOp(results)
            f.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get([], [r.type for r in results]))
        passmanager.PassManager.parse("builtin.module(canonicalize)").run(module.operation)
        ret = list(f.entry_block.operations)[-1]
        values = [ir.IntegerAttr(v.owner.attributes["value"]).value for v in ret.operands]
    return np.array(values).reshape(len(samples), -1)


def on_ints(formula, samples):
    """formula on the same operands as Python integers -> [len(samples), results] int."""
    out = [formula(*args) for args in samples]
    return np.array([o if isinstance(o, tuple) else (o,) for o in out], dtype=np.int64)


FORMULAS = {
    "operators": (lambda a, b: (a + b, a - b, a * b, a // (b + 1), a % (b + 1), a ^ b, a & b, a >> (b % 32),
                                7 + a, 7 - b, 5 ^ b, mi.umin(a, b), mi.smin(a, b), mi.smax(a, b)),
                  list(itertools.product([0, 1, 7, 8, 63, 1000, 65535], [0, 1, 5, 31, 64, 999]))),
    "swizzled_offset": (functools.partial(mi.swizzled_offset, row_bytes=1152, swizzle=64),
                        list(itertools.product(range(BLOCK_K), range(72)))),
    "swizzled_offset_128": (functools.partial(mi.swizzled_offset, row_bytes=256, swizzle=128),
                            list(itertools.product(range(16), range(16)))),
    "gather_unit": (lambda g: mi.gather_unit(g, 8), [(g,) for g in range(512)]),
    "fp8_lane": (mi.fp8_lane, [(t,) for t in range(128)]),
    "fp8_row": (lambda w, r8: tuple(mi.fp8_row(w, r8, g) for g in range(BLOCK_K // 32)),
                list(itertools.product(range(4), range(8)))),
    "fp8_scale": (lambda k: (mi.fp8_scale_unit(k), mi.fp8_scale_byte(k)), [(k,) for k in range(8)]),
    "fp8_scale_piece": (lambda h: tuple(mi.fp8_scale_piece(h, i, n_pieces=3, scales_per_piece=1) for i in range(2)),
                        [(0,), (1,)]),
    "lane_and_warp": (mi.lane_and_warp, [(t,) for t in range(0, 512, 7)]),
    "lane_vector": (lambda it, lane: tuple(mi.lane_vector(it, j, lane * vec, vec=vec, loads=LOADS)
                                           for j in range(LOADS) for vec in (1, 4)),
                    list(itertools.product(range(3), range(0, 32, 5)))),
    "sweep_load": (lambda c0, n: mi.smax(mi.smin(c0, mi.last_float4(n)), 0),
                   list(itertools.product([0, 4, 1020, 1024, 4092], [0, 1, 3, 4, 5, 1024, 4096]))),
    "first_bin": (lambda lane: mi.first_bin(lane, BINS), [(lane,) for lane in range(32)]),
}


def test_int_is_unsigned():
    """Int's // and % are arith.divui / remui and >> shrui (the formulas' operands are addresses)."""
    np.testing.assert_array_equal(fold(lambda a: (a // 3, a % 3, a >> 28), [(-8,)]),
                                  [[(2**32 - 8) // 3, (2**32 - 8) % 3, (2**32 - 8) >> 28]])


@pytest.mark.parametrize("name", FORMULAS)
def test_emitted_ops_compute_what_the_formula_does_on_ints(name):
    formula, samples = FORMULAS[name]
    np.testing.assert_array_equal(fold(formula, samples), on_ints(formula, samples))
