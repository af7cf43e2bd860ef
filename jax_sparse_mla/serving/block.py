"""A DeepSeek-V3.2 decoder block's feed-forward half, for the serving loop's `block="decoder"` mode.

Per layer the engine runs x = x + attn(RMSNorm(x)); x = x + moe(RMSNorm(x)). The attention is
this package's sparse MLA layer; the MoE FFN here is a stand-in with DeepSeek-V3.2's shapes and
arithmetic, random (seeded) weights in the config dtype:

  routed experts  `num_experts` (256) SwiGLU experts of intermediate size `intermediate_size`
                  (2048), `num_experts_per_tok` (8) active per token;
  shared expert   `num_shared_experts` (1) SwiGLU expert of intermediate size
                  `num_shared_experts * intermediate_size`, applied to every token;
  router          logits = x @ router [hidden, num_experts] (float32); scores = sigmoid(logits)
                  (DeepSeek-V3's scoring; `scoring="softmax"` for the V2 style); the top
                  `num_experts_per_tok` scores pick the experts, their weights are the picked
                  scores normalised to sum 1, times `routed_scaling_factor` (2.5 as DeepSeek).
                  Simplified: no group-limited routing (n_group / topk_group) and no score
                  correction bias; neither changes the FLOPs or the bytes moved.

An expert is SwiGLU: down(silu(gate(x)) * up(x)). The routed experts run as grouped matmuls:
the T * k (token, expert) pairs are sorted by expert, each expert's rows are one group, and
`grouped_matmul` computes gate, up and down over the groups (each group's rows padded to whole
tiles, each tile times its expert's weights, in chunks of tiles: FLOPs that follow the real rows,
padded to each group's last tile and the last chunk; not `jax.lax.ragged_dot`, which XLA expands
on the GPU to a dense dot over every expert, E times the FLOPs, whose autotuner scratch did not
fit an 80 GB card); the rows are then unsorted and summed per token with the routing weights.

Weight layout (grouped_matmul's [group, in, out]; Hugging Face stores each expert's Linear as [out, in]):
  "attn_norm.weight" [hidden], "ffn_norm.weight" [hidden], "router.weight" [hidden, E],
  "experts.gate" [E, hidden, I], "experts.up" [E, hidden, I], "experts.down" [E, I, hidden],
  "shared.gate" [hidden, S], "shared.up" [hidden, S], "shared.down" [S, hidden].
At DeepSeek-V3.2's dimensions the routed experts are 256 * 3 * 7168 * 2048 = 11.3 G parameters
(22.5 GB in bf16) a layer.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from .. import ops
from ..config import MLAConfig, check_config_type
from ..params import check_arrays
from ..validate import array_dtype, as_int, check_type

BLOCKS = ("attention", "decoder")
SCORINGS = ("sigmoid", "softmax")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Dimensions of the MoE FFN stand-in (defaults: DeepSeek-V3.2's)."""

    num_experts: int = 256
    num_experts_per_tok: int = 8
    intermediate_size: int = 2048
    num_shared_experts: int = 1
    routed_scaling_factor: float = 2.5
    scoring: str = "sigmoid"

    def __post_init__(self):
        for name in ("num_experts", "num_experts_per_tok", "intermediate_size"):
            object.__setattr__(self, name, as_int(getattr(self, name), f"MoEConfig.{name}", 1))
        object.__setattr__(self, "num_shared_experts",
                           as_int(self.num_shared_experts, "MoEConfig.num_shared_experts", 0))
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"MoEConfig: num_experts_per_tok = {self.num_experts_per_tok} exceeds "
                             f"num_experts = {self.num_experts}")
        if self.scoring not in SCORINGS:
            raise ValueError(f"MoEConfig.scoring must be one of {SCORINGS}, got {self.scoring!r}")
        f = self.routed_scaling_factor
        if isinstance(f, bool) or not isinstance(f, (int, float, np.floating, np.integer)) or not 0 < f < np.inf:
            raise ValueError(f"MoEConfig.routed_scaling_factor must be a positive real number, got {f!r}")
        object.__setattr__(self, "routed_scaling_factor", float(f))

    @classmethod
    def deepseek_v32(cls, **overrides) -> MoEConfig:
        return cls(**overrides)

    @classmethod
    def tiny(cls, **overrides) -> MoEConfig:
        """8 experts, 2 active, intermediate 32 (CPU tests)."""
        return cls(**{**dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32), **overrides})

    @classmethod
    def for_config(cls, config: MLAConfig) -> MoEConfig:
        """DeepSeek-V3.2's MoE for a config with its hidden size (7168), the tiny one otherwise."""
        return cls.deepseek_v32() if config.hidden_size == MLAConfig().hidden_size else cls.tiny()

    @property
    def shared_size(self) -> int:
        return self.num_shared_experts * self.intermediate_size


