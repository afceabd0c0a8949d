"""Dynamic-CP planning time against the fixed ``balanced`` plan, and the plans' simulated time.

One step of 3000 long-tailed samples (:func:`benchmarks._batches.tail_trace`:
96% log-normal around 1.5k tokens, 4% between 16k and 64k), 16384 tokens per
GPU, H100, for Qwen3-8B and DeepSeek-V3 at dp x cp = 8 x 4, 4 x 8 and 16 x 8:

- ``fixed``: seconds of ``build_schedule`` with ``packing="balanced",
  distribution="balanced"`` and fixed CP;
- ``dynamic``: the same with ``cp_mode="dynamic"`` (it builds the fixed plan
  too, and plans every step's CP degrees against it);
- ``ratio``: dynamic / fixed (goal: at most 5);
- the dynamic plan's simulated step time (``simulate(...).total_time_s``)
  now, and the one recorded before the planner was sped up
  (``benchmarks/dynamic_cp_baseline.json``, with the commit it came from):
  the faster planner must not give slower plans.

Planning times are CPU seconds (``time.process_time``), the best of a few repeats, so
that other work on a shared machine does not count.

Run: ``python -m benchmarks.dynamic_cp_speed`` (``--quick``: fewer repeats;
``--record``: rewrite the baseline from the current planner). Writes
``build/bench/dynamic_cp_speed.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from functools import partial
from pathlib import Path

from benchmarks._batches import CAP, tail_trace
from varbatch_kit import ModelShape, ScheduleConfig, build_schedule
from varbatch_kit.analysis.simulate import simulate
from varbatch_kit.core.hardware import HARDWARE, cp_cost_model

SAMPLES = 3000
LAYOUTS = [(8, 4), (4, 8), (16, 8)]
MODELS = ["qwen3-8b", "deepseek-v3"]
GOAL = 5.0
BASELINE = Path(__file__).with_name("dynamic_cp_baseline.json")
OUT = Path("build/bench/dynamic_cp_speed.json")


def case_key(model: str, dp: int, cp: int) -> str:
    return f"{model} {dp}x{cp}"


def _best_times(fns, repeats: int) -> tuple[list[float], list]:
    """CPU seconds of each function, the best of ``repeats`` rounds that run them in turn
    (so that a busy spell on a shared machine hits them alike), and their last results."""
    best, out = [float("inf")] * len(fns), [None] * len(fns)
    for _ in range(repeats):
        for j, fn in enumerate(fns):
            t0 = time.process_time()
            out[j] = fn()
            best[j] = min(best[j], time.process_time() - t0)
    return best, out


def run(repeats: int) -> list[dict]:
    rollouts = tail_trace(SAMPLES)
    hw = HARDWARE["H100"]
    rows = []
    for mname in MODELS:
        model = ModelShape.preset(mname)
        cost = cp_cost_model(model, hw)
        for dp, cp in LAYOUTS:
            cfg = ScheduleConfig(dp=dp, cp=cp, max_tokens_per_gpu=CAP, global_batch_size=SAMPLES,
                                 packing="balanced", distribution="balanced")
            dyn_cfg = cfg.with_(cp_mode="dynamic")
            (t_fixed, t_dyn), (_, dyn) = _best_times(
                [partial(build_schedule, rollouts, cfg, model),
                 partial(build_schedule, rollouts, dyn_cfg, model, cp_cost=cost)], repeats)
            dyn.check()
            rows.append({"case": case_key(mname, dp, cp), "model": mname, "dp": dp, "cp": cp,
                         "fixed_plan_s": t_fixed, "dynamic_plan_s": t_dyn,
                         "ratio": t_dyn / t_fixed,
                         "simulated_s": simulate(dyn, hardware=hw, timelines=False).total_time_s})
    return rows


def load_baseline() -> dict:
    """``{"commit": ..., "simulated_s": {case: seconds}}`` recorded before the speed-up."""
    return json.loads(BASELINE.read_text())


def record(rows: list[dict]) -> None:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    BASELINE.write_text(json.dumps({
        "commit": commit,
        "what": f"simulate(dynamic plan).total_time_s, tail_trace({SAMPLES}) as one step, "
                f"cap {CAP}, H100 defaults, packing=distribution='balanced'",
        "simulated_s": {r["case"]: r["simulated_s"] for r in rows}}, indent=1) + "\n")
    print(f"recorded {BASELINE}")


def print_table(rows: list[dict], base: dict) -> bool:
    """Print the table; True when every case meets the time goal and is not slower."""
    print(f"\nDynamic-CP planning time: one step of {SAMPLES} long-tail samples, cap {CAP}, H100; "
          f"ratio = dynamic / fixed balanced (goal <= {GOAL:g}); simulated step seconds of the "
          f"dynamic plan now and at commit {base['commit'][:10]} (before the speed-up)")
    head = (f"{'model':<13}{'dp x cp':>8}{'fixed ms':>10}{'dynamic ms':>12}{'ratio':>7}"
            f"{'sim before':>13}{'sim now':>13}{'ok':>5}")
    print(head)
    print("-" * len(head))
    good = True
    for r in rows:
        before = base["simulated_s"][r["case"]]
        ok = r["ratio"] <= GOAL and r["simulated_s"] <= before * (1 + 1e-9)
        good &= ok
        print(f"{r['model']:<13}{str(r['dp']) + 'x' + str(r['cp']):>8}"
              f"{1e3 * r['fixed_plan_s']:>10.1f}{1e3 * r['dynamic_plan_s']:>12.1f}"
              f"{r['ratio']:>7.2f}{before:>13.6f}{r['simulated_s']:>13.6f}"
              f"{'yes' if ok else 'NO':>5}")
    return good


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--record", action="store_true",
                        help="rewrite benchmarks/dynamic_cp_baseline.json from this planner")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    rows = run(repeats=3 if args.quick else 9)
    if args.record:
        record(rows)
    good = print_table(rows, load_baseline())
    print(f"all cases within {GOAL:g}x and not slower in simulation: {good}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"samples": SAMPLES, "cap": CAP, "hardware": "H100",
                                    "goal_ratio": GOAL, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
