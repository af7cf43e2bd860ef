"""forward against the whole-sequence reference: routes, chunking, decode, padding, dtypes."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sparse_mla import MLAConfig, Request, init_cache, init_params, plan_batch, read_indexer_keys, read_latent
from jax_sparse_mla import kernels as kernel_ops
from jax_sparse_mla.model import forward, jit_forward, linear, mla_projections
from jax_sparse_mla.serving.synthetic import Harness, rel_err
from tests.support import INTERPRET, equations_outside_kernels
from tests.support.cases import requests_on_fresh_pages

TINY = MLAConfig.tiny()  # topk 16, page 4, float32 activations, bf16 latent cache, fp8 indexer
DENSE_KERNEL_TINY = dataclasses.replace(TINY, dtype="bfloat16", qk_nope_head_dim=56, v_head_dim=64)  # head dims the dense kernel takes
TOL_F32 = 1e-4


def test_short_prefill_runs_dense_and_matches_reference():
    h = Harness(TINY)
    h.add(0, 11)
    h.add(1, 16)  # exactly topk: still dense
    out, plan, _ = h.step([(0, 11), (1, 16)])
    assert plan.use_dense_mha and not plan.has_indexer_scoring
    h.check(out, TOL_F32)


def test_forced_sparse_program_equals_dense_program():
    """The identity behind the skip: with every position selected, the sparse program gives the
    dense program's outputs, and both leave the same caches (indexer keys included)."""
    runs = {}
    for force in (False, True):
        h = Harness(TINY, seed=3)
        h.add(0, 14)
        h.add(1, 5)
        out, plan, _ = h.step([(0, 14), (1, 5)], force_sparse=force)
        assert plan.use_dense_mha != force and plan.has_indexer_scoring == force
        runs[force] = (out, h.cache, h.tables)
    (dense_out, dense, tables), (sparse_out, sparse, _) = runs[False], runs[True]
    for sid, n in [(0, 14), (1, 5)]:
        assert rel_err(sparse_out[sid], dense_out[sid]) < 1e-5
        k_d, k_s = read_indexer_keys(dense, tables[sid], n, TINY), read_indexer_keys(sparse, tables[sid], n, TINY)
        assert float(jnp.abs(k_d).max()) > 0
        np.testing.assert_array_equal(k_d, k_s)
        for a, b in zip(read_latent(dense, tables[sid], n, TINY), read_latent(sparse, tables[sid], n, TINY)):
            np.testing.assert_array_equal(a, b)


def test_long_prefill_runs_sparse_and_matches_reference():
    h = Harness(TINY, seed=1)
    h.add(0, 37)
    out, plan, _ = h.step([(0, 37)], prefill_route="sparse")
    assert not plan.use_dense_mha and plan.has_indexer_scoring
    h.check(out, TOL_F32)


def test_long_prefill_runs_masked_and_matches_reference():
    """Masked MHA: the long prefill is scored, then attends in the dense program's MHA call over
    its top-k positions; the same result as the sparse route (and the reference)."""
    outs = {}
    for route in ("masked", "sparse"):
        h = Harness(TINY, seed=1)
        h.add(0, 37)
        out, plan, _ = h.step([(0, 37)], prefill_route=route)
        assert plan.has_indexer_scoring and plan.use_dense_mha == (route == "masked")
        assert plan.masked == ("all" if route == "masked" else "none")
        assert plan.num_sparse_tokens == (64 if route == "masked" else 0)
        h.check(out, TOL_F32)
        outs[route] = out[0]
    assert rel_err(outs["masked"], outs["sparse"]) < 1e-5


def test_sparse_selection_matters():
    """Past topk, the output differs from dense attention: the top-k really restricts keys."""
    h = Harness(TINY, seed=2)
    h.add(0, 40)
    out, _, _ = h.step([(0, 40)])
    dense, _ = h.reference(0, 40, dense=True)
    assert rel_err(out[0][TINY.index_topk:], dense[TINY.index_topk:]) > 1e-3
    h.check(out, TOL_F32)


@pytest.mark.parametrize("kv_cache_dtype,case", [("bfloat16", "fresh"), ("bfloat16", "chunked"), ("fp8", "chunked"),
                                                 ("bfloat16", "ties")])
def test_masked_route_equals_sparse_route(kv_cache_dtype, case):
    """The same scoring and top-k, attended in the MHA form over the selected keys or in the
    absorbed form over the gathered latent rows: equal in float32 (both cache formats), for a
    fresh prefill (its first topk rows see fewer causal keys than topk), a chunk after context
    beside a decode, and all-tied logits (indexer weights zero: top-k breaks the ties)."""
    cfg = dataclasses.replace(TINY, kv_cache_dtype=kv_cache_dtype)
    outs = {}
    for route in ("masked", "sparse"):
        h = Harness(cfg, seed=31)
        if case == "ties":
            h.params = {**h.params, "indexer.weights_proj.weight": jnp.zeros_like(h.params["indexer.weights_proj.weight"])}
        h.add(0, 40)
        h.add(1, 25)
        if case == "chunked":
            h.step([(0, 17), (1, 24)], prefill_route="sparse")
            out, plan, _ = h.step([(0, 23), (1, 1)], prefill_route=route)
        else:
            out, plan, _ = h.step([(0, 40)], prefill_route=route)
        assert (plan.masked != "none") == (route == "masked")
        if case != "ties":
            h.check(out, TOL_F32)
        outs[route] = out
    for sid in outs["sparse"]:
        assert rel_err(outs["masked"][sid], outs["sparse"][sid]) < 1e-5, sid


