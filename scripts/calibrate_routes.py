"""Calibrates policy.prefill_route: what each route of a long prefill costs, per shard head.

    python scripts/calibrate_routes.py [--out routes.json] [--repeats 5]   # GPU, DeepSeek-V3.2 dims
    python scripts/calibrate_routes.py --plot routes.json --png crossover.png   # anywhere: the plot

A prefill longer than index_topk is scored and top-k'd either way; the routes differ in what
follows (policy.py states the model):
  sparse: absorbed sparse attention (`kernels.sparse_mla`, the layer's dispatch) over each row's
          min(position + 1, topk) gathered latent rows, plus the two per-head projections into
          and out of the latent (q_nope x W_UK, out x W_UV);
  masked: masked MHA (`kernels.dense_mha` with the row's top-k positions as its selection,
          bitmask construction included) over the sequence's keys, plus their up-projection
          (c x W_UK, c x W_UV, k_pe broadcast to every head).
For each case (context, query length) both routes' parts are timed at the model's dims (128
heads, bf16, a bf16 latent cache; selections are top-k of random scores over the row's causal
keys, so they spread over the row's range as the indexer's do), medians over --repeats batches
(scripts/timing.py), the routes interleaved case by case. The four constants are fitted by least
squares through the origin (kernel time against its work count, projection time against its
rows or keys) over all cases, printed in policy.py's form with each case's measured and
predicted route times and the plan's choice. --plot draws route time against length (with and
without context) from the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from timing import median_ms  # noqa: E402
from jax_sparse_mla import MLAConfig, kernels, policy  # noqa: E402
from jax_sparse_mla.model import per_head  # noqa: E402

# (context_len, query_len): fresh prefills across the expected crossover, 4K chunks after context
CASES = [(0, 2048), (0, 4096), (0, 8192), (0, 12288), (0, 16384), (4096, 4096), (12288, 4096), (28672, 4096)]


def top_positions(key, context_len, query_len, topk):
    """[query_len, topk] int32: per row the topk largest of random scores over its causal keys
    (all of them when it has <= topk), -1 padded: stand-ins for the indexer's top-k."""
    num_keys = context_len + query_len
    pos = context_len + jnp.arange(query_len)
    scores = jax.random.uniform(key, (query_len, num_keys))
    causal = jnp.arange(num_keys)[None, :] <= pos[:, None]
    vals, idx = jax.lax.top_k(jnp.where(causal, scores, -1.0), topk)
    return jnp.where(vals >= 0, idx, -1).astype(jnp.int32)


