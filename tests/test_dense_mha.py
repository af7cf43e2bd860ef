"""Dense causal MHA over packed ragged prefills, every implementation against the float32 reference.

Implementations (`pallas_kernels.dense_mha.dense_mha(..., implementation=)`): "xla"
(`dense_mha_reference`, jnp, float32: the XLA path and oracle, itself checked against a naive
per-sequence numpy computation) and "mosaic"
(the Mosaic GPU kernel: bf16 / f16, head dims multiples of 64; on CPU it runs in Mosaic GPU
interpret mode, which needs a CPU thread per kernel warpgroup: `ops.dense_mha_unsupported`).
Kernel errors are relative, ||out - ref|| / ||ref|| over the rows sequences own;
tolerance 1e-2 for bf16/f16 inputs: the kernel rounds the softmax probabilities to the input
dtype before the P.V product (as flash attention does) and rounds its output to it; observed
errors are ~2e-3. Rows no sequence owns must be exactly 0, and rows outside every sequence are
poisoned with large values in q, k and v so that reading them would show. The isolation tests
(every implementation) plant NaN / inf in other sequences' rows and unowned rows: a row's output
depends on its own sequence alone (no 0 * NaN through masked probabilities), and its own
non-finite values show. The `gpu` twin compiles the kernel at real sizes.
Small num_programs make each persistent program walk several (block, head) items.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.dense_mha import MosaicConfig, XlaConfig, dense_mha, unsupported_reason
from tests.support import INTERPRET, ops

OP = "dense_mha"
param = functools.partial(ops.implementation_param, OP)
KERNELS = [param("mosaic")]

TOL = 1e-2
POISON = 300.0


def require(implementation, q, v):
    """Skip unless `implementation` runs q, v's dtype and head dims here."""
    reason = ops.dense_mha_unsupported(implementation, q.dtype, q.shape[-1], v.shape[-1])
    if reason:
        pytest.skip(f"{implementation}: {reason}")


def run(implementation, q, k, v, q_start, k_start, **kw):
    """dense_mha by `implementation` (interpret mode off the GPU), skipped where it cannot run here;
    kw: dense_mha's (scale, selection, max_kv_len, config)."""
    require(implementation, q, v)
    return dense_mha(q, k, v, q_start, k_start, implementation=implementation, interpret=INTERPRET, **kw)


def make_batch(seed, q_lens, ctx_lens, *, heads, d_qk=192, d_v=128, pad_q=0, pad_k=0,
               dtype=jnp.bfloat16):
    """Packed q [T, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv] (fresh normals, unowned rows poisoned)
    and start locations [S+1]; T = sum(q_lens) + pad_q, Tk = sum(q_lens + ctx_lens) + pad_k."""
    kv_lens = [a + b for a, b in zip(q_lens, ctx_lens)]
    q_start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    k_start = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((q_start[-1] + pad_q, heads, d_qk), np.float32)
    k = rng.standard_normal((k_start[-1] + pad_k, heads, d_qk), np.float32)
    v = rng.standard_normal((k_start[-1] + pad_k, heads, d_v), np.float32)
    q[q_start[-1]:] = POISON
    k[k_start[-1]:] = POISON
    v[k_start[-1]:] = POISON
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
            jnp.asarray(q_start), jnp.asarray(k_start))


