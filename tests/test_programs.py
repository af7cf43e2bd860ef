"""Which programs exist: HLO contents per route, the bucketed program count, NNX use under jit."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_sparse_mla import (BucketPolicy, MLAConfig, Request, SparseMLA, init_cache, init_params, jit_forward,
                            plan_batch)
from jax_sparse_mla import kernels as kernel_ops
from jax_sparse_mla import model
from jax_sparse_mla import plan as plan_lib
from jax_sparse_mla.model import compiler_options, forward
from jax_sparse_mla.serving.synthetic import rel_err
from tests.support import equations_outside_kernels
from tests.support.cases import requests_on_fresh_pages

TINY = MLAConfig.tiny()


def compiled_hlo(plan, meta, config=TINY):
    params = init_params(config, jax.random.key(0))
    cache = init_cache(config, plan.num_pages)
    x = jnp.ones((plan.num_tokens, config.hidden_size))
    return jit_forward.lower(params, x, cache, meta, plan=plan, config=config).compile().as_text()


def scoring_ops(hlo: str) -> dict[str, int]:
    """Instructions of the compiled module under model.py's two scoring scopes (`scope_ops`;
    whatever the kernels lower to: Triton or Mosaic custom calls on the GPU, XLA ops in the
    interpreter)."""
    return {scope: scope_ops(hlo, scope) for scope in ("indexer_logits", "indexer_topk")}


@pytest.mark.parametrize("options,scored", [
    ({}, False),                        # short prefill: dense program, scoring absent
    ({"force_sparse": True}, True),     # sparse program
    ({"skip_indexer": False}, True),    # dense route, baseline that keeps scoring
])
def test_scoring_exists_only_where_the_plan_says(options, scored):
    plan, meta = plan_batch(TINY, [Request(0, 10, [0, 1, 2]), Request(0, 5, [3, 4])], num_pages=16, **options)
    assert plan.has_indexer_scoring == scored
    hlo = compiled_hlo(plan, meta)
    ops = scoring_ops(hlo)
    if scored:
        assert ops["indexer_logits"] > 0 and ops["indexer_topk"] > 0, ops
    else:
        assert ops == {"indexer_logits": 0, "indexer_topk": 0}, ops
        assert not re.search(r"\bsort\(|\btopk\(", hlo)  # no selection of any kind


def scope_ops(hlo: str, scope: str) -> int:
    """Instructions of the compiled module emitted under jax.named_scope(scope) (model.py's scopes)."""
    return len(re.findall(rf'op_name="[^"]*{scope}', hlo))


@pytest.mark.parametrize("requests,route,masked", [
    ([Request(0, 30, list(range(8)))], "masked", "all"),                            # masked MHA alone
    ([Request(0, 30, list(range(8))), Request(20, 1, list(range(8, 14)))], "masked", "some"),  # + a decode
    ([Request(0, 30, list(range(8)))], "sparse", "none"),                           # the sparse program
])
def test_masked_program_scores_and_attends_in_the_dense_call(requests, route, masked):
    """A masked prefill's program holds scoring and the dense MHA call, and sparse attention only
    where a scored row attends sparsely (a decode beside it); the sparse route has no dense MHA."""
    plan, meta = plan_batch(TINY, requests, num_pages=16, prefill_route=route)
    assert plan.masked == masked
    hlo = compiled_hlo(plan, meta)
    ops = scoring_ops(hlo)
    assert ops["indexer_logits"] > 0 and ops["indexer_topk"] > 0, ops
    assert (scope_ops(hlo, "dense_mha") > 0) == (masked != "none")
    assert (scope_ops(hlo, "sparse_attention") > 0) == (masked != "all")


def test_mixed_batch_scores_only_the_sparse_rows():
    plan, meta = plan_batch(TINY, [Request(20, 1, list(range(6))), Request(0, 9, [6, 7, 8])], num_pages=16)
    assert plan.use_dense_mha and plan.num_scored_tokens == plan.num_sparse_tokens == 1
    hlo = compiled_hlo(plan, meta)
    assert scoring_ops(hlo)["indexer_logits"] > 0
    # every scoring instruction works on the one decode row, none on all num_tokens rows
    leading = [int(m) for m in re.findall(r'= \w+\[(\d+)[,\]][^\n]*op_name="[^"]*indexer_logits', hlo)]
    assert leading and plan.num_tokens not in leading, leading


def test_serving_loop_compiles_no_more_programs_than_the_buckets_allow():
    """Random batches of a continuous-batching loop: one program per distinct plan, and the
    distinct plans are bounded by the bucket grid."""
    config, rng = TINY, np.random.default_rng(0)
    params = init_params(config, jax.random.key(1))
    num_pages = 128
    cache = init_cache(config, num_pages)
    policy = BucketPolicy()
    start = jit_forward._cache_size()
    plans = set()
    done = {}  # seq -> tokens in cache
    pages = {}
    free = list(range(num_pages))
    next_id = 0
    for _ in range(40):
        reqs = []
        for sid in list(done):
            if done[sid] >= 40:  # finished: free its pages
                free += pages.pop(sid)
                del done[sid]
        while len(done) < 4:
            done[next_id], pages[next_id] = 0, [free.pop(0) for _ in range(10)]
            next_id += 1
        work = []
        for sid in done:
            n = 1 if done[sid] > 0 and rng.random() < 0.6 else int(rng.integers(1, 41 - done[sid]))
            n = min(n, 40 - done[sid])
            reqs.append(Request(done[sid], n, pages[sid]))
            work.append((sid, n))
        plan, meta = plan_batch(config, reqs, num_pages=num_pages, buckets=policy)
        x = jnp.asarray(rng.standard_normal((plan.num_tokens, config.hidden_size)), jnp.float32)
        _, cache = jit_forward(params, x, cache, meta, plan=plan, config=config)
        plans.add(plan)
        for sid, n in work:
            done[sid] += n
    compiled = jit_forward._cache_size() - start
    assert compiled == len(plans)
    # Bucket grid for this workload: <= 160 tokens -> {16..256}: 5 values; 4 seqs -> {4}; <= 40
    # tokens of 4 per page -> {4, 8, 16}; scored rows <= 160 -> {0, 1, 2, ..., 256}; dense keys:
    # <= 4 sequences of <= 40 (short prefills, and longer ones routed masked) -> {0, 16, ..., 256}.
    for p in plans:
        assert p.num_tokens in (16, 32, 64, 128, 256) and p.num_seqs == 4
        assert p.pages_per_seq in (4, 8, 16) and p.num_sparse_tokens in (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)
        assert p.num_dense_keys in (0, 16, 32, 64, 128, 256)
    assert len(plans) < 40  # the bucketing is what makes programs repeat


def test_bad_request_raises_and_leaves_the_cache_untouched():
    params = init_params(TINY, jax.random.key(0))
    cache = init_cache(TINY, 8)
    plan, meta = plan_batch(TINY, [Request(0, 5, [0, 1])], num_pages=8)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((plan.num_tokens, TINY.hidden_size)), jnp.float32)
    _, cache = jit_forward(params, x, cache, meta, plan=plan, config=TINY)
    snapshot = jax.tree.map(np.asarray, cache)
    with pytest.raises(ValueError, match="request 1: page id 9"):
        plan_batch(TINY, [Request(5, 1, [0, 1]), Request(0, 3, [9])], num_pages=8)
    after = jax.tree.map(np.asarray, cache)
    for a, b in zip(jax.tree.leaves(snapshot), jax.tree.leaves(after)):
        np.testing.assert_array_equal(a, b)


