"""The Flax NNX layer: partition metadata per sharding.param_specs, axis names, dtypes, HF loading,
outputs equal to model.forward, and a sharded init on 2 virtual CPU devices (in a subprocess:
XLA_FLAGS must be set before jax starts, see tests/test_sharding.py)."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jax_sparse_mla
from jax_sparse_mla import MLAConfig, Request, SparseMLA, init_cache, init_params, plan_batch
from jax_sparse_mla.model import jit_forward
from jax_sparse_mla.sharding import cache_specs, param_specs
from tests.support import run_with_cpu_devices

TINY = MLAConfig.tiny()  # float32, 4 heads, 4 index heads


def _specs(layer):
    """{HF name: PartitionSpec} from the layer's NNX state."""
    state = nnx.get_partition_spec(nnx.state(layer))
    return {path[-1]: var.get_value() for path, var in nnx.to_flat_state(state)}


def _dtypes(layer):
    return {path[-1]: var.get_value().dtype for path, var in nnx.to_flat_state(nnx.state(layer, nnx.Param))}


@pytest.mark.parametrize("axes", [{}, {"tensor_axis": "model", "data_axis": "batch"}])
def test_partition_metadata_matches_param_specs(axes):
    layer = SparseMLA(TINY, rngs=nnx.Rngs(0), **axes)
    want = param_specs(TINY, tensor_axis=axes.get("tensor_axis", "tensor"))
    assert _specs(layer) == want
    tensor = axes.get("tensor_axis", "tensor")
    assert want["q_b_proj.weight"] == P(tensor, None) and want["o_proj.weight"] == P(None, tensor)
    assert want["q_a_proj.weight"] == P()
    assert layer.cache_specs() == cache_specs(TINY, data_axis=axes.get("data_axis", "data"))
    assert layer.cache_specs().latent == P(axes.get("data_axis", "data"))


def test_param_dtype_and_dtype():
    assert set(_dtypes(SparseMLA(TINY, rngs=nnx.Rngs(0))).values()) == {jnp.dtype(jnp.float32)}  # config.dtype
    assert set(_dtypes(SparseMLA(TINY, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)).values()) == {
        jnp.dtype(jnp.bfloat16)}
    SparseMLA(TINY, rngs=nnx.Rngs(0), dtype="float32")  # the config's: accepted
    with pytest.raises(ValueError, match="config.dtype"):
        SparseMLA(TINY, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="param_dtype"):
        SparseMLA(TINY, rngs=nnx.Rngs(0), param_dtype=jnp.int8)
    with pytest.raises(ValueError, match="two different names"):
        SparseMLA(TINY, rngs=nnx.Rngs(0), tensor_axis="x", data_axis="x")


@pytest.mark.parametrize("param_dtype,source,value", [
    (jnp.float16, np.float32, 1e5),       # float16 holds at most 65504
    (jnp.float16, np.float32, -7e4),
    (jnp.float16, jnp.float32, 1e5),      # a jax array is checked as a numpy one
    (None, np.float64, 1e300),            # stored as float32 (no jax_enable_x64): inf
    (jnp.float32, np.float64, 1e39),
])
def test_weights_that_overflow_the_param_dtype_are_refused(param_dtype, source, value):
    """The weights are checked as stored (after the cast to param_dtype): none becomes inf."""
    params = {k: np.array(v, np.float64) for k, v in init_params(TINY, jax.random.key(0)).items()}
    params["o_proj.weight"][1, 2] = value
    params = {k: (jnp.asarray(v, source) if source is jnp.float32 else np.asarray(v, source)) for k, v in params.items()}
    stored = "float32" if param_dtype is None else jnp.dtype(param_dtype).name
    with pytest.raises(ValueError, match=f"tensor 'o_proj.weight' overflows {stored}"):
        SparseMLA(TINY, params=params, param_dtype=param_dtype)
    if abs(value) < 3e38:  # in bfloat16's range
        layer = SparseMLA(TINY, params=params, param_dtype=jnp.bfloat16)
        assert np.isfinite(np.asarray(layer.params()["o_proj.weight"], np.float32)).all()
    params["o_proj.weight"] = np.full(params["o_proj.weight"].shape, np.nan, np.float32)
    with pytest.raises(ValueError, match="tensor 'o_proj.weight' has non-finite values"):
        SparseMLA(TINY, params=params, param_dtype=param_dtype)
    # under a trace the values are unknown: an abstract init is not refused
    nnx.eval_shape(lambda: SparseMLA(TINY, rngs=nnx.Rngs(0), param_dtype=jnp.float16))


def test_arguments_of_other_types_are_refused_by_name():
    """The constructor and the calls refuse a wrongly typed argument with a ValueError naming it
    (the calls through forward's and sharded_forward's checks)."""
    from jax_sparse_mla.sharding import make_mesh, plan_data_parallel

    for kwargs, message in [(dict(config={}), "config must be an MLAConfig, got dict"),
                            (dict(config=None), "config must be an MLAConfig, got NoneType"),
                            (dict(params=[1.0]), "params must be a dict of arrays, got list"),
                            (dict(kernels="cuda"), "kernels must be one of .*got 'cuda'")]:
        with pytest.raises(ValueError, match=message):
            SparseMLA(**{"config": TINY, "rngs": nnx.Rngs(0), **kwargs})
    layer = SparseMLA(TINY, rngs=nnx.Rngs(0), kernels="xla")
    plan, meta = plan_batch(TINY, [Request(0, 3, [0])], num_pages=8)
    x, cache = jnp.ones((plan.num_tokens, TINY.hidden_size)), init_cache(TINY, 8)
    for args, message in [((x, None, meta, plan), "cache must be a PagedCache .*got NoneType"),
                          ((x, {}, meta, plan), "cache must be a PagedCache .*got dict"),
                          ((None, cache, meta, plan), "hidden must be an array .*got NoneType"),
                          ((x, cache, (), plan), "meta must be a BatchMeta .*got tuple"),
                          ((x, cache, meta, None), "plan must be a BatchPlan .*got NoneType")]:
        with pytest.raises(ValueError, match=message):
            layer(*args)
    dp_plan, dp_meta = plan_data_parallel(TINY, [[Request(0, 3, [0])]], pages_per_shard=8)
    with pytest.raises(ValueError, match="cache must be a PagedCache .*got tuple"):
        layer.sharded(x, (), dp_meta, dp_plan, mesh=make_mesh(1, 1))
    with pytest.raises(ValueError, match="mesh must be a jax.sharding.Mesh .*got str"):
        layer.sharded(x, cache, dp_meta, dp_plan, mesh="mesh")


