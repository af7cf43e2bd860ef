"""What the Mosaic GPU kernels' `plgpu.inline_mgpu` bodies (raw MLIR and inline PTX) share: the
integer values, pointers and PTX helpers they are written with, and their address formulas.

`sparse_mla.mosaic` gathers cache rows into swizzled shared memory by `cp.async`, thread by
thread, and `topk.mosaic` sweeps a row a warp; neither can use Pallas' array-level indexing there,
so both compute their addresses by hand. Each address formula here is a function of integer
operands written with Python operators: while a kernel lowers, the operands are `Int`s and the
operators emit `arith` ops; given Python or numpy integers, the same function computes the same
addresses on the host, which is how tests/test_mosaic_inline.py checks them on a CPU, against
independent statements of the layouts (inline PTX has no interpreter: the kernels run only on a GPU).
"""

from __future__ import annotations

import numpy as np
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm

UNIT = 16  # bytes: a cp.async / vector shared-memory access, the swizzle's chunk
TILE_ROWS = 8  # rows of a Mosaic shared-memory tile (TilingTransform((8, ...)))
WAVEFRONT_LANES = 8  # lanes whose 16-byte shared accesses one 128-byte wavefront serves


def c32(v):
    """An i32 arith constant."""
    return arith.constant(ir.IntegerType.get_signless(32), v)


def scalar(v):
    """The ir.Value of a scalar inline_mgpu argument (a splat FragmentedArray or a value)."""
    return v.registers.flat[0] if hasattr(v, "registers") else v


class Int:
    """An integer MLIR value (i32 or i64) whose Python operators emit `arith` ops, so that an
    address formula written once runs on it (while a kernel lowers) and on Python / numpy integers
    (host tests). The ops are the unsigned / wrapping ones (+ addi, - subi, * muli, // divui,
    % remui, ^ xori, & andi, >> shrui): addresses are non-negative. An int operand becomes a
    constant of the value's type, created where Python evaluates the operator; an ir.Value
    operand is taken as it is."""

    __slots__ = ("value",)

    def __init__(self, value: ir.Value):
        self.value = value

    def _operand(self, other):
        if isinstance(other, Int):
            return other.value
        return other if isinstance(other, ir.Value) else arith.constant(self.value.type, other)

    def _op(self, op, other):
        return Int(op(self.value, self._operand(other)))

    def _rop(self, op, other):
        return Int(op(self._operand(other), self.value))

    def __add__(self, other):
        return self._op(arith.addi, other)

    def __radd__(self, other):
        return self._rop(arith.addi, other)

    def __sub__(self, other):
        return self._op(arith.subi, other)

    def __rsub__(self, other):
        return self._rop(arith.subi, other)

    def __mul__(self, other):
        return self._op(arith.muli, other)

    def __floordiv__(self, other):
        return self._op(arith.divui, other)

    def __mod__(self, other):
        return self._op(arith.remui, other)

    def __xor__(self, other):
        return self._op(arith.xori, other)

    def __rxor__(self, other):
        return self._rop(arith.xori, other)

    def __and__(self, other):
        return self._op(arith.andi, other)

    def __rshift__(self, other):
        return self._op(arith.shrui, other)


def umin(a, b):
    """Unsigned minimum (arith.minui) of an Int; the minimum of integers."""
    return a._op(arith.minui, b) if isinstance(a, Int) else np.minimum(a, b)


def smin(a, b):
    """Signed minimum (arith.minsi) of an Int; the minimum of integers."""
    return a._op(arith.minsi, b) if isinstance(a, Int) else np.minimum(a, b)


def smax(a, b):
    """Signed maximum (arith.maxsi) of an Int; the maximum of integers."""
    return a._op(arith.maxsi, b) if isinstance(a, Int) else np.maximum(a, b)


def gep(base, offset, elem):
    """&base[offset] as an llvm.ptr of base's address space, offset (an Int, an ir.Value or an
    int, made an i32 constant) counted in elements of MLIR type `elem`."""
    offset = offset.value if isinstance(offset, Int) else c32(offset) if isinstance(offset, int) else offset
    return llvm.getelementptr(base.type, base, [offset], [mgpu_utils.DYNAMIC32], elem, llvm.GEPNoWrapFlags.none)


def global_ptr(ref):
    """A global-memory (address space 1) llvm.ptr to the first element of a gmem ref."""
    return llvm.addrspacecast(llvm.PointerType.get(address_space=1), mgpu_utils.memref_ptr(ref))


def warp_sync():
    """bar.warp.sync over the whole warp: orders the lanes' earlier shared-memory accesses."""
    mgpu_utils.inline_ptx("bar.warp.sync -1;", has_side_effects=True, convergent=True)


def warp_ptx(text, *args):
    """Warp-level inline PTX (convergent: shuffles, votes, lane masks) of one i32 result."""
    return mgpu_utils.inline_ptx(text, *args, result_types=ir.IntegerType.get_signless(32), convergent=True)


def load_ptx(text, *args, n=1):
    """Inline PTX that reads memory the warp writes (n i32 results: one value, or a list), marked as
    having side effects: inline asm without them counts as reading no memory, so LLVM may merge
    two with the same address or hoist one out of a loop and move them across the writes."""
    i32 = ir.IntegerType.get_signless(32)
    out = mgpu_utils.inline_ptx(text, *args, result_types=[i32] * n, has_side_effects=True)
    return out[0] if n == 1 else out


