"""Fixed vs dynamic context parallelism: simulated step time.

For the bundled ``long_context`` trace (3.5k-33k tokens) and a synthetic
64k-tail trace (96% short samples, log-normal around 1.5k tokens, 4% between
16k and 64k), at dp x cp = 8 x 4 and 16 x 8 with 16384 tokens per GPU, for
the Qwen3-8B and DeepSeek-V3 shapes on the default H100 profile, the
simulator (:func:`varbatch_kit.analysis.simulate.simulate`) times:

- three fixed-CP schedules: ``first_fit + strided`` (slime's default),
  ``flops_kk + flops_kk`` (slime's ``--balance-by-flops``) and ``balanced``
  (varbatch_kit's FLOPs-balanced packing);
- the dynamic-CP schedule (``cp_mode="dynamic"``, ``packing="balanced"``:
  the planner keeps the balanced fixed plan for a step where it is not slower).

Both pay the same CP term: the ring's KV traffic that the attention does not
hide, and a latency per ring step (``HardwareProfile.cp_*``). A second table
repeats the grid with ``cp_overlap=0`` (the ring never hides behind the
attention, as with short per-rank chunks or a slower interconnect) to show
where dynamic CP pays.

Then megatron-core's own dynamic CP planner on the same steps
(``BalancedCPScheduler``, run from the installed package with a stand-in for
its process group: :mod:`benchmarks._megatron_hybrid_cp`), for Qwen3-8B
(megatron's hybrid CP refuses DeepSeek-V3's multi-latent attention): one row
per batch and planner (the three fixed-CP plans, the project's dynamic plan,
megatron's plan as megatron runs it, with a barrier over the pool after each of
its groups, and the same plan on the project's group timeline without those
barriers), with the simulated seconds under the same cost model, the largest
tokens per rank and the micro-batches over the cap, the groups megatron has no
process group for, and the samples per CP degree.

Then the planning-time table of :mod:`benchmarks.dynamic_cp_speed` (dynamic vs
fixed ``balanced`` planning time on a 3000-sample step, and the plans' simulated
time against the planner before its speed-up).

Run: ``python -m benchmarks.dynamic_cp`` (``--quick``: half the rollouts and the
default table only). Writes ``build/bench/dynamic_cp.json`` (its ``megatron``
rows: the comparison with megatron's planner) (and
``build/bench/dynamic_cp_speed.json``).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from benchmarks._batches import CAP, tail_trace
from varbatch_kit import ModelShape, Rollouts, ScheduleConfig, build_schedule
from varbatch_kit.analysis.simulate import simulate
from varbatch_kit.core.hardware import HARDWARE, cp_cost_model
from varbatch_kit.core.traces import bundled_traces, read_trace

LAYOUTS = [(8, 4), (16, 8)]
MODELS = ["qwen3-8b", "deepseek-v3"]
FIXED = {"first_fit": ("first_fit", "strided"), "flops_kk": ("flops_kk", "flops_kk"),
         "balanced": ("balanced", "balanced")}
OUT = Path("build/bench/dynamic_cp.json")


def traces(quick: bool) -> dict[str, tuple[Rollouts, int]]:
    """name -> (rollouts, global_batch_size): four steps each (two with --quick)."""
    lc = read_trace(bundled_traces()["long_context"])
    tail = tail_trace()
    if quick:
        lc = lc.subset(np.arange(len(lc) // 2))
        tail = tail.subset(np.arange(len(tail) // 2))
    return {"long_context": (lc, lc.num_rollouts // (2 if quick else 4)),
            "tail_64k": (tail, tail.num_rollouts // (2 if quick else 4))}


def one(rollouts: Rollouts, gbs: int, dp: int, cp: int, model: ModelShape, hw) -> dict:
    """Simulated seconds of the fixed schedules and the dynamic one, and the plan's figures."""
    row: dict = {}
    for name, (packing, distribution) in FIXED.items():
        cfg = ScheduleConfig(dp=dp, cp=cp, max_tokens_per_gpu=CAP, global_batch_size=gbs,
                             packing=packing, distribution=distribution)
        row[f"fixed_{name}_s"] = simulate(build_schedule(rollouts, cfg, model), hardware=hw,
                                          timelines=False).total_time_s
    cfg = ScheduleConfig(dp=dp, cp=cp, max_tokens_per_gpu=CAP, global_batch_size=gbs,
                         packing="balanced", cp_mode="dynamic")
    t0 = time.perf_counter()
    dyn = build_schedule(rollouts, cfg, model, cp_cost=cp_cost_model(model, hw)).check()
    row["plan_s"] = time.perf_counter() - t0
    sim = simulate(dyn, hardware=hw, timelines=False)
    row["dynamic_s"] = sim.total_time_s
    row["bound_s"] = sim.total_bound_s
    sizes = np.concatenate([s.sample_cp_sizes() for s in dyn.steps])
    row["share_c1"] = float((sizes == 1).mean())
    row["degrees"] = {int(c): int((sizes == c).sum()) for c in np.unique(sizes)}
    row["steps_kept_fixed"] = int(sum(all(p.degree == cp for p in s.placements)
                                      for s in dyn.steps))
    row["steps"] = dyn.num_steps
    for name in FIXED:
        row[f"ratio_vs_{name}"] = row[f"fixed_{name}_s"] / row["dynamic_s"]
    row["ratio_vs_best_fixed"] = min(row[f"fixed_{n}_s"] for n in FIXED) / row["dynamic_s"]
    return row


