"""A first Pallas call recompiles nothing compiled before it.

Pallas's first interpreted pallas_call imports jax's fuser lazily, which registers a jit-cache-key
setting (`pallas_fuser_disable_nested_fuse`); registering it changes every jit key, so each
program compiled before would be compiled again on its next call. pallas_kernels imports the
fuser eagerly to avoid that. The scenario runs in a fresh interpreter (an earlier test of this
session may already have imported the fuser, which would hide the recompile); compiles are counted
with jax.monitoring's backend-compile duration events of `forward`.
"""

from tests.support import COMPILE_EVENT, run_python


def _scenario():
    """xla, pallas, xla, pallas on one plan -> the number of `forward` compiles each call made."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_sparse_mla import MLAConfig, Request, init_cache, init_params, jit_forward, plan_batch

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(kw.get("fun_name"))
        if event == COMPILE_EVENT and "forward" in str(kw.get("fun_name")) else None)
    config = MLAConfig.tiny()
    params = init_params(config, jax.random.key(0))
    cache = init_cache(config, 16)
    # a decode next to a short prefill: the sparse rows run the Pallas sparse-attention and top-k kernels
    plan, meta = plan_batch(config, [Request(0, 10, [0, 1, 2]), Request(20, 1, [3, 4, 5, 6, 7, 8])], num_pages=16)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((plan.num_tokens, config.hidden_size)), jnp.float32)
    jax.block_until_ready((params, cache, x, meta))
    counts = []
    for kernels in ("xla", "pallas", "xla", "pallas"):
        before = len(compiles)
        out, cache = jit_forward(params, x, cache, meta, plan=plan, config=config, kernels=kernels)
        jax.block_until_ready(out)
        counts.append(len(compiles) - before)
    return counts


def test_a_pallas_call_recompiles_nothing_compiled_before():
    code = ("import json, tests.support; from tests.test_recompile import _scenario; "
            "print('RESULT', json.dumps(_scenario()))")
    xla_first, pallas_first, xla_again, pallas_again = run_python(code, env={"JAX_PLATFORMS": "cpu"})
    assert (xla_first, pallas_first) == (1, 1)  # one program each
    assert xla_again == 0, "the Pallas call made the xla program compile again"
    assert pallas_again == 0
