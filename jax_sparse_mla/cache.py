"""Paged caches: the MLA latent cache and the lightning indexer's key cache.

Both hold `num_pages` pages of `page_size` tokens. Token slot = page * page_size + offset.
Latent cache per token: c (kv_lora_rank) and rope(k_pe) (qk_rope_head_dim), stored as
  bfloat16 / float32: `latent` [P, page, R] and `k_pe` [P, page, rope] in that dtype;
  fp8 (FlashMLA's 656 bytes per token for R=512): `latent` e4m3 [P, page, R],
    `latent_scale` f32 [P, page, R // 128], `k_pe` bf16 [P, page, rope]; each 128-value tile is
    quantised as DeepSeek's act_quant (ops.quantize_tiles): a power-of-two (ue8m0) scale,
    max(amax, 1e-4) / 448 rounded up, and values clamp(c / scale, +-448) in e4m3.
Indexer key cache per token: `index_k` [P, page, D] in the indexer dtype, plus
  `index_k_scale` f32 [P, page] on the fp8 path (132 bytes per token for D=128).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from . import ops
from .config import FP8_TILE, MLAConfig, check_config_type
from .kernels import dequantize_index_keys, dequantize_latent, gather_paged_rows
from .plan import max_slot_pages
from .validate import as_int, as_page_ids, as_real, check_type


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedCache:
    latent: jax.Array
    latent_scale: jax.Array | None
    k_pe: jax.Array
    index_k: jax.Array
    index_k_scale: jax.Array | None

    @property
    def num_pages(self) -> int:
        return self.latent.shape[0]

    def arrays(self) -> dict[str, jax.Array]:
        """{field name: array} of the fields this cache has (its None fields left out)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    def flat(self, name: str):
        """One cache array with pages flattened to slots: [num_slots, ...] (None stays None)."""
        a = getattr(self, name)
        return None if a is None else a.reshape((-1,) + a.shape[2:])


def _storage_dtype(name: str):
    return ops.FP8_DTYPE if name == "fp8" else jnp.dtype(name)


def init_cache(config: MLAConfig, num_pages: int) -> PagedCache:
    """An empty cache of num_pages pages (contents are zeros: unwritten slots are never read)."""
    if not isinstance(num_pages, int) or num_pages <= 0:
        raise ValueError(f"num_pages must be a positive int, got {num_pages!r}")
    shape = (num_pages, config.page_size)
    latent_dtype, scales, k_pe_dtype = config.latent_cache_layout
    fp8_idx = config.indexer_dtype == "fp8"
    return PagedCache(
        latent=jnp.zeros(shape + (config.kv_lora_rank,), latent_dtype),
        latent_scale=jnp.zeros(shape + (scales,), jnp.float32) if scales else None,
        k_pe=jnp.zeros(shape + (config.qk_rope_head_dim,), k_pe_dtype),
        index_k=jnp.zeros(shape + (config.index_head_dim,), _storage_dtype(config.indexer_dtype)),
        index_k_scale=jnp.zeros(shape, jnp.float32) if fp8_idx else None,
    )


def page_bytes(config: MLAConfig) -> int:
    """Bytes of one page of one layer's cache: every array init_cache makes (latent, its fp8
    scales, k_pe, the indexer keys and their fp8 scales) for page_size tokens. Measured on
    init_cache's abstract output, so it follows the layout; what a user multiplies by num_pages
    and the layer count to size the caches (num_pages_for_budget). ValueError naming `config`
    unless it is an MLAConfig."""
    check_config_type(config)
    one_page = jax.eval_shape(lambda: init_cache(config, 1))
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(one_page))