def run(data: dict, overlaps: list[float]) -> list[dict]:
    rows = []
    for overlap in overlaps:
        hw = replace(HARDWARE["H100"], cp_overlap=overlap)
        for tname, (roll, gbs) in data.items():
            for mname in MODELS:
                model = ModelShape.preset(mname)
                for dp, cp in LAYOUTS:
                    row = {"trace": tname, "model": mname, "dp": dp, "cp": cp,
                           "cp_overlap": overlap, "global_batch_size": gbs}
                    row.update(one(roll, gbs, dp, cp, model, hw))
                    rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    for overlap in sorted({r["cp_overlap"] for r in rows}, reverse=True):
        print(f"\nH100, cap {CAP} tokens/GPU, cp_overlap={overlap:g}: simulated seconds "
              "(all steps), ratio = fixed / dynamic")
        head = (f"{'trace':<13}{'model':<13}{'dp x cp':>8}{'ff+strided':>12}{'kk+kk':>10}"
                f"{'balanced':>10}{'dynamic':>10}{'vs ff':>7}{'vs kk':>7}{'vs bal':>7}"
                f"{'vs best':>8}{'c=1':>6}{'kept':>6}")
        print(head)
        print("-" * len(head))
        for r in rows:
            if r["cp_overlap"] != overlap:
                continue
            print(f"{r['trace']:<13}{r['model']:<13}{str(r['dp']) + 'x' + str(r['cp']):>8}"
                  f"{r['fixed_first_fit_s']:>12.2f}{r['fixed_flops_kk_s']:>10.2f}"
                  f"{r['fixed_balanced_s']:>10.2f}{r['dynamic_s']:>10.2f}"
                  f"{r['ratio_vs_first_fit']:>7.3f}{r['ratio_vs_flops_kk']:>7.3f}"
                  f"{r['ratio_vs_balanced']:>7.3f}{r['ratio_vs_best_fixed']:>8.3f}"
                  f"{r['share_c1']:>6.0%}"
                  f"{str(r['steps_kept_fixed']) + '/' + str(r['steps']):>6}")
    print("c=1: share of samples the dynamic plan trains without CP; kept: steps where the "
          "balanced fixed plan was not slower and is kept")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="half the rollouts, default cp_overlap only")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    data = traces(args.quick)
    overlaps = [1.0] if args.quick else [1.0, 0.0]
    rows = run(data, overlaps)
    print_table(rows)
    worst = min(r["ratio_vs_best_fixed"] for r in rows)
    print(f"\nnever slower than the best fixed plan: {worst >= 1 - 1e-9} "
          f"(smallest ratio vs the best fixed {worst:.4f})")
    from benchmarks.dynamic_cp_megatron import megatron_rows, print_megatron_table

    mrows = megatron_rows(data, overlaps, LAYOUTS, FIXED)
    print_megatron_table(mrows)
    elapsed = time.perf_counter() - start
    print(f"({elapsed:.1f} s)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"quick": args.quick, "cap": CAP, "hardware": "H100",
                                    "seconds": elapsed, "rows": rows, "megatron": mrows},
                                   indent=1))
    print(f"wrote {args.out}")
    from benchmarks import dynamic_cp_speed

    dynamic_cp_speed.main(["--quick"] if args.quick else [])


if __name__ == "__main__":
    main()
