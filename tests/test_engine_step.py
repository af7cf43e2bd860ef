"""The engine's step: one dispatch of one program over every layer (serving.engine.jit_layer_stack)
equals the layers run one jit_forward call at a time; its input and metadata travel as one packed
int32 buffer (pack_step / unpack_step); one executable per plan."""

import dataclasses

import jax
import numpy as np
import pytest

from jax_sparse_mla import BucketPolicy, MLAConfig, Request, jit_forward, plan_batch
from jax_sparse_mla.plan import BatchMeta, check_batch, plan_host
from jax_sparse_mla.serving import Engine, EngineOptions, block
from jax_sparse_mla.serving.engine import jit_layer_stack, pack_step, packed_size, unpack_step
from tests.support import compiled_functions

TINY = MLAConfig.tiny()  # index_topk 16, page 4
K = TINY.index_topk


def pages(first, n):
    return list(range(first, first + n))


# Two steps over one cache: prefills (short: dense MHA; long: scored), then a mixed batch (the
# first step's requests decode or go on prefilling beside a new prefill).
PREFILLS = [Request(0, 10, pages(0, 8)), Request(0, K + 4, pages(8, 8)), Request(0, 6, pages(16, 8))]
MIXED = [Request(10, 1, pages(0, 8)), Request(K + 4, 1, pages(8, 8)), Request(6, 5, pages(16, 8)),
         Request(0, K + 2, pages(24, 8))]


def per_layer(engine, requests, **options):
    """The batch through engine's layers one model.jit_forward call each (the engine's caches
    updated), on the rows forward_batch feeds: -> (x [plan.num_tokens, hidden], plan)."""
    opts = engine.options.with_overrides(options)
    plan, meta = plan_batch(engine.config, requests, num_pages=engine.num_pages, **opts.plan_kwargs(engine.config, engine.num_pages))
    ids = np.full(plan.num_tokens, engine.pool_size, np.int32)
    n = sum(r.query_len for r in requests)
    ids[:n] = np.arange(n) % engine.pool_size
    x = engine.pool[ids]
    for layer, params in enumerate(engine.params):
        kw = dict(plan=plan, config=engine.config, kernels=opts.kernels)
        if engine.block == "decoder":
            bp = engine.block_params[layer]
            out, engine.caches[layer] = jit_forward(params, block.attn_input(bp, x, config=engine.config),
                                                    engine.caches[layer], meta, **kw)
            x = block.ffn_residual(bp, x + out, config=engine.config, moe=engine.moe)
        else:
            out, engine.caches[layer] = jit_forward(params, x, engine.caches[layer], meta, **kw)
            x = x + out
    return x, plan


