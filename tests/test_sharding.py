"""sharded_forward on (data, tensor) meshes of virtual CPU devices against the one-device forward.

XLA_FLAGS must be set before jax starts, and conftest has started it with one device: the mesh
runs happen in a subprocess with 4 virtual devices (`tests.support.sharding.mesh_errors` is what it runs).
"""

import dataclasses

import jax
import numpy as np
import pytest

from jax_sparse_mla import BatchMeta, BucketPolicy, Request, plan_batch, policy
from jax_sparse_mla import plan as plan_lib
from jax_sparse_mla.sharding import param_specs, plan_data_parallel, shard_config
from tests.support import run_with_cpu_devices
from tests.support.sharding import PAGES, ROUTES, TINY, mesh_errors

# (data, tensor) meshes: tensor, data and mixed; and whether the indexer splits its scoring by
# rows over the tensor shards for every group it divides (INDEXER_SPLIT_MIN_ROWS 1; by default
# the tiny batches are far below it: every shard scores every row). A mesh takes the first
# data x tensor of 8 virtual devices; all run in one subprocess (the CPU suite's budget), with
# dispatch="cond" plans on a (1, 2), a (2, 2) (plan_data_parallel's: each data shard its own stage
# sizes) and a (1, 4) mesh, the fp8 split last (UPFRONT_MIN_USES 1, so
# that the tiny config's long prefill splits).
MESHES = [((1, 2), False), ((2, 1), False), ((2, 4), False), ((2, 2), True), ((1, 4), True)]
TOL = 1e-4
_MESH_RUN = f"""
import json
from jax_sparse_mla import policy
from tests.support.sharding import mesh_errors, poisoned_rows
results = mesh_errors({[m for m, split in MESHES if not split]!r})
results["nan 1x2"] = poisoned_rows(1, 2)
results["nan cond 2x2"] = poisoned_rows(2, 2, "cond")
results["cond 1x2"] = mesh_errors([(1, 2)], dispatch="cond")["1x2"]
results["cond 2x2"] = mesh_errors([(2, 2)], dispatch="cond")["2x2"]
policy.INDEXER_SPLIT_MIN_ROWS = 1
results.update(mesh_errors({[m for m, split in MESHES if split]!r}))
results["cond 1x4 split"] = mesh_errors([(1, 4)], dispatch="cond")["1x4"]
policy.SCORING_WORKSPACE_BYTES = 768  # a few rows' logits a scoring chunk
results["cond 1x4 split chunks"] = mesh_errors([(1, 4)], dispatch="cond")["1x4"]
policy.SCORING_WORKSPACE_BYTES = {policy.SCORING_WORKSPACE_BYTES}
policy.INDEXER_SPLIT_MIN_ROWS = {policy.INDEXER_SPLIT_MIN_ROWS}
policy.UPFRONT_MIN_USES = 1
results["fp8 2x2"] = mesh_errors([(2, 2)], "fp8")["2x2"]
print("RESULT", json.dumps(results))
"""


@pytest.fixture(scope="module")
def mesh_results():
    return run_with_cpu_devices(_MESH_RUN, devices=8)


