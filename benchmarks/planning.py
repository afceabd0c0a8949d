"""How long does ``varbatch-kit plan`` take? The layout planner on the bundled agentic trace.

:func:`varbatch_kit.compat.slime.planner.plan_layouts` for Qwen3-8B on 64 H100s (the
issue's target: at most 60 s here), against the same search without its pruning by
time (``top`` unbounded: every candidate's memory predicted), in the same run: the
ratio of their times, and both must choose the same layout. Run:
``python -m benchmarks.planning`` (``--quick``: 16 GPUs); writes
``build/bench/planning.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KEYS = ("tp", "pp", "cp", "dp", "max_tokens_per_gpu", "packing", "recompute")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 GPUs instead of 64")
    args = parser.parse_args(argv)
    from varbatch_kit import read_trace
    from varbatch_kit.compat.slime.planner import plan_layouts
    from varbatch_kit.core.traces import bundled_traces

    gpus = 16 if args.quick else 64
    rollouts = read_trace(bundled_traces()["agentic"])
    kw = dict(hardware="H100", global_batch_size=64)
    t0 = time.perf_counter()
    pruned = plan_layouts(rollouts, "qwen3-8b", gpus, **kw)
    t_pruned = time.perf_counter() - t0
    t0 = time.perf_counter()
    exhaustive = plan_layouts(rollouts, "qwen3-8b", gpus, top=10**9, **kw)
    t_all = time.perf_counter() - t0
    same = ({k: pruned.best[k] for k in KEYS} == {k: exhaustive.best[k] for k in KEYS}
            if pruned.best and exhaustive.best else pruned.best == exhaustive.best)
    best = pruned.best or {}
    print(f"plan: agentic trace ({rollouts.num_samples} samples), qwen3-8b, {gpus} x H100")
    print(f"  pruned search     {t_pruned:6.1f} s  ({len(pruned.table)} candidates, pruned "
          f"{pruned.pruned})  target <= 60 s: {'met' if t_pruned <= 60 else 'MISSED'}")
    print(f"  exhaustive search {t_all:6.1f} s  ratio pruned / exhaustive "
          f"{t_pruned / t_all:.2f}; same best layout: {same}")
    print("  best: " + ", ".join(f"{k} {best.get(k)}" for k in KEYS)
          + f"; {best.get('time_s', float('nan')):.1f} s per rollout batch, predicted peak "
          f"{best.get('peak_gib', float('nan')):.1f} GiB of {pruned.memory_gib:g}")
    out = ROOT / "build" / "bench"
    out.mkdir(parents=True, exist_ok=True)
    (out / "planning.json").write_text(json.dumps({
        "gpus": gpus, "pruned_s": t_pruned, "exhaustive_s": t_all, "same_best": same,
        "best": {k: (v.item() if hasattr(v, "item") else v) for k, v in best.items()},
        "pruned": pruned.pruned}, indent=1, default=str))


if __name__ == "__main__":
    main()
