"""Measured pipeline order: the idle time of each of pp = 2 stages, trained for real, per order.

The pipeline-order policies (:mod:`varbatch_kit.policies.order`) were scored
by the simulator only. Here the toy GPT (the model of the bundled CPU
calibration, ``data/timing/cpu_toy_calibration.json``: 2 layers, one per
stage) trains with ``pp = 2`` on CPU (gloo, megatron-core's own 1F1B
schedule, one torch thread per rank) on a long-tailed batch, once per
``microbatch_order``:

- ``arrival`` (the distribution's order, slime's),
- ``small_ends`` (small micro-batches at both ends),
- ``min_bubble`` (the shortest simulated 1F1B pipeline).

Every order trains ``rounds`` times (3; 1 with ``--quick``), the orders in turn, in one
launch; each step keeps its fastest round (other processes only ever add time).

**Measured** (per stage, mean over the timed steps; the first step is warm-up): the engine
times every forward and backward of every micro-batch on every stage
(:class:`varbatch_kit.train.step.microbatch_timer.MicroBatchTimer`, around megatron's
``forward_step`` / ``backward_step``); the stage's *idle* time is the schedule's span on
that stage minus that work (the waits for the other stage: the bubble, plus p2p).
``bubble`` is the step's pipeline span (the longest stage's) minus the stage's work, the
quantity the simulator reports.

**Simulated**: ``simulate(schedule, hardware=<the calibrated cost model>, pp=2, order=...)``
on the same steps (``bubble_s``: the span minus one stage's work).

Prints the table; writes ``build/bench/pp_measured.json``. ``python -m benchmarks.pp_measured``
(``--quick``: fewer steps). The machine's load moves the measured numbers (other processes
on the same cores add waits to either stage): read the orders against each other, and run it
on a quiet machine for absolute values.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

ORDERS = ("arrival", "small_ends", "min_bubble")
OUT = Path("build/bench")
FULL = {"rollouts": 48, "gbs": 8, "steps": 6, "cap": 1024, "median": 120.0,
        "max_response": 900, "seed": 5, "rounds": 3}
QUICK = {"rollouts": 18, "gbs": 6, "steps": 3, "cap": 1024, "median": 120.0,
         "max_response": 900, "seed": 5, "rounds": 1}
GROUP = 4  # samples per rollout (a GRPO group)


def make_rollouts(p: dict):
    """Many short samples, a few up to ~1k tokens: micro-batches of very different costs."""
    from varbatch_kit import Rollouts

    return Rollouts.synthetic(p["rollouts"], samples_per_rollout=(GROUP, GROUP),
                              prompt_len=(8, 32), response_len=p["median"],
                              response_sigma=1.2, max_response_len=p["max_response"],
                              seed=p["seed"])


def cost_model():
    """The bundled CPU calibration of the toy GPT (its micro-batch cost model)."""
    from varbatch_kit.analysis.cost_model import MicroBatchCostModel
    from varbatch_kit.resources import data_dir

    d = json.loads(data_dir("timing").joinpath("cpu_toy_calibration.json").read_text())
    return MicroBatchCostModel.from_dict(d["model"])


def configs(p: dict):
    from varbatch_kit.train import TrainConfig

    base = TrainConfig().with_(pp=2, global_batch_size=p["gbs"], max_tokens_per_gpu=p["cap"],
                               packing="first_fit", max_steps=p["steps"], threads_per_worker=1,
                               n_samples_per_prompt=GROUP,
                               timeout_s=1800)
    # rounds: the orders in turn, again (a burst of load elsewhere does not hit one order only)
    return [base.with_(microbatch_order=o, label=f"{o} #{k}")
            for k in range(p["rounds"]) for o in ORDERS]


def measured(runs, skip: int = 1) -> dict:
    """Per stage: mean busy, idle (own span minus busy) and bubble (the step's span minus busy)
    over the steps after ``skip``; of each step, the round with the shortest span (other
    processes only ever add time)."""
    per_round = []
    for run in runs:
        rows = run.steps[run.steps["step"] > skip]
        per_round.append((np.array(rows["pipeline_span_s"].tolist(), dtype=float),  # [step,
                          np.array(rows["pipeline_idle_s"].tolist(), dtype=float)))  # stage]
    spans_all = np.stack([s for s, _ in per_round])  # [round, step, stage]
    idle_all = np.stack([i for _, i in per_round])
    best = spans_all.max(axis=2).argmin(axis=0)  # per step: the round of the shortest span
    steps = np.arange(spans_all.shape[1])
    spans, idle = spans_all[best, steps], idle_all[best, steps]
    busy = spans - idle
    bubble = spans.max(axis=1, keepdims=True) - busy
    return {"busy_s": busy.mean(axis=0).tolist(), "idle_s": idle.mean(axis=0).tolist(),
            "bubble_s": bubble.mean(axis=0).tolist(), "span_s": float(spans.max(axis=1).mean()),
            "steps": int(len(steps)), "rounds": len(runs),
            "all_rounds_idle_s": idle_all.mean(axis=1).tolist()}


def simulated(rollouts, cfg, model, skip: int = 1) -> dict:
    """``simulate(..., pp=2, order=...)`` on the arrival schedule with the cost model, and the
    engine's own schedule (built with that order) simulated as it is."""
    from varbatch_kit import build_schedule
    from varbatch_kit.analysis.simulate import simulate

    shape = cfg.model_shape()
    arrival = build_schedule(rollouts, cfg.schedule.with_(microbatch_order="arrival"),
                             model=shape)
    own = build_schedule(rollouts, cfg.schedule, model=shape)
    n = cfg.run.max_steps
    out = {}
    for key, sched, order in (("order", arrival, cfg.schedule.microbatch_order),
                              ("engine", own, None)):
        st = simulate(sched, hardware=model, pp=2, order=order, timelines=False).step_times
        st = st[(st["step"] >= skip) & (st["step"] < n)]  # the timed steps (0-based)
        out[key] = {"bubble_s": float(st["bubble_s"].mean()),
                    "span_s": float(st["busiest_rank_s"].mean())}
    return out


def trained_in_order(run, rollouts, cfg) -> bool:
    """Whether the engine's first stage ran every step's micro-batches in the schedule's order
    (``microbatch_order``): the lengths its stage timer recorded, against the schedule's."""
    from varbatch_kit import build_schedule

    sched = build_schedule(rollouts, cfg.schedule, model=cfg.model_shape())
    total = rollouts.total_len
    for (_, row), step in zip(run.steps.iterrows(), sched.steps):
        want = [[int(n) for n in total[w.samples]] for w in step.rank_program(0) if not w.idle]
        got = [r["lengths"] for r in row["micro_batch_timing"][0] if r.get("chunk", 0) == 0]
        if got != want:
            return False
    return True


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps")
    args = ap.parse_args(argv)
    p = QUICK if args.quick else FULL

    from varbatch_kit.train import run_many

    rollouts = make_rollouts(p)
    cfgs = configs(p)
    model = cost_model()
    t0 = time.perf_counter()
    runs = run_many(cfgs, rollouts, progress=False)
    wall = time.perf_counter() - t0
    table = []
    for k, cfg in enumerate(cfgs[:len(ORDERS)]):
        mine = runs[k::len(ORDERS)]  # this order's rounds
        m, s = measured(mine), simulated(rollouts, cfg, model)
        mbs = mine[0].steps["num_microbatches"].tolist()
        table.append({"order": cfg.schedule.microbatch_order, "mbs_per_rank": mbs, **m,
                      "trained_in_order": trained_in_order(mine[0], rollouts, cfg),
                      "sim_bubble_s": s["order"]["bubble_s"],
                      "sim_engine_bubble_s": s["engine"]["bubble_s"],
                      "sim_span_s": s["order"]["span_s"]})
    print(f"pp=2 toy GPT on CPU, {p['rollouts']} rollouts of {GROUP}, {p['steps']} steps of "
          f"{p['gbs']} (cap {p['cap']} tokens), first step warm-up, {p['rounds']} round(s) per "
          f"order (each step: its fastest round); launch {wall:.0f} s")
    head = (f"{'order':<11} {'mbs/step':>9} {'measured idle s (stage 0 / 1)':>30} "
            f"{'bubble s (0 / 1)':>20} {'span s':>7}   {'sim bubble s':>12} "
            f"{'sim (engine order)':>18} {'sim span s':>10} {'in order':>8}")
    print(head)
    for r in table:
        mbs = np.mean([m[0] for m in r["mbs_per_rank"][1:]])
        print(f"{r['order']:<11} {mbs:>9.1f} {r['idle_s'][0]:>14.3f} / {r['idle_s'][1]:<13.3f} "
              f"{r['bubble_s'][0]:>9.3f} / {r['bubble_s'][1]:<8.3f} {r['span_s']:>7.3f}   "
              f"{r['sim_bubble_s']:>12.3f} {r['sim_engine_bubble_s']:>18.3f} "
              f"{r['sim_span_s']:>10.3f} {str(r['trained_in_order']):>8}")
    out = {"params": p, "launch_wall_s": wall, "cost_model": model.__dict__, "rows": table}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "pp_measured.json").write_text(json.dumps(out, indent=1, default=str) + "\n")
    return out


if __name__ == "__main__":
    main()
