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
(:mod:`varbatch_kit.train.step.microbatch_timer`). Every policy trains ``rounds`` times
(3; 2 with ``--quick``), the policies in turn, so that a burst of load
elsewhere on the machine does not fall on one policy only; the first step of
each run is warm-up and not timed.

- **Fit.** ``t = c0 + c1 sum L + c2 sum L^2`` on the runs' micro-batches
  (each micro-batch, trained once per round, keeps its fastest round), 25 %
  held out for R². A second model is fitted on a calibration sweep
  (:mod:`varbatch_kit.train.measure.calibration`; not with ``--quick``) and judged on
  the runs' micro-batches: a model that never saw the training runs.
- **Predict.** ``simulate(schedule, hardware=model)`` per policy, plus one
  fixed per-step overhead for everything the micro-batch model does not see
  (optimizer, packing, gradient all-reduce: the median over all steps of
  the measured step time minus the busiest rank's busy time).
- **Measure.** Mean step time and straggler wait (busiest rank's busy time
  minus each rank's, averaged over ranks) over all rounds (``measured``),
  each with its 95 % interval over rounds (Student t on the per-round
  means, :mod:`benchmarks._intervals`), and over each step's fastest round
  (``best``: other processes only ever add time; one value per step, no
  interval). On a quiet machine the two agree.
- **Resolve.** The measured order joins two policies with ``<`` only where
  their intervals separate (``≈`` otherwise); it agrees with the predicted
  order when every pair it resolves is in the predicted order.
- **Large gain** (:mod:`benchmarks.measured_gain`, ``--no-large-gain`` to
  skip): the one-micro-batch-per-rank regime of the compact rollouts of a
  slime dump, where the simulator predicts a large gain of ``balanced``
  (with the workload fitted above) over slime's best flag
  (``compat.slime.recommend``); the measured gain must be at least half the
  predicted one and resolved.

Prints the table; writes ``build/bench/measured.json`` (per policy:
measured and predicted mean step seconds and straggler seconds; the fit's
coefficients and R²) and ``build/bench/cost_model.json``
(``MicroBatchCostModel.save``). ``python -m benchmarks.measured``
(``--quick``: fewer, smaller steps). Run it on a quiet machine: the
policies differ by 5-30 %, and other processes on the same two cores move
a micro-batch's time by up to 3x.
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
        "max_response": 4000, "hidden": 128, "layers": 2, "heads": 4, "rounds": 3}
QUICK = {"rollouts": 96, "gbs": 24, "steps": 4, "cap": 4096, "median": 500.0,
         "max_response": 3500, "hidden": 128, "layers": 2, "heads": 4, "rounds": 2}


def make_rollouts(p: dict):
    """Long-tailed single-sample rollouts: log-normal responses (sigma 1), cut at max_response."""
    from varbatch_kit import Rollouts

    return Rollouts.synthetic(p["rollouts"], samples_per_rollout=(1, 1), prompt_len=(16, 64),
                              response_len=p["median"], response_sigma=1.0,
                              max_response_len=p["max_response"], seed=11)


def configs(p: dict):
    from varbatch_kit import ScheduleConfig

    out = []
    for packing, dist in POLICIES * p["rounds"]:  # rounds: the policies in turn, again
        sched = ScheduleConfig(dp=2, global_batch_size=p["gbs"], max_tokens_per_gpu=p["cap"],
                               packing=packing, distribution=dist)
        out.append(train_config(sched, p, f"{packing}+{dist}", p["steps"]))
    return out


def train_config(schedule, p: dict, label: str, max_steps: int):
    """The bench's toy model (``p``'s layers, hidden size, heads) trained on ``schedule``.

    The rollouts have one sample per reward group, so the group rewards are not divided by
    their (undefined) std (``grpo_std_normalization=False``); the timing does not depend on it.
    """
    from varbatch_kit.train import LossConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig

    return TrainConfig(
        schedule=schedule,
        loss=LossConfig(grpo_std_normalization=False),
        model=ModelConfig(num_layers=p["layers"], hidden_size=p["hidden"],
                          num_attention_heads=p["heads"], vocab_size=64),
        optim=OptimConfig(lr=1e-4, min_lr=1e-4, lr_decay_style="constant"),
        run=RunConfig(max_steps=max_steps, threads_per_worker=1, timeout_s=1800, label=label))


def policy_runs(runs, n: int = len(POLICIES)) -> list[list]:
    """The runs of each of ``n`` policies (one per round), in the order they were given."""
    return [[r for j, r in enumerate(runs) if j % n == k] for k in range(n)]


def best_micro_batches(runs, skip: int = 1):
    """The runs' micro-batches after the warm-up steps; a micro-batch trained in several rounds
    (same policy, step, rank, position: the same samples) keeps its fastest round."""
    import pandas as pd

    frames = []
    for k, mine in enumerate(policy_runs(runs)):
        for r in mine:
            mb = r.micro_batches
            frames.append(mb[mb["step"] > skip].assign(policy=k))
    mbs = pd.concat(frames, ignore_index=True)
    keys = ["policy", "step", "rank", "position"]
    return mbs.loc[mbs.groupby(keys)["time_s"].idxmin()].reset_index(drop=True)


def _step_table(mine, skip: int):
    """One row per (round, step) of one policy after the warm-up steps."""
    import pandas as pd

    out = []
    for rnd, r in enumerate(mine):
        for _, s in r.steps[r.steps["step"] > skip].iterrows():
            out.append({"round": rnd, "step": int(s["step"]), "time": float(s["step_time_s"]),
                        "busiest": float(max(s["busy_s"])),
                        "straggler": float(np.mean(s["straggler_s"])),
                        "max_straggler": float(max(s["straggler_s"]))})
    return pd.DataFrame(out)


def step_overhead(runs, skip: int = 1) -> float:
    """Median over all steps (after ``skip``) of measured step time minus the busiest busy time:
    optimizer, packing, gradient all-reduce, the parts the micro-batch model does not see."""
    gaps = []
    for mine in policy_runs(runs):
        t = _step_table(mine, skip)
        gaps += list(t["time"] - t["busiest"])
    return float(max(0.0, np.median(gaps)))


def measured_row(mine, skip: int = 1) -> dict:
    """Per policy: means over the timed steps of every round (``measured_*``), with 95 %
    intervals over rounds (``*_ci``: the per-round means, :func:`benchmarks._intervals.interval`),
    and of each step's fastest round (``best_*``: other load on the machine only adds time)."""
    from benchmarks._intervals import interval

    t = _step_table(mine, skip)
    best = t.loc[t.groupby("step")["time"].idxmin()]
    per_round = t.groupby("round")[["time", "busiest", "straggler", "max_straggler"]].mean()
    row = {"measured_step_s": float(t["time"].mean()),
           "measured_busiest_s": float(t["busiest"].mean()),
           "measured_straggler_s": float(t["straggler"].mean()),
           "measured_max_straggler_s": float(t["max_straggler"].mean()),
           "best_step_s": float(best["time"].mean()),
           "best_straggler_s": float(best["straggler"].mean()),
           "steps_timed": int(best.shape[0]), "rounds": len(mine)}
    for key, col in (("measured_step_s", "time"), ("measured_busiest_s", "busiest"),
                     ("measured_straggler_s", "straggler"),
                     ("measured_max_straggler_s", "max_straggler")):
        row[f"{key}_ci"] = interval(per_round[col].tolist()).as_dict()
    return row


def ci(row: dict, key: str):
    """The :class:`~benchmarks._intervals.Interval` stored under ``key + "_ci"``."""
    from benchmarks._intervals import Interval

    return Interval(**row[f"{key}_ci"])


def predicted_row(cfg, rollouts, model, overhead: float, skip: int = 1) -> dict:
    from varbatch_kit import build_schedule
    from varbatch_kit.analysis.simulate import simulate

    sched = build_schedule(rollouts, cfg.schedule, model=cfg.model_shape())
    sim = simulate(sched, hardware=model, step_overhead_s=overhead, timelines=False)
    st = sim.step_times.iloc[skip:cfg.run.max_steps]
    return {"predicted_step_s": float(st["time_s"].mean()),
            "predicted_busiest_s": float(st["busiest_rank_s"].mean()),
            "predicted_straggler_s": float(st["straggler_wait_s"].mean()),
            "predicted_max_straggler_s": float(st["max_straggler_wait_s"].mean()),
            "bound_s": float(st["bound_s"].mean())}


def ranking(rows, key) -> list[str]:
    return [r["policy"] for r in sorted(rows, key=lambda r: r[key])]


def resolved_ranking(rows, predicted_key: str = "predicted_step_s") -> dict:
    """The measured order with ``<`` only where the 95 % intervals separate, whether every
    neighbour is resolved, and whether the predicted order holds on every resolved pair."""
    from benchmarks._intervals import order_agrees
    from benchmarks._intervals import ranking as interval_ranking

    measured = {r["policy"]: ci(r, "measured_step_s") for r in rows}
    text, full = interval_ranking(measured)
    agrees = order_agrees(measured, {r["policy"]: r[predicted_key] for r in rows})
    return {"ranking_text": text, "fully_resolved": full, "order_agrees_where_resolved": agrees}


def large_gain_case(p: dict, template, model, overhead: float, *, quick: bool,
                    runs_dir: Path | None = None) -> dict:
    """Train :mod:`benchmarks.measured_gain`'s case: slime's best flag against ``balanced``
    with ``model`` as its workload; print the table and the verdict, return them."""
    from benchmarks import measured_gain as mg
    from benchmarks._intervals import gain_verdict
    from varbatch_kit import build_schedule
    from varbatch_kit.train import run_many

    g = mg.QUICK if quick else mg.FULL
    rollouts = mg.compact_rollouts(g["rollouts"])
    shape = template.model_shape()
    rec, slime_cfg, ours_cfg = mg.schedules(rollouts, g, model, shape)
    steps = build_schedule(rollouts, ours_cfg, shape).num_steps
    pair = [(f"slime {rec.best['policy']}", slime_cfg), ("balanced·cal", ours_cfg)]
    cfgs = [train_config(c, p, label, steps) for _ in range(g["rounds"]) for label, c in pair]
    t0 = time.perf_counter()
    runs = run_many(cfgs, rollouts, out_dir=runs_dir, progress=False)
    wall = time.perf_counter() - t0
    rows = []
    for cfg, mine in zip(cfgs, policy_runs(runs, len(pair))):
        row = {"policy": cfg.name, **measured_row(mine),
               **predicted_row(cfg, rollouts, model, overhead)}
        row["error"] = row["measured_step_s"] / row["predicted_step_s"] - 1.0
        rows.append(row)
    slime, ours = rows
    verdict = gain_verdict(ci(slime, "measured_step_s"), ci(ours, "measured_step_s"),
                           slime["predicted_step_s"], ours["predicted_step_s"])
    L = rollouts.total_len
    print(f"large-gain case: {rollouts.num_rollouts} compact rollouts of the slime dump "
          f"({L.size} samples, lengths {int(L.min())}-{int(L.max())}), dp=2, "
          f"{g['gbs']} rollouts per step, cap {g['cap']}: one micro-batch per rank; "
          f"{steps} steps x {g['rounds']} rounds (step 1 = warm-up); training wall {wall:.0f} s")
    print(f"  slime's best flag (compat.slime.recommend, simulated with the fitted model): "
          f"{rec.command}")
    print(f"  {'policy':<36}{'measured s':>16}{'predicted s':>12}{'error':>8}"
          f"{'pred/bound':>11}{'straggler meas':>17}")
    for r in rows:
        print(f"  {r['policy']:<36}{ci(r, 'measured_step_s').text():>16}"
              f"{r['predicted_step_s']:>12.3f}{r['error'] * 100:>7.1f}%"
              f"{r['predicted_step_s'] / r['bound_s']:>11.3f}"
              f"{ci(r, 'measured_straggler_s').text():>17}")
    print(f"  gain of balanced·cal over slime's best flag: predicted "
          f"{verdict['predicted_gain'] * 100:.1f} %, measured "
          f"{verdict['measured_gain'] * 100:.1f} %"
          f" ({verdict['share_of_predicted']:.2f} of the predicted); intervals separate: "
          f"{verdict['resolved']}; target (at least half the predicted gain, resolved): "
          f"{verdict['ok']}")
    return {"params": g, "user_flags": mg.user_flags(rollouts.num_rollouts, g),
            "slime_best_command": rec.command, "steps": steps, "policies": rows,
            "train_wall_s": wall, **verdict}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.measured", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer, smaller steps (< 2 min)")
    ap.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=None,
                    help="also fit a cost model on a calibration sweep, judge it on the runs' "
                         "micro-batches and predict with it (default: on, off with --quick)")
    ap.add_argument("--out", default=str(OUT), help="output folder (default build/bench)")
    ap.add_argument("--runs-dir", default=None, help="keep the training runs here")
    ap.add_argument("--large-gain", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the large-gain case (benchmarks.measured_gain; default on)")
    args = ap.parse_args(argv)

    from varbatch_kit.analysis.cost_model import fit_with_holdout
    from varbatch_kit.train import run_many

    p = QUICK if args.quick else FULL
    if args.sweep is None:
        args.sweep = not args.quick
    rollouts = make_rollouts(p)
    cfgs = configs(p)
    t0 = time.perf_counter()
    runs = run_many(cfgs, rollouts, out_dir=args.runs_dir, progress=False)
    train_wall = time.perf_counter() - t0

    mbs = best_micro_batches(runs)
    fit = fit_with_holdout(mbs["sum_len"], mbs["sum_len_sq"], mbs["time_s"], holdout=0.25,
                           seed=0, device=runs[0].meta.get("device", ""),
                           source="benchmarks.measured runs",
                           forward_share=float(mbs["fwd_s"].sum() / mbs["time_s"].sum()))
    model = fit.model
    overhead = step_overhead(runs)
    models = {"runs": model}
    sweep_summary = None
    if args.sweep:
        from varbatch_kit.analysis.cost_model import r_squared
        from varbatch_kit.train.measure.calibration import calibrate

        cal = calibrate(cfgs[0], max_tokens=p["cap"], repeats=5, progress=False)
        models["sweep"] = cal.model
        sweep_summary = cal.fit.summary()
        # a model that never saw the training runs, judged on their micro-batches
        sweep_summary["r2_on_runs"] = r_squared(
            mbs["time_s"], cal.model.seconds(mbs["sum_len"], mbs["sum_len_sq"]))

    rows = []
    for cfg, mine in zip(cfgs, policy_runs(runs)):
        row = {"policy": cfg.name, **measured_row(mine),
               **predicted_row(cfg, rollouts, model, overhead)}
        row["error"] = row["measured_step_s"] / row["predicted_step_s"] - 1.0
        row["best_error"] = row["best_step_s"] / row["predicted_step_s"] - 1.0
        if "sweep" in models:
            row["predicted_sweep_step_s"] = predicted_row(cfg, rollouts, models["sweep"],
                                                          overhead)["predicted_step_s"]
        rows.append(row)
    predicted_rank = ranking(rows, "predicted_step_s")
    s = fit.summary()
    print(f"trace: {p['rollouts']} rollouts, lengths {int(rollouts.total_len.min())}-"
          f"{int(rollouts.total_len.max())} (median {int(np.median(rollouts.total_len))}); "
          f"dp=2, gbs {p['gbs']}, cap {p['cap']}, {p['steps']} steps "
          f"x {p['rounds']} round(s) (step 1 = warm-up, not timed); "
          f"model {p['layers']}x{p['hidden']}")
    print(f"cost model (fit on {s['n_fit']} run micro-batches, fastest round each): "
          f"{model.describe()}")
    print(f"held-out R2 {s['r2_heldout']:.4f} on {s['n_heldout']} micro-batches; "
          f"step overhead {overhead * 1e3:.1f} ms; training wall {train_wall:.0f} s")
    if sweep_summary:
        print(f"sweep model: {models['sweep'].describe()}; held-out R2 "
              f"{sweep_summary['r2_heldout']:.4f}; R2 on the runs' micro-batches "
              f"{sweep_summary['r2_on_runs']:.4f}")
    sweep_col = "sweep" in models
    print("measured: mean over all rounds, ± the half-width of its 95 % interval over rounds; "
          "best: mean over steps of each step's fastest round (no interval)")
    print(f"{'policy':<22}{'measured s':>16}{'best s':>8}{'predicted s':>12}{'error':>8}"
          f"{'best err':>9}{'straggler meas':>17}{'best':>7}{'pred':>7}{'bound s':>9}"
          + (f"{'pred(sweep) s':>14}" if sweep_col else ""))
    for r in rows:
        print(f"{r['policy']:<22}{ci(r, 'measured_step_s').text():>16}{r['best_step_s']:>8.3f}"
              f"{r['predicted_step_s']:>12.3f}{r['error'] * 100:>7.1f}%"
              f"{r['best_error'] * 100:>8.1f}%{ci(r, 'measured_straggler_s').text():>17}"
              f"{r['best_straggler_s']:>7.3f}{r['predicted_straggler_s']:>7.3f}"
              f"{r['bound_s']:>9.3f}"
              + (f"{r['predicted_sweep_step_s']:>14.3f}" if sweep_col else ""))
    verdict = {}
    for key, err in (("measured_step_s", "error"), ("best_step_s", "best_error")):
        order = ranking(rows, key)
        verdict[key] = {"ranking": order, "rankings_match": order == predicted_rank,
                        "all_within_15pct": all(abs(r[err]) <= 0.15 for r in rows)}
    resolved = resolved_ranking(rows, "predicted_step_s")
    verdict["measured_step_s"].update(resolved)
    print(f"ranking measured  {resolved['ranking_text']}  ("
          + ("every neighbour resolved" if resolved["fully_resolved"] else
             "≈: the 95 % intervals overlap, that order is not resolved") + ")")
    print(f"ranking best      {' < '.join(verdict['best_step_s']['ranking'])}  (no intervals)")
    print(f"ranking predicted {' < '.join(predicted_rank)}")
    print(f"targets: held-out R2 >= 0.95: {s['r2_heldout'] >= 0.95}; every policy within 15% "
          f"(measured / best): {verdict['measured_step_s']['all_within_15pct']} / "
          f"{verdict['best_step_s']['all_within_15pct']}; the measured order agrees with the "
          f"predicted one on every pair it resolves: {resolved['order_agrees_where_resolved']}")
    gain = None
    if args.large_gain:
        gain = large_gain_case(p, cfgs[0], model, overhead, quick=args.quick,
                               runs_dir=None if args.runs_dir is None else
                               Path(args.runs_dir) / "large_gain")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save(out / "cost_model.json")
    result = {
        "quick": bool(args.quick), "params": p, "policies": rows,
        "fit": {**s, "forward_share": model.forward_share},
        "step_overhead_s": overhead, "ranking_predicted": predicted_rank,
        "ranking_measured": verdict["measured_step_s"]["ranking"],
        "rankings_match": verdict["measured_step_s"]["rankings_match"],
        "all_within_15pct": verdict["measured_step_s"]["all_within_15pct"],
        "ranking_measured_resolved": verdict["measured_step_s"]["ranking_text"],
        "fully_resolved": verdict["measured_step_s"]["fully_resolved"],
        "order_agrees_where_resolved": verdict["measured_step_s"]["order_agrees_where_resolved"],
        "best_of_rounds": verdict["best_step_s"], "train_wall_s": train_wall,
        "sweep_fit": sweep_summary, "large_gain": gain,
    }
    (out / "measured.json").write_text(json.dumps(result, indent=1, default=float) + "\n")
    print(f"wrote {out / 'measured.json'} and {out / 'cost_model.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
