"""The package's harness: what drives the layer for benchmarks, the demo and the tests, kept apart
from the layer a model imports (no module of jax_sparse_mla outside this subpackage imports it,
bar the command line's demo; tests/test_layering.py checks it). It has one page allocator and one
scheduling loop: a continuous-batching serving loop over a stack of sparse-MLA layers, with
latency metrics.

Pieces (each usable alone; modules workload, allocator, engine, metrics, block, synthetic, demo):
  `Workload`    a vLLM-style random workload: input/output lengths uniform in
                [len * (1 - ratio), len * (1 + ratio)], arrival times (all at once, or Poisson at
                `request_rate`), and a client-side `concurrency` cap -> `RequestSpec`s.
  `PageAllocator` the free list of cache pages (allocator); in the loop a request reserves every
                page it will ever need when it is admitted and frees them when it finishes (no
                preemption needed).
  `Engine`      N layers (random weights, one PagedCache each) served step by step: vLLM's
                scheduling policy (running decodes first, then prefill chunks under a per-step
                token budget `max_num_batched_tokens`, at most `max_num_seqs` running), one
                plan per step shared by every layer, hidden flowing layer to layer as
                x = x + attn(x) (block="attention"), or through decoder blocks
                x = x + attn(RMSNorm(x)); x = x + moe(RMSNorm(x)) with a DeepSeek-V3.2 MoE FFN
                stand-in (block="decoder", `block.MoEConfig`); a step is one dispatch of one
                program over every layer (`engine.jit_layer_stack`), its input and metadata one
                packed int32 transfer (`engine.pack_step`); the running requests are arrays over
                slots, so a step's batch is gathered, not rebuilt request by request; each step's
                host part is a profiler trace span (`engine.STEP_ANNOTATION`).
  `ServeResult` per-request metrics (TTFT, TPOT), per-step records, and a summary.
  `synthetic.Harness` one layer's sequences of known random hidden states, each step's work
                chosen by the caller (no scheduler), its pages from a `PageAllocator`, every
                step's rows checked against `reference.sequence_forward` (the tests' and the
                demo's oracle).
  `demo.run_demo` `python -m jax_sparse_mla demo`: a fixed workload through a Harness, step by step.

Time. The loop keeps a clock that starts at 0 and advances by each step's measured wall time
(scheduling + planning + every layer, up to block_until_ready); when nothing is running it jumps
to the next arrival instead of sleeping. A request arrives at max(its arrival time, the moment the
client's concurrency cap lets it be sent). TTFT = end of the step that finished its prefill (which
produces its first output token) - arrival; TPOT = mean time between its output tokens.

The loop's tokens are synthetic: every token's hidden state (a prompt token, or the "next token"
a decode step feeds back) is a row of a seeded random pool kept on the device, picked by a seeded
per-request index sequence, so a step's input is one gather and runs are reproducible.
"""

from .allocator import PageAllocator, PoolTooSmallError
from .engine import Engine, EngineOptions, reference_outputs
from .metrics import RequestMetrics, ServeResult, StepRecord
from .workload import RequestSpec, Workload

__all__ = ["Engine", "EngineOptions", "PageAllocator", "PoolTooSmallError", "RequestMetrics", "RequestSpec",
           "ServeResult", "StepRecord", "Workload", "reference_outputs"]