# ------------------------------------------------------------------------------------------------
# Swizzled shared memory (sparse_mla's stage ring)
# ------------------------------------------------------------------------------------------------

def swizzled_offset(row, unit, *, row_bytes, swizzle):
    """Byte offset of 16-byte unit `unit` of row `row` in a 2-D shared-memory array of rows of
    row_bytes, laid out as Pallas' TilingTransform((8, swizzle / itemsize)) + SwizzleTransform(
    swizzle) store it (swizzle 32, 64 or 128; row_bytes a multiple of it): tiles of 8 rows x
    swizzle bytes, row-major, and within a tile unit u of row r at u XOR (r / (128 / swizzle)) (the
    swizzle XORs address bits 4.. with the bits above 7). The kernels' own copies into such an
    array (which wgmma then reads) address it so."""
    r8 = row % TILE_ROWS
    per = swizzle // UNIT  # units a tile row
    u = (unit % per) ^ (r8 // (128 // swizzle))
    tile = (row // TILE_ROWS) * (row_bytes // swizzle) + unit // per
    return tile * (TILE_ROWS * swizzle) + r8 * swizzle + u * UNIT


def unit_stride(units, *, swizzle):
    """Bytes from unit x of a row to unit x + units in `swizzled_offset`'s layout, for units a
    multiple of swizzle / 16: the same place, units / (swizzle / 16) tiles on (a constant offset
    from one computed address)."""
    return units // (swizzle // UNIT) * TILE_ROWS * swizzle


def gather_unit(g, per_row):
    """(row, unit) that flat index g (a producer thread's id + a multiple of the thread count)
    copies, per_row 16-byte units a row: consecutive lanes take WAVEFRONT_LANES consecutive rows of
    one unit, then the next unit, so a wavefront's 8 accesses are one unit of 8 consecutive rows,
    which the swizzle spreads over all 8 bank groups (8 lanes along one row would conflict)."""
    rest = g // WAVEFRONT_LANES
    return (rest // per_row) * WAVEFRONT_LANES + g % WAVEFRONT_LANES, rest % per_row


# sparse_mla's fp8 dequantisation (its `_fp8_per_thread`): each producer thread copies raw e4m3
# chunks of 16 values into the stage units that its own conversion then overwrites with the bf16.

def fp8_lane(tid):
    """(r8, octet, warp) of producer thread tid < 128: lane tid % 8 of octet tid / 8 % 4 of warp
    tid / 32. The thread converts rows `fp8_row(warp, r8, g)`, of each the 16-value chunks
    c = 4 u + octet (bf16 units 2 c and 2 c + 1; the raw chunk lands in 2 c + 1): the 8 lanes of an
    octet access one unit of 8 consecutive rows at a time (one wavefront, no bank conflict)."""
    return tid % 8, tid // 8 % 4, tid // 32


def fp8_row(warp, r8, g):
    """Block row of row group g of fp8 producer lane r8 of `warp` (of 4): 8 (warp + 4 g) + r8."""
    return (warp + 4 * g) * 8 + r8


def fp8_scale_unit(k):
    """The stage unit of a block row that receives the row's f32 scale k: unit 8 (k / 4), 4 scales
    a unit (`fp8_scale_byte`), an even unit of octet 0's, so no raw chunk lands there: the scales
    need no shared memory of their own, and the warp reads them before that unit is converted."""
    return k // 4 * 8


def fp8_scale_byte(k):
    """Byte of scale k (f32) within its `fp8_scale_unit`: 4 (k % 4)."""
    return k % 4 * 4


def fp8_scale_copy_bytes(n_scales):
    """Bytes a cp.async of a row's n_scales f32 scales copies: 16 (4 scales, one whole unit: the
    fewest copies) where the scales fill whole units, else 4 (one scale)."""
    return 16 if n_scales % 4 == 0 else 4


def fp8_scale_piece(half, i, *, n_pieces, scales_per_piece):
    """First scale of scale copy i (< ceil(n_pieces / 2)) by a row's lanes of octet parity `half`
    (0 or 1), a row's scales being n_pieces copies of scales_per_piece: pieces half, half + 2, ...
    (the last again where n_pieces is odd), so the two parities' copies together cover the row."""
    return umin(half + 2 * i, n_pieces - 1) * scales_per_piece


# ------------------------------------------------------------------------------------------------
# Warp-strided rows (top-k's sweep: one warp a row)
# ------------------------------------------------------------------------------------------------

def lane_and_warp(tid):
    """(lane, warp) of thread tid: tid % 32, tid / 32."""
    return tid & 31, tid >> 5


def lane_vector(it, j, lane_first, *, vec, loads):
    """First element of the `vec` consecutive ones that a lane reads as its load j (of `loads`) in
    iteration it over a row, lane_first = its lane x vec (computed once by the caller): load j of a
    warp covers the 32 vec elements from (32 loads it + 32 j) vec, lane by lane (coalesced)."""
    return it * (32 * vec * loads) + (32 * vec * j + lane_first)


def last_float4(row_len):
    """First element of the last 4-element (16-byte) group of a row of row_len elements that
    holds one of them (-4 if row_len is 0): loads clamped to it stay inside the row's float4s."""
    return ((row_len + 3) & -4) - 4


def first_bin(lane, bins):
    """First of the 8 histogram bins lane reads (bins = 32 x 8): lane L the bins from bins - 8 - 8 L,
    so the lanes hold the digits in descending order and an exclusive scan over the lanes counts
    the keys above a lane's digits."""
    return bins - 8 - lane * 8