def test_masked_rows_gather_nothing_in_the_sparse_call(monkeypatch):
    """A masked prefill beside a decode ("some"): the sparse attention call spans the scored rows,
    but only the decode's row selects slots there; the masked and padding rows select none (a
    row that selects none costs the kernels nothing)."""
    seen = []

    def spy(q, latent, latent_scale, k_pe, slots, **kw):
        jax.debug.callback(lambda s: seen.append(np.asarray(s)), jnp.sum(slots >= 0, axis=1))
        return sparse_mla(q, latent, latent_scale, k_pe, slots, **kw)

    sparse_mla = kernel_ops.sparse_mla
    monkeypatch.setattr(kernel_ops, "sparse_mla", spy)
    jax.clear_caches()  # retrace with the spy
    h = Harness(TINY, seed=32)
    h.add(0, 30)
    h.add(1, 25)
    h.step([(1, 24)], prefill_route="sparse")
    out, plan, _ = h.step([(0, 30), (1, 1)], prefill_route="masked")
    assert plan.masked == "some" and plan.num_sparse_tokens == 32
    h.check(out, TOL_F32)
    assert len(seen) == 2 and seen[-1].shape == (32,)  # (the first step's sparse program, then this one)
    np.testing.assert_array_equal(seen[-1], [0] * 30 + [TINY.index_topk, 0])  # the decode's row is row 30
    jax.clear_caches()


@pytest.mark.parametrize("length", [TINY.index_topk - 1, TINY.index_topk, TINY.index_topk + 1])
def test_lengths_around_topk(length):
    for route in ("masked", "sparse") if length > TINY.index_topk else ("auto",):
        h = Harness(TINY, seed=length)
        h.add(0, length)
        out, plan, _ = h.step([(0, length)], prefill_route=route)
        assert plan.use_dense_mha == (length <= TINY.index_topk or route == "masked")
        assert plan.masked == ("all" if length > TINY.index_topk and route == "masked" else "none")
        h.check(out, TOL_F32)


def test_chunked_prefill_with_context():
    h = Harness(TINY, seed=4)
    h.add(0, 30)
    h.add(1, 14)
    out, plan, _ = h.step([(0, 9), (1, 6)])  # all short: dense
    assert plan.use_dense_mha
    h.check(out, TOL_F32)
    out, plan, _ = h.step([(0, 12), (1, 8)])  # seq 0 total 21 > topk: sparse, with context; seq 1 dense
    assert plan.use_dense_mha and plan.num_sparse_tokens == 16 and plan.num_scored_tokens == 16
    h.check(out, TOL_F32)
    out, plan, _ = h.step([(0, 9)])  # the rest
    h.check(out, TOL_F32)


def test_decodes_after_prefills():
    h = Harness(TINY, seed=5)
    h.add(0, 24)
    h.add(1, 12)
    h.step([(0, 18), (1, 8)])
    for _ in range(4):  # seq 0 crosses topk while decoding; seq 1 stays under it
        out, plan, _ = h.step([(0, 1), (1, 1)])
        assert not plan.use_dense_mha  # no prefill in the batch: every row is sparse
        h.check(out, TOL_F32)


def test_mixed_prefill_and_decode_batch():
    """Short prefills beside decodes: prefills dense, only the decode rows are scored."""
    h = Harness(TINY, seed=6)
    for sid, n in [(0, 30), (1, 12), (2, 12)]:
        h.add(sid, n)
    h.step([(0, 25)])
    out, plan, _ = h.step([(1, 9), (0, 1), (2, 12)])
    assert plan.use_dense_mha and plan.num_sparse_tokens == 1 and plan.num_scored_tokens == 1
    h.check(out, TOL_F32)
    out, plan, _ = h.step([(0, 1), (1, 3)], skip_indexer=False)  # baseline: every row scored
    assert plan.use_dense_mha and plan.num_scored_tokens == plan.num_tokens
    h.check(out, TOL_F32)


def test_padded_batch_many_sequences():
    h = Harness(TINY, seed=7, num_pages=96)
    lengths = [1, 2, 5, 17, 3]
    for sid, n in enumerate(lengths):
        h.add(sid, n)
    out, plan, _ = h.step([(sid, n) for sid, n in enumerate(lengths)])
    assert plan.num_tokens > sum(lengths) and plan.num_seqs > len(lengths)
    h.check(out, TOL_F32)


@pytest.mark.parametrize("indexer_dtype", ["fp8", "bfloat16", "float32"])
@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "float32", "fp8"])
def test_dtypes(indexer_dtype, kv_cache_dtype):
    cfg = dataclasses.replace(TINY, indexer_dtype=indexer_dtype, kv_cache_dtype=kv_cache_dtype)
    h = Harness(cfg, seed=8)
    h.add(0, 26)
    h.add(1, 11)
    for work in ([(0, 20), (1, 10)], [(0, 1), (1, 1)], [(0, 5)]):
        out, _, _ = h.step(work)
        h.check(out, TOL_F32)


def test_bfloat16_activations():
    cfg = dataclasses.replace(TINY, dtype="bfloat16")
    h = Harness(cfg, seed=9)
    h.add(0, 28)
    h.add(1, 9)
    out, _, _ = h.step([(0, 28), (1, 9)])
    k = TINY.index_topk
    # Rows that attend every causal position: bf16 rounding of each matmul operand only.
    assert rel_err(out[1], h.reference(1, 9)[0]) < 1e-2
    assert rel_err(out[0][:k], h.reference(0, 28)[0][:k]) < 1e-2
    # Past topk, bf16 logits also flip near-ties of the tiny indexer (4 heads of 16 dims).
    assert rel_err(out[0][k:], h.reference(0, 28)[0][k:]) < 1e-1