def block_param_shapes(config: MLAConfig, moe: MoEConfig) -> dict[str, tuple[int, ...]]:
    """Block param name -> shape (the weight layout above; the shared expert's only when
    moe.num_shared_experts > 0)."""
    h, e, i, s = config.hidden_size, moe.num_experts, moe.intermediate_size, moe.shared_size
    shapes = {"attn_norm.weight": (h,), "ffn_norm.weight": (h,), "router.weight": (h, e),
              "experts.gate": (e, h, i), "experts.up": (e, h, i), "experts.down": (e, i, h)}
    if s:
        shapes.update({"shared.gate": (h, s), "shared.up": (h, s), "shared.down": (s, h)})
    return shapes


@partial(jax.jit, static_argnames=("shape", "dtype", "fan_in", "norm"))
def _random(key, *, shape, dtype, fan_in, norm):
    # generated in the target dtype inside one jitted program: no float32 copy of a 22 GB tensor
    if norm:
        return (1.0 + 0.1 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    return jax.random.normal(key, shape, dtype) * jnp.asarray(fan_in ** -0.5, dtype)


def init_block_params(config: MLAConfig, moe: MoEConfig, key: jax.Array) -> dict[str, jax.Array]:
    """Random block params in config.dtype: matrices ~ N(0, 1/fan_in), norm weights near 1."""
    shapes = block_param_shapes(config, moe)
    keys = dict(zip(shapes, jax.random.split(key, len(shapes))))
    return {name: _random(keys[name], shape=shape, dtype=config.jnp_dtype, fan_in=shape[-2] if len(shape) > 1 else 1,
                          norm=name.endswith("norm.weight"))
            for name, shape in shapes.items()}


def route(params, x, moe: MoEConfig):
    """x [T, hidden] -> (weights [T, k] float32, experts [T, k] int32)."""
    logits = jnp.dot(x, params["router.weight"], precision=ops.matmul_precision(x.dtype),
                     preferred_element_type=jnp.float32)
    scores = jax.nn.sigmoid(logits) if moe.scoring == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(scores, moe.num_experts_per_tok)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True) * moe.routed_scaling_factor
    return weights, experts.astype(jnp.int32)


def _swiglu(x, gate, up, down, dtype):
    kw = dict(precision=ops.matmul_precision(dtype), preferred_element_type=jnp.float32)
    g = jnp.dot(x, gate, **kw)
    u = jnp.dot(x, up, **kw)
    return jnp.dot((jax.nn.silu(g) * u).astype(dtype), down, **kw)


GATHERED_WEIGHT_BYTES = 1 << 29  # grouped_matmul's default bound on a chunk's gathered weights (512 MiB)