def test_nnx_module_under_jit_matches_functional_forward():
    layer = SparseMLA(TINY, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(layer)
    plan, meta = plan_batch(TINY, [Request(0, 20, list(range(5)))], num_pages=8)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((plan.num_tokens, TINY.hidden_size)), jnp.float32)

    @jax.jit
    def step(state, x, cache, meta):
        return nnx.merge(graphdef, state)(x, cache, meta, plan)

    out, _ = step(state, x, init_cache(TINY, 8), meta)
    ref, _ = forward(layer.params(), x, init_cache(TINY, 8), meta, plan=plan, config=TINY)
    assert rel_err(out, ref) < 1e-6
    assert set(layer.params()) == set(init_params(TINY, jax.random.key(0)))


def test_cond_programs_hold_the_stages_their_batches_need(monkeypatch):
    """A cond plan's program holds the stages of its batch: short prefills alone give a program
    with no scoring (and no conditional where the row stages have one size), decodes alone one
    with no dense call and no conditional (compiled with XLA's command buffers, which the
    programs with conditionals have off), and one executable of both stages serves a short
    prefill beside a decode as well as a long prefill (masked) beside one, picking the dense
    call's keys, the scored and the attending rows at run time."""
    policy = BucketPolicy(min_pages_per_seq=8)
    plan_p, meta_p = plan_batch(TINY, [Request(0, 10, [0, 1, 2]), Request(0, 12, [3, 4, 5])], num_pages=16,
                                dispatch="cond", buckets=policy)
    hlo = compiled_hlo(plan_p, meta_p)
    assert not plan_p.has_indexer_scoring and not any(scoring_ops(hlo).values())
    assert len(re.findall(r"\bconditional\(", hlo)) == 1  # the dense call's key sizes
    assert plan_p.has_conditionals and compiler_options(plan_p) == {"xla_gpu_enable_command_buffer": ""}
    plan_d, meta_d = plan_batch(TINY, [Request(20, 1, list(range(6))), Request(9, 1, [6, 7, 8])], num_pages=16,
                                dispatch="cond", buckets=policy)
    hlo = compiled_hlo(plan_d, meta_d)
    assert plan_d.num_dense_keys == 0 and scoring_ops(hlo)["indexer_logits"] > 0
    assert not re.search(r"\bconditional\(", hlo) and scope_ops(hlo, "dense_mha") == 0
    assert not plan_d.has_conditionals and compiler_options(plan_d) == {}  # XLA's command buffers
    # jit_forward compiled each under its own options: one jax.jit each, both counted
    jits = model._jitted_forward._jits
    assert {(), (("xla_gpu_enable_command_buffer", ""),)} <= set(jits)
    assert jit_forward._cache_size() == sum(j._cache_size() for j in jits.values())

    monkeypatch.setattr(plan_lib, "LADDER_MIN_TOKENS", 16)  # row stages of several sizes
    reqs_short = [Request(0, 10, [0, 1, 2]), Request(0, 10, [3, 4, 5]), Request(20, 1, list(range(6, 12)))]
    reqs_long = [Request(0, 20, [0, 1, 2, 3, 4]), Request(20, 1, list(range(5, 11)))]
    plan_a, meta_a = plan_batch(TINY, reqs_short, num_pages=16, dispatch="cond", buckets=policy)
    plan_b, meta_b = plan_batch(TINY, reqs_long, num_pages=16, dispatch="cond", buckets=policy)
    assert plan_a == plan_b and plan_a.route == "cond" and plan_a.attend_sizes == (0, 16, 32)
    assert [plan_a.dense_calls[i] for i in (meta_a.branches[1], meta_b.branches[1])] == [(32, False), (32, True)]
    # 1 scored row, 1 attending: the 16-row sizes; 21 scored rows of 2 sequences (32, decode-shaped), 1 attending
    assert [plan_a.score_calls[m.branches[0]] for m in (meta_a, meta_b)] == [(16, "decode"), (32, "decode")]
    assert [plan_a.attend_sizes[m.branches[2]] for m in (meta_a, meta_b)] == [16, 16]
    hlo = compiled_hlo(plan_a, meta_a)
    assert scoring_ops(hlo)["indexer_logits"] > 0 and len(re.findall(r"\bconditional\(", hlo)) >= 3
    assert plan_a.has_conditionals


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8"])
def test_programs_run_no_loop_outside_the_kernels(monkeypatch, kv_cache_dtype):
    """The layer's programs on Hopper (the Pallas kernels as they run there, traced on the CPU)
    hold no while loop outside the kernels: XLA runs such a loop from the host, an iteration at
    a time (a loop of small kernels, launched one by one, that also splits the CUDA graphs of a
    program around it). A jnp.searchsorted of the default method is such a loop (a scan over the
    halvings); the kernels' wrappers use method="compare_all". Static programs (the batch's own
    route and the sparse one) and a cond program of every stage, its row stages through row_matmul
    (at any bucket size here), at DeepSeek-V3.2 dimensions, both latent cache formats."""
    monkeypatch.setattr(kernel_ops, "interpret_mode", lambda: False)
    monkeypatch.setattr(kernel_ops, "on_hopper", lambda: True)
    monkeypatch.setattr(kernel_ops, "ROW_KERNEL_MIN_TOKENS", 0)
    config = MLAConfig.deepseek_v32(num_attention_heads=16, kv_cache_dtype=kv_cache_dtype)
    # a prefill, two decodes, a chunk
    requests, start = requests_on_fresh_pages(config, ((0, 600), (3000, 1), (3000, 1), (6000, 700)))
    params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    cache = jax.eval_shape(lambda: init_cache(config, start))
    cond = {"dispatch": "cond", "buckets": BucketPolicy.for_limits(config, max_num_seqs=8, max_model_len=8192)}
    for options in ({}, {"force_sparse": True}, cond):
        plan, meta = plan_batch(config, requests, num_pages=start, **options)
        assert plan.has_indexer_scoring
        x = jax.ShapeDtypeStruct((plan.num_tokens, config.hidden_size), config.jnp_dtype)
        traced = jax.jit(forward, static_argnames=("plan", "config", "kernels")).trace(
            params, x, cache, meta, plan=plan, config=config, kernels="pallas")
        assert equations_outside_kernels(traced.jaxpr.jaxpr, ("while", "scan")) == [], (options, plan.route)


