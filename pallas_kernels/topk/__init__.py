"""Top-k of the indexer logits: `topk` (Pallas, Triton backend: sampled thresholds, counted
writes, an exact select within the threshold band) and `topk_reference` (lax.top_k). Design and
measurements: docs/design/topk.md."""

from .api import CONFIGS, IMPLEMENTATIONS, TritonConfig, topk
from .reference import topk_reference

__all__ = ["CONFIGS", "IMPLEMENTATIONS", "TritonConfig", "topk", "topk_reference"]
