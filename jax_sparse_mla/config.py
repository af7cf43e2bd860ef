"""Static configuration of one DeepSeek-V3.2 sparse-MLA layer.

`MLAConfig` uses the Hugging Face field names so that a checkpoint's config.json maps onto it
directly. It is frozen and hashable: it is passed to jitted functions as a static argument.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax.numpy as jnp

ACTIVATION_DTYPES = ("bfloat16", "float32")
KV_CACHE_DTYPES = ("bfloat16", "float32", "fp8")
INDEXER_DTYPES = ("fp8", "bfloat16", "float32")
FP8_TILE = 128  # values per fp32 scale in the fp8 latent cache (FlashMLA's layout)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """YaRN rope scaling (`rope_scaling` in config.json; only type "yarn" is supported)."""

    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0

    @classmethod
    def from_hf(cls, d: Mapping[str, Any] | None) -> RopeScaling | None:
        if d is None:
            return None
        kind = d.get("type", d.get("rope_type"))
        if kind != "yarn":
            raise ValueError(f"rope_scaling type {kind!r} is not supported (only 'yarn')")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Dimensions and dtypes of one sparse-MLA attention layer.

    dtype: parameters and activations ("bfloat16" | "float32").
    kv_cache_dtype: latent cache storage ("bfloat16" | "float32" | "fp8": 512 e4m3 values with
      one fp32 scale per 128, plus bf16 rope values, FlashMLA's 656 bytes per token).
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

        for f in ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                  "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_n_heads",
                  "index_head_dim", "index_topk", "page_size", "max_position_embeddings"):
            need(isinstance(getattr(self, f), int) and getattr(self, f) > 0,
                 f"{f} must be a positive int, got {getattr(self, f)!r}")
        need(self.dtype in ACTIVATION_DTYPES, f"dtype must be one of {ACTIVATION_DTYPES}, got {self.dtype!r}")
        need(self.kv_cache_dtype in KV_CACHE_DTYPES,
             f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        need(self.indexer_dtype in INDEXER_DTYPES,
             f"indexer_dtype must be one of {INDEXER_DTYPES}, got {self.indexer_dtype!r}")
        need(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim must be even (rope rotates pairs)")
        need(self.qk_rope_head_dim <= self.index_head_dim,
             "the indexer applies rope to its first qk_rope_head_dim dims: index_head_dim must be >= qk_rope_head_dim")
        need(self.index_head_dim & (self.index_head_dim - 1) == 0,
             f"index_head_dim must be a power of two (Hadamard transform), got {self.index_head_dim}")
        need(self.kv_cache_dtype != "fp8" or self.kv_lora_rank % FP8_TILE == 0,
             f"kv_cache_dtype='fp8' needs kv_lora_rank to be a multiple of {FP8_TILE}, got {self.kv_lora_rank}")
        need(self.rope_theta > 0 and self.rms_norm_eps > 0, "rope_theta and rms_norm_eps must be positive")
        need(self.rope_scaling is None or isinstance(self.rope_scaling, RopeScaling),
             "rope_scaling must be a RopeScaling (use MLAConfig.from_hf_config for a dict)")

    # ---- constructors -------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], **overrides) -> MLAConfig:
        """Reads a Hugging Face config.json dict; unknown keys are ignored."""
        names = {f.name for f in dataclasses.fields(cls)} - {"rope_scaling"}
        kw = {k: hf[k] for k in names if k in hf}
        if "rope_scaling" in hf:
            kw["rope_scaling"] = RopeScaling.from_hf(hf["rope_scaling"])
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