def test_from_hf_keeps_the_hf_names():
    params = init_params(TINY, jax.random.key(3))
    state_dict = {f"model.layers.0.self_attn.{k}": np.asarray(v) for k, v in params.items()}
    layer = SparseMLA.from_hf(state_dict, TINY, param_dtype=jnp.bfloat16)
    assert set(layer.params()) == set(params)
    for name, value in layer.params().items():
        assert value.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(value), np.asarray(params[name].astype(jnp.bfloat16)))
    with pytest.raises(ValueError, match="params has no"):
        SparseMLA(TINY, params={k: v for k, v in params.items() if k != "o_proj.weight"})


@pytest.mark.parametrize("param_dtype", [None, jnp.bfloat16])
def test_outputs_equal_forward(param_dtype):
    layer = SparseMLA(TINY, rngs=nnx.Rngs(0), kernels="xla", param_dtype=param_dtype)
    plan, meta = plan_batch(TINY, [Request(0, 10, [0, 1, 2]), Request(20, 1, [3, 4, 5, 6, 7, 8])], num_pages=16)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((plan.num_tokens, TINY.hidden_size)), jnp.float32)

    @nnx.jit(static_argnums=4)
    def step(layer, x, cache, meta, plan):
        return layer(x, cache, meta, plan)

    out, cache = step(layer, x, init_cache(TINY, 16), meta, plan)
    ref, ref_cache = jit_forward(layer.params(), x, init_cache(TINY, 16), meta, plan=plan, config=TINY,
                                 kernels="xla")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-6, atol=1e-7)
    for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(ref_cache)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def _sharded_init():
    """On 2 devices, mesh axes ("batch", "model"): params placed per the specs by SparseMLA(mesh=)
    and by a jitted init under jax.set_mesh; sharded() against forward."""
    mesh = jax_sparse_mla.make_mesh(1, 2, data_axis="batch", tensor_axis="model")
    axes = {"tensor_axis": "model", "data_axis": "batch"}
    specs = param_specs(TINY, tensor_axis="model")
    eager = SparseMLA(TINY, rngs=nnx.Rngs(0), mesh=mesh, kernels="xla", **axes)
    with jax.set_mesh(mesh):
        jitted = nnx.jit(lambda: SparseMLA(TINY, rngs=nnx.Rngs(0), kernels="xla", **axes))()
    plain = SparseMLA(TINY, rngs=nnx.Rngs(0)).params()
    result = {"placed": {}, "diff": {}}
    for which, layer in (("eager", eager), ("jit", jitted)):
        for name, value in layer.params().items():
            ok = (value.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, specs[name]), value.ndim)
                  and len(value.sharding.device_set) == 2)
            result["placed"][f"{which}:{name}"] = bool(ok)
            diff = float(np.max(np.abs(np.asarray(value) - np.asarray(plain[name]))))
            result["diff"][which] = max(result["diff"].get(which, 0.0), diff)
    result["q_b_rows"] = sorted(s.data.shape[0] for s in eager.params()["q_b_proj.weight"].addressable_shards)
    # the sharded step with the layer's axis names
    reqs = [Request(0, 10, [0, 1, 2]), Request(20, 1, [3, 4, 5, 6, 7, 8])]
    plan, meta = jax_sparse_mla.plan_data_parallel(TINY, [reqs], pages_per_shard=16, tensor_parallel=2)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((plan.num_tokens, TINY.hidden_size)), jnp.float32)
    cache = jax_sparse_mla.init_sharded_cache(TINY, mesh, 16, **axes)
    out, _ = nnx.jit(lambda layer, x, cache, meta: layer.sharded(x, cache, meta, plan, mesh=mesh))(
        eager, x, cache, meta)
    plan1, meta1 = plan_batch(TINY, reqs, num_pages=16)
    ref, _ = jit_forward(plain, x, init_cache(TINY, 16), meta1, plan=plan1, config=TINY, kernels="xla")
    result["err"] = float(np.max(np.abs(np.asarray(out) - np.asarray(ref))) / np.max(np.abs(np.asarray(ref))))
    return result


def test_sharded_init_places_params_per_the_specs():
    code = ("import json, tests.support; from tests.test_nnx_layer import _sharded_init; "
            "print('RESULT', json.dumps(_sharded_init()))")
    r = run_with_cpu_devices(code, devices=2)
    assert r["placed"] and all(r["placed"].values()), {k: v for k, v in r["placed"].items() if not v}
    assert r["diff"]["eager"] == 0.0, r["diff"]  # the same values as an unsharded init
    assert r["diff"]["jit"] < 1e-6, r["diff"]  # (jitted random init: XLA may fuse differently)
    assert r["q_b_rows"] == [TINY.num_attention_heads // 2 * TINY.qk_head_dim] * 2
    assert r["err"] < 1e-4, r["err"]