@pytest.mark.parametrize("dp,tp,split_rows", [(*m, split) for m, split in MESHES])
def test_mesh_matches_one_device(mesh_results, dp, tp, split_rows):
    r = mesh_results[f"{dp}x{tp}"]
    assert r["routes"] == ROUTES
    assert r["err"] < TOL, r
    assert r["cache_pages"] == r["index_pages"] == [PAGES] * (dp * tp)  # split over data, copied over tensor
    assert r["q_b_rows"] == [TINY.num_attention_heads // tp * TINY.qk_head_dim] * (dp * tp)
    assert r["wq_b_rows"] == [TINY.index_n_heads * TINY.index_head_dim] * (dp * tp)  # the indexer is whole
    # scoring split by rows over the tensor shards where asked for (the groups whose rows tp divides:
    # some), nowhere otherwise
    if split_rows and tp > 1:
        assert tp in r["indexer_shards"] and set(r["indexer_shards"]) <= {1, tp}, r["indexer_shards"]
    else:
        assert set(r["indexer_shards"]) == {1}, r["indexer_shards"]


def test_fp8_split_mesh_matches_one_device(mesh_results):
    """An fp8 latent cache with the prefill / decode split (threshold lowered so that the tiny
    config's long prefill splits): the data shards' common split gives each shard's one-device
    outputs and caches."""
    r = mesh_results["fp8 2x2"]
    assert r["routes"] == ROUTES and r["err"] < TOL, r
    assert r["splits"][0] > 0  # step 1: the long prefill's rows over their own pages


@pytest.mark.parametrize("name,split_rows,chunks", [("cond 1x2", False, False), ("cond 2x2", False, False),
                                                   ("cond 1x4 split", True, False),
                                                   ("cond 1x4 split chunks", True, True)])
def test_cond_plan_mesh_matches_one_device(mesh_results, name, split_rows, chunks):
    """A dispatch="cond" plan through sharded_forward (plan_batch's on one data shard,
    plan_data_parallel's on two: one plan, each shard's own meta.branches): dense and sparse
    steps, each shard's rows as the one-device forward of its own cond plan gives them; with the
    indexer's rows split over the tensor shards (all_gather inside the branch) too, and each
    shard's share scored in row chunks (policy.SCORING_WORKSPACE_BYTES of a few rows)."""
    r = mesh_results[name]
    assert r["routes"] == ROUTES and r["err"] < TOL, r
    assert (4 in r["indexer_shards"]) == split_rows, r["indexer_shards"]
    split_and_chunked = [s > 1 and c > 1 for s, c in zip(r["indexer_shards"], r["score_chunks"])]
    assert any(split_and_chunked) == chunks and (max(r["score_chunks"]) > 1) == chunks, r["score_chunks"]


@pytest.mark.parametrize("name", ["nan 1x2", "nan cond 2x2"])
def test_a_requests_nonfinite_input_shows_in_its_rows_on_a_mesh(mesh_results, name):
    """A NaN in a long prefill's hidden row 5 (batch row 13) makes that request's rows from there
    on NaN in every column after the tensor shards' sum, as on one device; the rows before it and
    the other request's rows are the one-device forward's."""
    r = mesh_results[name]
    assert r["nan_rows"] == r["ref_nan_rows"] == list(range(13, 28)) and r["partial"] == 0, r
    assert r["err"] < TOL, r


def test_param_specs_split_heads():
    specs = param_specs(TINY)
    assert specs["q_b_proj.weight"] == jax.sharding.PartitionSpec("tensor", None)
    assert specs["o_proj.weight"] == jax.sharding.PartitionSpec(None, "tensor")
    for name in ("indexer.wq_b.weight", "indexer.weights_proj.weight", "indexer.wk.weight"):
        assert specs[name] == jax.sharding.PartitionSpec(), name  # the indexer is whole on every shard
    local = shard_config(TINY, 2)
    assert (local.num_attention_heads, local.index_n_heads) == (2, 4)
    with pytest.raises(ValueError, match="num_attention_heads=4 does not split over a tensor axis of size 3"):
        shard_config(TINY, 3)


def test_plan_data_parallel_common_plan_and_errors(monkeypatch):
    short = [Request(0, 5, [0, 1])]
    decode = [Request(9, 1, [0, 1, 2]), Request(3, 1, [3])]
    plan, meta = plan_data_parallel(TINY, [short, decode, []], pages_per_shard=8)
    assert plan.route == "dense" and plan.num_sparse_tokens == 2 and plan.num_scored_tokens == 2
    T = plan.num_tokens
    assert meta.positions.shape == (3 * T,) and meta.block_tables.shape == (3 * plan.num_seqs, plan.pages_per_seq)
    np.testing.assert_array_equal(np.asarray(meta.sparse_rows), [-1, -1, 0, 1, -1, -1])
    assert np.all(np.asarray(meta.positions[2 * T:]) == -1)  # the idle shard is all padding
    long_ = [Request(0, 20, list(range(5)))]
    plan, meta = plan_data_parallel(TINY, [short, long_], pages_per_shard=8)
    assert plan.route == "dense" and plan.num_sparse_tokens == 32  # the long prefill's rows attend sparsely
    assert plan_data_parallel(TINY, [long_, long_], pages_per_shard=8)[0].route == "sparse"
    # fp8 cache: one shard's split (its long prefill) becomes every shard's
    fp8 = dataclasses.replace(TINY, kv_cache_dtype="fp8")
    monkeypatch.setattr(policy, "UPFRONT_MIN_USES", 1)
    assert plan_batch(fp8, long_, prefill_route="sparse")[0].num_upfront_rows == 32
    short_and_decode = [Request(0, 5, [0, 1]), Request(9, 1, [2, 3, 4])]  # rows 0-4 dense, row 5 a decode
    plan, meta = plan_data_parallel(fp8, [short_and_decode, long_], pages_per_shard=8)
    assert plan.route == "dense" and (plan.num_upfront_rows, plan.num_kernel_rows, plan.num_upfront_pages) == (32, 1, 8)
    np.testing.assert_array_equal(meta.upfront_rows, [-1] * 32 + list(range(20)) + [-1] * 12)
    np.testing.assert_array_equal(meta.kernel_rows, [5, -1])
    np.testing.assert_array_equal(meta.upfront_pages, [-1] * 8 + [0, 1, 2, 3, 4, -1, -1, -1])
    assert plan_data_parallel(TINY, [short_and_decode, long_], pages_per_shard=8)[0].num_upfront_rows == 0
    with pytest.raises(ValueError, match="data shard 1: request 0: page id 9 is outside"):
        plan_data_parallel(TINY, [short, [Request(0, 3, [9])]], pages_per_shard=8)
    with pytest.raises(ValueError, match="at least one request"):
        plan_data_parallel(TINY, [[], []], pages_per_shard=8)


def test_plan_data_parallel_cond_is_each_shards_own_cond_plan():
    """dispatch="cond": the shards' cond plans under the common buckets and with every shard's
    stages (here a dense call and the sparse stages, though no one shard needs both) are one
    plan; each shard keeps its own stage sizes (meta.branches [dp * 4]), its long prefill masked
    where plan_batch would route it so; a static plan refuses prefill routes other than sparse."""
    short = [Request(0, 5, [0, 1])]
    long_ = [Request(0, 20, list(range(5)))]
    decode = [Request(9, 1, [0, 1, 2])]
    plan, meta = plan_data_parallel(TINY, [short, long_, decode, []], pages_per_shard=8, dispatch="cond")
    common = BucketPolicy(min_tokens=32, min_seqs=4, min_pages_per_seq=8)  # the largest shard's buckets
    assert plan_batch(TINY, decode, num_pages=8, buckets=common, dispatch="cond")[0].num_dense_keys == 0
    for d, reqs in enumerate([short, long_, decode]):
        batch, num_pages = plan_lib.check_batch(TINY, reqs, 8, False, True, common, "cond", 1, "auto")
        own, own_meta = plan_lib.plan_host(TINY, batch, num_pages=num_pages, force_sparse=False, skip_indexer=True,
                                           buckets=common, dispatch="cond", stages=(True, True))
        assert own == plan
        for name in BatchMeta.shapes(plan):
            n = getattr(own_meta, name).shape[0]
            np.testing.assert_array_equal(np.asarray(getattr(meta, name))[d * n:(d + 1) * n], getattr(own_meta, name))
    branches = np.asarray(meta.branches).reshape(4, 4)
    assert [plan.dense_calls[i] for i in branches[:, 1]] == [(16, False), (32, True), (0, False), (0, False)]
    with pytest.raises(ValueError, match='prefill_route must be "sparse" \\(or None\\) with dispatch="static"'):
        plan_data_parallel(TINY, [short], pages_per_shard=8, prefill_route="masked")


@pytest.mark.gpu
def test_two_gpus_match_one_device():
    """On a machine with >= 2 GPUs (the Pallas kernels inside shard_map): tensor and data parallel."""
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 GPUs")
    for name, r in mesh_errors([(1, 2), (2, 1)]).items():
        assert r["routes"] == ROUTES and r["err"] < TOL, (name, r)


def test_indexer_split_by_rows_is_a_plan_decision(monkeypatch):
    """Whether tensor shards split a scoring call by rows is decided once, in the plan
    (RowGroup.indexer_shards from policy.indexer_shards), with the Mosaic kernel shape chosen for
    one shard's rows; the index heads need not divide the tensor axis (the indexer is whole)."""
    n = policy.INDEXER_SPLIT_MIN_ROWS
    assert [policy.indexer_shards(rows, tp) for rows, tp in [(n, 4), (n - 1, 4), (n * 3 + 1, 3), (4 * n, 1)]] == \
        [4, 1, 1, 1]
    long_ = [Request(0, 20, list(range(5)))]  # 32 padded rows, all scored (the sparse program)
    assert [g.indexer_shards for g in plan_batch(TINY, long_, tensor_parallel=2)[0].groups] == [1]
    monkeypatch.setattr(policy, "INDEXER_SPLIT_MIN_ROWS", 16)
    (group,) = plan_batch(TINY, long_, tensor_parallel=2)[0].groups
    assert (group.num_rows, group.indexer_shards) == (32, 2)
    assert group.indexer_kernel == policy.indexer_kernel(16, 4)  # one shard's 16 rows over the 4 padded sequences
    three_index_heads = dataclasses.replace(TINY, index_n_heads=3)
    assert plan_batch(three_index_heads, long_, tensor_parallel=2)[0].tensor_parallel == 2
    with pytest.raises(ValueError, match="tensor_parallel=3 does not divide num_attention_heads=4"):
        plan_batch(TINY, long_, tensor_parallel=3)


def test_data_parallel_programs_per_device():
    """jax_sparse_mla.data_parallel: each device plans and runs its own batch (its own route), on
    its own cache, and gets exactly what one device running that batch alone gets; outputs and
    caches never leave their device; an idle device keeps its cache."""
    r = run_with_cpu_devices("import json; from tests.support.sharding import device_parallel_errors; "
                             "print('RESULT', json.dumps(device_parallel_errors()))", devices=2)
    assert r["routes"] == [["masked", "dense"], ["sparse", "dense"], [None, "sparse"]], r
    assert r["err"] == 0.0 and r["placed"], r


def test_data_parallel_checks_its_arguments():
    from jax_sparse_mla.data_parallel import data_parallel_step, plan_shards

    dev = jax.devices()[:1]
    with pytest.raises(ValueError, match="2 request lists for 1 devices"):
        plan_shards(TINY, [[], []], dev, pages_per_device=8)
    with pytest.raises(ValueError, match="data shard 0: request 0: page id 9 is outside"):
        plan_shards(TINY, [[Request(0, 3, [9])]], dev, pages_per_device=8)
    with pytest.raises(ValueError, match="data shard 0: expected a sequence of Requests"):
        plan_shards(TINY, [Request(0, 3, [1])], dev, pages_per_device=8)
    with pytest.raises(ValueError, match="one entry per device"):
        data_parallel_step([{}], [], [None], [None], config=TINY)
    with pytest.raises(ValueError, match="data shard 0 is idle"):
        data_parallel_step([{}], [np.zeros(1)], [None], [None], config=TINY)


@pytest.mark.parametrize("name,value,message", [
    ("cache", {}, "cache must be a PagedCache .*got dict"),
    ("cache", None, "cache must be a PagedCache .*got NoneType"),
    ("params", (), "params must be a dict of arrays, got tuple"),
    ("hidden", [[0.0]], "hidden must be an array .*got list"),
    ("meta", None, "meta must be a BatchMeta .*got NoneType"),
    ("plan", {}, "plan must be a BatchPlan .*got dict"),
    ("config", None, "config must be an MLAConfig, got NoneType"),
    ("kernels", "cuda", "kernels must be one of .*got 'cuda'"),
    ("mesh", None, "mesh must be a jax.sharding.Mesh .*got NoneType"),
])
def test_step_entry_points_refuse_arguments_of_other_types(name, value, message):
    """sharded_forward and data_parallel_step make forward's type checks (model.check_arguments):
    a ValueError naming the argument, not an AttributeError from inside."""
    from jax_sparse_mla import init_cache, init_params
    from jax_sparse_mla.data_parallel import data_parallel_step
    from jax_sparse_mla.sharding import make_mesh, sharded_forward

    plan, meta = plan_data_parallel(TINY, [[Request(0, 3, [0])]], pages_per_shard=8)
    args = dict(params=init_params(TINY, jax.random.key(0)), hidden=np.ones((plan.num_tokens, TINY.hidden_size),
                np.float32), cache=init_cache(TINY, 8), meta=meta, plan=plan, config=TINY, kernels="xla",
                mesh=make_mesh(1, 1))
    args[name] = value
    with pytest.raises(ValueError, match=message):
        sharded_forward(**args)
    if name == "mesh":
        return
    step = dict(params=[args["params"]], hidden=[args["hidden"]], caches=[args["cache"]],
                plans=[(args["plan"], args["meta"])], config=args["config"], kernels=args["kernels"])
    per_shard = "" if name in ("config", "kernels") else "data shard 0: "
    with pytest.raises(ValueError, match=per_shard + message):
        data_parallel_step(**step)


def test_data_parallel_step_refuses_lists_and_plans_of_other_types():
    from jax_sparse_mla.data_parallel import data_parallel_step

    for kwargs, message in [(dict(params={}), "params must be a sequence with one entry per device, got dict"),
                            (dict(caches=None), "caches must be a sequence with one entry per device, got NoneType"),
                            (dict(plans=[("plan",)]), r"data shard 0: plans\[0\] must be None or a \(plan, meta\) pair")]:
        with pytest.raises(ValueError, match=message):
            data_parallel_step(**{**dict(params=[{}], hidden=[np.zeros(1)], caches=[None], plans=[None], config=TINY),
                                  **kwargs})
def test_data_parallel_checks_every_device_before_running_any():
    """A bad input for device 1 (a hidden row too many, a plan for another cache size or tensor
    axis, params missing a tensor, a deleted cache) is refused naming device 1 and the input,
    before device 0 runs: device 0's cache is not donated."""
    r = run_with_cpu_devices("import json; from tests.support.sharding import device_parallel_refusals; "
                             "print('RESULT', json.dumps(device_parallel_refusals()))", devices=2)
    expected = {"hidden": "hidden has shape", "pages": "validated for 16 pages, the cache has 32",
                "tensor": "tensor axis of size 2", "params": "params has no 'indexer.wk.weight'",
                "deleted": "cache.latent has been deleted"}
    for name, fragment in expected.items():
        assert r[name]["message"] is not None and r[name]["message"].startswith("data shard 1: "), r[name]
        assert fragment in r[name]["message"], r[name]
        assert r[name]["device 0 cache alive"], (name, r[name])


def test_a_shard_config_is_checked_against_the_layer_plan():
    plan, _ = plan_batch(TINY, [Request(0, 5, [0, 1])], tensor_parallel=2)
    plan.check_config(shard_config(TINY, 2), 2)  # what sharded_forward's shards do
    with pytest.raises(ValueError, match=r"num_attention_heads=4 \(the config has 1 a shard x 2 shards\)"):
        plan.check_config(shard_config(TINY, 4), 2)
    with pytest.raises(ValueError, match=r"num_attention_heads=4 \(the config has 2\)"):
        plan.check_config(shard_config(TINY, 2))
