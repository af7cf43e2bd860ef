"""sharded_forward on (data, tensor) meshes of virtual CPU devices against the one-device forward.

XLA_FLAGS must be set before jax starts, and conftest has started it with one device: the mesh
runs happen in a subprocess with 4 virtual devices (`tests.support.sharding.mesh_errors` is what it runs).
"""

import dataclasses

import jax
import numpy as np
import pytest

from jax_sparse_mla import Request, plan_batch
from jax_sparse_mla.sharding import param_specs, plan_data_parallel, shard_config
from tests.support import run_with_cpu_devices
from tests.support.sharding import PAGES, ROUTES, TINY, mesh_errors

MESHES = [(1, 2), (2, 2), (1, 4)]  # (data, tensor)
TOL = 1e-4


@pytest.fixture(scope="module")
def mesh_results():
    return run_with_cpu_devices(f"import json; from tests.support.sharding import mesh_errors; "
                                f"print('RESULT', json.dumps(mesh_errors({MESHES!r})))")


@pytest.mark.parametrize("dp,tp", MESHES)
def test_mesh_matches_one_device(mesh_results, dp, tp):
    r = mesh_results[f"{dp}x{tp}"]
    assert r["routes"] == ROUTES
    assert r["err"] < TOL, r
    assert r["cache_pages"] == r["index_pages"] == [PAGES] * (dp * tp)  # split over data, copied over tensor
    assert r["q_b_rows"] == [TINY.num_attention_heads // tp * TINY.qk_head_dim] * (dp * tp)


def test_fp8_split_mesh_matches_one_device():
    """An fp8 latent cache with the prefill / decode split (threshold lowered so that the tiny
    config's long prefill splits): the data shards' common split gives each shard's one-device
    outputs and caches."""
    r = run_with_cpu_devices(
        "import json; from jax_sparse_mla import policy; policy.UPFRONT_MIN_USES = 1; "
        "from tests.support.sharding import mesh_errors; print('RESULT', json.dumps(mesh_errors([(2, 2)], 'fp8')))")
    r = r["2x2"]
    assert r["routes"] == ROUTES and r["err"] < TOL, r
    assert r["splits"][0] > 0  # step 1: the long prefill's rows over their own pages


def test_param_specs_split_heads():
    specs = param_specs(TINY)
    assert specs["q_b_proj.weight"] == jax.sharding.PartitionSpec("tensor", None)
    assert specs["o_proj.weight"] == jax.sharding.PartitionSpec(None, "tensor")
    assert specs["indexer.weights_proj.weight"] == jax.sharding.PartitionSpec("tensor", None)
    assert specs["indexer.wk.weight"] == jax.sharding.PartitionSpec()
    local = shard_config(TINY, 2)
    assert (local.num_attention_heads, local.index_n_heads) == (2, 2)
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
    from jax_sparse_mla import policy
    monkeypatch.setattr(policy, "UPFRONT_MIN_USES", 1)
    assert plan_batch(fp8, long_)[0].num_upfront_rows == 32
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


@pytest.mark.gpu
def test_two_gpus_match_one_device():
    """On a machine with >= 2 GPUs (the Pallas kernels inside shard_map): tensor and data parallel."""
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 GPUs")
    for name, r in mesh_errors([(1, 2), (2, 1)]).items():
        assert r["routes"] == ROUTES and r["err"] < TOL, (name, r)
