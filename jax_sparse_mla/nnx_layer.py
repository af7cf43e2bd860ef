"""Flax NNX wrapper over the functional core."""

from __future__ import annotations

import jax
from flax import nnx

from .config import MLAConfig
from .model import forward
from .params import init_params


class SparseMLA(nnx.Module):
    """One DeepSeek-V3.2 sparse-MLA attention layer; `weights` holds nnx.Param leaves under HF names.

    Use inside a caller's jit (nnx.jit, or nnx.split/merge around jax.jit); plan is static.
    """

    def __init__(self, config: MLAConfig, *, rngs: nnx.Rngs | None = None, params: dict | None = None,
                 kernels: str = "auto"):
        if params is None:
            if rngs is None:
                raise ValueError("SparseMLA needs rngs (random init) or params (e.g. from params_from_hf)")
            params = init_params(config, rngs.params())
        self.config = config
        self.kernels = kernels
        self.weights = nnx.data({name: nnx.Param(value) for name, value in params.items()})

    def params(self) -> dict[str, jax.Array]:
        return {name: p[...] for name, p in self.weights.items()}

    def __call__(self, hidden, cache, meta, plan):
        """hidden: [plan.num_tokens, hidden_size] -> (out [plan.num_tokens, hidden_size], new cache)."""
        return forward(self.params(), hidden, cache, meta, plan=plan, config=self.config, kernels=self.kernels)
