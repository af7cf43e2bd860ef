"""The oracle: a slow, obviously correct float32 DeepSeek-V3.2 sparse-MLA layer.

It runs one whole sequence from scratch (no cache, no plan, no absorption): every token's
indexer logits over its causal range, its top-k set (every position when the range holds at
most index_topk), then plain multi-head attention (k_nope and v up-projected per head) masked
to that set. Storage rounding of the caches (bf16 / fp8) is applied the way the caches store
values, so that the fast path can be compared tightly for every dtype.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import cache as cache_lib
from .config import MLAConfig
from .kernels import dequantize_index_keys, dequantize_latent
from .model import indexer_keys, indexer_queries, mla_projections

HI = jax.lax.Precision.HIGHEST
# The oracle compiles one program per padded sequence length, each run a few times: XLA's GEMM
# autotuning made a compile take 25-31 s at real dimensions on the H200, 2.4-3.4 s without it
# (docs/benchmarks-archive.md); the GEMM kernel chosen moves a float32 HIGHEST result by rounding only.
_ORACLE_JIT = dict(static_argnames="config", compiler_options={"xla_gpu_autotune_level": 0})


def _f32(params, hidden, config: MLAConfig):
    """Float32 params, hidden and config: the oracle computes in float32 whatever config.dtype."""
    params = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)
    return params, jnp.asarray(hidden, jnp.float32), dataclasses.replace(config, dtype="float32")


def _stored_latent(c, k_pe, config):
    rows = cache_lib.encode_latent(c, k_pe, config)
    return dequantize_latent(rows["latent"], rows.get("latent_scale")), rows["k_pe"].astype(jnp.float32)


def _stored_index_keys(k, config):
    rows = cache_lib.encode_index_keys(k, config)
    return dequantize_index_keys(rows["index_k"], rows.get("index_k_scale"))


@functools.partial(jax.jit, **_ORACLE_JIT)
def _indexer_logits(params, hidden, config: MLAConfig):
    params, x, cfg = _f32(params, hidden, config)
    pos = jnp.arange(x.shape[0])
    qr = mla_projections(params, x, pos, cfg)[0]
    q, w = indexer_queries(params, x, qr, pos, cfg)
    k = _stored_index_keys(indexer_keys(params, x, pos, cfg), cfg)
    scores = jnp.einsum("thd,sd->ths", q.astype(jnp.float32), k, precision=HI)
    logits = jnp.einsum("th,ths->ts", w, jax.nn.relu(scores), precision=HI)
    return jnp.where(pos[None, :] <= pos[:, None], logits, -jnp.inf)


def indexer_logits(params, hidden, config: MLAConfig) -> np.ndarray:
    """[L, L] float32 logits of a whole sequence, -inf above the diagonal (non-causal)."""
    return np.asarray(_indexer_logits(params, hidden, config))


# Rows whose k-th and (k+1)-th largest logits lie closer than this (relative to the row's largest
# |logit|) may select either: fp8 tensor-core accumulation and summation order move logits by
# ~1e-4 relative, so such rows have no single correct top-k set at working precision.
TIE_TOLERANCE = 1e-3
PAD_TO = 256  # sequence rows per compiled reference program


def selection(params, hidden, config: MLAConfig) -> tuple[np.ndarray, np.ndarray]:
    """Top-k sets of a whole sequence.

    Returns (mask [L, L] bool: s is among t's top-k, all causal positions when t < index_topk;
    ambiguous [L] bool: t's set is decided by a near-tie, see TIE_TOLERANCE).
    """
    logits = indexer_logits(params, hidden, config)
    L, k = logits.shape[0], config.index_topk
    mask = np.zeros((L, L), bool)
    ambiguous = np.zeros(L, bool)
    for t in range(L):
        row = logits[t, : t + 1]
        order = np.argsort(-row, kind="stable")
        mask[t, order[:k]] = True
        if t + 1 > k:
            ambiguous[t] = row[order[k - 1]] - row[order[k]] < TIE_TOLERANCE * np.abs(row).max()
    return mask, ambiguous


@functools.partial(jax.jit, **_ORACLE_JIT)
def _masked_attention(params, hidden, mask, config: MLAConfig):
    """MHA-form attention of every token over the key positions mask [L, L] allows, then o_proj."""
    params, x, cfg = _f32(params, hidden, config)
    L, H = x.shape[0], cfg.num_attention_heads
    pos = jnp.arange(L)
    _, q_nope, q_pe, c, k_pe = mla_projections(params, x, pos, cfg)
    c, k_pe = _stored_latent(c, k_pe, config)
    kv = jnp.einsum("sr,or->so", c, params["kv_b_proj.weight"], precision=HI)
    kv = kv.reshape(L, H, cfg.qk_nope_head_dim + cfg.v_head_dim)
    k_nope, v = kv[..., : cfg.qk_nope_head_dim], kv[..., cfg.qk_nope_head_dim:]
    scores = (jnp.einsum("thn,shn->hts", q_nope, k_nope, precision=HI)
              + jnp.einsum("thp,sp->hts", q_pe, k_pe, precision=HI)) * cfg.softmax_scale
    probs = jax.nn.softmax(jnp.where(mask[None], scores, -jnp.inf), axis=-1)
    heads = jnp.einsum("hts,shv->thv", probs, v, precision=HI).reshape(L, H * cfg.v_head_dim)
    return jnp.einsum("ti,oi->to", heads, params["o_proj.weight"], precision=HI)


def sequence_forward(params, hidden, config: MLAConfig, *, dense: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """One whole sequence hidden [L, hidden_size] -> (out [L, hidden_size] float32, ambiguous [L] bool).

    dense=True attends every causal position (what the dense route computes; nothing is ambiguous).
    ambiguous marks rows whose top-k set hinges on a near-tie (see `selection`).
    """
    L = len(hidden)
    # Padded to a multiple of PAD_TO rows so that sequences of nearby lengths share one compiled
    # program; causality makes the padding rows invisible to the first L rows.
    padded = np.zeros((-(-L // PAD_TO) * PAD_TO, np.shape(hidden)[1]), np.float32)
    padded[:L] = hidden
    if dense:
        mask, ambiguous = np.tril(np.ones((len(padded),) * 2, bool)), np.zeros(L, bool)
    else:
        mask, ambiguous = selection(params, padded, config)
    return np.asarray(_masked_attention(params, padded, mask, config))[:L], ambiguous[:L]