def test_padding_rows_write_nowhere():
    h = Harness(TINY, seed=11, num_pages=8)
    before = jax.tree.map(np.asarray, h.cache)
    h.add(0, 3)
    h.step([(0, 3)])  # 3 real rows, 13 padding rows with random hidden states
    after = jax.tree.map(np.asarray, h.cache)
    page = h.tables[0][0]
    for name in ("latent", "k_pe", "index_k"):
        b, a = getattr(before, name), getattr(after, name)
        changed = np.argwhere(np.any(a.reshape(a.shape[0], a.shape[1], -1) != b.reshape(a.shape[0], a.shape[1], -1), -1))
        assert sorted(map(tuple, changed)) == [(page, 0), (page, 1), (page, 2)], name


def test_hidden_shape_and_cache_dtype_errors():
    h = Harness(TINY)
    plan, meta = plan_batch(TINY, [Request(0, 3, [0])], num_pages=h.num_pages)
    x = jnp.ones((plan.num_tokens + 1, TINY.hidden_size))
    with pytest.raises(ValueError, match="hidden has shape"):
        forward(h.params, x, h.cache, meta, plan=plan, config=TINY)
    wrong = init_cache(dataclasses.replace(TINY, kv_cache_dtype="fp8"), 64)
    with pytest.raises(ValueError, match="cache.latent"):
        forward(h.params, x[:-1], wrong, meta, plan=plan, config=TINY)
    with pytest.raises(ValueError, match="kernels must be one of"):
        forward(h.params, x[:-1], h.cache, meta, plan=plan, config=TINY, kernels="cuda")


def test_a_plan_made_without_num_pages_is_refused():
    """plan_batch / plan_arrays without num_pages check page ids only for >= 0 and int32 slots:
    page 99 of a 64-page cache would read clamped slots and write nowhere, with a finite output.
    forward (and jit_forward, at trace time) refuses such a plan, naming the fix."""
    from jax_sparse_mla import plan_arrays

    h = Harness(TINY)
    x = jnp.ones((16, TINY.hidden_size))
    message = r"plan.num_pages is None: plan the batch with num_pages=cache.num_pages \(64\): only then"
    for plan, meta in [plan_batch(TINY, [Request(0, 10, [3, 7, 99])]), plan_arrays(TINY, [0], [10], [[3, 7, 99]])]:
        assert plan.num_pages is None and plan.num_tokens == x.shape[0]
        for step in (forward, jit_forward):
            with pytest.raises(ValueError, match=message):
                step(h.params, x, h.cache, meta, plan=plan, config=TINY)
    assert not h.cache.latent.is_deleted()  # refused before anything ran
    with pytest.raises(ValueError, match="request 0: page id 99 is outside"):
        plan_batch(TINY, [Request(0, 10, [3, 7, 99])], num_pages=h.cache.num_pages)


def test_public_signatures_say_the_modes_and_the_donation():
    """forward, jit_forward, SparseMLA and the planners are annotated, their mode strings as
    Literal types; help(jit_forward) says the cache is donated."""
    import typing

    from jax_sparse_mla import PagedCache, SparseMLA, plan_arrays
    from jax_sparse_mla.plan import BatchMeta, BatchPlan

    kernels, dispatch = typing.Literal["auto", "xla", "pallas"], typing.Literal["static", "cond"]
    route = typing.Literal["auto", "masked", "sparse"]
    for fn in (forward, jit_forward):
        hints = typing.get_type_hints(fn)
        assert hints["kernels"] == kernels and hints["cache"] is PagedCache and hints["plan"] is BatchPlan
        assert hints["hidden"] is jax.Array and hints["return"] == tuple[jax.Array, PagedCache]
    assert typing.get_type_hints(SparseMLA.__init__)["kernels"] == kernels
    assert typing.get_type_hints(SparseMLA.__call__) == dict(hidden=jax.Array, cache=PagedCache, meta=BatchMeta,
                                                            plan=BatchPlan, **{"return": tuple[jax.Array, PagedCache]})
    for fn in (plan_batch, plan_arrays):
        hints = typing.get_type_hints(fn)
        assert hints["dispatch"] == dispatch and hints["prefill_route"] == route
    assert "the cache DONATED" in jit_forward.__doc__ and "continue with the cache it" in jit_forward.__doc__


def _step_arguments():
    """forward's arguments for a one-request batch of the tiny config: a dict to corrupt."""
    h = Harness(TINY)
    plan, meta = plan_batch(TINY, [Request(0, 3, [0])], num_pages=h.num_pages)
    return dict(params=h.params, hidden=jnp.ones((plan.num_tokens, TINY.hidden_size)), cache=h.cache, meta=meta,
                plan=plan, config=TINY, kernels="xla")


