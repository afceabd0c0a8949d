"""The project's dynamic CP against megatron-core's own (``BalancedCPScheduler``), same steps.

Part of :mod:`benchmarks.dynamic_cp` (its batches, layouts and fixed-CP
policies), for Qwen3-8B on the H100 profile: megatron's hybrid CP refuses
multi-latent attention, so DeepSeek-V3 is left out. For every batch (trace,
``dp x cp``, ``cp_overlap``) one row per planner:

- ``fixed <policy>``: the fixed-CP schedules of :data:`benchmarks.dynamic_cp.FIXED`;
- ``project dynamic``: ``cp_mode="dynamic"`` (:mod:`varbatch_kit.policies.dynamic_cp`),
  degrees up to ``cp`` inside each CP replica;
- ``megatron (barriers)``: megatron's plan of the same step's samples over the
  whole pool of ``dp * cp`` ranks (degrees up to ``dp * cp``), timed as megatron's
  forward-backward runs it: one forward/backward per sample, a barrier over
  the pool after each of its groups
  (:func:`benchmarks._megatron_hybrid_cp.barrier_step_time`);
- ``megatron (no barrier)``: the same plan converted to the project's
  :class:`~varbatch_kit.core.step.Step` and timed by the project's simulator
  (:func:`varbatch_kit.analysis.simulate.simulate`: each group starts when its
  ranks are free).

Every row is timed with the one cost model (:func:`varbatch_kit.core.hardware.cp_cost_model`
of the profile; the simulator's defaults). ``max tok/rank``: the largest
``sum(L) / c`` of a micro-batch; ``over cap``: micro-batches with more than the
cap (16384 tokens per GPU) per rank, a single sample longer than ``c * cap`` too
(a fixed plan trains one alone, over the cap);
``x bound``: seconds over the project's bound of the batch; ``busy max/mean``:
the busiest rank's compute over the mean rank's, per step (megatron balances
by its own estimate ``L**2 / c``, attention only, one sample per
forward/backward, and widens a sample's CP group only to fill idle ranks);
``unaligned``: megatron groups on ranks that have no megatron process group
(not an aligned power-of-two block nor the whole pool,
``create_hybrid_dp_cp_groups``). Run from :func:`benchmarks.dynamic_cp.main`.
"""

from __future__ import annotations

import time
from dataclasses import replace
from importlib.metadata import version

import numpy as np

from benchmarks import _megatron_hybrid_cp as mh
from benchmarks._batches import CAP
from varbatch_kit import ModelShape, ScheduleConfig, build_schedule
from varbatch_kit.analysis.simulate import simulate
from varbatch_kit.core.hardware import HARDWARE, cp_cost_model

MODEL = "qwen3-8b"
PLANNERS = ["fixed first_fit", "fixed flops_kk", "fixed balanced", "project dynamic",
            "megatron (barriers)", "megatron (no barrier)"]


def _figures(sched, lengths: np.ndarray) -> dict:
    """Micro-batches, the cap figures and the samples per CP degree of a schedule."""
    per_rank, over, sizes = [], 0, []
    for st in sched.steps:
        deg = [p.degree for p in st.placements]
        tpr = mh.tokens_per_rank(lengths, st.micro_batches, deg)
        per_rank.append(tpr.max())
        over += int((tpr > CAP).sum())
        sizes.append(st.sample_cp_sizes())
    sizes = np.concatenate(sizes)
    return {"micro_batches": int(sum(len(st.micro_batches) for st in sched.steps)),
            "max_tokens_per_rank": float(max(per_rank)), "over_cap": over,
            "degrees": {int(c): int((sizes == c).sum()) for c in np.unique(sizes)}}


