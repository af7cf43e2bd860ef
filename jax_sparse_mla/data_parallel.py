"""Data-parallel attention with a program per device: every device holds the whole layer and serves
its own sequences with its own plan (DeepSeek's deployment of MLA: attention by data parallelism,
the MoE by expert parallelism).

Next to `sharding` (one SPMD program over a (data, tensor) mesh), this layout runs one ordinary
`jit_forward` per device, dispatched back to back (JAX dispatch is asynchronous, so the devices
run concurrently):
  * plans per shard: each device's batch is planned alone (`plan_shards`), with its own buckets
    and its own route; a shard of decodes runs the sparse program while a shard with a short
    prefill runs the dense one. `sharding.plan_data_parallel` instead pads every shard to the
    largest shard's buckets and gives them one route (one program for the mesh).
  * caches per shard: each device's PagedCache lives on that device only, its block tables in
    its own page ids.
  * no cross-device traffic in the layer: params are replicated once (`replicate_params`), and
    a step moves nothing between devices.
The cost: a program is compiled per (plan, device), where the SPMD mesh program is compiled once
per plan; a device's step time follows its own batch (no padding to the largest shard).

When to use which (docs/design/sharding.md): data parallelism keeps the attention kernels at the
layer's 128 heads (their most efficient shape) and needs no collective, at the memory cost of a
whole attention layer per device (~0.2B parameters a layer at DeepSeek-V3.2's dimensions);
tensor parallelism splits every weight but the indexer's and each token's attention work over
devices, for a latency-bound batch or when the weights must be split.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax

from .cache import PagedCache, init_cache
from .config import MLAConfig, check_config_type
from .kernels import check_kernels
from .model import check_arguments, check_inputs, jit_forward
from .plan import BatchMeta, BatchPlan, Request, plan_batch


def replicate_params(params: dict, devices: Sequence[jax.Device]) -> list[dict]:
    """One copy of the (HF-named) params per device, committed there."""
    return [jax.device_put(params, d) for d in devices]


def init_device_caches(config: MLAConfig, devices: Sequence[jax.Device], pages_per_device: int) -> list[PagedCache]:
    """An empty cache of pages_per_device pages on each device, created in place."""
    return [jax.jit(lambda: init_cache(config, pages_per_device), out_shardings=jax.sharding.SingleDeviceSharding(d))()
            for d in devices]


def plan_shards(config: MLAConfig, shards: Sequence[Sequence[Request]], devices: Sequence[jax.Device], *,
                pages_per_device: int, **plan_options) -> list[tuple[BatchPlan, BatchMeta] | None]:
    """plan_batch for each device's requests (block tables in that device's page ids; None for an
    idle device), its metadata placed on the device. plan_options as plan_batch's (buckets,
    force_sparse, skip_indexer, dispatch, prefill_route). Raises ValueError naming the shard."""
    if isinstance(shards, (str, bytes)) or not isinstance(shards, Sequence):
        raise ValueError(f"shards must be a sequence of request lists (one per device), got {type(shards).__name__}")
    if len(shards) != len(devices):
        raise ValueError(f"{len(shards)} request lists for {len(devices)} devices: give one per device")
    plans = []
    for d, (reqs, device) in enumerate(zip(shards, devices)):
        if isinstance(reqs, (str, bytes, Request)) or not isinstance(reqs, Sequence):
            raise ValueError(f"data shard {d}: expected a sequence of Requests, got {type(reqs).__name__}")
        if not len(reqs):
            plans.append(None)
            continue
        try:
            plan, meta = plan_batch(config, reqs, num_pages=pages_per_device, **plan_options)
        except ValueError as e:
            raise ValueError(f"data shard {d}: {e}") from None
        plans.append((plan, jax.device_put(meta, device)))
    return plans


def data_parallel_step(params: Sequence[dict], hidden: Sequence[jax.Array | None], caches: Sequence[PagedCache],
                       plans: Sequence[tuple[BatchPlan, BatchMeta] | None], *, config: MLAConfig,
                       kernels: str = "auto") -> tuple[list[jax.Array | None], list[PagedCache]]:
    """One layer step on every device with work: (outs, caches), per device.

    params, caches: per device (replicate_params, init_device_caches); plans: plan_shards's;
    hidden[d]: [plan.num_tokens, hidden_size] of device d's plan (None for an idle device), rows
    in plan_batch's order. outs[d] is None for an idle device, whose cache is returned as it was.
    Each cache is donated to its device's step. Every device's arguments are checked (what
    forward checks: model.check_arguments, model.check_inputs) before any device runs: ValueError
    naming the data shard and the argument (`data shard 1: hidden has shape ...`; lists that are
    not sequences, a plan that is not plan_shards's (plan, meta) pair), every cache left as it was.
    """
    check_config_type(config)
    check_kernels(kernels)
    for name, value in (("params", params), ("hidden", hidden), ("caches", caches), ("plans", plans)):
        if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
            raise ValueError(f"{name} must be a sequence with one entry per device, got {type(value).__name__}")
    if not len(params) == len(hidden) == len(caches) == len(plans):
        raise ValueError(f"params, hidden, caches and plans must have one entry per device, got "
                         f"{len(params)}, {len(hidden)}, {len(caches)}, {len(plans)}")
    for d, (p, x, cache, planned) in enumerate(zip(params, hidden, caches, plans)):
        if planned is None:
            if x is not None:
                raise ValueError(f"data shard {d} is idle (no plan) but has hidden states")
            continue
        if x is None:
            raise ValueError(f"data shard {d} has a plan but no hidden states")
        if not isinstance(planned, (tuple, list)) or len(planned) != 2:
            raise ValueError(f"data shard {d}: plans[{d}] must be None or a (plan, meta) pair from plan_shards, "
                             f"got {type(planned).__name__}")
        plan, meta = planned
        try:
            check_arguments(p, x, cache, meta, plan, config, kernels)
            check_inputs(p, x, cache, meta, plan, config)
        except ValueError as e:
            raise ValueError(f"data shard {d}: {e}") from None
    outs, new_caches = [], []
    for p, x, cache, planned in zip(params, hidden, caches, plans):
        if planned is None:
            outs.append(None)
            new_caches.append(cache)
            continue
        plan, meta = planned
        device = next(iter(cache.latent.devices()))
        out, cache = jit_forward(p, jax.device_put(x, device), cache, meta, plan=plan, config=config, kernels=kernels)
        outs.append(out)
        new_caches.append(cache)
    return outs, new_caches