WRONG_TYPES = [  # (argument, value, message): each names the argument and what it must be
    ("cache", {}, "cache must be a PagedCache .*got dict"),
    ("cache", (), "cache must be a PagedCache .*got tuple"),
    ("cache", None, "cache must be a PagedCache .*got NoneType"),
    ("params", None, "params must be a dict of arrays, got NoneType"),
    ("params", [], "params must be a dict of arrays, got list"),
    ("hidden", None, r"hidden must be an array \[num_tokens, hidden_size\], got NoneType"),
    ("hidden", [[0.0] * 64] * 16, r"hidden must be an array .*got list"),
    ("hidden", np.zeros((16, 64), np.int32), "hidden must be floating point, got int32"),
    ("meta", None, "meta must be a BatchMeta .*got NoneType"),
    ("meta", {}, "meta must be a BatchMeta .*got dict"),
    ("plan", None, "plan must be a BatchPlan .*got NoneType"),
    ("plan", (), "plan must be a BatchPlan .*got tuple"),
    ("config", {}, "config must be an MLAConfig, got dict"),
    ("config", None, "config must be an MLAConfig, got NoneType"),
    ("kernels", None, "kernels must be one of .*got None"),
    ("kernels", 3, "kernels must be one of .*got 3"),
    ("tensor_axis", 3, "tensor_axis must be None or a mesh axis name .*got 3"),
]


@pytest.mark.parametrize("name,value,message", WRONG_TYPES)
def test_forward_refuses_arguments_of_other_types(name, value, message):
    """A wrongly typed argument is a ValueError naming it (not an AttributeError from inside)."""
    args = _step_arguments()
    args[name] = value
    # (jit's static arguments must hash: a dict config fails in jax.jit itself)
    for step in (forward, jit_forward) if name in ("cache", "params", "hidden", "meta") else (forward,):
        with pytest.raises(ValueError, match=message):
            step(args["params"], args["hidden"], args["cache"], args["meta"],
                 **{k: v for k, v in args.items() if k not in ("params", "hidden", "cache", "meta")})


@pytest.mark.parametrize("kv_cache_dtype,indexer_dtype,route", [("bfloat16", "fp8", "sparse"),
                                                                ("fp8", "bfloat16", "masked")])
def test_pallas_kernels_through_forward(kv_cache_dtype, indexer_dtype, route):
    """kernels="pallas": interpret mode on CPU, compiled on a GPU; every route in three steps
    (the long prefill of the second masked or sparse)."""
    cfg = dataclasses.replace(TINY, kv_cache_dtype=kv_cache_dtype, indexer_dtype=indexer_dtype)
    h = Harness(cfg, seed=12, kernels="pallas")
    for sid, n in [(0, 37), (1, 11), (2, 30)]:
        h.add(sid, n)
    out, plan, _ = h.step([(2, 25)], prefill_route="sparse")
    assert not plan.use_dense_mha
    h.check(out, TOL_F32)
    out, plan, _ = h.step([(0, 37), (1, 10), (2, 1)], prefill_route=route)  # long + short prefill + decode
    assert plan.use_dense_mha and plan.masked == ("some" if route == "masked" else "none")
    assert plan.num_sparse_tokens == plan.num_scored_tokens == 64
    h.check(out, TOL_F32)
    out, plan, _ = h.step([(1, 1), (2, 1)], dispatch="cond")  # both programs under lax.cond
    assert plan.route == "cond"
    h.check(out, TOL_F32)


def test_fp8_prefill_rows_dequantised_upfront_through_forward(monkeypatch):
    """The plan's fp8 split through the Pallas route: the prefill rows attend over a copy of their
    own pages dequantised upfront, the decode rows over the fp8 cache (dequantised in the
    kernel), and every route still matches the reference. The threshold is lowered so that the
    tiny config's prefills pass it (rows x topk a copied row) and its decodes do not."""
    from jax_sparse_mla import policy
    from pallas_kernels.sparse_mla import api as sparse_mla_api

    copies = []

    def spy(latent, latent_scale, k_pe, slots, pages, **kw):
        copies.append(pages.shape)
        return dequantize_pages(latent, latent_scale, k_pe, slots, pages, **kw)

    dequantize_pages = sparse_mla_api.dequantize_pages
    monkeypatch.setattr(policy, "UPFRONT_MIN_USES", 4)
    monkeypatch.setattr(sparse_mla_api, "dequantize_pages", spy)
    jax.clear_caches()  # retrace under the patched threshold
    cfg = dataclasses.replace(TINY, kv_cache_dtype="fp8")
    h = Harness(cfg, seed=13, kernels="pallas")
    h.add(0, 38)
    h.add(1, 33)
    h.add(2, 12)
    out, plan, _ = h.step([(0, 37), (2, 11)], prefill_route="sparse")  # a long prefill (split), a short one
    assert plan.use_dense_mha and plan.num_upfront_rows == 64 and plan.num_kernel_rows == 0
    assert copies == [(plan.num_upfront_pages,)]
    h.check(out, TOL_F32)
    out, plan, _ = h.step([(1, 30), (0, 1)], prefill_route="sparse")  # a long prefill and a decode: all sparse
    assert not plan.use_dense_mha and plan.num_upfront_rows == 32 and plan.num_kernel_rows == 1
    assert copies[1:] == [(plan.num_upfront_pages,)]  # the decode row dequantises in the kernel
    h.check(out, TOL_F32)
    jax.clear_caches()