def rel_error(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("dispatch", ["static", "cond"])
@pytest.mark.parametrize("block_kind", ["attention", "decoder"])
def test_one_dispatch_step_equals_the_per_layer_path(block_kind, dispatch):
    kw = dict(num_layers=2, num_pages=32, seed=3, block=block_kind, dispatch=dispatch)
    stacked, layered = Engine(TINY, **kw), Engine(TINY, **kw)
    routes = []
    for requests in (PREFILLS, MIXED):
        x, plan = stacked.forward_batch(requests)
        want, want_plan = per_layer(layered, requests)
        assert plan == want_plan
        routes.append(plan.route if dispatch == "cond" else plan.masked)
        rows = sum(r.query_len for r in requests)
        assert np.isfinite(np.asarray(want[:rows])).all()
        assert rel_error(x, want) < 1e-6, (requests, rel_error(x, want))
        for got_cache, want_cache in zip(stacked.caches, layered.caches, strict=True):
            for name, a in want_cache.arrays().items():
                assert rel_error(getattr(got_cache, name), a) < 1e-6, name
    # static: masked MHA for the long prefills beside dense MHA, then decodes attending sparsely beside them
    assert routes == (["all", "some"] if dispatch == "static" else ["cond", "cond"])


def host_plan(config, requests, **options):
    """plan_batch's plan with its metadata left on the host (numpy); dispatch static unless given."""
    kw = EngineOptions(dispatch="static", buckets=BucketPolicy()).with_overrides(options).plan_kwargs(config, None)
    batch, num_pages = check_batch(config, requests, num_pages=None, **kw)
    return plan_host(config, batch, num_pages=num_pages, **kw)


def test_packed_meta_round_trips_with_every_optional_field_present_or_absent(monkeypatch):
    from jax_sparse_mla import policy

    monkeypatch.setattr(policy, "UPFRONT_MIN_USES", 4)  # the fp8 split pays for the tiny batch below
    fp8 = dataclasses.replace(TINY, kv_cache_dtype="fp8")
    split = [Request(20, 1, pages(0, 6)), Request(0, 3, [6]), Request(0, K + 1, pages(7, 5))]
    cases = {"static": host_plan(TINY, PREFILLS), "cond": host_plan(TINY, MIXED, dispatch="cond"),
             "sparse": host_plan(TINY, [Request(5, 1, [0, 1])]),
             "fp8 split": host_plan(fp8, split, prefill_route="sparse")}
    assert cases["fp8 split"][0].num_upfront_rows and cases["static"][0].masked != "none"
    assert cases["cond"][1].branches is not None and cases["static"][1].branches is None
    present, empty = set(), set()
    for name, (plan, meta) in cases.items():
        rows = np.arange(plan.num_tokens, dtype=np.int32)
        packed = pack_step(plan, meta, rows)
        assert packed.dtype == np.int32 and packed.shape == (packed_size(plan),)
        for unpack in (unpack_step, jax.jit(unpack_step, static_argnums=1)):
            got_rows, got = unpack(packed, plan)
            np.testing.assert_array_equal(got_rows, rows)
            for f in dataclasses.fields(BatchMeta):
                want, value = getattr(meta, f.name), getattr(got, f.name)
                if want is None:
                    assert value is None, (name, f.name)
                    continue
                assert value.shape == np.shape(want) and value.dtype == np.int32, (name, f.name)
                np.testing.assert_array_equal(value, want, err_msg=f"{name}: {f.name}")
                (present if np.size(want) else empty).add(f.name)
    assert present == {f.name for f in dataclasses.fields(BatchMeta)}  # every field carried some values
    assert {"sparse_rows", "upfront_rows", "dense_key_slots"} <= empty  # and the empty ones pass too


def test_a_decode_runs_packed_input_holds_each_steps_rows():
    """A decode run's buffer (rows [steps, T]) unpacks to the same rows and metadata."""
    plan, meta = host_plan(TINY, [Request(5, 1, [0, 1]), Request(9, 1, [2, 3, 4])], dispatch="cond")
    rows = np.arange(3 * plan.num_tokens, dtype=np.int32).reshape(3, plan.num_tokens)
    packed = pack_step(plan, meta, rows)
    assert packed.shape == (packed_size(plan, 3),) == (packed_size(plan) + 2 * plan.num_tokens,)
    got_rows, got = unpack_step(packed, plan, 3)
    np.testing.assert_array_equal(got_rows, rows)
    np.testing.assert_array_equal(got.block_tables, meta.block_tables)
    np.testing.assert_array_equal(got.branches, meta.branches)


def test_pack_step_refuses_metadata_of_another_plan():
    plan, meta = host_plan(TINY, PREFILLS)
    cond, cond_meta = host_plan(TINY, PREFILLS, dispatch="cond")
    rows, T = np.zeros(plan.num_tokens, np.int32), plan.num_tokens
    for bad, message in [
        (dataclasses.replace(meta, branches=np.zeros(4, np.int32)), "meta.branches is set, but BatchMeta.shapes"),
        (dataclasses.replace(meta, positions=meta.positions.astype(np.int64)), rf"meta.positions is int64 \({T},\), "
                                                                               rf"expected int32 \({T},\)"),
        (dataclasses.replace(meta, block_tables=meta.block_tables[:, :1]), "meta.block_tables is int32"),
    ]:
        with pytest.raises(ValueError, match=message):
            pack_step(plan, bad, rows)
    with pytest.raises(ValueError, match="meta.branches is None, but BatchMeta.shapes"):
        pack_step(cond, dataclasses.replace(cond_meta, branches=None), rows)
    with pytest.raises(ValueError, match=rf"rows must be int32 \[plan.num_tokens\] = \[{T}\] \(or \[steps, {T}\]\), got int64"):
        pack_step(plan, meta, rows.astype(np.int64))
    with pytest.raises(ValueError, match=r"packed has shape \(3,\), expected \[packed_size\(plan, steps=1\)\]"):
        unpack_step(np.zeros(3, np.int32), plan)
    with pytest.raises(ValueError, match=rf"rows must be int32 \[plan.num_tokens\] = \[{T}\] \(or \[steps, {T}\]\)"):
        pack_step(plan, meta, np.zeros((2, T + 1), np.int32))


def test_one_executable_per_plan_and_nothing_else_compiles():
    """The step is one program: a new plan adds exactly one jit_layer_stack executable and one
    backend compile (no gather, residual or per-layer program beside it), a repeat adds none."""
    config = MLAConfig.tiny(max_position_embeddings=96)  # this test's plans are new to the process
    engine = Engine(config, num_layers=3, num_pages=48)
    layers_before = jit_forward._cache_size()
    batches = [PREFILLS, MIXED, PREFILLS[:1], [Request(3, 1, [40])], MIXED]
    plans = [plan_batch(config, b, num_pages=48, **engine.options.plan_kwargs(config, 48))[0] for b in batches]
    assert len(set(plans)) == 4  # the engine's cond plans: one per row bucket and stage set (64, 32, 16 twice)
    seen = set()
    for requests, plan in zip(batches, plans):
        before = jit_layer_stack._cache_size()
        with compiled_functions() as compiled:
            engine.forward_batch(requests)[0].block_until_ready()
        new = plan not in seen
        seen.add(plan)
        assert jit_layer_stack._cache_size() - before == new
        assert len(compiled) == new and all("layer_stack" in name for name in compiled), compiled
    # compile_batches compiles ahead of time what has no executable yet: jit's programs are not executables
    assert engine.compile_batches(batches) == len(seen) and engine.compile_batches(batches) == 0
    assert jit_forward._cache_size() == layers_before  # the layers run inside the step only
