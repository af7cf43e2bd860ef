"""A DeepSeek-V3.2-style decoder layer around `SparseMLA`: how a model calls the attention layer.

    x = x + self_attn(attn_norm(x));   x = x + mlp(ffn_norm(x))

- `SparseMLA` is DeepSeek's `self_attn` alone: its input is the normed hidden state, and the
  model adds its output to the residual stream (neither the norm nor the residual is inside it).
- The layer takes packed rows, not [B, S, D]: `pack` lays a batch's valid rows (sequence b's
  first lengths[b]) out sequence after sequence, in the order of plan_batch's requests, and
  zero rows after them up to plan.num_tokens (the plan pads the token count to a bucket, so a
  few shapes serve every batch). `unpack` puts the output rows back to [B, S, D].
- Rope positions come from the plan: meta.positions[t] is row t's position in its sequence
  (its request's context_len + its offset among the new rows), and the layer ropes its queries
  and keys with it: the model passes no positions.
- One jitted step per batch (`step`): nnx.jit with the plan static and the cache donated, so the
  new cache reuses the old one's buffers. The cache passed in is deleted: the next step takes
  the cache this one returned.

The MLP is the dense SwiGLU of DeepSeek's first layers (the later ones have the MoE;
jax_sparse_mla.serving.block has a stand-in for it). `main` runs on the CPU with
MLAConfig.tiny(): a ragged prefill of three sequences (one longer than index_topk, so its rows
are scored by the indexer), then one decode step of each; tests/test_example_decoder_layer.py
checks each sequence's rows against the layer run on that sequence alone.

    python scripts/example_decoder_layer.py
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from jax_sparse_mla import (MLAConfig, Request, SparseMLA, init_cache, num_pages_for_budget,  # noqa: E402
                            plan_batch)


class DecoderLayer(nnx.Module):
    """attn_norm -> SparseMLA -> residual; ffn_norm -> SwiGLU MLP -> residual, in config.dtype.

    Args: config (the attention's MLAConfig; hidden_size and rms_norm_eps are the layer's too),
    intermediate_size (the MLP's), rngs (random init).
    """

    def __init__(self, config: MLAConfig, intermediate_size: int, *, rngs: nnx.Rngs):
        dim, dtype = config.hidden_size, config.jnp_dtype
        self.attn_norm = nnx.RMSNorm(dim, epsilon=config.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.self_attn = SparseMLA(config, rngs=rngs)
        self.ffn_norm = nnx.RMSNorm(dim, epsilon=config.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.gate_proj = nnx.Linear(dim, intermediate_size, use_bias=False, dtype=dtype, rngs=rngs)
        self.up_proj = nnx.Linear(dim, intermediate_size, use_bias=False, dtype=dtype, rngs=rngs)
        self.down_proj = nnx.Linear(intermediate_size, dim, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x, cache, meta, plan):
        """x: [plan.num_tokens, hidden_size] residual rows (pack's layout) -> (x after the layer,
        the cache with this batch's keys written)."""
        attn, cache = self.self_attn(self.attn_norm(x), cache, meta, plan)
        x = x + attn
        h = self.ffn_norm(x)
        return x + self.down_proj(nnx.silu(self.gate_proj(h)) * self.up_proj(h)), cache


@nnx.jit(static_argnames="plan", donate_argnames="cache")
def step(layer: DecoderLayer, x, cache, meta, plan):
    """One layer step over a planned batch (one program per plan; the cache is donated)."""
    return layer(x, cache, meta, plan)


def _valid_rows(lengths, seq_len: int) -> np.ndarray:
    """Indices into a [B * seq_len] flattening of the valid rows (s < lengths[b]), sequence after sequence."""
    return np.concatenate([b * seq_len + np.arange(n) for b, n in enumerate(lengths)])


def pack(x, lengths, num_tokens: int):
    """x [B, S, D], row s of sequence b valid for s < lengths[b] -> rows [num_tokens, D]: the valid
    rows sequence after sequence, then zero rows (the plan's padding)."""
    B, S, D = x.shape
    rows = _valid_rows(lengths, S)
    return jnp.zeros((num_tokens, D), x.dtype).at[:len(rows)].set(x.reshape(B * S, D)[rows])


def unpack(y, lengths, seq_len: int):
    """pack's inverse: rows [num_tokens, D] -> [B, seq_len, D], zeros where s >= lengths[b]."""
    rows = _valid_rows(lengths, seq_len)
    out = jnp.zeros((len(lengths) * seq_len, y.shape[1]), y.dtype).at[rows].set(y[:len(rows)])
    return out.reshape(len(lengths), seq_len, y.shape[1])


def main(seed: int = 0) -> dict:
    """The tiny layer's ragged prefill of three sequences, then a decode step of each. Returns
    what the test checks: the config, layer, num_pages, block tables, inputs and outputs
    (prefill [B, S, D], decode [B, 1, D])."""
    config = MLAConfig.tiny()
    layer = DecoderLayer(config, intermediate_size=128, rngs=nnx.Rngs(seed))
    lengths = [24, 9, 17]  # prompt lengths: 24 > index_topk = 16 attends over its top-k positions
    B, S = len(lengths), max(lengths)
    # the cache: 64 KiB for this one layer (a model passes its budget and layer count)
    num_pages = num_pages_for_budget(config, 64 * 1024, num_layers=1)
    cache = init_cache(config, num_pages)
    pages_per_seq = -(-(S + 1) // config.page_size)  # room for the prompt and one decoded token
    tables = [list(range(b * pages_per_seq, (b + 1) * pages_per_seq)) for b in range(B)]
    kx, kd = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (B, S, config.hidden_size), config.jnp_dtype)  # the embeddings; s >= lengths[b] unused

    plan, meta = plan_batch(config, [Request(0, n, t) for n, t in zip(lengths, tables)], num_pages=num_pages)
    # rope positions: the plan's (row t of a prefill from scratch sits at its offset; padding at -1)
    assert np.array_equal(np.asarray(meta.positions)[:sum(lengths)], np.concatenate([np.arange(n) for n in lengths]))
    y, cache = step(layer, pack(x, lengths, plan.num_tokens), cache, meta, plan)
    prefill = unpack(y, lengths, S)

    x_decode = jax.random.normal(kd, (B, 1, config.hidden_size), config.jnp_dtype)  # the next token of each
    plan, meta = plan_batch(config, [Request(n, 1, t) for n, t in zip(lengths, tables)], num_pages=num_pages)
    y, cache = step(layer, pack(x_decode, [1] * B, plan.num_tokens), cache, meta, plan)  # the prefill's cache
    decode = unpack(y, [1] * B, 1)
    return dict(config=config, layer=layer, num_pages=num_pages, tables=tables, lengths=lengths, x=x,
                x_decode=x_decode, prefill=prefill, decode=decode)


if __name__ == "__main__":
    r = main()
    print(f"prefill {r['prefill'].shape} and decode {r['decode'].shape} outputs over a cache of {r['num_pages']} "
          f"pages; all finite: {bool(jnp.isfinite(r['prefill']).all() and jnp.isfinite(r['decode']).all())}")