def measure(config: MLAConfig, context_len: int, query_len: int, repeats: int, seed: int) -> dict:
    """Times of both routes' parts for one prefill (ms), and their work counts."""
    c_, H, K = config, config.num_attention_heads, config.index_topk
    impl = kernels.resolve("auto", config)
    dt = c_.jnp_dtype
    num_keys = context_len + query_len
    keys = jax.random.split(jax.random.key(seed), 8)
    normal = lambda k, shape: jax.random.normal(k, shape, jnp.float32).astype(dt)  # noqa: E731
    top = top_positions(keys[0], context_len, query_len, K)
    w_uk = normal(keys[1], (H, c_.qk_nope_head_dim, c_.kv_lora_rank)) * 0.05
    w_uv = normal(keys[2], (H, c_.v_head_dim, c_.kv_lora_rank)) * 0.05
    out = {"context_len": context_len, "query_len": query_len,
           "sparse_keys": policy._positions_sum(context_len, num_keys, K),
           "masked_keys": policy._positions_sum(context_len, num_keys), "rows": query_len, "keys": num_keys}

    # sparse: the absorbed kernel over a bf16 cache holding the sequence (slot = position), and
    # the two per-head latent projections of the rows
    latent = normal(keys[3], (num_keys, c_.kv_lora_rank))
    k_pe = normal(keys[4], (num_keys, c_.qk_rope_head_dim))
    q_abs = normal(keys[5], (query_len, H, c_.kv_lora_rank + c_.qk_rope_head_dim))
    pages = jnp.arange(-(-num_keys // c_.page_size), dtype=jnp.int32)
    sparse = jax.jit(lambda q, lat, pe, s: kernels.sparse_mla(
        q, lat, None, pe, s, scale=c_.softmax_scale, pages=pages, page_size=c_.page_size, dequantize="kernel",
        **impl.sparse_mla.kwargs)[0])
    q_nope = normal(keys[6], (query_len, H, c_.qk_nope_head_dim))
    in_f32 = impl.dots_in_f32
    absorb = jax.jit(lambda qn, lat_out: (per_head("thn,hnr->thr", qn, w_uk, c_, in_f32=in_f32, dtype=dt),
                                          per_head("thr,hvr->thv", lat_out, w_uv, c_, in_f32=in_f32, dtype=dt)))
    lat_out = jnp.zeros((query_len, H, c_.kv_lora_rank), jnp.float32)

    # masked: dense MHA with the top-k positions as the selection, and the keys' up-projection
    q = normal(keys[7], (query_len, H, c_.qk_head_dim))
    k = normal(keys[3], (num_keys, H, c_.qk_head_dim))
    v = normal(keys[4], (num_keys, H, c_.v_head_dim))
    q_start = jnp.array([0, query_len], jnp.int32)
    k_start = jnp.array([0, num_keys], jnp.int32)
    masked = jax.jit(lambda q, k, v, sel: kernels.dense_mha(
        q, k, v, q_start, k_start, scale=c_.softmax_scale, selection=sel, **impl.dense_mha.kwargs,
        max_kv_len=num_keys))
    c = jnp.zeros((num_keys, c_.kv_lora_rank), dt)

    def up(c, pe):
        k_nope = per_head("kr,hnr->khn", c, w_uk, c_, in_f32=in_f32, dtype=dt)
        v = per_head("kr,hvr->khv", c, w_uv, c_, in_f32=in_f32, dtype=dt)
        pe = jnp.broadcast_to(pe[:, None], (pe.shape[0], H, pe.shape[-1])).astype(dt)
        return jnp.concatenate([k_nope, pe], -1), v
    up = jax.jit(up)

    out["sparse_kernel_ms"] = median_ms(sparse, q_abs, latent, k_pe, top, batches=repeats)
    out["masked_kernel_ms"] = median_ms(masked, q, k, v, top, batches=repeats)
    out["absorb_ms"] = median_ms(absorb, q_nope, lat_out, batches=repeats)
    out["up_ms"] = median_ms(up, c, k_pe, batches=repeats)
    return out


def fit(results: list[dict], heads: int) -> dict:
    """The four constants (ns per shard head per unit) by least squares through the origin."""
    def slope(ms, units):
        t, x = np.array([r[ms] for r in results]) * 1e6, np.array([r[units] for r in results], float) * heads
        return float(t @ x / (x @ x))
    return {"SPARSE_NS_PER_KEY": slope("sparse_kernel_ms", "sparse_keys"),
            "ABSORB_NS_PER_ROW": slope("absorb_ms", "rows"),
            "MASKED_NS_PER_KEY": slope("masked_kernel_ms", "masked_keys"),
            "UP_NS_PER_KEY": slope("up_ms", "keys")}


def report(results: list[dict], constants: dict, heads: int, topk: int) -> None:
    print("constants (policy.py):")
    for name, value in constants.items():
        print(f"  {name} = {value:.3g}")
    print(f"{'context':>8} {'query':>6} | {'sparse ms':>9} {'masked ms':>9} {'ratio':>6} | "
          f"{'model sparse':>12} {'model masked':>12} | current plan")
    for r in results:
        s = r["sparse_kernel_ms"] + r["absorb_ms"]
        m = r["masked_kernel_ms"] + r["up_ms"]
        ps = heads * 1e-6 * (constants["SPARSE_NS_PER_KEY"] * r["sparse_keys"] + constants["ABSORB_NS_PER_ROW"] * r["rows"])
        pm = heads * 1e-6 * (constants["MASKED_NS_PER_KEY"] * r["masked_keys"] + constants["UP_NS_PER_KEY"] * r["keys"])
        route = policy.prefill_route(r["context_len"], r["query_len"], topk)
        print(f"{r['context_len']:>8} {r['query_len']:>6} | {s:9.3f} {m:9.3f} {s / m:6.2f} | {ps:12.3f} {pm:12.3f} | {route}")


def plot(path: str, png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(path) as f:
        data = json.load(f)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, fresh in zip(axes, (True, False)):
        rs = [r for r in data["results"] if (r["context_len"] == 0) == fresh]
        x = [r["query_len"] if fresh else r["context_len"] for r in rs]
        for name, parts in (("sparse", ("sparse_kernel_ms", "absorb_ms")), ("masked", ("masked_kernel_ms", "up_ms"))):
            ax.plot(x, [sum(r[p] for p in parts) for r in rs], "o-", label=f"{name} (attention + projections)")
        ax.set_xlabel("prefill length (tokens)" if fresh else "context before a 4096-token chunk (tokens)")
        ax.set_ylabel("ms, one layer, 128 heads")
        ax.set_title("fresh prefill" if fresh else "4096-token chunk after context")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(data.get("device", ""))
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="routes.json")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--plot", help="a JSON this script wrote: draw it instead of measuring")
    ap.add_argument("--png", default="crossover.png")
    args = ap.parse_args()
    if args.plot:
        return plot(args.plot, args.png)
    if jax.default_backend() != "gpu":
        sys.exit("calibrate_routes measures GPU kernels: run it on a GPU (or --plot a JSON)")
    config = MLAConfig.deepseek_v32(dtype="bfloat16", kv_cache_dtype="bfloat16")
    results = []
    for i, (ctx, n) in enumerate(CASES):
        results.append(measure(config, ctx, n, args.repeats, seed=i))
        r = results[-1]
        print(f"  ctx {ctx:>6} q {n:>6}: sparse {r['sparse_kernel_ms']:.3f} + {r['absorb_ms']:.3f} ms, "
              f"masked {r['masked_kernel_ms']:.3f} + {r['up_ms']:.3f} ms", flush=True)
    constants = fit(results, config.num_attention_heads)
    report(results, constants, config.num_attention_heads, config.index_topk)
    device = f"{jax.devices()[0].device_kind}, jax {jax.__version__}"
    with open(args.out, "w") as f:
        json.dump({"device": device, "constants": constants, "results": results}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