def naive(q, k, v, q_start, k_start, scale, selection=None):
    """Per-sequence float64 softmax attention with an explicit causal loop: [T, H, Dv]; with a
    selection [T, K], each row over the distinct causal positions it lists (none: 0)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    q_start, k_start = np.asarray(q_start), np.asarray(k_start)
    out = np.zeros((q.shape[0], q.shape[1], v.shape[2]))
    for s in range(len(q_start) - 1):
        q_len = q_start[s + 1] - q_start[s]
        ctx = (k_start[s + 1] - k_start[s]) - q_len
        for i in range(q_len):
            keys = k_start[s] + np.arange(ctx + i + 1)
            if selection is not None:
                listed = np.unique(np.asarray(selection)[q_start[s] + i])
                keys = keys[np.isin(np.arange(ctx + i + 1), listed)]
                if not len(keys):
                    continue
            logits = np.einsum("hd,khd->hk", q[q_start[s] + i], k[keys]) * scale
            w = np.exp(logits - logits.max(axis=1, keepdims=True))
            out[q_start[s] + i] = np.einsum("hk,khd->hd", w / w.sum(axis=1, keepdims=True), v[keys])
    return out


def random_selection(seed, q_start, k_start, num_rows, width, *, recent=None):
    """[num_rows, width] int32 selections: per row a random subset of its causal positions (the
    `recent` latest of them only, when given), then a duplicate, a position past the row's, one
    past its sequence, -5 and -1 padding (all of which the op ignores); the first row of each
    sequence with a context lists nothing. Rows no sequence owns list random positions."""
    rng = np.random.default_rng(seed)
    q_start, k_start = np.asarray(q_start), np.asarray(k_start)
    sel = rng.integers(0, 50, (num_rows, width)).astype(np.int32)
    for s in range(len(q_start) - 1):
        q_len = q_start[s + 1] - q_start[s]
        kv_len = k_start[s + 1] - k_start[s]
        ctx = kv_len - q_len
        for i in range(q_len):
            pos, row = ctx + i, q_start[s] + i
            lo = 0 if recent is None else max(0, pos + 1 - recent)
            n = min(width - 5, pos + 1 - lo)
            picked = lo + rng.choice(pos + 1 - lo, n, replace=False)
            sel[row] = -1
            sel[row, :n] = picked
            sel[row, n:n + 4] = [picked[0], pos + 1, kv_len + 3, -5]
            if i == 0 and ctx:
                sel[row] = -1
    return jnp.asarray(sel)


def rel_err(out, ref, rows):
    out, ref = np.asarray(out, np.float32)[:rows], np.asarray(ref, np.float32)[:rows]
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


# lengths not multiples of any block (64-row warpgroup tiles, 128-row blocks, 128-key tiles),
# sequences starting off the 8-row grid of the kernel's tiles, a single query, an empty
# sequence, contexts 0 and > 0 (several unmasked key tiles)
RAGGED = dict(q_lens=[70, 1, 0, 130, 129], ctx_lens=[0, 5, 3, 200, 64])


def test_reference_matches_naive():
    q, k, v, q_start, k_start = make_batch(0, [5, 0, 1, 9], [0, 4, 3, 6], heads=2, d_qk=16,
                                           d_v=8, pad_q=3, pad_k=2, dtype=jnp.float32)
    expected = naive(q, k, v, q_start, k_start, 0.3)
    # one query block; blocks of 4 queries (18 rows: a ragged last block)
    for max_scores in (1 << 27, 4 * 2 * k.shape[0]):
        ref = dense_mha(q, k, v, q_start, k_start, scale=0.3, implementation="xla",
                        config=XlaConfig(max_scores=max_scores))
        assert ref.shape == (q.shape[0], 2, 8) and ref.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(ref), expected, rtol=1e-5, atol=1e-5)


# T, Tk = 339, 607 (the kernel pads them to multiples of 8) and 336, 608 (no padding)
@pytest.mark.parametrize("implementation", KERNELS)
@pytest.mark.parametrize("dtype,pad_q,pad_k", [(jnp.bfloat16, 9, 5), (jnp.float16, 6, 6)])
def test_ragged_batch(implementation, dtype, pad_q, pad_k):
    q, k, v, q_start, k_start = make_batch(1, **RAGGED, heads=2, pad_q=pad_q, pad_k=pad_k, dtype=dtype)
    out = run(implementation, q, k, v, q_start, k_start, scale=0.1, config=MosaicConfig(num_programs=3))
    ref = dense_mha(q, k, v, q_start, k_start, scale=0.1, implementation="xla")
    assert out.shape == (q.shape[0], 2, 128) and out.dtype == dtype
    owned = int(q_start[-1])
    assert rel_err(out, ref, owned) < TOL
    np.testing.assert_array_equal(np.asarray(out[owned:], np.float32), 0.0)


@pytest.mark.parametrize("implementation", KERNELS)
@pytest.mark.parametrize("block_kv", [128, 96])  # 96: V swizzled at 64 bytes
def test_long_context_and_key_tiles(implementation, block_kv):
    """Key tiles in two slots, a context of several tiles, one query row per sequence end."""
    q, k, v, q_start, k_start = make_batch(2, [65, 3], [300, 130], heads=1, d_qk=64, d_v=64, pad_q=1)
    out = run(implementation, q, k, v, q_start, k_start, scale=0.2,
              config=MosaicConfig(block_kv=block_kv, num_stages=2, num_programs=2))
    ref = dense_mha(q, k, v, q_start, k_start, scale=0.2, implementation="xla")
    assert rel_err(out, ref, int(q_start[-1])) < TOL
    np.testing.assert_array_equal(np.asarray(out[-1], np.float32), 0.0)


# Work-list orders and diagonal tiles: sequences of at most 128 rows on average (items dealt
# head fastest: several heads, more items than programs) and 128-aligned prefills with and
# without a 128-aligned context (warpgroup 0's diagonal key tiles run as 64-key half steps).
@pytest.mark.parametrize("implementation", KERNELS)
@pytest.mark.parametrize("q_lens,ctx_lens", [([100, 7, 0, 120, 29], [0, 3, 9, 0, 64]),
                                             ([256, 128], [0, 128])])
def test_short_and_aligned_prefills(implementation, q_lens, ctx_lens):
    q, k, v, q_start, k_start = make_batch(6, q_lens, ctx_lens, heads=4, d_qk=64, d_v=64, pad_q=3)
    out = run(implementation, q, k, v, q_start, k_start, scale=0.2, config=MosaicConfig(num_programs=3))
    ref = dense_mha(q, k, v, q_start, k_start, scale=0.2, implementation="xla")
    owned = int(q_start[-1])
    assert rel_err(out, ref, owned) < TOL
    np.testing.assert_array_equal(np.asarray(out[owned:], np.float32), 0.0)


def test_selection_reference_matches_naive():
    q, k, v, q_start, k_start = make_batch(11, [5, 0, 1, 9], [0, 4, 3, 6], heads=2, d_qk=16,
                                           d_v=8, pad_q=3, pad_k=2, dtype=jnp.float32)
    sel = random_selection(11, q_start, k_start, q.shape[0], 12)
    expected = naive(q, k, v, q_start, k_start, 0.3, selection=sel)
    for max_scores in (1 << 27, 4 * 2 * k.shape[0]):
        ref = dense_mha(q, k, v, q_start, k_start, scale=0.3, implementation="xla", selection=sel,
                        config=XlaConfig(max_scores=max_scores))
        np.testing.assert_allclose(np.asarray(ref), expected, rtol=1e-5, atol=1e-5)


def test_reference_takes_host_start_locations():
    """q_start_loc / k_start_loc as numpy arrays (a host BatchMeta's, forward called without jit):
    the reference, selection and query blocks included, gives what it gives for device arrays."""
    q, k, v, q_start, k_start = make_batch(11, [5, 0, 1, 9], [0, 4, 3, 6], heads=2, d_qk=16,
                                           d_v=8, pad_q=3, pad_k=2, dtype=jnp.float32)
    sel = random_selection(11, q_start, k_start, q.shape[0], 12)
    config = XlaConfig(max_scores=4 * 2 * k.shape[0])  # several query blocks
    want, got = (dense_mha(q, k, v, qs, ks, scale=0.3, implementation="xla", selection=sel, config=config)
                 for qs, ks in ((jnp.asarray(q_start), jnp.asarray(k_start)), (np.asarray(q_start), np.asarray(k_start))))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# Masked MHA: ragged sequences with contexts, a sequence whose rows select only their 40 most
# recent keys (its blocks skip the early key tiles of a 300-key context), tilings with 128- and
# 96-key tiles, several items per program.
@pytest.mark.parametrize("implementation", KERNELS)
@pytest.mark.parametrize("block_kv", [128, 96])
def test_selection_matches_reference(implementation, block_kv):
    q, k, v, q_start, k_start = make_batch(12, [70, 1, 0, 130, 129], [0, 5, 3, 300, 64], heads=2,
                                           d_qk=64, d_v=64, pad_q=9, pad_k=5)
    sel = random_selection(12, q_start, k_start, q.shape[0], 48)
    recent = random_selection(13, q_start, k_start, q.shape[0], 48, recent=40)
    s3 = slice(int(q_start[3]), int(q_start[4]))
    sel = sel.at[s3].set(recent[s3])
    kw = dict(config=MosaicConfig(block_kv=block_kv, num_stages=2, num_programs=3))
    out = run(implementation, q, k, v, q_start, k_start, scale=0.2, selection=sel, **kw)
    ref = dense_mha(q, k, v, q_start, k_start, scale=0.2, implementation="xla", selection=sel)
    owned = int(q_start[-1])
    assert out.shape == (q.shape[0], 2, 64) and out.dtype == q.dtype
    assert rel_err(out, ref, owned) < TOL
    out = np.asarray(out, np.float32)
    np.testing.assert_array_equal(out[owned:], 0.0)
    for s in (1, 3, 4):  # the rows listing nothing
        np.testing.assert_array_equal(out[int(q_start[s])], 0.0)
    # every causal position listed: causal attention
    every = jnp.where(jnp.arange(512)[None] <= jnp.arange(512)[:, None], jnp.arange(512)[None], -1)
    _, pos = ref_positions(q_start, k_start, q.shape[0])
    full = run(implementation, q, k, v, q_start, k_start, scale=0.2, selection=every[jnp.maximum(pos, 0)], **kw)
    assert rel_err(full, dense_mha(q, k, v, q_start, k_start, scale=0.2, implementation="xla"), owned) < TOL


def test_selection_masks_list_exactly_the_tiles_a_block_selects():
    """The kernel's live-tile lists (what its producer loads): per 128-row block, the key tiles
    holding a selected key of a row the block stores, ascending; a block whose rows select only
    recent keys skips the early tiles; the bitmask holds each row's selected causal keys."""
    from pallas_kernels.dense_mha import mosaic

    q, k, v, q_start, k_start = make_batch(15, [200, 3, 130], [0, 5, 700], heads=1, d_qk=64, d_v=64, pad_q=4)
    sel = random_selection(15, q_start, k_start, q.shape[0], 64, recent=100)
    num_rows, block_kv = q.shape[0], 128
    num_blocks = 8
    table, used = mosaic._block_table(q_start, k_start, num_rows, num_blocks)
    key_tiles = -(-(k.shape[0] + 7) // block_kv)
    bits, tiles, num_live = (np.asarray(a) for a in mosaic._selection_masks(sel, q_start, k_start, table, key_tiles,
                                                                             block_kv))
    table, sel = np.asarray(table), np.asarray(sel)
    seq, pos = ref_positions(q_start, k_start, num_rows)
    pos = np.asarray(pos)
    shift = np.asarray(k_start)[:-1] % 8
    skipped = 0
    for b in range(int(used[0])):
        rows = range(8 * table[b, 0] + table[b, 1], 8 * table[b, 0] + table[b, 2])
        want = set()
        for r in rows:
            keys = {int(p) for p in sel[r] if 0 <= p <= pos[r]}
            coords = {p + int(shift[seq[r]]) for p in keys}
            got = {j for j in range(bits.shape[0] * 32) if (int(bits[j // 32, r]) >> (j % 32)) & 1}
            assert got == coords, r
            want |= {j // block_kv for j in coords}
        assert list(tiles[b, :num_live[b]]) == sorted(want), b
        causal_tiles = (pos[rows[-1]] + int(shift[seq[rows[0]]])) // block_kv + 1
        skipped += causal_tiles - num_live[b]
    assert skipped > 0  # the 700-token context's early tiles
    assert not num_live[int(used[0]):].any()


def ref_positions(q_start, k_start, num_rows):
    """(sequence [T] (-1: none), position [T]) of each packed query row."""
    q_start, k_start = np.asarray(q_start), np.asarray(k_start)
    seq = np.full(num_rows, -1)
    pos = np.full(num_rows, -1)
    for s in range(len(q_start) - 1):
        ctx = (k_start[s + 1] - k_start[s]) - (q_start[s + 1] - q_start[s])
        seq[q_start[s]:q_start[s + 1]] = s
        pos[q_start[s]:q_start[s + 1]] = ctx + np.arange(q_start[s + 1] - q_start[s])
    return seq, jnp.asarray(pos)


@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize("implementation", KERNELS)
def test_selection_past_max_kv_len_is_nan(implementation):
    """A sequence longer than max_kv_len (its bitmask would drop keys) comes out NaN, loudly;
    the shorter sequences are unaffected."""
    q, k, v, q_start, k_start = make_batch(14, [40, 90], [0, 200], heads=1, d_qk=64, d_v=64)
    sel = random_selection(14, q_start, k_start, q.shape[0], 32)
    out = np.asarray(run(implementation, q, k, v, q_start, k_start, scale=0.2, selection=sel,
                         max_kv_len=100, config=MosaicConfig(num_programs=2)), np.float32)
    ref = np.asarray(dense_mha(q, k, v, q_start, k_start, scale=0.2, implementation="xla", selection=sel))
    assert np.isnan(out[40:]).all()
    assert rel_err(out[:40], ref[:40], 40) < TOL


@pytest.mark.parametrize("implementation", [param("xla")] + KERNELS)
def test_all_padding(implementation):
    q, k, v, q_start, k_start = make_batch(3, [0, 0], [0, 4], heads=1, d_qk=64, d_v=64, pad_q=5)
    out = run(implementation, q, k, v, q_start, k_start, scale=0.2)
    np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)


@pytest.mark.parametrize("implementation", KERNELS)
def test_bad_inputs(implementation):
    q, k, v, q_start, k_start = make_batch(4, [3], [0], heads=2, d_qk=64, d_v=64)
    call = lambda *a, **kw: dense_mha(*a, scale=1.0, implementation=implementation, interpret=INTERPRET,  # noqa: E731
                                      **kw)
    with pytest.raises(ValueError, match="heads"):
        call(q[:, :1], k, v, q_start, k_start)
    with pytest.raises(ValueError, match="head dim"):
        call(q[..., :32], k, v, q_start, k_start)
    with pytest.raises(ValueError, match="dtype"):
        call(q.astype(jnp.float32), k, v, q_start, k_start)
    with pytest.raises(ValueError, match="multiple of 64"):
        call(q[..., :32], k[..., :32], v, q_start, k_start)
    with pytest.raises(ValueError, match="int32"):
        call(q, k, v, q_start.astype(jnp.float32), k_start)
    with pytest.raises(ValueError, match="shared memory"):
        call(*make_batch(4, [3], [0], heads=1)[:3], q_start, k_start,
             config=MosaicConfig(block_kv=128, num_stages=3))
    with pytest.raises(ValueError, match="both"):
        call(q, k, v, q_start, k_start, config=MosaicConfig(block_kv=128))
    sel = jnp.zeros((3, 4), jnp.int32)
    with pytest.raises(ValueError, match=r"selection must be \[T, K\] with T = 3"):
        call(q, k, v, q_start, k_start, selection=sel[:2])
    with pytest.raises(ValueError, match="selection must be int32"):
        call(q, k, v, q_start, k_start, selection=sel.astype(jnp.int16))
    with pytest.raises(ValueError, match="max_kv_len must be a positive int"):
        call(q, k, v, q_start, k_start, selection=sel, max_kv_len=0)
    with pytest.raises(ValueError, match="give it with a selection"):
        call(q, k, v, q_start, k_start, max_kv_len=8)
    with pytest.raises(ValueError, match="selection must be an int32 array"):
        call(q, k, v, q_start, k_start, selection=[[0]] * 3)


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", KERNELS)
def test_real_dims_compiled(implementation):
    """H=128, Dqk 192, Dv 128 at prefill sizes, compiled; the reference on 8 heads."""
    q, k, v, q_start, k_start = make_batch(5, [1000, 1, 0, 300, 2048, 77], [0, 5, 3, 700, 0, 64],
                                           heads=128, pad_q=37, pad_k=11)
    out = jax.jit(lambda *a: dense_mha(*a, scale=192 ** -0.5, implementation=implementation,
                                         interpret=INTERPRET))(q, k, v, q_start, k_start)
    heads = slice(0, 8)
    ref = dense_mha(q[:, heads], k[:, heads], v[:, heads], q_start, k_start,
                        scale=192 ** -0.5, implementation="xla")
    owned = int(q_start[-1])
    assert rel_err(out[:, heads], ref, owned) < TOL
    np.testing.assert_array_equal(np.asarray(out[owned:], np.float32), 0.0)
    # masked MHA: top-k-like selections of 2048 positions (the 1000 most recent for sequence 3)
    sel = random_selection(5, q_start, k_start, q.shape[0], 2048)
    recent = random_selection(6, q_start, k_start, q.shape[0], 2048, recent=1000)
    s3 = slice(int(q_start[3]), int(q_start[4]))
    sel = sel.at[s3].set(recent[s3])
    out = jax.jit(lambda *a: dense_mha(*a, scale=192 ** -0.5, selection=sel, max_kv_len=2048,
                                         implementation=implementation, interpret=INTERPRET))(
        q, k, v, q_start, k_start)
    ref = dense_mha(q[:, heads], k[:, heads], v[:, heads], q_start, k_start,
                        scale=192 ** -0.5, implementation="xla", selection=sel)
    assert rel_err(out[:, heads], ref, owned) < TOL
    np.testing.assert_array_equal(np.asarray(out[owned:], np.float32), 0.0)


def test_unsupported_reason_names_the_problem():
    assert unsupported_reason(jnp.bfloat16, 192, 128) is None
    assert "float32" in unsupported_reason(jnp.float32, 192, 128)
    assert "Dqk=24" in unsupported_reason(jnp.bfloat16, 24, 16)
    assert "Dv=320" in unsupported_reason(jnp.float16, 192, 320)


# 192 / 128: the model's (128-key tiles, 2 stages); 256 / 256: the largest head dims
# unsupported_reason accepts (64-key tiles, 2 stages: the only tiling whose shared memory fits)
@pytest.mark.parametrize("d_qk,d_v", [(192, 128), (256, 256)])
def test_kernel_lowers_for_the_gpu_at_real_dims(d_qk, d_v):
    """CPU twin of the hardware run: the kernel lowers to a Mosaic GPU module at H=128
    (the interpreter does not check layouts or swizzles; lowering does)."""
    sd = jax.ShapeDtypeStruct
    args = (sd((4096, 128, d_qk), jnp.bfloat16), sd((6144, 128, d_qk), jnp.bfloat16),
            sd((6144, 128, d_v), jnp.bfloat16), sd((5,), jnp.int32), sd((5,), jnp.int32))
    fn = jax.jit(lambda *a: dense_mha(*a, scale=0.07, implementation="mosaic"))
    assert "mosaic_gpu" in fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    masked = jax.jit(lambda *a: dense_mha(*a[:5], scale=0.07, selection=a[5], max_kv_len=8192,
                                          implementation="mosaic"))
    sel = sd((4096, 2048), jnp.int32)
    assert "mosaic_gpu" in masked.trace(*args, sel).lower(lowering_platforms=("cuda",)).as_text()


# Isolation: sequences whose first keys sit off the 8-row grid (key tiles start k_shift = 1..7
# keys early, on the previous sequence's keys), contexts > 0, a query-less sequence (keys only),
# 8 padding query rows and 9 unowned key rows. Sequence 1 (70 queries): warpgroup 0 reads its
# last key tile as a half step, warpgroup 1 the whole tile; sequence 4 (100 queries after 30
# cached): its last key tile is warpgroup 1's alone. Tiles past each sequence's last key run
# into the next sequence's keys or into the unowned rows.
ISOLATION = dict(q_lens=[5, 70, 3, 0, 100, 9], ctx_lens=[3, 0, 61, 4, 30, 1])
NONFINITE = np.array([np.nan, np.inf, -np.inf], np.float32)


def poison_except(x, start_loc, keep):
    """x with every row not owned by a sequence of `keep` (other sequences' rows, rows no sequence
    owns) set to NaN, inf or -inf (by row)."""
    x = np.array(x, np.float32)
    start_loc = np.asarray(start_loc)
    owned = np.zeros(x.shape[0], bool)
    for s in keep:
        owned[start_loc[s]:start_loc[s + 1]] = True
    rows = np.flatnonzero(~owned)
    x[rows] = NONFINITE[rows % 3][:, None, None]
    return x


def seq_rows(start_loc, seqs):
    start_loc = np.asarray(start_loc)
    return np.concatenate([np.arange(start_loc[s], start_loc[s + 1]) for s in seqs])


def check_isolation(run, q, k, v, q_start, k_start, *, clean):
    """run(q, k, v) with all but half the sequences poisoned (each half once): the kept
    sequences' rows stay finite and equal to `clean` (run on unpoisoned inputs)."""
    num_seqs = len(q_start) - 1
    for keep in (range(0, num_seqs, 2), range(1, num_seqs, 2)):
        poisoned = [jnp.asarray(poison_except(x, loc, keep), x.dtype)
                    for x, loc in ((q, q_start), (k, k_start), (v, k_start))]
        out = np.asarray(run(*poisoned), np.float32)
        rows = seq_rows(q_start, keep)
        assert np.isfinite(out[rows]).all(), f"sequences {list(keep)}: non-finite outputs"
        yield out[rows], clean[rows]


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the interpreter's NaN products
@pytest.mark.parametrize("implementation,config,masked", [
    param("xla", XlaConfig(max_scores=1 << 27), False, id="xla-one_query_block"),
    param("xla", XlaConfig(max_scores=7 * 2 * 300), False, id="xla-query_blocks_of_7"),
    param("mosaic", MosaicConfig(block_kv=128, num_stages=2, num_programs=2), False, id="mosaic-block_kv128"),
    # 96: 64-row pieces of the V tile overlap
    param("mosaic", MosaicConfig(block_kv=96, num_stages=2, num_programs=2), False, id="mosaic-block_kv96"),
    param("mosaic", MosaicConfig(block_kv=128, num_stages=2, num_programs=2), True, id="mosaic-masked"),
])
def test_rows_see_only_their_sequence(implementation, config, masked):
    """NaN / inf in other sequences' q, k, v rows and in rows no sequence owns never reach a
    sequence's outputs (no 0 * NaN through the masked probabilities). The reference (float32)
    is checked on small head dims against the naive computation; the kernel, whose key tiles start
    up to 7 keys before a sequence's first key and run past its last one, against the reference,
    and its kept sequences' rows are bit-identical to the clean run."""
    selection = None
    if implementation == "xla":
        q, k, v, q_start, k_start = make_batch(8, **ISOLATION, heads=2, d_qk=16, d_v=8, pad_q=8,
                                               pad_k=9, dtype=jnp.float32)
        scale = 0.3
    else:
        q, k, v, q_start, k_start = make_batch(9, **ISOLATION, heads=2, d_qk=64, d_v=64, pad_q=8,
                                               pad_k=9)
        scale = 0.2
        if masked:
            selection = random_selection(9, q_start, k_start, q.shape[0], 24)
    attend = lambda q, k, v: run(implementation, q, k, v, q_start, k_start, scale=scale,  # noqa: E731
                                 selection=selection, config=config)
    clean = np.asarray(attend(q, k, v), np.float32)
    owned = int(q_start[-1])
    if implementation == "xla":
        np.testing.assert_allclose(clean, naive(q, k, v, q_start, k_start, scale), rtol=1e-5, atol=1e-5)
    else:
        ref = dense_mha(q, k, v, q_start, k_start, scale=scale, implementation="xla", selection=selection)
        assert rel_err(clean, ref, owned) < TOL
        np.testing.assert_array_equal(clean[owned:], 0.0)
    for out, expected in check_isolation(attend, q, k, v, q_start, k_start, clean=clean):
        if implementation == "xla":
            assert rel_err(out, expected, len(out)) < 1e-6
        else:
            np.testing.assert_array_equal(out, expected)


@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize("implementation", [param("xla")] + KERNELS)
def test_own_nonfinite_values_reach_own_rows(implementation):
    """A sequence's own NaN / inf is not hidden: NaN in its key 0's v reaches all its rows, inf in
    one of its queries reaches that row; the other rows are unchanged."""
    q, k, v, q_start, k_start = make_batch(10, **ISOLATION, heads=2, d_qk=64, d_v=64, pad_q=8,
                                           pad_k=9)
    config = None if implementation == "xla" else MosaicConfig(num_programs=2)
    attend = lambda q, v: run(implementation, q, k, v, q_start, k_start, scale=0.2, config=config)  # noqa: E731
    clean = np.asarray(attend(q, v), np.float32)
    bad_seq, bad_row = 4, int(q_start[1]) + 30  # all of sequence 4; one query of sequence 1
    out = np.asarray(attend(q.at[bad_row, 1, 3].set(jnp.inf), v.at[k_start[bad_seq], 0, 5].set(jnp.nan)),
                     np.float32)
    bad = seq_rows(q_start, [bad_seq])
    assert (~np.isfinite(out[bad, 0])).any(axis=-1).all()  # head 0 of every row of sequence 4
    assert (~np.isfinite(out[bad_row, 1])).any()  # head 1 of the poisoned query
    # everything else: the other head of those rows, and the other rows
    np.testing.assert_array_equal(out[bad, 1], clean[bad, 1])
    np.testing.assert_array_equal(out[bad_row, 0], clean[bad_row, 0])
    rest = np.setdiff1d(np.arange(q.shape[0]), np.append(bad, bad_row))
    np.testing.assert_array_equal(out[rest], clean[rest])
