"""Dense causal MHA over packed ragged prefills: the Pallas Mosaic GPU kernel (Hopper: TMA +
wgmma, warp-specialised) behind `api.dense_mha`.

Mosaic GPU rather than Pallas-Triton: wgmma with warp-specialised TMA pipelining (Triton-lowered
attention ran ~3.4x slower; docs/design/dense_mha.md).

Bound by HBM at short sequences and by the tensor cores plus softmax at long ones; numbers and
variants: docs/design/dense_mha.md.

Parts: `_Tiling` and `_schedule` decide the work (key tiles and slots; which program takes which
item), `_producer` loads K and V, `_consumer` runs `_kv_step` (wgmma and online softmax) over an
item's key tiles and `_epilogue` stores its rows.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..device import LOG2E, MAX_SWIZZLE, SMEM_BYTES, num_sms

_WG_ROWS = 64  # query rows per consumer warpgroup (one wgmma M tile)
CONSUMER_WGS = 2  # consumer warpgroups (64 query rows each); one producer warpgroup besides
_BLOCK_Q = _WG_ROWS * CONSUMER_WGS  # query rows per kernel block
_ALIGN = 8  # rows: TMA into (8, 64)-tiled shared memory starts at a multiple of 8 rows
# Block table columns (one row per kernel block, int32), see _block_table:
_ROW0, _LO, _HI, _POS0, _KROW0, _KSHIFT, _KV_END = range(7)
_NUM_LIVE = 7  # with a selection: the block's live key tiles (an 8th column, see _selection_masks)
_WORD = 32  # keys per word of the selection bitmask
_O_COLS = 64  # output columns per store round (one 64 x 64 tile per consumer)
_ROW_LAYOUT = plgpu.Layout.WGMMA.reduce(1)  # a row statistic of a wgmma tile (max, sum, mask word)
# setmaxnreg budgets. The kernel launches 384 threads at 168 registers (65536 / 384, rounded down
# to 8): the three warpgroups' must sum to at most 3 x 168 = 504, or an increase waits forever.
_CONSUMER_REGS = 232  # each consumer: its 64 x Dv f32 accumulator, the scores and P live at once
_PRODUCER_REGS = 40  # the producer only issues TMA copies: the rest goes to the consumers


@dataclasses.dataclass(frozen=True)
class _Tiling:
    """The kernel's key tiling: block_kv keys per K / V tile (a multiple of 32 in [64, 256]: the
    selection's 32-key words, wgmma's N <= 256), streamed through num_stages (>= 2) shared-memory
    slots. ValueError on construction otherwise; `pick` also checks the shared memory. One checked
    value, since every part of the kernel reads it."""
    block_kv: int
    num_stages: int

    def __post_init__(self):
        if self.block_kv % 32 or not 64 <= self.block_kv <= 256:
            raise ValueError(f"block_kv={self.block_kv} must be a multiple of 32 in [64, 256]")
        if self.num_stages < 2:
            raise ValueError(f"num_stages={self.num_stages} must be >= 2")

    def smem_bytes(self, itemsize, d_qk, d_v):
        """Bytes of shared memory of the kernel: q and the o tiles of a block, K and V per slot."""
        return itemsize * (_BLOCK_Q * (d_qk + _O_COLS) + self.num_stages * self.block_kv * (d_qk + d_v))

    @classmethod
    def pick(cls, dtype, d_qk, d_v, block_kv=None, num_stages=None):
        """The given tiling (both or neither of block_kv, num_stages), else the first of _TILINGS
        whose shared memory fits dtype's q [., Dqk], k and v [., Dv]; ValueError where the given
        one does not fit."""
        itemsize = jnp.dtype(dtype).itemsize
        if block_kv is None and num_stages is None:
            # unsupported_reason's head dims fit the last one
            return next(t for t in _TILINGS if t.smem_bytes(itemsize, d_qk, d_v) <= SMEM_BYTES)
        if block_kv is None or num_stages is None:
            raise ValueError(f"give both block_kv and num_stages or neither; got {block_kv}, "
                             f"{num_stages}")
        tiling = cls(block_kv, num_stages)
        smem = tiling.smem_bytes(itemsize, d_qk, d_v)
        if smem > SMEM_BYTES:
            raise ValueError(f"block_kv={block_kv}, num_stages={num_stages} need {smem} bytes of "
                             f"shared memory (> {SMEM_BYTES})")
        return tiling

    def slot(self, tile):
        """The shared-memory slot of an int32 tile count >= 0: a bit-and when num_stages is a
        power of two (no signed-remainder fix-up)."""
        if self.num_stages & (self.num_stages - 1) == 0:
            return tile & (self.num_stages - 1)
        return lax.rem(tile, self.num_stages)


# by preference (measured: docs/design/dense_mha.md): the first whose shared memory fits
_TILINGS = (_Tiling(128, 2), _Tiling(64, 3), _Tiling(64, 2))


def _block_table(q_start_loc, k_start_loc, num_rows, num_blocks):
    """The kernel's work list: one row per block of _BLOCK_Q packed q rows, 8-row aligned,
    whose rows [lo, hi) are queries of one sequence (the others are computed, not stored).

    Returns ([num_blocks, 7] int32, [1] int32 count of blocks in use). Columns:
      _ROW0   packed q row of the block's row 0, divided by 8
      _LO     first block row to store (> 0 only where the sequence starts unaligned)
      _HI     end of the block rows to store (lo < hi for blocks in use)
      _POS0   position (context included) of block row 0 in the sequence: may be negative
      _KROW0  packed k row of the sequence's key 0 rounded down to 8, divided by 8
      _KSHIFT packed k row of key 0 minus 8 * _KROW0: key tiles start _KSHIFT keys early
      _KV_END keys the block reads (position of its last stored query + 1); 0 for the blocks
              that only write zeros (the padding rows q_start_loc[S]..num_rows)
    Rows are in sequence order, each sequence's last (longest) block first, so blocks in use
    come first. (No sort: the argsort that dealt the longest blocks first cost ~15 us, 4% of
    the kernel at 64x128, and the snake-order dealing balances the programs without it.)
    """
    num_seqs = q_start_loc.shape[0] - 1
    q_len = jnp.diff(q_start_loc)
    kv_len = jnp.diff(k_start_loc)
    # The padding rows form one more "sequence" that reads no keys.
    seq_start = q_start_loc
    seq_end = jnp.append(q_start_loc[1:], num_rows)
    seq_ctx = jnp.append(kv_len - q_len, 0)
    seq_krow = jnp.append(k_start_loc[:-1], 0)
    seq_base = seq_start // _ALIGN * _ALIGN
    seq_blocks = jnp.where(seq_end > seq_start, (seq_end - seq_base + _BLOCK_Q - 1) // _BLOCK_Q, 0)
    blocks_end = jnp.cumsum(seq_blocks)
    blk = jnp.arange(num_blocks, dtype=jnp.int32)
    # compare_all: one fused kernel (the default scan is a loop of small ones)
    seq = jnp.minimum(jnp.searchsorted(blocks_end, blk, side="right", method="compare_all"),
                      num_seqs).astype(jnp.int32)
    in_use = blk < blocks_end[-1]
    row0 = seq_base[seq] + (blocks_end[seq] - 1 - blk) * _BLOCK_Q
    lo = jnp.where(in_use, jnp.maximum(seq_start[seq] - row0, 0), 0)
    hi = jnp.where(in_use, jnp.minimum(seq_end[seq] - row0, _BLOCK_Q), 0)
    pos0 = seq_ctx[seq] + row0 - seq_start[seq]
    kv_end = jnp.where(in_use & (seq < num_seqs), pos0 + hi, 0)
    krow = seq_krow[seq]
    table = jnp.stack([row0 // _ALIGN, lo, hi, pos0, krow // _ALIGN, krow % _ALIGN, kv_end], axis=1)
    return table.astype(jnp.int32), blocks_end[-1:].astype(jnp.int32)


def _selection_masks(selection, q_start_loc, k_start_loc, table, key_tiles, block_kv):
    """The kernel's form of a selection: the keys each row attends, as bits and live tiles.

    selection: [T, K] int32 key positions per row (-1 padded; entries < 0 or past the row's own
    position are dropped). Key position p of sequence s sits at tile coordinate j = p + k_shift_s
    (k_shift_s = k_start_loc[s] % 8: the kernel's key tiles start on the 8-row grid), in key
    tile j // block_kv of key_tiles (coordinates past them are dropped; the kernel makes the
    rows of a block whose keys reach there NaN). table: _block_table's.
    Returns (bits [key_tiles * block_kv / 32, round_up(T, 8) + _BLOCK_Q] int32: bit j % 32 of
    bits[j // 32, r] is set when row r attends coordinate j (word-major: a warpgroup's 64 rows
    of a word are one contiguous load; zero columns past T cover the blocks' overhang);
    live tiles [num_blocks, key_tiles] int32: each table row's key tiles holding a bit of a row
    it stores, ascending, then the others; live counts [num_blocks] int32).
    No scatter with colliding writes (docs/design/dense_mha.md): the bits come from a
    [T, key_tiles * block_kv] boolean scatter with one store per (row, position), a position
    listed twice storing the same True twice (unique_indices: XLA orders no stores), packed 32
    to a word; a block's live tiles from the prefix sums over rows of each row's nonzero tiles,
    taken at the block's stored rows.
    """
    num_rows = selection.shape[0]
    num_seqs = q_start_loc.shape[0] - 1
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(q_start_loc, rows, side="right", method="compare_all") - 1,
                   0, num_seqs - 1).astype(jnp.int32)
    owned = rows < q_start_loc[-1]
    ctx = jnp.diff(k_start_loc) - jnp.diff(q_start_loc)
    pos = ctx[seq] + rows - q_start_loc[seq]
    coord = selection + (k_start_loc[seq] % _ALIGN)[:, None]
    num_coords = key_tiles * block_kv
    valid = (owned[:, None] & (selection >= 0) & (selection <= pos[:, None])
             & (coord < num_coords))
    hit = jnp.zeros((num_rows, num_coords), jnp.bool_).at[
        rows[:, None], jnp.where(valid, coord, num_coords)].set(True, mode="drop", unique_indices=True)
    weights = jnp.left_shift(jnp.uint32(1), jnp.arange(_WORD, dtype=jnp.uint32))
    words = jnp.sum(hit.reshape(num_rows, num_coords // _WORD, _WORD).astype(jnp.uint32) * weights,
                    axis=-1, dtype=jnp.uint32)  # distinct bits: their sum is their OR
    bits = jnp.pad(lax.bitcast_convert_type(words, jnp.int32).T,
                   ((0, 0), (0, -num_rows % _ALIGN + _BLOCK_Q)))
    tile_hit = jnp.any(words.reshape(num_rows, key_tiles, block_kv // _WORD) != 0, axis=-1)
    hits_before = jnp.pad(jnp.cumsum(tile_hit, axis=0, dtype=jnp.int32), ((1, 0), (0, 0)))  # [T + 1, tiles]
    first = jnp.clip(table[:, _ROW0] * _ALIGN + table[:, _LO], 0, num_rows)
    end = jnp.clip(table[:, _ROW0] * _ALIGN + table[:, _HI], first, num_rows)  # stored rows [first, end)
    live = hits_before[end] > hits_before[first]  # [num_blocks, key_tiles]
    tiles = jnp.argsort(~live, axis=1, stable=True).astype(jnp.int32)
    return bits, tiles, jnp.sum(live, axis=1, dtype=jnp.int32)


def dense_mha_mosaic(q, k, v, q_start_loc, k_start_loc, *, scale, selection=None, max_kv_len=None,
                     interpret=False, block_kv=None, num_stages=None, num_programs=None):
    """`api.dense_mha`'s kernel, on inputs it has checked.

    Work items are (block of 128 packed q rows, 8-row aligned, holding queries of one sequence,
    head), from a table built here from the start locations (traced; sequence order, each
    sequence's last block first), dealt head fastest when the real sequences average at most 128
    rows, else table row fastest (a head's blocks together, their keys reused from L2): decided
    at run time, as the padded sequence count of a caller's shape bucket says nothing of it.
    num_programs persistent blocks (default: one per SM) walk the items; each has two consumer
    warpgroups of 64 query rows and one producer warpgroup that streams block_kv-key tiles of K
    and V through num_stages shared-memory slots with TMA, continuously across items
    (block_kv, num_stages: both or neither; neither = the first of _TILINGS whose shared memory
    fits, 128 x 2 for the model's 192 / 128 head dims). An item reads only the key tiles its
    causal range reaches and masks only the diagonal ones; a consumer whose rows end in the
    first half of their last key tile reads only that half (64 keys). The consumers take turns
    on the tensor cores (one's softmax overlaps the other's matmuls) and hand the turn over
    before storing an item's output; each awaits a tile's K while the previous tile's PV
    product runs. The next item's q tile is loaded as soon as the last QK
    product has read the current one. Output leaves in 64-column pieces
    through a 64 x 64 shared-memory tile per consumer: swizzled when all 64 rows are the
    sequence's, else plain rows stored with a ladder of power-of-two-row TMA stores so no other
    sequence's rows are touched.
    TMA into swizzled shared memory needs 8-row aligned starts: query tiles start at the
    sequence's first row rounded down to 8 and key tiles likewise, and an item's last key tile
    runs past its last key. The mask of the scores drops those other sequences' (or no
    sequence's) keys; their V rows, which P = 0 would multiply (0 * NaN = NaN), are zeroed in
    shared memory before the first P.V product that reads the tile (only in masked steps whose
    tile holds such rows: none where keys start on the 8-row grid and end on a key tile
    boundary, e.g. 4 x 2048); other sequences' query rows are computed and not stored. T or Tk
    not a multiple of 8 costs a padded copy of q or of k and v.

    With a selection (masked MHA) a row attends only the keys it lists, given to the kernel as
    a bitmask and each block's list of live key tiles (`_selection_masks`, XLA ahead of the
    kernel). An item walks only its live tiles (the producer loads no other), and each step
    tests every score's bit instead of the causal mask (the bits hold causality): the rows'
    words of the tile are loaded from global memory (L2-resident across the heads) before the
    QK product is awaited. Both consumers walk every live tile (no per-warpgroup trimming, no
    half steps), and a row's running max stays -inf until its first selected key. Rows of a
    block whose last position + k_shift lies past the bitmask (max_kv_len + 7 keys, rounded up
    to a tile) come out NaN.
    """
    num_rows, heads, d_qk = q.shape
    d_v = v.shape[2]
    tiling = _Tiling.pick(q.dtype, d_qk, d_v, block_kv, num_stages)
    if num_rows == 0:
        return jnp.zeros((0, heads, d_v), q.dtype)
    num_seqs = q_start_loc.shape[0] - 1
    # sum over sequences (and the padding) of ceil((rows + 7) / _BLOCK_Q) is at most this
    num_blocks = (num_rows + (num_seqs + 1) * (_ALIGN - 1 + _BLOCK_Q - 1)) // _BLOCK_Q
    if num_programs is None:
        num_programs = num_sms()
    table, blocks_used = _block_table(q_start_loc, k_start_loc, num_rows, num_blocks)
    # Head fastest in the item order when the real sequences average at most one block: nothing
    # to reuse from L2 across a sequence's blocks then, and the concurrent items read (and write)
    # neighbouring heads of the same rows. Else table row fastest, keeping a head's blocks
    # together (their keys are reused from L2).
    real_seqs = jnp.sum(jnp.diff(q_start_loc) > 0)
    heads_per_group = jnp.where(q_start_loc[-1] <= real_seqs * _BLOCK_Q, heads, 1)
    order = jnp.concatenate([blocks_used, heads_per_group[None].astype(jnp.int32)])  # [2] int32
    masks = ()
    if selection is not None:
        key_tiles = -(-(max_kv_len + _ALIGN - 1) // tiling.block_kv)
        bits, tiles, num_live = _selection_masks(selection, q_start_loc, k_start_loc, table, key_tiles,
                                                 tiling.block_kv)
        table = jnp.concatenate([table, num_live[:, None]], axis=1)
        masks = (bits, tiles)
    pad_rows = (lambda x: jnp.pad(x, ((0, -x.shape[0] % _ALIGN), (0, 0), (0, 0))))
    if num_rows % _ALIGN:
        q = pad_rows(q)
    if k.shape[0] % _ALIGN:
        k, v = pad_rows(k), pad_rows(v)
    call = functools.partial(_attention_call, num_programs=min(num_programs, num_blocks * heads),
                             scale=float(scale), tiling=tiling, interpret=interpret)
    if interpret:
        with plgpu.force_gpu_interpret_mode():
            return call(table, order, q, k, v, *masks)[:num_rows]
    return call(table, order, q, k, v, *masks)[:num_rows]


def _attention_call(table, order, q, k, v, *masks, num_programs, scale, tiling, interpret):
    """The kernel over num_programs persistent programs: [T8, H, Dv] in q.dtype from table
    (`_block_table`'s, with _NUM_LIVE given masks), order [2] int32 (table rows in use, heads per
    item group), q [T8, H, Dqk], k [Tk8, H, Dqk], v [Tk8, H, Dv] (T8, Tk8 multiples of 8) and
    masks: () or `_selection_masks`' (bits, live tiles)."""
    num_rows, heads, d_qk = q.shape
    d_v = v.shape[2]
    dtype = q.dtype
    block_kv, num_stages = tiling.block_kv, tiling.num_stages
    # exp2 of scores pre-multiplied by scale * log2(e): one FMA per score
    qk_scale = scale * LOG2E

    def kernel(*refs):  # Mosaic GPU names the kernel's module after this function
        operands, scratch = refs[:6 + len(masks)], refs[6 + len(masks):]
        if not masks:
            operands = (*operands[:5], None, None, operands[5])
        refs = _Refs(*operands, *scratch, *([] if interpret else [None]))
        wg = lax.axis_index("wg")
        pl.when(wg < CONSUMER_WGS)(lambda: _consumer(refs, wg, tiling, num_programs, qk_scale))
        pl.when(wg == CONSUMER_WGS)(lambda: _producer(refs, tiling, num_programs))

    def swizzled(swizzle=MAX_SWIZZLE):
        return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
                plgpu.SwizzleTransform(swizzle))

    # 128-byte swizzle: 64 bf16 columns per swizzled tile row. V is the B operand of P.V,
    # contracted over block_kv keys: its swizzle must span a divisor of block_kv (64 keys at
    # 128 bytes, 32 at 64).
    v_swizzle = MAX_SWIZZLE if block_kv % 64 == 0 else MAX_SWIZZLE // 2
    scratch = [
        plgpu.SMEM((CONSUMER_WGS, _WG_ROWS, d_qk), dtype, transforms=swizzled()),
        # the o tile: swizzled for whole 64-row stores, plain (any row slice is a TMA box) for
        # the partial ones at sequence edges
        plgpu.RefUnion((plgpu.SMEM((CONSUMER_WGS, _WG_ROWS, _O_COLS), dtype,
                                   transforms=swizzled()),),
                       (plgpu.SMEM((CONSUMER_WGS, _WG_ROWS, _O_COLS), dtype),)),
        plgpu.SMEM((num_stages, block_kv, d_qk), dtype, transforms=swizzled()),
        plgpu.SMEM((num_stages, block_kv, d_v), dtype, transforms=swizzled(v_swizzle)),
        plgpu.Barrier(num_barriers=CONSUMER_WGS),
        plgpu.Barrier(num_barriers=num_stages),
        plgpu.Barrier(num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=CONSUMER_WGS, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=CONSUMER_WGS, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=CONSUMER_WGS),
    ]
    if interpret:
        scratch.append(plgpu.SMEM((CONSUMER_WGS, _WG_ROWS, block_kv), dtype,
                                  transforms=swizzled(v_swizzle)))
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((num_rows, heads, d_v), dtype),
        scratch_types=scratch,
        grid=(num_programs,),
        grid_names=("program",),
        num_threads=CONSUMER_WGS + 1,
        thread_name="wg",
        # No auto barriers: no thread reads shared memory it wrote (the o tile is read by TMA;
        # q, k, v tiles are written by TMA). No reduction scratch: the row reductions of the
        # wgmma layout stay within warps (its 2 KB default is most of what two 128-key stages
        # leave free).
        compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True,
                                             reduction_scratch_bytes=0),
    )(table, order, q, k, v, *masks)


