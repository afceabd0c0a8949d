"""The step-time simulator of dynamic-CP schedules, group by group on the pool of ranks.

:func:`varbatch_kit.analysis.simulate.simulate` hands here every schedule
with a step whose placements are not the fixed-CP shape (a dynamic-CP plan,
``cp_mode="dynamic"``; ``pp = 1`` only). It is simulated on the pool of
``dp * cp`` ranks: each micro-batch keeps the ``c`` ranks of its group busy
for :meth:`CPCostModel.time <varbatch_kit.policies.dynamic_cp.CPCostModel.time>`
(:func:`varbatch_kit.policies.dynamic_cp.group_timeline`); a group starts
when all its ranks are free (its collectives need every member), so a rank
may idle waiting for its group; the step ends when the last rank does. Its
bound is ``max(step compute / (dp * cp), largest sample's compute / cp)``.
Reached through :func:`~varbatch_kit.analysis.simulate.simulate` only.
"""

from __future__ import annotations

import numpy as np

from varbatch_kit.analysis.simulate_common import SimulationResult, _cost, _mb_sq_tokens, _Params
from varbatch_kit.core.schedule import Schedule
from varbatch_kit.policies.dynamic_cp import CPCostModel, group_timeline

__all__: list[str] = []  # reached through varbatch_kit.analysis.simulate.simulate


def _dynamic_bound(schedule: Schedule, step, cost: CPCostModel, p: _Params) -> float:
    """``max(step compute / (dp*cp), largest sample's compute / cp)`` plus the step overhead."""
    L = schedule.rollouts.total_len[step.sample_indices].astype(np.float64)
    c1 = cost.compute(L, L * L, 1)
    cfg = schedule.config
    return max(float(c1.sum()) / cfg.world_size, float(c1.max()) / cfg.cp) + p.step_overhead_s


def _simulate_dynamic(schedule: Schedule, p: _Params, timelines: bool) -> SimulationResult:
    """:func:`simulate` for a dynamic-CP schedule (see the module doc)."""
    import pandas as pd

    if p.pp > 1:
        raise ValueError(
            f"simulating a dynamic-CP schedule (cp_mode='dynamic') supports pp=1 only, got "
            f"pp={p.pp}: simulate the fixed-CP schedule for pipeline studies")
    cfg = schedule.config
    pool = cfg.world_size
    cost = _cost(schedule.model, p)
    L = schedule.rollouts.total_len.astype(np.float64)
    flops = schedule.sample_flops
    step_rows, rank_frames, tl_frames = [], [], []
    clock = 0.0
    for step in schedule.steps:
        pl = step.placements
        tokens = np.array([L[mb].sum() for mb in step.micro_batches])
        sq = _mb_sq_tokens(schedule, step)
        deg = np.array([q.degree for q in pl])
        dur = cost.time(tokens, sq, deg)
        rounds = [q.round for q in pl]
        start, end, finish, busy = group_timeline(dur, rounds, [q.ranks for q in pl], pool)
        slow = int(np.argmax(finish))
        span = float(finish[slow])
        time_s = span + p.step_overhead_s
        wait = span - finish
        bound = _dynamic_bound(schedule, step, cost, p)
        step_rows.append({
            "step": step.index, "start_s": clock, "time_s": time_s, "bound_s": bound,
            "ratio": time_s / bound, "busiest_rank_s": span, "compute_s": float(busy[slow]),
            "bubble_s": span - float(busy[slow]),
            "straggler_wait_s": float(wait.mean()), "max_straggler_wait_s": float(wait.max()),
            "micro_batches_per_rank": step.num_rounds})
        rank_frames.append(pd.DataFrame({"step": step.index, "rank": np.arange(pool),
                                         "busy_s": busy, "end_s": finish, "wait_s": wait}))
        if timelines:
            rows = [(w, pl[b].round, b) for w, bins in enumerate(step.rank_bins) for b in bins]
            w_, r_, b_ = (np.array(x, dtype=np.int64) for x in zip(*rows)) if rows else (
                np.zeros(0, dtype=np.int64),) * 3
            mb_flops = np.array([flops[mb].sum() for mb in step.micro_batches])
            sizes = np.array([mb.size for mb in step.micro_batches])
            tl_frames.append(pd.DataFrame({
                "step": step.index, "rank": w_, "micro_batch": r_, "start_s": start[b_],
                "end_s": end[b_], "compute_s": dur[b_], "flops": mb_flops[b_],
                "tokens": tokens[b_].astype(np.int64), "samples": sizes[b_], "bin": b_,
                "cp_size": deg[b_]}))
        clock += time_s
    tl_cols = ["step", "rank", "micro_batch", "start_s", "end_s", "compute_s", "flops", "tokens",
               "samples", "bin", "cp_size"]
    prof = p.profile
    return SimulationResult(
        step_times=pd.DataFrame(step_rows),
        rank_times=pd.concat(rank_frames, ignore_index=True),
        timelines=(pd.concat(tl_frames, ignore_index=True) if tl_frames
                   else pd.DataFrame(columns=tl_cols)),
        params={"hardware": prof.name, "peak_flops": prof.peak_flops,
                "efficiency": p.efficiency, "microbatch_overhead_s": p.microbatch_overhead_s,
                "pp": p.pp, "tp": p.tp, "cp": cfg.cp, "step_overhead_s": p.step_overhead_s,
                "backward_factor": p.backward_factor, "cp_mode": "dynamic",
                "cp_bandwidth_Bps": prof.cp_bandwidth_Bps, "cp_latency_s": prof.cp_latency_s,
                "cp_overlap": prof.cp_overlap},
    )
