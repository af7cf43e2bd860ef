"""Static configuration of one DeepSeek-V3.2 sparse-MLA layer.

`MLAConfig` uses the Hugging Face field names so that a checkpoint's config.json maps onto it
directly. It is frozen and hashable: it is passed to jitted functions as a static argument.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax.numpy as jnp

from .validate import as_int, as_real, check_type

ACTIVATION_DTYPES = ("bfloat16", "float32")
KV_CACHE_DTYPES = ("bfloat16", "float32", "fp8")
INDEXER_DTYPES = ("fp8", "bfloat16", "float32")
FP8_TILE = 128  # values per fp32 scale in the fp8 latent cache (FlashMLA's layout)


# rope types of config.json's rope_scaling / rope_parameters: "yarn" is supported, "default" means none.
ROPE_TYPES = ("yarn", "default")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """YaRN rope scaling (`rope_scaling` in config.json, or transformers 5's `rope_parameters`).

    Only type "yarn" is supported. The softmax scale takes mscale_all_dim (DeepSeek's reference:
    qk_head_dim^-0.5 * (0.1 * mscale_all_dim * ln(factor) + 1)^2), and the rotation is not
    scaled: Hugging Face's DeepSeek rope multiplies cos and sin by
    get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim), which is 1 only when
    mscale == mscale_all_dim (DeepSeek-V3.2: both 1.0). A config with mscale != mscale_all_dim is
    therefore refused (ValueError) rather than served with a different rotation.
    """

    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0

    def __post_init__(self):
        def put(name, value):
            object.__setattr__(self, name, value)

        try:
            put("factor", as_real(self.factor, "factor", finite=True, positive=True))
            put("original_max_position_embeddings",
                as_int(self.original_max_position_embeddings, "original_max_position_embeddings", 1))
            put("beta_fast", as_real(self.beta_fast, "beta_fast", finite=True, positive=True))
            put("beta_slow", as_real(self.beta_slow, "beta_slow", finite=True, positive=True))
            put("mscale", as_real(self.mscale, "mscale", finite=True, nonnegative=True))
            put("mscale_all_dim", as_real(self.mscale_all_dim, "mscale_all_dim", finite=True, nonnegative=True))
        except ValueError as e:
            raise ValueError(f"invalid rope_scaling: {e}") from None
        if self.beta_fast < self.beta_slow:
            raise ValueError(f"invalid rope_scaling: beta_fast ({self.beta_fast}) must be >= beta_slow ({self.beta_slow})")
        if self.mscale != self.mscale_all_dim:
            raise ValueError(f"invalid rope_scaling: mscale={self.mscale} != mscale_all_dim={self.mscale_all_dim} is "
                             "not supported: the rotation would be scaled by their YaRN mscale ratio (only "
                             "mscale == mscale_all_dim, as in DeepSeek-V3.2)")

    @classmethod
    def from_hf(cls, d: Mapping[str, Any] | None, *, what: str = "rope_scaling") -> RopeScaling | None:
        """A config.json rope dict -> RopeScaling, or None for no dict / rope type "default".

        Known keys are type-checked; other keys (HF extras such as `rope_theta`, `truncate`) are
        ignored, except `attention_factor`, which must be absent, null or 1 (no rotation scaling
        here). Raises ValueError naming the key (and `what`, the config.json field).
        """
        if d is None:
            return None
        if not isinstance(d, Mapping):
            raise ValueError(f"{what} must be a JSON object, got {type(d).__name__} {d!r}")
        kinds = {k: d[k] for k in ("type", "rope_type") if k in d}
        if len(set(map(repr, kinds.values()))) > 1:
            raise ValueError(f"{what} has type {kinds.get('type')!r} and rope_type {kinds.get('rope_type')!r}")
        kind = next(iter(kinds.values()), None)
        if kind == "default":
            return None
        if kind != "yarn":
            raise ValueError(f"{what} type {kind!r} is not supported (only 'yarn', or 'default' for none)")
        attention_factor = d.get("attention_factor")
        if attention_factor is not None and as_real(attention_factor, f"{what}.attention_factor", finite=True) != 1.0:
            raise ValueError(f"{what}.attention_factor={attention_factor!r} is not supported (only 1)")
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        try:
            return cls(**kw)
        except ValueError as e:
            raise ValueError(str(e).replace("invalid rope_scaling: ", f"invalid {what}: ", 1)) from None


_INT_FIELDS = ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
               "qk_rope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim", "index_topk",
               "max_position_embeddings", "page_size")
_FLOAT_FIELDS = ("rope_theta", "rms_norm_eps")
_CHOICE_FIELDS = {"dtype": ACTIVATION_DTYPES, "kv_cache_dtype": KV_CACHE_DTYPES, "indexer_dtype": INDEXER_DTYPES}


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Dimensions and dtypes of one sparse-MLA attention layer.

    dtype: parameters and activations ("bfloat16" | "float32").
    kv_cache_dtype: latent cache storage ("bfloat16" | "float32" | "fp8": 512 e4m3 values with
      one fp32 power-of-two scale per 128 as DeepSeek's act_quant, plus bf16 rope values,
      FlashMLA's 656 bytes per token).
    indexer_dtype: indexer q/k arithmetic and key cache ("fp8": e4m3 with power-of-two scales,
      as DeepSeek's act_quant | "bfloat16" | "float32").
    page_size: tokens per page of both paged caches.
    max_position_embeddings: the longest sequence (context + new tokens) a request may have;
      plan_batch refuses longer ones.
    """

    hidden_size: int = 7168
    num_attention_heads: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = RopeScaling()
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 163840
    page_size: int = 64
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "bfloat16"
    indexer_dtype: str = "fp8"

    def __post_init__(self):
        def need(ok: bool, msg: str):
            if not ok:
                raise ValueError(f"invalid MLAConfig: {msg}")

        def put(name, convert):
            try:
                object.__setattr__(self, name, convert(getattr(self, name), name))
            except ValueError as e:
                raise ValueError(f"invalid MLAConfig: {e}") from None

        for f in _INT_FIELDS:
            put(f, lambda v, name: as_int(v, name, 1))
        for f in _FLOAT_FIELDS:
            put(f, lambda v, name: as_real(v, name, finite=True, positive=True))
        for f, choices in _CHOICE_FIELDS.items():
            v = getattr(self, f)
            need(isinstance(v, str) and v in choices, f"{f} must be one of {choices}, got {v!r}")
        need(self.rope_scaling is None or isinstance(self.rope_scaling, RopeScaling),
             "rope_scaling must be a RopeScaling or None (use MLAConfig.from_hf_config for a dict), "
             f"got {type(self.rope_scaling).__name__}")
        need(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim must be even (rope rotates pairs)")
        need(self.qk_rope_head_dim <= self.index_head_dim,
             "the indexer applies rope to its first qk_rope_head_dim dims: index_head_dim must be >= qk_rope_head_dim")
        need(self.index_head_dim & (self.index_head_dim - 1) == 0,
             f"index_head_dim must be a power of two (Hadamard transform), got {self.index_head_dim}")
        need(self.kv_cache_dtype != "fp8" or self.kv_lora_rank % FP8_TILE == 0,
             f"kv_cache_dtype='fp8' needs kv_lora_rank to be a multiple of {FP8_TILE}, got {self.kv_lora_rank}")
        need(self.rope_scaling is None or self.rope_theta > 1,
             f"rope_theta must be > 1 with YaRN rope_scaling (it divides by log(rope_theta)), got {self.rope_theta}")

    # ---- constructors -------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], **overrides) -> MLAConfig:
        """Reads a Hugging Face config.json dict; unknown keys are ignored.

        Rope: `rope_scaling` (+ top-level `rope_theta`), or transformers 5's `rope_parameters`
        (`rope_theta`, `rope_type` and the YaRN fields in one dict; rope_type "default", or none,
        means no scaling). Both may be given if they agree; without either, MLAConfig's defaults
        apply.
        Raises ValueError naming the field that is wrongly typed, out of range or unsupported.
        """
        if not isinstance(hf, Mapping):
            raise ValueError(f"a Hugging Face config must be a JSON object, got {type(hf).__name__}")
        names = {f.name for f in dataclasses.fields(cls)} - {"rope_scaling", "rope_theta"}
        kw = {k: hf[k] for k in names if k in hf}
        theta = {}  # spelling -> value
        scaling = {}
        if "rope_theta" in hf:
            theta["rope_theta"] = hf["rope_theta"]
        if "rope_scaling" in hf:
            scaling["rope_scaling"] = RopeScaling.from_hf(hf["rope_scaling"], what="rope_scaling")
        params = hf.get("rope_parameters")
        if params is not None:
            if not isinstance(params, Mapping):
                raise ValueError(f"rope_parameters must be a JSON object, got {type(params).__name__} {params!r}")
            if "rope_theta" in params:
                theta["rope_parameters.rope_theta"] = params["rope_theta"]
            if not {"type", "rope_type"} & set(params):  # transformers' default: no scaling
                params = {**params, "rope_type": "default"}
            scaling["rope_parameters"] = RopeScaling.from_hf(params, what="rope_parameters")
        if theta:
            values = {k: as_real(v, k, finite=True, positive=True) for k, v in theta.items()}
            if len(set(values.values())) > 1:
                raise ValueError(f"rope_theta and rope_parameters.rope_theta disagree: {values}")
            kw["rope_theta"] = next(iter(values.values()))
        if scaling:
            if len(set(scaling.values())) > 1:
                raise ValueError(f"rope_scaling and rope_parameters disagree: {scaling['rope_scaling']} "
                                 f"vs {scaling['rope_parameters']}")
            kw["rope_scaling"] = next(iter(scaling.values()))
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def deepseek_v32(cls, **overrides) -> MLAConfig:
        """The real DeepSeek-V3.2 dimensions."""
        return cls(**overrides)

    @classmethod
    def tiny(cls, **overrides) -> MLAConfig:
        """Small dimensions for CPU tests; topk 16 so that sparse paths run on short sequences."""
        kw = dict(hidden_size=64, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=128,
                  qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, index_n_heads=4,
                  index_head_dim=16, index_topk=16, page_size=4, dtype="float32",
                  rope_scaling=RopeScaling(factor=4.0, original_max_position_embeddings=16))
        kw.update(overrides)
        return cls(**kw)

    # ---- derived quantities ---------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values per token in the latent cache: c (kv_lora_rank) and rope(k_pe)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """MLA softmax scale: qk_head_dim^-0.5 times YaRN's mscale squared."""
        scale = self.qk_head_dim ** -0.5
        rs = self.rope_scaling
        if rs is not None and rs.mscale_all_dim:
            m = 0.1 * rs.mscale_all_dim * math.log(rs.factor) + 1.0
            scale *= m * m
        return scale

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def latent_cache_layout(self):
        """Per-token storage of the latent cache: (latent dtype, fp32 scales per token (0: none),
        k_pe dtype). fp8: e4m3 values, one scale per FP8_TILE values, bf16 rope values."""
        if self.kv_cache_dtype == "fp8":
            return jnp.dtype(jnp.float8_e4m3fn), self.kv_lora_rank // FP8_TILE, jnp.dtype(jnp.bfloat16)
        dt = jnp.dtype(self.kv_cache_dtype)
        return dt, 0, dt


def check_config_type(config) -> None:
    """ValueError naming `config` unless it is an MLAConfig (every entry point that takes one)."""
    check_type(config, "config", MLAConfig, "an MLAConfig")
