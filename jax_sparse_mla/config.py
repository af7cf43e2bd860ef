"""Static configuration of one DeepSeek-V3.2 sparse-MLA layer.

`MLAConfig` uses the Hugging Face field names so that a checkpoint's config.json maps onto it
directly. It is frozen and hashable: it is passed to jitted functions as a static argument.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

from .validate import as_int, as_real, check_type

ACTIVATION_DTYPES = ("bfloat16", "float32")
KV_CACHE_DTYPES = ("bfloat16", "float32", "fp8")
INDEXER_DTYPES = ("fp8", "bfloat16", "float32")
FP8_TILE = 128  # values per fp32 scale in the fp8 latent cache (FlashMLA's layout)
# config.json's model_type of the models whose attention this layer is (a model_type is checked when present)
DSA_MODEL_TYPES = ("deepseek_v32",)
# the lightning indexer's dimensions: what a DeepSeek-V3.2 (DSA) config.json has and a DeepSeek-V3 one lacks
INDEXER_KEYS = ("index_n_heads", "index_head_dim", "index_topk")


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


def _dtype_name(value, what: str, choices: tuple[str, ...]) -> str:
    """value as its name in `choices`: one of the names itself, or a numpy / jax dtype or scalar
    type naming one (jnp.bfloat16, np.float32, jnp.dtype("bfloat16"); float8_e4m3fn is "fp8"),
    so that configs made either way are equal (and hash alike, as a static argument must).
    ValueError naming `what` otherwise."""
    if isinstance(value, str) and value in choices:
        return value
    name = None
    if isinstance(value, (str, np.dtype, type)):
        try:
            dtype = jnp.dtype(value)
        except (TypeError, ValueError):
            pass
        else:
            name = "fp8" if dtype == jnp.float8_e4m3fn else dtype.name
    if name not in choices:
        raise ValueError(f"{what} must be one of {choices} (or that numpy / jnp dtype), got {value!r}")
    return name


def read_hf_config(hf) -> tuple[Mapping[str, Any], str]:
    """from_hf_config's argument -> (the config dict, a prefix naming its file for error
    messages: "" for a dict). ValueError (FileNotFoundError for a missing file) saying which
    forms are accepted. The one reader of a config.json (from_hf_config and the checkpoint
    loaders): the bytes are decoded as JSON specifies (UTF-8, a byte-order mark allowed), not
    in the locale's encoding."""
    forms = "a dict (a parsed config.json) or the path of a config.json (str or os.PathLike)"
    if isinstance(hf, Mapping):
        return hf, ""
    if isinstance(hf, str) and hf.lstrip().startswith("{"):
        raise ValueError(f"a Hugging Face config must be {forms}, got a string of JSON text: pass json.loads(text)")
    if not isinstance(hf, (str, os.PathLike)):
        raise ValueError(f"a Hugging Face config must be {forms}, got {type(hf).__name__}")
    path = pathlib.Path(hf)
    if path.is_dir():
        raise ValueError(f"{path} is a directory: pass the path of its config.json (or read it with "
                         "jax_sparse_mla.hf_checkpoint.load_hf_config(directory))")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (a Hugging Face config must be {forms})")
    try:
        d = json.loads(path.read_bytes())
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(d).__name__}")
    return d, f"{path}: "


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
    The three dtype fields also take the numpy / jnp dtype of a name (jnp.bfloat16, np.float32;
    jnp.float8_e4m3fn for "fp8") and hold the name.
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
            put(f, lambda v, name: _dtype_name(v, name, choices))
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
    def from_hf_config(cls, hf: Mapping[str, Any] | str | os.PathLike, **overrides) -> MLAConfig:
        """The config of a DeepSeek-V3.2 checkpoint's config.json: `hf` is the parsed dict or the
        path of the file (str or os.PathLike); keys this layer does not use are ignored, and
        `overrides` (MLAConfig fields) replace what the file says.

        Only DeepSeek-V3.2 sparse attention (DSA) is read: a config without the indexer's
        dimensions (INDEXER_KEYS: a DeepSeek-V3 config) or with a model_type other than
        DSA_MODEL_TYPES is refused, since filling in V3.2's indexer would make a layer the
        checkpoint has no weights for.
        dtype: `torch_dtype` (transformers 5: `dtype`) sets MLAConfig.dtype, the parameters' and
        activations' dtype; one it does not support (float16) is refused unless `dtype=` is
        overridden.
        Rope: `rope_scaling` (+ top-level `rope_theta`), or transformers 5's `rope_parameters`
        (`rope_theta`, `rope_type` and the YaRN fields in one dict; rope_type "default", or none,
        means no scaling). Both may be given if they agree; without either, MLAConfig's defaults
        apply.
        Raises ValueError naming the field that is missing, wrongly typed, out of range or
        unsupported (prefixed with the file's path when given one); FileNotFoundError for a path
        that is not a file.
        """
        hf, where = read_hf_config(hf)
        try:
            return cls._from_hf_dict(hf, overrides)
        except ValueError as e:
            if not where:
                raise
            raise ValueError(f"{where}{e}") from None

    @classmethod
    def _from_hf_dict(cls, hf: Mapping[str, Any], overrides: Mapping[str, Any]) -> MLAConfig:
        """from_hf_config on the parsed dict (its checks, in the order its docstring lists them)."""
        model_type = hf.get("model_type")
        if model_type is not None and model_type not in DSA_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not DeepSeek-V3.2 sparse attention: expected "
                             f"{' or '.join(map(repr, DSA_MODEL_TYPES))}")
        missing = [k for k in INDEXER_KEYS if k not in hf]
        if missing:
            raise ValueError(f"not a DeepSeek-V3.2 sparse attention (DSA) config: it has no {', '.join(missing)} "
                             "(the lightning indexer's dimensions; a DeepSeek-V3 config has none). Build an MLAConfig "
                             "directly to give another model an indexer")
        names = {f.name for f in dataclasses.fields(cls)} - {"rope_scaling", "rope_theta", "dtype"}
        kw = {k: hf[k] for k in names if k in hf}
        given = {} if "dtype" in overrides else {k: hf[k] for k in ("torch_dtype", "dtype") if hf.get(k) is not None}
        dtypes = {}  # spelling -> MLAConfig.dtype
        for key in given:
            try:
                dtypes[key] = _dtype_name(given[key], key, ACTIVATION_DTYPES)
            except ValueError:
                raise ValueError(f"{key}={given[key]!r} is not supported: the layer's parameters and activations "
                                 f"(MLAConfig.dtype) are one of {ACTIVATION_DTYPES}; pass dtype=... to choose "
                                 "one") from None
        if len(set(dtypes.values())) > 1:
            raise ValueError(f"torch_dtype={given['torch_dtype']!r} and dtype={given['dtype']!r} disagree")
        if dtypes:
            kw["dtype"] = next(iter(dtypes.values()))
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