class _Refs(NamedTuple):
    """The kernel's refs in plgpu.kernel's order (operands, output, scratch; S = num_stages,
    B = block_kv): one record, since producer, consumers and epilogue share them."""
    table: Any  # [num_blocks, 7 (8 with a selection)] int32 in GMEM: _block_table's rows
    order: Any  # [2] int32: table rows in use, heads per item group
    q: Any  # [T8, H, Dqk] (bf16 / f16, as all tiles)
    k: Any  # [Tk8, H, Dqk]
    v: Any  # [Tk8, H, Dv]
    bits: Any  # selection bitmask words [key tiles * B / 32, T8 + 128] int32, or None
    tiles: Any  # live key tiles [num_blocks, key tiles] int32, or None (no selection)
    out: Any  # [T8, H, Dv]
    q_smem: Any  # [2, 64, Dqk]: each consumer's q tile
    o_smems: Any  # [2, 64, 64] o tiles, as ((swizzled,), (plain,))
    k_smem: Any  # [S, B, Dqk]
    v_smem: Any  # [S, B, Dv]
    q_ready: Any  # [2] barriers: a consumer's q tile landed
    k_ready: Any  # [S]: a slot's K landed
    v_ready: Any  # [S]: a slot's V landed
    k_free: Any  # [S], 2 arrivals: both consumers' QK products read the slot's K
    v_free: Any  # [S], 2 arrivals: both consumers' PV products read the slot's V
    turn: Any  # 2 arrivals: the consumers' turns on the tensor cores (`_take_turn`)
    p_smem: Any  # interpreter only: [2, 64, B] P tiles (else None)

    @property
    def selective(self):
        return self.bits is not None


