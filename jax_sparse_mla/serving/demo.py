"""The demo: a small synthetic serving workload, step by step, checked against the reference."""

from __future__ import annotations

import sys

import jax

from ..config import MLAConfig
from ..model import jit_forward
from ..progress import progress_bar
from .synthetic import Harness


def workload(topk: int):
    """(description, sequences to add {id: length}, work [(id, new tokens)]) per step.

    Lengths are set relative to index_topk so that every route appears at any scale.
    """
    short, long_ = topk // 2, topk + topk // 4
    return [
        ("short prefills", {0: short + 3, 1: short, 2: long_ + 8}, [(0, short), (1, short)]),
        ("long prefill", {}, [(2, long_)]),
        ("chunked prefill, first chunk", {3: topk + 8}, [(3, topk // 2)]),
        ("chunked prefill with context", {}, [(3, topk // 2 + 4)]),
        ("decode", {}, [(0, 1), (2, 1), (3, 1)]),
        ("decode", {}, [(0, 1), (2, 1), (3, 1)]),
        ("mixed: short prefill + decodes", {4: short}, [(4, short), (2, 1), (3, 1)]),
        ("mixed: short + long prefill", {6: short, 7: long_}, [(6, short), (7, long_)]),
        ("mixed, no skip (baseline)", {5: short}, [(5, short), (2, 1), (3, 1), (0, 1)]),
    ]


# one step of the deepseek_v32 demo on a CPU backend (first call with compilation, then 5 timed re-runs), as observed
CPU_MINUTES_PER_STEP_V32 = 8


def run_demo(config_name: str | None, kernels: str, *, force: bool = False) -> int:
    platform = jax.devices()[0].platform
    on_gpu = platform == "gpu"
    if config_name is None:
        config_name = "deepseek_v32" if on_gpu else "tiny"
    if config_name == "deepseek_v32" and platform == "cpu" and not force:
        n = len(workload(MLAConfig.tiny().index_topk))
        print(f"demo --config deepseek_v32 on a CPU backend takes about {CPU_MINUTES_PER_STEP_V32} minutes a step, "
              f"about {n * CPU_MINUTES_PER_STEP_V32} minutes for its {n} steps (the real DeepSeek-V3.2 dimensions; "
              "made for a GPU). Run --config tiny (the CPU default), or pass --force to run it anyway.",
              file=sys.stderr)
        return 2
    config = MLAConfig.tiny() if config_name == "tiny" else MLAConfig.deepseek_v32()
    tol = 1e-4 if config.dtype == "float32" else 5e-2
    steps = workload(config.index_topk)
    max_len = max(n for _, seqs, _ in steps for n in seqs.values())
    h = Harness(config, num_pages=8 * (-(-max_len // config.page_size)), kernels=kernels)
    print(f"config {config_name} on {platform}, kernels={kernels}: {config.num_attention_heads} heads, "
          f"topk {config.index_topk}, page {config.page_size}, dtype {config.dtype}, "
          f"kv cache {config.kv_cache_dtype}, indexer {config.indexer_dtype}")
    print(f"{'step':<32} {'route':<7} {'scoring':<9} {'tokens':>7} {'padded':>7} {'1st call ms':>11} "
          f"{'ms':>9} {'max rel err':>12}")
    programs_before = jit_forward._cache_size()
    worst = 0.0
    bar = progress_bar(steps, progress=None, desc="demo", unit="step", leave=False)
    for description, seqs, work in bar:
        bar.set_postfix_str(description)
        for sid, length in seqs.items():
            h.add(sid, length)
        options = {"skip_indexer": False} if "no skip" in description else {}
        result, plan, (first_ms, ms) = h.step(work, timed=True, **options)
        errs = h.errors(result)  # empty when every row of the step is a near-tie
        worst = max([worst, *errs.values()])
        err = f"{max(errs.values()):.2e}" if errs else "tied"
        scoring = f"{plan.num_scored_tokens} rows" if plan.has_indexer_scoring else "absent"
        bar.write(f"{description:<32} {plan.route:<7} {scoring:<9} {sum(n for _, n in work):>7} "
                  f"{plan.num_tokens:>7} {first_ms:>11.0f} {ms:>9.2f} {err:>12}")
    bar.close()
    print(f"compiled programs: {jit_forward._cache_size() - programs_before} for {len(steps)} steps "
          "(one per distinct plan; buckets keep the set bounded)")
    ok = worst < tol
    print(f"largest relative error against the reference: {worst:.2e} ({'ok' if ok else 'FAILED'}, tolerance {tol:g})")
    return 0 if ok else 1