def test_dense_kernel_through_forward_matches_xla():
    """The dense route's Mosaic kernel (bf16 config; float32 configs run dense MHA on XLA) gives
    the XLA route's output: ragged prefills with and without context, beside a decode. On CPU the
    kernel runs in Mosaic GPU's interpreter inside the forward's jit (conftest sizes the CPU pool)."""
    cfg = DENSE_KERNEL_TINY
    assert kernel_ops.resolve("pallas", cfg).dense_mha.implementation == "mosaic"
    outs = {}
    for kernels in ("pallas", "xla"):
        h = Harness(cfg, seed=21, kernels=kernels)
        for sid, n in [(0, 9), (1, 13), (2, 21)]:
            h.add(sid, n)
        h.add(3, 45)
        h.add(4, 6)
        h.add(5, 30)
        h.step([(0, 4), (2, 20)])
        out, plan, _ = h.step([(0, 5), (1, 13), (2, 1)])  # chunk after context, fresh prefill, decode
        assert plan.use_dense_mha and plan.num_sparse_tokens == 1
        h.check(out, 5e-2)  # bf16 against the float32 oracle, as the demo
        outs[kernels] = out
        # masked MHA: a 25-token chunk after 20 cached tokens beside a short prefill and a decode
        h.step([(3, 20), (5, 29)], prefill_route="sparse")
        out, plan, _ = h.step([(3, 25), (4, 6), (5, 1)], prefill_route="masked")
        assert plan.masked == "some" and plan.num_sparse_tokens == 32
        outs[kernels, "masked"] = out  # (bf16 scoring picks other near-tied keys than the f32 oracle)
    for key in ((), ("masked",)):
        a, b = outs[("pallas", *key)] if key else outs["pallas"], outs[("xla", *key)] if key else outs["xla"]
        for sid in a:
            assert rel_err(a[sid], b[sid]) < 2e-2, (key, sid)


@pytest.mark.parametrize("threads, dense_impl", [("2", "xla"), ("3", "mosaic")])
def test_dense_interpreter_needs_a_thread_per_warpgroup(monkeypatch, threads, dense_impl):
    """Off the GPU, kernels="pallas" runs dense MHA on XLA when XLA's CPU pool has fewer threads than
    the kernel's warpgroups (the interpreter would deadlock), and the kernel otherwise."""
    cfg = DENSE_KERNEL_TINY
    monkeypatch.setattr(kernel_ops, "interpret_mode", lambda: True)
    monkeypatch.setenv("PJRT_NPROC", threads)
    impl = kernel_ops.resolve("pallas", cfg)
    assert impl.dense_mha.implementation == dense_impl
    assert impl.sparse_mla.implementation == impl.indexer_logits.implementation == impl.topk.implementation == "triton"


def test_short_and_long_prefills_in_one_batch():
    """Each prefill is routed by its own length: the long one is scored, the short ones are not."""
    h = Harness(TINY, seed=13)
    for sid, n in [(0, 30), (1, 9), (2, 12), (3, 20)]:
        h.add(sid, n)
    h.step([(3, 15)], prefill_route="sparse")
    out, plan, _ = h.step([(1, 9), (0, 30), (2, 12), (3, 1)], prefill_route="sparse")
    assert plan.use_dense_mha and plan.num_sparse_tokens == 32 and plan.num_scored_tokens == 32
    h.check(out, TOL_F32)


def test_masked_short_and_sparse_rows_in_one_batch():
    """A masked prefill, short prefills and a decode in one dense program: one dense MHA call
    (the short prefills' rows select every causal position), the decode scored and sparse."""
    h = Harness(TINY, seed=13)
    for sid, n in [(0, 30), (1, 9), (2, 12), (3, 20)]:
        h.add(sid, n)
    h.step([(3, 15)])
    out, plan, _ = h.step([(1, 9), (0, 30), (2, 12), (3, 1)], prefill_route="masked")
    assert plan.masked == "some" and plan.num_sparse_tokens == plan.num_scored_tokens == 32
    assert [g.name for g in plan.groups] == ["sparse"]
    h.check(out, TOL_F32)