def _aligned_rows(row_div8, offset):
    """row_div8 * 8 + offset, written so Mosaic sees a multiple of 8 (offset: one too)."""
    return row_div8 * _ALIGN + offset


def _item_tiles(refs, tiling, info):
    """An item's key tiles (int32; info: its table row): its live tiles with a selection, else
    those its causal range reaches."""
    if refs.selective:
        return info[_NUM_LIVE]
    return (info[_KV_END] + info[_KSHIFT] + tiling.block_kv - 1) // tiling.block_kv


def _key_tile(refs, info, step):
    """The key tile of an item's step: its live tiles in order, else every tile from 0."""
    return refs.tiles[info[-1], step] if refs.selective else step


def _take_turn(turn, step=None):
    """Rendezvous of the two consumers at the turn barrier: with one of them a half step ahead,
    this makes one's softmax run while the other's matmuls do. An item's first turn (step 0)
    was arrived at before the previous item's epilogue (or before the first item), so the other
    consumer's last PV product ran meanwhile: it only waits. Each consumer alternates arrive and
    wait, so no phase counts two arrivals of one consumer."""
    if step is None:
        plgpu.barrier_arrive(turn)
    else:
        pl.when(step != 0)(lambda: plgpu.barrier_arrive(turn))
    plgpu.barrier_wait(turn)