def test_scoring_in_row_chunks_holds_one_chunks_logits_at_a_time(monkeypatch):
    """The compiled program's workspace follows the scoring chunks: a 256-row sparse prefill over
    8192 key positions (8 MB of f32 logits, and the XLA scoring's per-head products beside them)
    scored in 16 chunks needs under a third of the temp memory of the call made whole, so XLA
    keeps one chunk's logits at a time (each chunk waits for the previous one's top-k)."""
    from jax_sparse_mla import policy

    requests = [Request(4000, 256, list(range(1064)))]
    temp = {}
    for bound in (None, 16 * 4 * 8192):  # 16 rows a chunk
        if bound:
            monkeypatch.setattr(policy, "SCORING_WORKSPACE_BYTES", bound)
        plan, meta = plan_batch(TINY, requests, num_pages=1100, prefill_route="sparse")
        assert plan.pages_per_seq * TINY.page_size == 8192
        (group,) = plan.groups
        params = init_params(TINY, jax.random.key(0))
        x = jnp.ones((plan.num_tokens, TINY.hidden_size))
        compiled = jit_forward.lower(params, x, init_cache(TINY, 1100), meta, plan=plan, config=TINY).compile()
        temp[group.score_chunks] = compiled.memory_analysis().temp_size_in_bytes
    assert set(temp) == {1, 16} and temp[16] < temp[1] / 3, temp