def grouped_tiling(m: int, g: int, weight_bytes: int) -> tuple[int, int]:
    """grouped_matmul's default (tile, chunk) for m rows in g groups whose [K, N] weights take
    weight_bytes each. tile: the power of two at most m / g, clamped to [8, 256] (a group pads
    under one tile, so the padding adds at most m rows, or 8 * g below 8 rows a group; 256 rows
    already fill a matmul). chunk: as many tiles as keep their gathered weights within
    GATHERED_WEIGHT_BYTES, at least 1."""
    tile = int(np.clip(1 << (max(m // g, 1).bit_length() - 1), 8, 256))
    return tile, max(1, GATHERED_WEIGHT_BYTES // weight_bytes)


def grouped_matmul(x, w, group_sizes, *, tile: int | None = None, chunk: int | None = None,
                   precision=None, preferred_element_type=None):
    """x [M, K] rows sorted by group, w [G, K, N], group_sizes [G] int32 (non-negative, summing to
    M; traced, not checked) -> [M, N] in preferred_element_type (None: jnp.result_type(x, w)): row i is
    x[i] @ w[group of i], what jax.lax.ragged_dot computes. Why not ragged_dot: XLA lowers it to a
    dense [M, G * K] x [G * K, N] dot (each row expanded over every group), G times the FLOPs, and
    on an 80 GB GPU its autotuner's scratch for the MoE stand-in did not fit.

    How: each group's rows are laid out from a multiple of `tile` rows, in a padded layout of
    ceil(M / tile) + min(G, M) tiles (an upper bound: at most min(G, M) groups hold rows, each
    pads under one tile; a decode's few rows take few tiles, not G); positions past a
    group's rows hold zeros (selected, never another row's values times 0), and each tile is
    tagged with its group (tiles past the last used one: group G - 1, all zeros, never read
    back). lax.map computes the tiles `chunk` at a time (the tiles split evenly over the fewest
    chunks): it gathers the chunk's rows and weights w[tile group] [chunk, K, N] and runs one
    batched matmul [chunk, tile, K] x [chunk, K, N]; each row's result is then gathered from its
    padded position. Cost: the FLOPs of the layout's rows (its tiles rounded up to whole chunks,
    times tile) and a [K, N] weight gather a tile; memory: a chunk's rows and weights, and the
    padded [tiles * tile, N] result. tile (rows a tile) / chunk (tiles a lax.map step, at most)
    None: grouped_tiling's; ValueError naming tile or chunk if not a positive integer, or w if it
    has no group."""
    m, k = x.shape
    g, _, n = w.shape
    if g == 0:
        raise ValueError(f"grouped_matmul: w must hold at least one group, got shape {w.shape}")
    if m == 0:
        return jnp.zeros((0, n), preferred_element_type or jnp.result_type(x, w))
    default_tile, default_chunk = grouped_tiling(m, g, k * n * w.dtype.itemsize)
    tile = default_tile if tile is None else as_int(tile, "tile", 1)
    chunk = default_chunk if chunk is None else as_int(chunk, "chunk", 1)
    n_tiles = -(-m // tile) + min(g, m)
    n_chunks = -(-n_tiles // chunk)
    chunk = -(-n_tiles // n_chunks)
    n_tiles = n_chunks * chunk
    sizes = group_sizes.astype(jnp.int32)
    row_start = jnp.cumsum(sizes) - sizes                        # [G] each group's first row in x
    group_tiles = -(-sizes // tile)
    tile_start = jnp.cumsum(group_tiles) - group_tiles           # [G] each group's first tile
    # compare_all: one fused kernel each (the default method is a loop of small kernels in the program)
    tile_group = jnp.minimum(jnp.searchsorted(tile_start + group_tiles, jnp.arange(n_tiles), side="right",
                                              method="compare_all"), g - 1)  # [n_tiles]
    pos = jnp.arange(n_tiles * tile)                             # padded position -> its row of x
    pos_group = tile_group[pos // tile]
    j = pos - tile_start[pos_group] * tile                       # its row within the group
    real = j < sizes[pos_group]
    src = jnp.where(real, row_start[pos_group] + j, 0)

    def one(args):
        src, real, groups = args                                 # [chunk * tile], [chunk * tile], [chunk]
        xs = jnp.where(real[:, None], x[src], jnp.zeros((), x.dtype)).reshape(chunk, tile, k)
        return jnp.matmul(xs, w[groups], precision=precision, preferred_element_type=preferred_element_type)

    y = jax.lax.map(one, (src.reshape(n_chunks, -1), real.reshape(n_chunks, -1), tile_group.reshape(n_chunks, -1)))
    rows = jnp.arange(m)
    row_group = jnp.searchsorted(row_start + sizes, rows, side="right", method="compare_all")
    return y.reshape(-1, n)[tile_start[row_group] * tile + rows - row_start[row_group]]


def moe_ffn(params, x, moe: MoEConfig):
    """The MoE FFN on x [T, hidden] (config dtype) -> [T, hidden] float32: routed experts through
    grouped_matmul plus the shared expert."""
    dtype = x.dtype
    T, k, E = x.shape[0], moe.num_experts_per_tok, moe.num_experts
    weights, experts = route(params, x, moe)
    flat = experts.reshape(-1)                       # [T * k] expert of each (token, slot) pair
    order = jnp.argsort(flat, stable=True)           # pairs grouped by expert
    group_sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    xs = x[order // k]                               # [T * k, hidden] each pair's token
    kw = dict(precision=ops.matmul_precision(dtype), preferred_element_type=jnp.float32)
    g = grouped_matmul(xs, params["experts.gate"], group_sizes, **kw)
    u = grouped_matmul(xs, params["experts.up"], group_sizes, **kw)
    h = (jax.nn.silu(g) * u).astype(dtype)
    y = grouped_matmul(h, params["experts.down"], group_sizes, **kw)
    y = jnp.zeros_like(y).at[order].set(y, unique_indices=True)  # unsort: back to (token, slot) order
    out = jnp.einsum("tkh,tk->th", y.reshape(T, k, -1), weights, precision=kw["precision"])
    if moe.shared_size:
        out = out + _swiglu(x, params["shared.gate"], params["shared.up"], params["shared.down"], dtype)
    return out


def check_block_params(params, config: MLAConfig, moe: MoEConfig, what: str = "block_params") -> None:
    """ValueError naming config or moe if not an MLAConfig / a MoEConfig, else `what` or its first
    missing, non-float, misshapen or unexpected entry (params.check_arrays with block_param_shapes).
    Values are not read (see params.check_finite)."""
    check_config_type(config)
    check_type(moe, "moe", MoEConfig, "a MoEConfig")
    check_arrays(params, block_param_shapes(config, moe), what)


def _check_x(x) -> None:
    dtype = array_dtype(x)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"x must be a floating-point array [T, hidden_size], got "
                         f"{type(x).__name__ if dtype is None else dtype}")


def norm(params, name: str, x, config: MLAConfig):
    """RMSNorm with params[name] (config.rms_norm_eps) -> config dtype."""
    return ops.rms_norm(x, params[name], config.rms_norm_eps).astype(config.jnp_dtype)


@partial(jax.jit, static_argnames=("config",))
def attn_input(params, x, *, config: MLAConfig):
    """RMSNorm(x) with the attention norm: the attention layer's input. params: a dict with
    "attn_norm.weight" [hidden_size] (the block params); ValueError naming a wrongly typed argument."""
    check_config_type(config)
    check_type(params, "params", Mapping, "a dict of arrays (the block params)")
    used = {"attn_norm.weight": (config.hidden_size,)}  # (the other block params are ffn_residual's)
    check_arrays({k: params[k] for k in used if k in params}, used, "params")
    _check_x(x)
    return norm(params, "attn_norm.weight", x, config)


@partial(jax.jit, static_argnames=("config", "moe"))
def ffn_residual(params, x, *, config: MLAConfig, moe: MoEConfig):
    """x + moe(RMSNorm(x)) in config dtype (x: the residual stream after the attention; params:
    the block params, check_block_params); ValueError naming a wrongly typed argument."""
    check_block_params(params, config, moe, "params")
    _check_x(x)
    y = moe_ffn(params, norm(params, "ffn_norm.weight", x, config), moe)
    return (x.astype(jnp.float32) + y).astype(config.jnp_dtype)


# ---- float64 numpy oracles ------------------------------------------------------------------

def _np(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def reference_route(params, x, moe: MoEConfig):
    """numpy: (weights [T, k], experts [T, k], margin [T]: gap between the k-th and (k+1)-th score,
    0 when every expert is active)."""
    logits = np.asarray(x, np.float64) @ _np(params["router.weight"])
    if moe.scoring == "sigmoid":
        scores = 1 / (1 + np.exp(-logits))
    else:
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
    k = moe.num_experts_per_tok
    experts = np.argsort(-scores, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(scores, experts, -1)
    srt = -np.sort(-scores, axis=-1)
    margin = srt[:, k - 1] - srt[:, k] if k < moe.num_experts else np.full(len(x), np.inf)
    return w / w.sum(-1, keepdims=True) * moe.routed_scaling_factor, experts, margin


def reference_moe(params, x, moe: MoEConfig):
    """The dense per-token loop: every token through each of its chosen experts, weighted, plus
    the shared expert (float64 numpy). x [T, hidden] -> (out [T, hidden], margin [T])."""
    x = np.asarray(x, np.float64)
    p = {k: _np(v) for k, v in params.items()}
    silu = lambda a: a / (1 + np.exp(-a))  # noqa: E731
    weights, experts, margin = reference_route(params, x, moe)
    out = np.zeros_like(x)
    for t in range(len(x)):
        for w, e in zip(weights[t], experts[t]):
            h = silu(x[t] @ p["experts.gate"][e]) * (x[t] @ p["experts.up"][e])
            out[t] += w * (h @ p["experts.down"][e])
        if moe.shared_size:
            out[t] += (silu(x[t] @ p["shared.gate"]) * (x[t] @ p["shared.up"])) @ p["shared.down"]
    return out, margin


def reference_norm(params, name: str, x, config: MLAConfig):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + config.rms_norm_eps) * _np(params[name])