def _schedule(refs, num_programs):
    """(this program's item count, item_info(i) -> (head, (*table row i's columns, its index)));
    int32 scalars. Items (head, table row), in groups of heads_per_group heads (refs.order:
    [table rows in use, heads_per_group]), table row fastest across a group and head fastest
    within it, are dealt out in rounds of num_programs, in snake order (odd rounds right to
    left): with plain round robin a program whose position recurs in the table (num_programs a
    multiple of the rows per head) met the same block length every round. Each warpgroup calls
    it after its register reallocation: ptxas spills values live across setmaxnreg to local
    memory."""
    heads = refs.q.shape[1]
    num_used = refs.order[0]
    heads_per_group = refs.order[1]
    program = lax.axis_index("program")
    num_total = num_used * heads
    last_round = num_total // num_programs

    def position(i):
        return jnp.where(i % 2 == 0, program, num_programs - 1 - program)

    def item_info(i):
        # (head, table row) of this program's item i; in range even past its last item
        item = i * num_programs + position(i)
        group_items = heads_per_group * num_used
        group = item // group_items
        within = item - group * group_items
        blk = within // heads_per_group
        head = group * heads_per_group + (within - blk * heads_per_group)
        # the table row's columns, then its index (the row of its live tiles)
        return head, (*(refs.table[blk, c] for c in range(refs.table.shape[1])), blk)

    num_items = last_round + (position(last_round) < num_total % num_programs).astype(
        jnp.int32)
    return num_items, item_info


