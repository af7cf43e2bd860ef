"""scripts/example_decoder_layer.py: the batched decoder-layer steps (packed ragged prefill,
then a decode of each sequence) give each sequence what the layer gives it run alone."""

import importlib.util
import pathlib

import numpy as np

import jax_sparse_mla
from jax_sparse_mla import Request, init_cache, plan_batch

SCRIPT = pathlib.Path(jax_sparse_mla.__file__).absolute().parent.parent / "scripts" / "example_decoder_layer.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("example_decoder_layer", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_decoder_layer_matches_each_sequence_alone():
    example = _load_example()
    r = example.main()
    config, layer, lengths = r["config"], r["layer"], r["lengths"]
    S = max(lengths)
    assert r["prefill"].shape == (len(lengths), S, config.hidden_size)
    prefill, decode = np.asarray(r["prefill"]), np.asarray(r["decode"])
    plan, _ = plan_batch(config, [Request(0, n, t) for n, t in zip(lengths, r["tables"])])
    assert plan.has_indexer_scoring  # the longest prompt is scored: the sparse side of the layer ran
    for b, (n, table) in enumerate(zip(lengths, r["tables"])):
        cache = init_cache(config, r["num_pages"])
        plan, meta = plan_batch(config, [Request(0, n, table)], num_pages=r["num_pages"])
        y, cache = example.step(layer, example.pack(r["x"][b:b + 1], [n], plan.num_tokens), cache, meta, plan)
        np.testing.assert_allclose(prefill[b, :n], np.asarray(y[:n]), rtol=1e-5, atol=1e-5, err_msg=f"prefill {b}")
        assert not prefill[b, n:].any()  # unpack leaves the rows past the prompt empty
        plan, meta = plan_batch(config, [Request(n, 1, table)], num_pages=r["num_pages"])
        y, cache = example.step(layer, example.pack(r["x_decode"][b:b + 1], [1], plan.num_tokens), cache, meta, plan)
        np.testing.assert_allclose(decode[b, 0], np.asarray(y[0]), rtol=1e-5, atol=1e-5, err_msg=f"decode {b}")
