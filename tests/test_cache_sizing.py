"""Cache sizing: page_bytes against the arrays init_cache makes, num_pages_for_budget's bounds,
and the README's DeepSeek-V3.2 table against both."""

import dataclasses
import pathlib

import jax
import numpy as np
import pytest

import jax_sparse_mla
from jax_sparse_mla import MLAConfig, init_cache, num_pages_for_budget, page_bytes
from jax_sparse_mla.plan import max_slot_pages

TINY = MLAConfig.tiny()
README = pathlib.Path(jax_sparse_mla.__file__).absolute().parent.parent / "README.md"
GiB = 2 ** 30


def _nbytes(cache) -> int:
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(cache))


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "float32", "fp8"])
@pytest.mark.parametrize("indexer_dtype", ["fp8", "bfloat16", "float32"])
def test_page_bytes_is_a_page_of_every_cache_array(kv_cache_dtype, indexer_dtype):
    config = dataclasses.replace(TINY, kv_cache_dtype=kv_cache_dtype, indexer_dtype=indexer_dtype)
    assert page_bytes(config) * 3 == _nbytes(init_cache(config, 3))


def test_page_bytes_of_deepseek_v32():
    """64 tokens a page of: c (512) and k_pe (64) in the cache dtype (fp8: FlashMLA's 656 bytes a
    token), indexer keys (128 e4m3) and their fp32 scale."""
    assert page_bytes(MLAConfig.deepseek_v32()) == 64 * (512 * 2 + 64 * 2 + 128 + 4)
    assert page_bytes(MLAConfig.deepseek_v32(kv_cache_dtype="fp8")) == 64 * (656 + 132)
    with pytest.raises(ValueError, match="config must be an MLAConfig, got dict"):
        page_bytes({})


def test_num_pages_for_budget_fills_the_budget():
    per_page = page_bytes(TINY)
    assert num_pages_for_budget(TINY, 10 * per_page) == 10
    assert num_pages_for_budget(TINY, 10 * per_page - 1) == 9
    assert num_pages_for_budget(TINY, 30 * per_page + 5, num_layers=3) == 10
    assert num_pages_for_budget(TINY, float(per_page) * 2.5) == 2       # a float budget (a fraction of memory)
    assert num_pages_for_budget(TINY, np.int64(per_page), num_layers=np.int32(1)) == 1
    for budget, layers in ((GiB, 1), (7 * GiB + 12345, 5)):
        n = num_pages_for_budget(TINY, budget, layers)
        assert layers * _nbytes(jax.eval_shape(lambda: init_cache(TINY, n))) <= budget < layers * (n + 1) * per_page
    assert num_pages_for_budget(TINY, 2 ** 50) == max_slot_pages(TINY)  # slot numbers stay int32


@pytest.mark.parametrize("args,message", [
    ((TINY, 1167), r"budget_bytes = 1167 is below one page: a page of each of the 1 layer\(s\) takes 1168 bytes "
                   r"\(1168 a layer, page_size = 4 tokens, kv_cache_dtype = 'bfloat16'\)"),
    ((TINY, 2000, 2), r"budget_bytes = 2000 is below one page: a page of each of the 2 layer\(s\) takes 2336 bytes"),
    ((TINY, 0), "budget_bytes must be positive, got 0.0"),
    ((TINY, "1e9"), r"budget_bytes must be a real number, got '1e9' \(str\)"),
    ((TINY, float("inf")), "budget_bytes must be finite"),
    ((TINY, 10 ** 9, 0), "num_layers must be >= 1, got 0"),
    ((TINY, 10 ** 9, 2.0), r"num_layers must be an integer, got 2.0 \(float\)"),
    (("tiny", 10 ** 9), "config must be an MLAConfig, got str"),
])
def test_num_pages_for_budget_refuses(args, message):
    assert page_bytes(TINY) == 1168  # the messages' numbers
    with pytest.raises(ValueError, match=message):
        num_pages_for_budget(*args)


def test_readme_sizing_table_is_the_functions():
    """Each row of the README's DeepSeek-V3.2 table (61 layers, 40 GiB) as the functions give it."""
    text = README.read_text()
    for kv_cache_dtype in ("bfloat16", "fp8"):
        config = MLAConfig.deepseek_v32(kv_cache_dtype=kv_cache_dtype)
        per_page = page_bytes(config)
        pages = num_pages_for_budget(config, 40 * GiB, num_layers=61)
        row = (f'| `"{kv_cache_dtype}"` | {per_page:,} | {per_page // config.page_size:,} | {pages:,} | '
               f'{pages * config.page_size:,} |')
        assert row in text, row