def _producer(refs, tiling, num_programs):
    """The producer warpgroup: TMA loads of each item's key tiles, K [block_kv, Dqk] and V
    [block_kv, Dv] of the item's head, into the slots in turn, each once both consumers freed
    it. Why a warpgroup of its own: the loads run ahead of the math, across items."""
    plgpu.set_max_registers(_PRODUCER_REGS, action="decrease")
    num_items, item_info = _schedule(refs, num_programs)
    block_kv, num_stages = tiling.block_kv, tiling.num_stages

    def item_body(i, carry):
        tile0, head, info = carry
        next_head, next_info = item_info(i + 1)  # loaded early, used next iteration

        @pl.loop(0, _item_tiles(refs, tiling, info))
        def _fetch(step):
            tile = tile0 + step
            slot = tiling.slot(tile)
            keys = pl.ds(_aligned_rows(info[_KROW0], _key_tile(refs, info, step) * block_kv), block_kv)

            @pl.when(tile >= num_stages)
            def _():
                plgpu.barrier_wait(refs.k_free.at[slot])

            plgpu.copy_gmem_to_smem(refs.k.at[keys, head], refs.k_smem.at[slot], refs.k_ready.at[slot])

            @pl.when(tile >= num_stages)
            def _():
                plgpu.barrier_wait(refs.v_free.at[slot])

            plgpu.copy_gmem_to_smem(refs.v.at[keys, head], refs.v_smem.at[slot], refs.v_ready.at[slot])

        return tile0 + _item_tiles(refs, tiling, info), next_head, next_info

    tiles, _, _ = lax.fori_loop(0, num_items, item_body, (jnp.int32(0), *item_info(0)))

    # Observe the last releases too: every barrier phase is waited on before exit.
    @pl.loop(jnp.maximum(tiles - num_stages, 0), tiles)
    def _drain(tile):
        slot = tiling.slot(tile)
        plgpu.barrier_wait(refs.k_free.at[slot])
        plgpu.barrier_wait(refs.v_free.at[slot])


def _load_q(refs, wg, q_tile, head, info):
    """TMA of consumer wg's 64 q rows [64, Dqk] of an item (head, table row info) into q_tile."""
    rows = pl.ds(_aligned_rows(info[_ROW0], wg * _WG_ROWS), _WG_ROWS)
    plgpu.copy_gmem_to_smem(refs.q.at[rows, head], q_tile, refs.q_ready.at[wg])