def num_pages_for_budget(config: MLAConfig, budget_bytes: int | float, num_layers: int = 1) -> int:
    """num_pages for init_cache such that `num_layers` layers' caches (one per layer, each of
    num_pages pages) fit in `budget_bytes`: floor(budget_bytes / (num_layers * page_bytes(config))),
    at most plan.max_slot_pages(config) (slot numbers are int32). The budget is the bytes the caches
    may occupy: summed over the devices a sharded cache spreads its pages over; activations,
    weights and XLA's scratch are the caller's to leave room for. ValueError naming the argument:
    budget_bytes not a positive finite number, num_layers not an integer >= 1, or a budget below
    one page of each layer."""
    budget = as_real(budget_bytes, "budget_bytes", finite=True, positive=True)
    layers = as_int(num_layers, "num_layers", 1)
    per_layer = page_bytes(config)
    if budget < per_layer * layers:
        raise ValueError(f"budget_bytes = {budget_bytes} is below one page: a page of each of the {layers} layer(s) "
                         f"takes {per_layer * layers} bytes ({per_layer} a layer, page_size = {config.page_size} "
                         f"tokens, kv_cache_dtype = {config.kv_cache_dtype!r})")
    return min(int(budget // (per_layer * layers)), max_slot_pages(config))


def check_cache(cache: PagedCache, config: MLAConfig) -> None:
    """Raises ValueError if config is not an MLAConfig, cache not a PagedCache, or the cache's
    arrays do not match the config (shapes and dtypes)."""
    check_config_type(config)
    check_type(cache, "cache", PagedCache, "a PagedCache (from init_cache)")
    expected = jax.eval_shape(lambda: init_cache(config, cache.num_pages))
    for field in dataclasses.fields(PagedCache):
        got, want = getattr(cache, field.name), getattr(expected, field.name)
        if (got is None) != (want is None):
            raise ValueError(f"cache.{field.name} is {'missing' if got is None else 'unexpected'} "
                             f"for kv_cache_dtype={config.kv_cache_dtype!r}, indexer_dtype={config.indexer_dtype!r}")
        if got is not None and (got.shape != want.shape or got.dtype != want.dtype):
            raise ValueError(f"cache.{field.name} has {got.dtype}{list(got.shape)}, expected {want.dtype}{list(want.shape)}")


def encode_latent(c, k_pe, config: MLAConfig) -> dict[str, jax.Array]:
    """Latent rows in storage form. c: [T, R], k_pe: [T, rope] (float32) -> cache field -> [T, ...]."""
    if config.kv_cache_dtype == "fp8":
        values, scale = ops.quantize_tiles(c, FP8_TILE)
        return {"latent": values, "latent_scale": scale, "k_pe": ops.cast_rounded(k_pe, jnp.bfloat16)}
    dt = jnp.dtype(config.kv_cache_dtype)
    return {"latent": ops.cast_rounded(c, dt), "k_pe": ops.cast_rounded(k_pe, dt)}


def encode_index_keys(k, config: MLAConfig) -> dict[str, jax.Array]:
    """Indexer keys in storage form. k: [T, D] float32 (after rope and Hadamard)."""
    if config.indexer_dtype == "fp8":
        values, scale = ops.act_quant(k)
        return {"index_k": values, "index_k_scale": scale}
    return {"index_k": ops.cast_rounded(k, jnp.dtype(config.indexer_dtype))}


def write(cache: PagedCache, slot_mapping, rows: dict[str, jax.Array]) -> PagedCache:
    """Writes rows[name][t] into slot slot_mapping[t] of each named field; slots < 0 write nowhere."""
    num_slots = cache.latent.shape[0] * cache.latent.shape[1]
    target = jnp.where(slot_mapping >= 0, slot_mapping, num_slots)  # out of range: dropped
    updates = {}
    for name, value in rows.items():
        flat = cache.flat(name)
        updates[name] = flat.at[target].set(value.astype(flat.dtype), mode="drop").reshape(getattr(cache, name).shape)
    return dataclasses.replace(cache, **updates)


def _sequence_reader(cache: PagedCache, block_table, length, config: MLAConfig):
    """name -> rows [length, ...] of that cache field (None for a field the cache lacks) for the
    first `length` positions of a sequence. ValueError naming the argument: cache not a
    PagedCache of config's layout, block_table not a list of page ids (validate.as_page_ids) or
    with an entry outside [0, num_pages) (-1 included), length not an integer >= 0 or more rows
    than block_table's pages hold."""
    check_cache(cache, config)
    table = as_page_ids(block_table, "block_table")
    length = as_int(length, "length", 0)
    for k, page in enumerate(table):
        if not 0 <= page < cache.num_pages:
            raise ValueError(f"block_table[{k}] = {page} is not a page of the cache: page ids are in "
                             f"[0, {cache.num_pages})")
    needed = -(-length // config.page_size)
    if needed > len(table):
        raise ValueError(f"length = {length} rows need {needed} pages of {config.page_size}, but block_table "
                         f"lists {len(table)}")
    pages = jnp.asarray(table[:needed], jnp.int32)[None]

    def rows(name: str):
        a = cache.flat(name)
        return None if a is None else gather_paged_rows(a, pages, config.page_size)[0, :length]
    return rows


def read_latent(cache: PagedCache, block_table, length: int, config: MLAConfig):
    """Dense, dequantized latent rows of one sequence: (c [length, R], k_pe [length, rope]) float32.

    block_table: the sequence's page ids (a list, tuple or 1-D numpy integer array), every entry
    a page of the cache; length: the rows to read, at most what the table's pages hold. Exactly
    `length` rows come back; ValueError naming the argument otherwise (see _sequence_reader)."""
    rows = _sequence_reader(cache, block_table, length, config)
    return dequantize_latent(rows("latent"), rows("latent_scale")), rows("k_pe").astype(jnp.float32)


def read_indexer_keys(cache: PagedCache, block_table, length: int, config: MLAConfig):
    """Dense, dequantized indexer keys of one sequence: [length, D] float32 (arguments and errors
    as read_latent's)."""
    rows = _sequence_reader(cache, block_table, length, config)
    return dequantize_index_keys(rows("index_k"), rows("index_k_scale"))
