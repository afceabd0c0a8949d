"""Measured, not only simulated: real dp=2 training runs of four policies vs the calibrated model.

The same long-tailed rollouts (samples up to ~4k tokens, so per-sample
attention's ``sum L^2`` matters) train with dp=2 on CPU (gloo, one torch
thread per rank: ``threads_per_worker=1``) under four packing +
distribution policies:

- ``first_fit + strided`` (slime's default),
- ``first_fit + flops_kk`` (slime's ``--balance-data``),
- ``flops_kk + flops_kk`` (slime's ``--balance-by-flops``),
- ``balanced + balanced`` (varbatch_kit's).

The engine records every micro-batch's forward and backward time
(:mod:`varbatch_kit.train.timing`). The cost model
``t = c0 + c1 sum L + c2 sum L^2`` is fitted on those micro-batches
(the first step of each run left out as warm-up; the full bench trains every
policy twice, in turn, so that a burst of load elsewhere does not fall on one
policy only), 25 % of them held out for
R². A second model is fitted on a calibration sweep
(:mod:`varbatch_kit.train.calibrate`, not with ``--quick``) and judged on the
runs' micro-batches: a model that never saw the training runs. One fixed per-step overhead
(optimizer, packing, gradient all-reduce: the median over all steps of the
measured step time minus the busiest rank's busy time) is added to every
predicted step. Then, per policy, ``simulate(schedule, hardware=model)``
predicts the mean step time and straggler wait, next to the measured ones.

Prints the table; writes ``build/bench/measured.json`` (per policy:
measured and predicted mean step seconds and straggler seconds; the fit's
coefficients and R²) and ``build/bench/cost_model.json``
(``MicroBatchCostModel.save``). ``python -m benchmarks.measured``
(``--quick``: fewer, smaller steps). Run it on a quiet machine: the
policies' differences are a few tens of percent, and other processes on
the same cores move the measured times by as much.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

POLICIES = [("first_fit", "strided"), ("first_fit", "flops_kk"), ("flops_kk", "flops_kk"),
            ("balanced", "balanced")]
OUT = Path("build/bench")

FULL = {"rollouts": 320, "gbs": 32, "steps": 9, "cap": 4096, "median": 600.0,
        "max_response": 4000, "hidden": 128, "layers": 2, "heads": 4, "rounds": 2}
QUICK = {"rollouts": 96, "gbs": 24, "steps": 4, "cap": 4096, "median": 500.0,
         "max_response": 3500, "hidden": 128, "layers": 2, "heads": 4, "rounds": 1}


def make_rollouts(p: dict):
    """Long-tailed single-sample rollouts: log-normal responses (sigma 1), cut at max_response."""
    from varbatch_kit import Rollouts

    return Rollouts.synthetic(p["rollouts"], samples_per_rollout=(1, 1), prompt_len=(16, 64),
                              response_len=p["median"], response_sigma=1.0,
                              max_response_len=p["max_response"], seed=11)


def configs(p: dict):
    from varbatch_kit import ScheduleConfig
    from varbatch_kit.train import TrainConfig

    out = []
    for packing, dist in POLICIES * p["rounds"]:  # rounds: the policies in turn, again
        sched = ScheduleConfig(dp=2, global_batch_size=p["gbs"], max_tokens_per_gpu=p["cap"],
                               packing=packing, distribution=dist)
        out.append(TrainConfig(schedule=sched, num_layers=p["layers"], hidden_size=p["hidden"],
                               num_attention_heads=p["heads"], vocab_size=64, lr=1e-4,
                               min_lr=1e-4, lr_decay_style="constant", max_steps=p["steps"],
                               threads_per_worker=1, timeout_s=1800,
                               label=f"{packing}+{dist}"))
    return out


def step_overhead(runs, skip: int = 1) -> float:
    """Median over the steps (after ``skip``) of measured step time minus the busiest busy time."""
    gaps = []
    for r in runs:
        s = r.steps[r.steps["step"] > skip]
        gaps += [float(t) - max(b) for t, b in zip(s["step_time_s"], s["busy_s"])]
    return float(max(0.0, np.median(gaps)))


def measured_row(runs, skip: int = 1) -> dict:
    """Means over the timed steps of every round of one policy."""
    import pandas as pd

    s = pd.concat([r.steps[r.steps["step"] > skip] for r in runs], ignore_index=True)
    return {"measured_step_s": float(s["step_time_s"].mean()),
            "measured_busiest_s": float(np.mean([max(b) for b in s["busy_s"]])),
            "measured_straggler_s": float(np.mean([np.mean(x) for x in s["straggler_s"]])),
            "measured_max_straggler_s": float(np.mean([max(x) for x in s["straggler_s"]])),
            "steps_timed": int(len(s))}


def predicted_row(cfg, rollouts, model, overhead: float, skip: int = 1) -> dict:
    from varbatch_kit import build_schedule
    from varbatch_kit.analysis.simulate import simulate

    sched = build_schedule(rollouts, cfg.schedule, model=cfg.model_shape())
    sim = simulate(sched, hardware=model, step_overhead_s=overhead, timelines=False)
    st = sim.step_times.iloc[skip:cfg.max_steps]
    return {"predicted_step_s": float(st["time_s"].mean()),
            "predicted_busiest_s": float(st["busiest_rank_s"].mean()),
            "predicted_straggler_s": float(st["straggler_wait_s"].mean()),
            "predicted_max_straggler_s": float(st["max_straggler_wait_s"].mean()),
            "bound_s": float(st["bound_s"].mean())}


def ranking(rows, key) -> list[str]:
    return [r["policy"] for r in sorted(rows, key=lambda r: r[key])]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.measured", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer, smaller steps (< 2 min)")
    ap.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=None,
                    help="also fit a cost model on a calibration sweep, judge it on the runs' "
                         "micro-batches and predict with it (default: on, off with --quick)")
    ap.add_argument("--out", default=str(OUT), help="output folder (default build/bench)")
    ap.add_argument("--runs-dir", default=None, help="keep the training runs here")
    args = ap.parse_args(argv)

    from varbatch_kit.analysis.cost_model import fit_from_run
    from varbatch_kit.train import run_many

    p = QUICK if args.quick else FULL
    if args.sweep is None:
        args.sweep = not args.quick
    rollouts = make_rollouts(p)
    cfgs = configs(p)
    t0 = time.perf_counter()
    runs = run_many(cfgs, rollouts, out_dir=args.runs_dir, progress=False)
    train_wall = time.perf_counter() - t0

    fit = fit_from_run(runs, holdout=0.25, seed=0, skip_first_steps=1)
    model = fit.model
    overhead = step_overhead(runs)
    models = {"runs": model}
    sweep_summary = None
    if args.sweep:
        import pandas as pd

        from varbatch_kit.analysis.cost_model import r_squared
        from varbatch_kit.train.calibrate import calibrate

        cal = calibrate(cfgs[0], max_tokens=p["cap"], repeats=5, progress=False)
        models["sweep"] = cal.model
        sweep_summary = cal.fit.summary()
        mbs = pd.concat([r.micro_batches for r in runs], ignore_index=True)
        mbs = mbs[mbs["step"] > 1]  # the sweep's model judged on the runs' own micro-batches
        sweep_summary["r2_on_runs"] = r_squared(
            mbs["time_s"], cal.model.seconds(mbs["sum_len"], mbs["sum_len_sq"]))

    rows = []
    for k, cfg in enumerate(cfgs[:len(POLICIES)]):
        mine = [r for j, r in enumerate(runs) if j % len(POLICIES) == k]
        row = {"policy": cfg.name, **measured_row(mine),
               **predicted_row(cfg, rollouts, model, overhead)}
        row["error"] = row["measured_step_s"] / row["predicted_step_s"] - 1.0
        if "sweep" in models:
            row["predicted_sweep_step_s"] = predicted_row(cfg, rollouts, models["sweep"],
                                                          overhead)["predicted_step_s"]
        rows.append(row)
    measured_rank, predicted_rank = ranking(rows, "measured_step_s"), ranking(rows,
                                                                               "predicted_step_s")
    s = fit.summary()
    print(f"trace: {p['rollouts']} rollouts, lengths {int(rollouts.total_len.min())}-"
          f"{int(rollouts.total_len.max())} (median {int(np.median(rollouts.total_len))}); "
          f"dp=2, gbs {p['gbs']}, cap {p['cap']}, {p['steps']} steps "
          f"x {p['rounds']} round(s) (step 1 = warm-up, not timed); "
          f"model {p['layers']}x{p['hidden']}")
    print(f"cost model (fit on {s['n_fit']} run micro-batches): {model.describe()}")
    print(f"held-out R2 {s['r2_heldout']:.4f} on {s['n_heldout']} micro-batches; "
          f"step overhead {overhead * 1e3:.1f} ms; training wall {train_wall:.0f} s")
    if sweep_summary:
        print(f"sweep model: {models['sweep'].describe()}; held-out R2 "
              f"{sweep_summary['r2_heldout']:.4f}; R2 on the runs' micro-batches "
              f"{sweep_summary['r2_on_runs']:.4f}")
    sweep_col = "sweep" in models
    head = (f"{'policy':<22}{'measured s':>11}{'predicted s':>12}{'error':>8}"
            f"{'straggler meas':>15}{'straggler pred':>15}{'bound s':>9}"
            + (f"{'pred (sweep) s':>15}" if sweep_col else ""))
    print(head)
    for r in rows:
        print(f"{r['policy']:<22}{r['measured_step_s']:>11.3f}{r['predicted_step_s']:>12.3f}"
              f"{r['error'] * 100:>7.1f}%{r['measured_straggler_s']:>15.3f}"
              f"{r['predicted_straggler_s']:>15.3f}{r['bound_s']:>9.3f}"
              + (f"{r['predicted_sweep_step_s']:>15.3f}" if sweep_col else ""))
    within = all(abs(r["error"]) <= 0.15 for r in rows)
    print(f"ranking measured:  {' < '.join(measured_rank)}")
    print(f"ranking predicted: {' < '.join(predicted_rank)}")
    print(f"targets: held-out R2 >= 0.95: {s['r2_heldout'] >= 0.95}; every policy within 15%: "
          f"{within}; rankings match: {measured_rank == predicted_rank}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save(out / "cost_model.json")
    result = {
        "quick": bool(args.quick), "params": p, "policies": rows,
        "fit": {**s, "forward_share": model.forward_share},
        "step_overhead_s": overhead, "ranking_measured": measured_rank,
        "ranking_predicted": predicted_rank, "rankings_match": measured_rank == predicted_rank,
        "all_within_15pct": within, "train_wall_s": train_wall,
        "sweep_fit": sweep_summary,
    }
    (out / "measured.json").write_text(json.dumps(result, indent=1, default=float) + "\n")
    print(f"wrote {out / 'measured.json'} and {out / 'cost_model.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