def _cond_against_static(config, seed, seqs, work, *, check_oracle=True, **options):
    """Runs `work` (steps of [(seq_id, n_new)]) over the sequences `seqs` [(seq_id, length)]
    through a static and a cond Harness with plan options `options`: every step passes the
    oracle (check_oracle), the cond rows equal the static ones (rel_err < 1e-6) and the final
    caches are equal. Returns (the static plans, [(cond plan, its host meta)] per step)."""
    results, cond_steps = {}, []
    for dispatch in ("static", "cond"):
        h = Harness(config, seed=seed)
        for sid, n in seqs:
            h.add(sid, n)
        outs, plans = [], []
        for w in work:
            if dispatch == "cond":
                reqs = [Request(h.done[sid], n, h.tables[sid]) for sid, n in w]
                cond_steps.append(plan_batch(config, reqs, num_pages=h.num_pages, dispatch="cond", **options))
            out, plan, _ = h.step(w, dispatch=dispatch, **options)
            if check_oracle:
                h.check(out, TOL_F32)
            outs.append(out)
            plans.append(plan)
        results[dispatch] = (outs, h.cache, plans)
    (s_outs, s_cache, s_plans), (c_outs, c_cache, _) = results["static"], results["cond"]
    for a, b in zip(s_outs, c_outs):
        for sid in a:
            assert rel_err(b[sid], a[sid]) < 1e-6, sid
    for a, b in zip(jax.tree.leaves(s_cache), jax.tree.leaves(c_cache)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    return s_plans, cond_steps


@pytest.mark.parametrize("config,options", [
    (TINY, {}), (TINY, {"skip_indexer": False}), (TINY, {"force_sparse": True}), (TINY, {"prefill_route": "masked"}),
    (dataclasses.replace(TINY, kv_cache_dtype="fp8"), {}),
], ids=["skip", "no_skip", "force_sparse", "masked", "fp8"])
def test_cond_dispatch_matches_static_dispatch(config, options):
    """dispatch="cond": one program per shape bucket and stage set; same outputs and caches as the static plans
    (the oracle checks the bf16-cache runs; an fp8 cache's static plan may split its rows)."""
    work = [[(0, 9), (1, 5)], [(0, 14), (1, 1)], [(0, 1), (2, 20)], [(1, 1), (0, 1)]]
    s_plans, cond_steps = _cond_against_static(config, 14, [(0, 30), (1, 7), (2, 20)], work,
                                               check_oracle=config.kv_cache_dtype != "fp8", **options)
    c_plans = {plan for plan, _ in cond_steps}
    assert {p.route for p in c_plans} == {"cond"}
    assert {p.route for p in s_plans} == ({"sparse"} if options.get("force_sparse") else {"dense", "sparse"})
    # a cond plan holds the stages its batch needs: the dense call where the static plan has it,
    # scoring and sparse attention where it scores rows
    for s, (c, _) in zip(s_plans, cond_steps):
        assert (bool(c.num_dense_keys), bool(c.num_sparse_tokens)) == (
            bool(s.use_dense_mha), not s.use_dense_mha or s.num_sparse_tokens > 0)
    assert len(c_plans) == len({(p.num_tokens, p.num_seqs, p.pages_per_seq, p.use_dense_mha, p.num_sparse_tokens > 0)
                                for p in s_plans})


def test_cond_stages_follow_the_batch(monkeypatch):
    """dispatch="cond": each stage runs at the smallest size of its ladder that holds the batch
    (meta.branches: scoring, the dense call's keys, sparse attention; row ladders of several
    sizes from LADDER_MIN_TOKENS rows, lowered here to the tiny buckets): short prefills (16 and
    32 keys), a masked long prefill, a decode beside a short prefill, and short prefills with
    context whose keys pass the largest key size (the last one then attends sparsely); each step
    gives the static plan's outputs and cache."""
    from jax_sparse_mla import plan as plan_lib

    monkeypatch.setattr(plan_lib, "LADDER_MIN_TOKENS", 16)
    work = [[(0, 6), (1, 5)], [(0, 6), (1, 5)], [(2, 20)], [(2, 1), (3, 4)],
            [(s, 12) for s in range(4, 9)], [(s, 3) for s in range(4, 9)]]
    seqs = [(0, 12), (1, 10), (2, 21), (3, 4)] + [(s, 15) for s in range(4, 9)]
    _, cond_steps = _cond_against_static(TINY, 15, seqs, work)
    # (stages, the picks' sizes): scored rows, the dense call (keys, masked), attending rows, projected rows
    assert [((bool(p.num_dense_keys), bool(p.num_sparse_tokens)), p.score_calls[m.branches[0]][0] if p.score_calls else None,
             p.dense_calls[m.branches[1]], p.attend_sizes[m.branches[2]] if p.attend_sizes else None,
             p.row_sizes[m.branches[3]]) for p, m in cond_steps] == [
        ((True, False), None, (16, False), None, 11), ((True, False), None, (32, False), None, 11),
        ((True, True), 32, (32, True), 0, 20),  # 20 rows scored, masked: none attends sparsely
        ((True, True), 16, (16, False), 16, 9),  # a bucket of 16: one size for scoring and attending
        ((True, False), None, (64, False), None, 60),
        ((True, True), 16, (64, False), 16, 15)]  # 75 keys > 4 x 16: the last prefill attends sparsely


def test_cond_program_with_constant_stage_sizes_has_no_conditional_and_the_same_output(monkeypatch):
    """meta.branches given as numpy (the stages' sizes fixed at trace time, as bench_layer's
    cond_baked variants compile it): every stage calls its branch directly, the program holds no
    conditional, and its output and cache equal the program that switches at run time (a masked
    prefill beside a decode and a short prefill: scoring, the dense call, sparse attention and the
    row matmuls each of several sizes)."""
    from jax_sparse_mla import plan as plan_lib

    monkeypatch.setattr(plan_lib, "LADDER_MIN_TOKENS", 16)
    config = TINY
    requests, start = requests_on_fresh_pages(config, ((0, 20), (9, 1), (0, 5)))
    plan, meta = plan_batch(config, requests, num_pages=start, dispatch="cond")
    assert len(plan.row_sizes) > 1 and len(plan.dense_calls) > 1
    params = init_params(config, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (plan.num_tokens, config.hidden_size))
    branches = np.asarray(meta.branches)

    def switching(params, x, cache, meta):
        return forward(params, x, cache, meta, plan=plan, config=config, kernels="xla")

    def baked(params, x, cache, meta):  # the sizes as constants inside the trace
        return switching(params, x, cache, dataclasses.replace(meta, branches=branches))

    runs = [jax.jit(f) for f in (switching, baked)]
    jaxprs = [str(f.trace(params, x, init_cache(config, start), meta).jaxpr) for f in runs]
    assert " cond[" in jaxprs[0] and " cond[" not in jaxprs[1]
    (out, cache), (out_b, cache_b) = (f(params, x, init_cache(config, start), meta) for f in runs)
    assert rel_err(out_b, out) < 1e-6  # (two programs XLA may fuse differently)
    for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(cache_b)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_cond_program_with_the_row_kernel_has_no_row_conditional_and_the_same_output(monkeypatch):
    """Where the row_matmul kernel runs (Implementations.row_matmul: Hopper, interpreted here), a
    cond program's projections and o_proj run over every row with the real rows counted at run
    time: two conditionals fewer than the ladder's program, the same output and caches (a bf16
    config: the kernel's operands), and padding rows 0 though hidden's are NaN there. A bucket
    under kernels.ROW_KERNEL_MIN_TOKENS keeps the ladder."""
    from jax_sparse_mla import plan as plan_lib

    monkeypatch.setattr(plan_lib, "LADDER_MIN_TOKENS", 16)
    config = dataclasses.replace(TINY, dtype="bfloat16")
    requests, start = requests_on_fresh_pages(config, ((0, 20), (9, 1), (0, 5)))
    plan, meta = plan_batch(config, requests, num_pages=start, dispatch="cond")
    assert len(plan.row_sizes) > 1
    params = init_params(config, jax.random.key(0))
    real = sum(r.query_len for r in requests)
    x = jax.random.normal(jax.random.key(1), (plan.num_tokens, config.hidden_size)).at[real:].set(jnp.nan)
    ladder = kernel_ops.resolve("xla", config)
    row_kernel = dataclasses.replace(ladder, row_matmul=kernel_ops.OpImpl("mosaic", interpret=INTERPRET))
    monkeypatch.setattr(kernel_ops, "resolve", lambda kernels, config: row_kernel if kernels == "pallas" else ladder)

    def program(kernels):  # a new jit each time: the threshold is read when it traces
        return jax.jit(functools.partial(forward, plan=plan, config=config, kernels=kernels))

    def conds(kernels):
        jaxpr = program(kernels).trace(params, x, init_cache(config, start), meta).jaxpr.jaxpr
        return len(equations_outside_kernels(jaxpr, ("cond",)))

    monkeypatch.setattr(kernel_ops, "ROW_KERNEL_MIN_TOKENS", plan.num_tokens + 1)
    assert conds("pallas") == conds("xla")
    monkeypatch.setattr(kernel_ops, "ROW_KERNEL_MIN_TOKENS", plan.num_tokens)
    assert conds("pallas") == conds("xla") - 2
    runs = [program(k) for k in ("xla", "pallas")]
    (out, cache), (out_k, cache_k) = (f(params, x, init_cache(config, start), meta) for f in runs)
    assert np.all(np.asarray(out_k[real:]) == 0) and np.isfinite(np.asarray(out_k, np.float32)).all()
    assert rel_err(out_k, out) < 1e-2  # (bf16 roundings of float32 sums taken in another order)
    for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(cache_k)):
        assert rel_err(jnp.asarray(b, jnp.float32), jnp.asarray(a, jnp.float32)) < 1e-2