def _consumer(refs, wg, tiling, num_programs, qk_scale):
    """Consumer warpgroup wg (0 or 1): for each item of its program, its 64 query rows of the
    item's block attend the item's key tiles (`_attend`, `_skip_step`), f32 softmax statistics
    [64] and accumulator [64, Dv] normalised and stored (`_epilogue`). Why two consumers: one's
    softmax runs while the other's matmuls do (`_take_turn`)."""
    plgpu.set_max_registers(_CONSUMER_REGS, action="increase")
    num_items, item_info = _schedule(refs, num_programs)
    block_kv, selective = tiling.block_kv, refs.selective
    d_v = refs.v.shape[2]
    q_tile = refs.q_smem.at[wg]
    # one 64 x 64 tile per consumer, seen two ways (see _epilogue)
    (o_swizzled,), (o_plain,) = refs.o_smems
    o_tiles = o_swizzled.at[wg], o_plain.at[wg]
    load_q = functools.partial(_load_q, refs, wg, q_tile)
    take_turn = functools.partial(_take_turn, refs.turn)

    @pl.when(num_items > 0)
    def _():
        load_q(*item_info(0))

    pl.when(wg == 1)(take_turn)
    plgpu.barrier_arrive(refs.turn)  # the first item's first turn

    def item_body(i, carry):
        tile0, head, info = carry
        # the next item's table row, loaded now so its latency hides under this item
        next_head, next_info = item_info(i + 1)
        k_shift = info[_KSHIFT]
        # rows [lo, hi) of this warpgroup's 64 are queries of the item's sequence
        lo = jnp.clip(info[_LO] - wg * _WG_ROWS, 0, _WG_ROWS)
        hi = jnp.clip(info[_HI] - wg * _WG_ROWS, lo, _WG_ROWS)
        wg_pos0 = info[_POS0] + wg * _WG_ROWS
        tiles = _item_tiles(refs, tiling, info)
        causal_steps = tiles if selective else (wg_pos0 + hi + k_shift + block_kv - 1) // block_kv
        steps = jnp.where((hi > lo) & (info[_KV_END] > 0), causal_steps, 0)
        # warpgroup 1 zeroes the foreign V rows of the tiles after warpgroup 0's last
        # (warpgroup 0 holds rows of every block in use: _LO < 8)
        hi0 = jnp.clip(info[_HI], 0, _WG_ROWS)
        steps0 = tiles if selective else (info[_POS0] + hi0 + k_shift + block_kv - 1) // block_kv
        zero_from = jnp.where(wg == 0, 0, steps0)
        plgpu.barrier_wait(refs.q_ready.at[wg])
        pl.when(steps > 0)(lambda: plgpu.barrier_wait(refs.k_ready.at[tiling.slot(tile0)]))
        carry = (
            plgpu.layout_cast(jnp.zeros((_WG_ROWS, d_v), jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((_WG_ROWS,), -jnp.inf, jnp.float32), _ROW_LAYOUT),
            plgpu.layout_cast(jnp.zeros((_WG_ROWS,), jnp.float32), _ROW_LAYOUT),
        )
        has_next = i + 1 < num_items

        def after_qk(step):
            # the q tile is free once the item's last QK product is read: fetch the next
            pl.when((step == steps - 1) & has_next)(lambda: load_q(next_head, next_info))

        step_fn = functools.partial(_kv_step, refs, wg, q_tile, tiling, qk_scale, tile0=tile0,
                                    wg_pos0=wg_pos0, k_shift=k_shift, after_qk=after_qk, steps=steps,
                                    kv_end=info[_KV_END], zero_from=zero_from, keys=block_kv, info=info)
        acc, _, l_i = _attend(refs, tiling, step_fn, carry, info, steps, wg_pos0, lo, hi, k_shift)

        @pl.when(has_next & (steps == 0))
        def _():
            load_q(next_head, next_info)  # no QK product read the q tile: fetch now

        lax.fori_loop(steps, tiles, functools.partial(_skip_step, refs, tiling, tile0=tile0), None)
        pl.when(tiles > 0)(lambda: plgpu.barrier_arrive(refs.turn))  # the next item's first turn
        # l_i >= 1 in any row that saw a key; rows that saw none (zero blocks) stay 0
        inv_l = 1.0 / jnp.where(l_i > 0, l_i, 1.0)
        if selective:  # keys past the bitmask were dropped: NaN rather than partly attended
            num_coords = refs.bits.shape[0] * _WORD  # the key coordinates the bitmask covers
            inv_l = inv_l + jnp.where(info[_KV_END] + k_shift > num_coords, jnp.nan, 0.0)
        _epilogue(refs, wg, o_tiles, acc * lax.broadcast_in_dim(inv_l, acc.shape, [0]), head, info,
                  lo, hi)
        return tile0 + tiles, next_head, next_info

    lax.fori_loop(0, num_items, item_body, (jnp.int32(0), *item_info(0)))
    plgpu.barrier_wait(refs.turn)  # the last arrival in advance
    pl.when(wg == 0)(take_turn)
    plgpu.wait_smem_to_gmem(0)


def _attend(refs, tiling, step_fn, carry, info, steps, wg_pos0, lo, hi, k_shift):
    """Runs a consumer's `steps` key tiles of an item through step_fn (`_kv_step` bound to the
    item) from carry (acc [64, Dv], m [64], l [64] f32) and returns the last carry. With a
    selection every live tile, bit-masked (the bits hold causality); else masked steps only where
    the causal mask or a foreign key reaches, the last one a half step where the rows end in its
    first half. Why several loops: each traces one static form of the step."""
    if refs.selective:
        return lax.fori_loop(0, steps, functools.partial(step_fn, masked=True),
                             (*carry, _key_tile(refs, info, 0)))[:3]
    block_kv = tiling.block_kv
    # Unmasked: key tiles after the first when that one starts k_shift keys early,
    # and entirely at or before the position of query row lo.
    first_full = jnp.minimum(jnp.where(k_shift > 0, 1, 0), steps)
    end_full = jnp.clip((wg_pos0 + lo + 1 + k_shift) // block_kv, first_full, steps)
    carry = lax.fori_loop(0, first_full, functools.partial(step_fn, masked=True), carry)
    carry = lax.fori_loop(first_full, end_full, functools.partial(step_fn, masked=False), carry)
    # The last masked tile as a half step when the last row's position falls in its
    # first half (warpgroup 0 of every block of an aligned prefill): a quarter of the
    # diagonal tiles' matmuls skipped. Half steps need block_kv / 2 a multiple of 64
    # (V's 128-byte swizzle spans 64 keys).
    halves = block_kv % 128 == 0
    half_keys = block_kv // 2
    half_last = halves & (end_full < steps) & (
        wg_pos0 + hi - 1 < (steps - 1) * block_kv - k_shift + half_keys)
    masked_end = steps - half_last.astype(jnp.int32)
    carry = lax.fori_loop(end_full, masked_end, functools.partial(step_fn, masked=True), carry)
    if halves:
        carry = lax.fori_loop(masked_end, steps, functools.partial(
            step_fn, masked=True, keys=half_keys), carry)
    return carry


def _kv_step(refs, wg, q_tile, tiling, qk_scale, step, carry, *, tile0, wg_pos0, k_shift, masked,
             after_qk, steps, kv_end, zero_from, keys, info):
    """One key tile of consumer wg's item: S = q_tile [64, Dqk] . K^T [Dqk, keys] (wgmma, f32),
    masked (causal and foreign keys, or the selection's bits), online softmax in log2 units
    (running max m and sum l [64] f32), acc [64, Dv] f32 += P (q's dtype) . V [keys, Dv].
    carry: (acc, m, l), plus the step's key tile with a selection. Reads the tile's first `keys`
    keys (< block_kv: see `_attend`'s half step). Its K tile was awaited before the item's loops
    (step 0) or during the previous step's PV product. Selective: the next step's tile is loaded
    now (its first use is a step away) and this tile's bitmask words too. Why one function: the
    turn-taking interleaves the matmuls and the softmax within it."""
    selective = refs.selective
    block_kv = tiling.block_kv
    if selective:
        acc, m_i, l_i, tile = carry
        next_tile = _key_tile(refs, info, jnp.minimum(step + 1, refs.tiles.shape[1] - 1))
        words = _load_words(refs, wg, info, tile, block_kv // _WORD)
    else:
        acc, m_i, l_i = carry
        tile = step
    slot = tiling.slot(tile0 + step)
    k_tile, v_tile = refs.k_smem.at[slot], refs.v_smem.at[slot]
    if keys < block_kv:
        k_tile, v_tile = k_tile.at[pl.ds(0, keys)], v_tile.at[pl.ds(0, keys)]
    zeroes = None
    if masked:
        # Only masked steps read rows of other sequences (or none's): the first tile
        # starts k_shift keys early, the item's last tile runs past its last key.
        # Their V rows are zeroed in shared memory before the first P.V product that
        # reads the tile, by the consumer that runs it first: warpgroup 0, or 1 on
        # the tiles after warpgroup 0's last (zero_from: the first step this
        # consumer zeroes). Whole tile: the other consumer may read past a half step.
        key0 = tile * block_kv - k_shift
        zeroes = (step >= zero_from) & ((key0 < 0) | (key0 + block_kv > kv_end))

        @pl.when(zeroes)
        def _():
            plgpu.barrier_wait(refs.v_ready.at[slot])
            _zero_foreign_values(refs.v_smem.at[slot], key0, kv_end, block_kv, refs.v.shape[2])

    def qk_product(acc_ref):
        plgpu.wgmma(acc_ref, q_tile, k_tile.transpose((1, 0)))
        _take_turn(refs.turn, step)
        return acc_ref[...]

    s = pl.run_scoped(qk_product, plgpu.ACC((_WG_ROWS, keys), jnp.float32))
    plgpu.barrier_arrive(refs.k_free.at[slot])
    after_qk(step)
    if selective:
        s = _select(s, words)
    elif masked:
        # key 0 of the sequence sits k_shift columns into tile 0
        q_pos = wg_pos0 + plgpu.broadcasted_iota(
            jnp.int32, (_WG_ROWS, keys), 0, layout=plgpu.Layout.WGMMA)
        k_pos = (step * block_kv - k_shift) + plgpu.broadcasted_iota(
            jnp.int32, (_WG_ROWS, keys), 1, layout=plgpu.Layout.WGMMA)
        s = jnp.where((k_pos <= q_pos) & (k_pos >= 0), s, -jnp.inf)
    # the scale rides on the max and on one FMA per score
    m_new = jnp.maximum(m_i, s.max(axis=1) * qk_scale)
    # selective: rows with no selected key yet keep m = -inf, exponentiated from 0
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if selective else m_new
    p = jnp.exp2(s * qk_scale - lax.broadcast_in_dim(m_use, s.shape, [0]))
    alpha = jnp.exp2(m_i - m_use)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    if zeroes is None:
        l_i = l_i * alpha  # + p's row sums, added while the tensor cores work
    p16 = p.astype(q_tile.dtype)
    plgpu.barrier_arrive(refs.turn)
    if zeroes is None:
        plgpu.barrier_wait(refs.v_ready.at[slot])
    else:
        pl.when(~zeroes)(lambda: plgpu.barrier_wait(refs.v_ready.at[slot]))
        # after the branch, in the basic block of the row sums' addition: one FMA,
        # as before the branch existed (the outputs stay bit-identical)
        l_i = l_i * alpha
    plgpu.barrier_wait(refs.turn)

    def await_next_k():
        # Off the path from this PV product's end to the next QK product's issue.
        # Each barrier phase is awaited exactly once: Mosaic flips a barrier's phase
        # bit on every wait, so a second wait would wait for the next phase.
        pl.when(step + 1 < steps)(
            lambda: plgpu.barrier_wait(refs.k_ready.at[tiling.slot(tile0 + step + 1)]))

    if refs.p_smem is not None:
        # The interpreter has no register operands or pre-initialised accumulators
        # for wgmma: P goes through shared memory and the product is added.
        p_tile = refs.p_smem.at[wg, :, pl.ds(0, keys)]
        p_tile[...] = p16

        def pv_alone(acc_ref):
            plgpu.wgmma(acc_ref, p_tile, v_tile)
            return acc_ref[...]

        acc = acc + pl.run_scoped(pv_alone, plgpu.ACC((_WG_ROWS, acc.shape[1]), jnp.float32))
        l_i = l_i + p.sum(axis=1)
        await_next_k()
    else:
        def pv_then_sum(state):
            acc_ref, l_ref = state
            plgpu.wgmma(acc_ref, p16, v_tile)
            l_ref[...] += p.sum(axis=1)  # while the tensor cores work
            await_next_k()

        acc, l_i = pl.run_state(pv_then_sum)((plgpu.ACC.init(acc), l_i))
    plgpu.barrier_arrive(refs.v_free.at[slot])
    if selective:
        return acc, m_new, l_i, next_tile
    return acc, m_new, l_i


def _zero_foreign_values(v_tile, key0, kv_end, block_kv, d_v):
    """Zeroes the rows of a landed V tile [block_kv, Dv] whose keys (key0 + row) lie outside
    [0, kv_end): other sequences' rows or rows no sequence owns, which the P.V product would
    multiply by P = 0 (NaN or inf there would leak into every row). Keys kv_end.. of the item's
    own sequence are zeroed too: no stored row sees them. Only 64-row pieces holding such rows
    are rewritten (the last one overlaps the one before it where block_kv is not a multiple of
    64), 64 columns at a time."""
    v_pieces = sorted({*range(0, block_kv - _WG_ROWS + 1, _WG_ROWS), block_kv - _WG_ROWS})
    for n, r0 in enumerate(v_pieces):
        if n and r0 < v_pieces[n - 1] + _WG_ROWS:
            plgpu.commit_smem()  # overlap: the piece before's stores land first

        @pl.when((key0 + r0 < 0) | (key0 + r0 + _WG_ROWS > kv_end))
        def _(r0=r0):
            cols = min(64, d_v)
            keys = key0 + r0 + plgpu.broadcasted_iota(
                jnp.int32, (_WG_ROWS, cols), 0, layout=plgpu.Layout.WGMMA)
            keep = (keys >= 0) & (keys < kv_end)
            for c0 in range(0, d_v, cols):
                piece = v_tile.at[pl.ds(r0, _WG_ROWS), pl.ds(c0, cols)]
                piece[...] = jnp.where(
                    keep, plgpu.load(piece, layout=plgpu.Layout.WGMMA), 0)
    # generic-proxy stores before any wgmma (async proxy) read of the tile: this
    # warpgroup's after the fence and barrier, the other consumer's after the
    # release / acquire of the turn barrier that orders its P.V product after ours
    plgpu.commit_smem()


def _load_words(refs, wg, info, tile, tile_words):
    """Consumer wg's rows' bitmask words of key tile `tile`: tile_words [64] int32 (row layout)."""
    rows = pl.ds(_aligned_rows(info[_ROW0], wg * _WG_ROWS), _WG_ROWS)
    return [plgpu.load(refs.bits.at[tile * tile_words + w, rows], layout=_ROW_LAYOUT,
                       optimized=False) for w in range(tile_words)]


def _select(s, words):
    """Scores s [64, block_kv] f32 with -inf where the key's bit is clear (bit c % 32 of word
    c // 32 of `words`, column c)."""
    cols = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
    word = lax.broadcast_in_dim(words[0], s.shape, [0])
    for w in range(1, len(words)):
        word = jnp.where(cols >= w * _WORD, lax.broadcast_in_dim(words[w], s.shape, [0]),
                         word)
    bit = lax.shift_right_logical(word, cols & (_WORD - 1)) & 1
    return jnp.where(bit != 0, s, -jnp.inf)


def _skip_step(refs, tiling, step, _, *, tile0):
    """A tile only the other consumer needs: released once it has landed, with the turn-taking
    kept in step."""
    slot = tiling.slot(tile0 + step)
    plgpu.barrier_wait(refs.k_ready.at[slot])
    plgpu.barrier_arrive(refs.k_free.at[slot])
    _take_turn(refs.turn, step)
    plgpu.barrier_wait(refs.v_ready.at[slot])
    plgpu.barrier_arrive(refs.v_free.at[slot])
    _take_turn(refs.turn)


def _epilogue(refs, wg, o_tiles, out, head, info, lo, hi):
    """Stores consumer wg's rows [lo, hi) of out [64, Dv] f32 (normalised) in refs.out's dtype at
    its rows of the item's block, head `head`, 64 columns at a time through its o tile (o_tiles:
    (swizzled, plain) views): swizzled when all 64 rows are the sequence's, else plain rows with
    a ladder of power-of-two-row TMA stores, so no other sequence's rows are touched."""
    o_swizzled, o_plain = o_tiles
    wg_row0 = _aligned_rows(info[_ROW0], wg * _WG_ROWS)
    count = hi - lo
    whole = count == _WG_ROWS
    for col0 in range(0, out.shape[1], _O_COLS):
        cols = pl.ds(col0, _O_COLS)
        piece = out[:, col0:col0 + _O_COLS].astype(refs.out.dtype)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the o tile's last stores

        @pl.when(whole)
        def _():
            # all 64 rows: through the swizzled view (bank-conflict-free writes)
            o_swizzled[...] = piece
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_swizzled, refs.out.at[pl.ds(wg_row0, _WG_ROWS), head, cols])

        @pl.when(~whole)
        def _():
            # rows [lo, hi): plain rows, one TMA per set bit of hi - lo, largest first
            o_plain[...] = piece
            plgpu.commit_smem()
            stored = lo
            size = _WG_ROWS // 2
            while size >= 1:
                @pl.when((count & size) != 0)
                def _store(size=size, stored=stored):
                    plgpu.copy_smem_to_gmem(
                        o_plain.at[pl.ds(stored, size)],
                        refs.out.at[pl.ds(wg_row0 + stored, size), head, cols])
                stored = stored + (count & size)
                size //= 2
