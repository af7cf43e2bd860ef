"""The layer's programs at DeepSeek-V3.2's dimensions, with the kernels `kernels.resolve` picks
on Hopper, lowered for the GPU on any machine: Mosaic GPU's lowering rules and shared-memory
bounds, and Triton's lowering rules (its shared memory is checked only when XLA compiles), at
the shapes the layer gives the kernels, which the interpreted tests (small configs, no
lowering) do not reach, before a GPU run would."""

import dataclasses
import functools

import jax
import pytest

from jax_sparse_mla import MLAConfig, forward, init_cache, init_params, plan_batch
from jax_sparse_mla import kernels as kernel_ops
from tests.support.cases import requests_on_fresh_pages

# Triton's lowering reads the target from the abstract mesh's device where no GPU is attached.
HOPPER = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
HOPPER_MESH = jax.sharding.AbstractMesh((1,), ("device",), (jax.sharding.AxisType.Auto,), abstract_device=HOPPER)


@pytest.mark.parametrize("specs,kv,dispatch", [
    ([(4096, 1)] * 64, "bfloat16", "static"),  # sparse decode: indexer decode kernel, top-k, sparse MLA
    ([(4096, 1)] * 64, "fp8", "static"),  # the fp8 latent cache's sparse path
    ([(0, 256)] * 8, "bfloat16", "static"),  # dense causal MHA
    ([(0, 4096)], "bfloat16", "static"),  # masked MHA: indexer prefill kernel, top-k over 4096 rows
    ([(0, 1024)] * 2 + [(4096, 1)] * 64, "bfloat16", "cond"),  # the serving program, row_matmul included
], ids=["decode", "decode-fp8", "dense", "masked", "mixed-cond"])
def test_layer_lowers_for_hopper_at_real_dimensions(monkeypatch, specs, kv, dispatch):
    monkeypatch.setattr(kernel_ops, "interpret_mode", lambda: False)
    monkeypatch.setattr(kernel_ops, "on_hopper", lambda: True)
    config = dataclasses.replace(MLAConfig.deepseek_v32(), kv_cache_dtype=kv)
    impl = kernel_ops.resolve("pallas", config)
    assert {getattr(impl, op).implementation for op in kernel_ops.OPS} == {"mosaic"}, impl
    requests, num_pages = requests_on_fresh_pages(config, specs)
    plan, meta = plan_batch(config, requests, num_pages=num_pages, dispatch=dispatch)
    if dispatch == "cond":  # a bucket whose row stages run through row_matmul
        assert len(plan.row_sizes) > 1 and kernel_ops.row_kernel(impl.row_matmul, plan.num_tokens) is not None
    params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    cache = jax.eval_shape(lambda: init_cache(config, num_pages))
    hidden = jax.ShapeDtypeStruct((plan.num_tokens, config.hidden_size), config.jnp_dtype)
    fn = jax.jit(functools.partial(forward, plan=plan, config=config, kernels="pallas"))
    with jax.sharding.use_abstract_mesh(HOPPER_MESH):
        text = fn.trace(params, hidden, cache, meta).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