def one_batch(roll, gbs: int, dp: int, cp: int, fixed: dict, hw) -> list[dict]:
    """The rows of one batch: every planner's simulated seconds (all steps) and figures."""
    model = ModelShape.preset(MODEL)
    cost = cp_cost_model(model, hw)
    lengths = roll.total_len
    scheds = {}
    for name, (packing, distribution) in fixed.items():
        cfg = ScheduleConfig(dp=dp, cp=cp, max_tokens_per_gpu=CAP, global_batch_size=gbs,
                             packing=packing, distribution=distribution)
        scheds[f"fixed {name}"] = build_schedule(roll, cfg, model)
    cfg = ScheduleConfig(dp=dp, cp=cp, max_tokens_per_gpu=CAP, global_batch_size=gbs,
                         packing="balanced", cp_mode="dynamic")
    t0 = time.perf_counter()
    dyn = build_schedule(roll, cfg, model, cp_cost=cost).check()
    plan_s = {"project dynamic": time.perf_counter() - t0}
    scheds["project dynamic"] = dyn
    t0 = time.perf_counter()
    mg, plans = mh.megatron_schedule(dyn)  # checked: every sample once, groups disjoint
    plan_s["megatron (barriers)"] = plan_s["megatron (no barrier)"] = time.perf_counter() - t0
    scheds["megatron (no barrier)"] = mg
    pool = dp * cp
    rows = []
    for name in PLANNERS:
        sched = scheds.get(name, mg)
        row = {"planner": name, "plan_s": plan_s.get(name)}
        sim = simulate(sched, hardware=hw, timelines=False)
        if name == "megatron (barriers)":
            row["step_s"] = sum(mh.barrier_step_time(plan, lengths[st.sample_indices], cost, pool)
                                for plan, st in zip(plans, dyn.steps))
        else:
            row["step_s"] = sim.total_time_s
        if name == "project dynamic":
            bound = sim.total_bound_s
        busy = sim.rank_times.groupby("step")["busy_s"]
        row["busy_max_over_mean"] = float((busy.max() / busy.mean()).mean())
        row.update(_figures(sched, lengths))
        row["unaligned"] = (sum(mh.unaligned_groups(p, pool) for p in plans)
                            if name.startswith("megatron") else None)
        row["megatron_groups"] = (sum(len(p.group_rounds) for p in plans)
                                  if name.startswith("megatron") else None)
        rows.append(row)
    base = rows[PLANNERS.index("project dynamic")]["step_s"]
    for row in rows:
        row["vs_dynamic"] = row["step_s"] / base
        row["vs_bound"] = row["step_s"] / bound
    assert rows[4]["step_s"] >= rows[5]["step_s"] - 1e-9, "a barrier cannot make a step shorter"
    return rows


def megatron_rows(data: dict, overlaps: list[float], layouts, fixed: dict) -> list[dict]:
    """Rows of every (overlap, trace, layout) batch of :mod:`benchmarks.dynamic_cp`."""
    mh.megatron_groups([1, 1], 2, 1)  # megatron's import and first call: not in plan_s

    out = []
    for overlap in overlaps:
        hw = replace(HARDWARE["H100"], cp_overlap=overlap)
        for tname, (roll, gbs) in data.items():
            for dp, cp in layouts:
                for row in one_batch(roll, gbs, dp, cp, fixed, hw):
                    out.append({"trace": tname, "model": MODEL, "dp": dp, "cp": cp,
                                "cp_overlap": overlap, "global_batch_size": gbs, **row})
    return out


def print_megatron_table(rows: list[dict]) -> None:
    print(f"\nmegatron-core {version('megatron-core')} BalancedCPScheduler (installed package; "
          "a stand-in answering dp_cp_group.size() for its process group) against the project's "
          f"dynamic CP and fixed CP, on the same steps: {MODEL} (DeepSeek-V3 left out: megatron's "
          f"hybrid CP refuses multi-latent attention), H100, cap {CAP} tokens/GPU, "
          "simulated seconds (all steps) under the same cost model; x dyn = seconds / project "
          "dynamic's")
    head = (f"{'trace':<13}{'dp x cp':>8}{'ovl':>5}  {'planner':<22}{'sim s':>8}{'x dyn':>7}"
            f"{'x bound':>8}{'busy max/mean':>14}{'plan s':>8}{'mbs':>6}{'max tok/rank':>13}"
            f"{'over cap':>9}{'unaligned':>10}  samples per CP degree")
    print(head)
    print("-" * (len(head) + 24))
    for r in rows:
        plan = "-" if r["plan_s"] is None else f"{r['plan_s']:.3f}"
        unal = "-" if r["unaligned"] is None else str(r["unaligned"])
        deg = " ".join(f"{c}:{n}" for c, n in r["degrees"].items())
        print(f"{r['trace']:<13}{str(r['dp']) + 'x' + str(r['cp']):>8}{r['cp_overlap']:>5g}  "
              f"{r['planner']:<22}{r['step_s']:>8.2f}{r['vs_dynamic']:>7.3f}{r['vs_bound']:>8.3f}"
              f"{r['busy_max_over_mean']:>14.3f}{plan:>8}"
              f"{r['micro_batches']:>6}{r['max_tokens_per_rank']:>13.0f}{r['over_cap']:>9}"
              f"{unal:>10}  {deg}")
    print("x bound: seconds / the project's bound (max(step compute / (dp*cp), largest sample / "
          "cp) per step); busy max/mean: busiest rank's compute / the mean rank's, mean over steps "
          "(fixed CP: per DP replica); plan s: planning seconds (megatron's: its scheduler and the "
          "conversion). megatron balances by its own estimate L**2 / c (attention only; 'not meant "
          "to be an accurate flops calculator'; the cost model also counts the linear layers), "
          "one sample per forward/backward, and raises a sample's CP size only to fill idle "
          "ranks.")
    print("megatron (barriers): as megatron's forward-backward runs the plan (a barrier over the "
          "pool after each of its groups); megatron (no barrier): the same plan on the project's "
          "group timeline. over cap: micro-batches with more than cap tokens per rank; "
          "unaligned: megatron CP groups with no megatron process group.")
    print(f"megatron's limitations: {mh.LIMITATIONS}")