@pytest.mark.parametrize("num_tokens", [512, 1024, 8192, 16384])
def test_projection_ladder_pads_a_bounded_share_of_the_real_rows(num_tokens):
    """At every real row count n of a bucket of T rows, the projection size picked for it holds n
    and exceeds it by under 1/8 of n above T / 2, under 1/4 of n down to T / 16, and is T / 16
    below: the matmuls over every row cost about the real rows whatever the bucket (a policy's
    minimum or an engine's coarser buckets hold more rows open than a power of two of n)."""
    from jax_sparse_mla import plan as plan_lib

    ladder = np.array(plan_lib.projection_ladder(num_tokens))
    n = np.arange(1, num_tokens + 1)
    picked = ladder[np.searchsorted(ladder, n)]
    assert ladder[-1] == num_tokens and (picked >= n).all()
    top, mid, low = n > num_tokens // 2, (n > num_tokens // 16) & (n <= num_tokens // 2), n <= num_tokens // 16
    assert (picked[top] - n[top] < n[top] / 8).all()
    assert (picked[mid] - n[mid] < n[mid] / 4).all()
    assert (picked[low] == num_tokens // 16).all()


def test_cond_projects_about_its_real_rows(monkeypatch):
    """A cond plan's matmuls over every row (projections, o_proj) run over its real rows rounded
    up to plan.projection_ladder's next size (from LADDER_MIN_TOKENS rows up, lowered here to
    the tiny buckets): the pick is meta.branches[3], and every step gives the
    static plan's outputs and cache (rows past the pick are padding: zero, written nowhere)."""
    from jax_sparse_mla import plan as plan_lib

    monkeypatch.setattr(plan_lib, "LADDER_MIN_TOKENS", 16)
    assert plan_lib.projection_ladder(32) == (16, 18, 20, 22, 24, 26, 28, 30, 32)
    work = [[(0, 17), (1, 3)], [(0, 1), (1, 1), (2, 20)], [(0, 1), (1, 1), (2, 1), (3, 32)]]
    _, cond_steps = _cond_against_static(TINY, 16, [(0, 19), (1, 5), (2, 22), (3, 32)], work)
    assert [(plan.num_tokens, plan.row_sizes[int(meta.branches[3])]) for plan, meta in cond_steps] == [
        (32, 20), (32, 22), (64, 36)]  # 20, 22 and 35 real rows


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_projections_round_q_where_deepseeks_reference_does(dtype):
    """q leaves q_b_proj in config.dtype (bf16: DeepSeek's reference rounds it there), its rope
    half is rounded there again after the rope (as the reference's), the other projections stay
    float32; a float32 config (the oracle's) keeps everything float32."""
    config = MLAConfig.tiny(dtype=dtype)
    params = init_params(config, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (5, config.hidden_size))
    qr, q_nope, q_pe, c, k_pe = mla_projections(params, x, jnp.arange(5), config)
    assert q_nope.dtype == q_pe.dtype == jnp.dtype(dtype)
    assert {a.dtype for a in (qr, c, k_pe)} == {jnp.dtype(jnp.float32)}
    q = linear(qr, params["q_b_proj.weight"], config).astype(dtype)
    q = q.reshape(5, config.num_attention_heads, config.qk_head_dim)
    want = q[..., :config.qk_nope_head_dim]
    np.testing.assert_array_equal(np.asarray(q_nope, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("in_f32", [True, pytest.param(False, marks=pytest.mark.gpu)])
def test_linear_rounds_its_float32_accumulation_once(in_f32):
    """linear into bf16 equals the float32 product rounded to bf16: in float32 then rounded (the
    CPU's way) or written in bf16 by the dot itself (the GPU's: f32 accumulation inside it), to
    one bf16 rounding step (the two products may sum in another order)."""
    config = MLAConfig.tiny(dtype="bfloat16")
    kx, kw = jax.random.split(jax.random.key(4))
    x = jax.random.normal(kx, (300, 96), jnp.float32)
    w = jax.random.normal(kw, (200, 96), jnp.float32)
    got = jax.jit(lambda x, w: linear(x, w, config, dtype=jnp.bfloat16, in_f32=in_f32))(x, w)
    assert got.dtype == jnp.bfloat16
    want = linear(x, w, config)  # float32
    assert want.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=2 ** -7, atol=1e-6)
    assert rel_err(got.astype(jnp.float32), want) < 4e-3


@pytest.mark.parametrize("kernels", kernel_ops.CHOICES)
def test_per_head_einsums_run_in_float32_off_the_gpu(kernels):
    """XLA's CPU backend has no batched bf16 x bf16 -> f32 dot: resolve says so off the GPU."""
    assert kernel_ops.resolve(kernels, MLAConfig.tiny(dtype="bfloat16")).dots_in_f32 == (jax.default_backend() != "gpu")


@pytest.mark.gpu
@pytest.mark.parametrize("spec, a_shape, a_dtype", [("thn,hnr->thr", (33, 8, 64), "bfloat16"),  # q_nope -> q_lat
                                                     ("thr,hvr->thv", (33, 8, 128), "float32"),   # kernel out -> heads
                                                     ("kr,hnr->khn", (70, 128), "bfloat16")])    # latent -> keys
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
def test_per_head_on_the_gpu_accumulates_in_float32(spec, a_shape, a_dtype, out_dtype):
    """The per-head einsums in the operands' own dtype (bf16 rows and weights, float32 kernel
    outputs) equal the float32 oracle to the output's rounding, as the float32 route does (TF32)."""
    from jax_sparse_mla.model import per_head
    config = MLAConfig.tiny(dtype="bfloat16")
    ka, kw = jax.random.split(jax.random.key(3))
    a = jax.random.normal(ka, a_shape, jnp.float32).astype(a_dtype)
    w = jax.random.normal(kw, (8, 64, 128), jnp.float32).astype(jnp.bfloat16)  # [H, nope or v, R]
    want = jnp.einsum(spec, a.astype(jnp.float32), w.astype(jnp.float32), precision="highest")
    for in_f32 in (False, True):
        got = jax.jit(lambda a, w: per_head(spec, a, w, config, in_f32=in_f32, dtype=out_dtype))(a, w)
        assert got.dtype == jnp.dtype(out_dtype)
        assert rel_err(got.astype(jnp.float32), want) < (4e-3 if out_dtype == "bfloat16" else 1e-3), in_f32


@pytest.mark.parametrize("kernels,options", [
    ("auto", {"prefill_route": "sparse"}), ("auto", {"prefill_route": "masked"}), ("auto", {"dispatch": "cond"}),
    ("pallas", {"prefill_route": "sparse"}),
], ids=["sparse", "masked", "cond", "pallas"])
def test_scoring_in_row_chunks_gives_the_whole_calls_result(monkeypatch, kernels, options):
    """With a scoring workspace of a few rows' logits (policy.SCORING_WORKSPACE_BYTES), every
    scoring call runs in row chunks (RowGroup.score_chunks > 1; a call's rows -1 padded to whole
    chunks) and gives the outputs and caches of the calls made whole: a long prefill beside a
    short one, then decodes."""
    from jax_sparse_mla import policy

    runs = {}
    for bound in (None, 3 * 4 * 64):  # 3 rows of 64 keys a chunk: chunks that do not divide the rows
        if bound:
            monkeypatch.setattr(policy, "SCORING_WORKSPACE_BYTES", bound)
        h = Harness(TINY, seed=21, num_pages=32, kernels=kernels)
        for sid, n in [(0, 41), (1, 10)]:
            h.add(sid, n)
        outs, chunks = [], []
        for work in ([(0, 40), (1, 9)], [(0, 1), (1, 1)]):
            out, plan, _ = h.step(work, **options)
            assert plan.pages_per_seq * TINY.page_size == 64 and plan.has_indexer_scoring
            chunks.append(max(g.score_chunks for g in plan.groups))
            h.check(out, TOL_F32)
            outs.append(out)
        runs[bound] = (outs, h.cache, chunks)
    (whole, whole_cache, whole_chunks), (split, split_cache, split_chunks) = runs.values()
    assert whole_chunks == [1, 1] and min(split_chunks) > 1, split_chunks
    for a, b in zip(whole, split):
        for sid in a:
            assert rel_err(b[sid], a[sid]) < 1e-6, sid
    for a, b in zip(jax.tree.leaves(whole_cache), jax.tree.leaves(split_cache)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
