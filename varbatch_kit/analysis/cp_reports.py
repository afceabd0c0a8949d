"""Reports under no CP, fixed CP and dynamic CP of the same step: the invariance check.

A step of a schedule becomes a *plan* (per world rank, per round: samples, CP
degree, CP rank; :meth:`varbatch_kit.core.step.Step.rank_program`) and
:func:`varbatch_kit.report.report_under_plan` computes, in one process, the
report every rank's micro-batch value vectors give. Under dynamic CP each
sample is cut by the zigzag rule of its own degree; the sound report modes
must give the value without CP to float64 rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from varbatch_kit.analysis.warn_once import warn_once
from varbatch_kit.core.build import build_schedule
from varbatch_kit.core.config import ScheduleConfig
from varbatch_kit.core.flops import ModelShape
from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.core.step import Step
from varbatch_kit.report import report_under_layout, report_under_plan

__all__ = ["CP_CHECK_MODES", "cp_report_check", "step_programs"]

#: slime's two modes and verl's four (every sound mode)
CP_CHECK_MODES = ("per_rollout_mean", "per_token", "token-mean", "seq-mean-token-mean",
                  "seq-mean-token-sum", "seq-mean-token-sum-norm")


def step_programs(step: Step) -> list[list[tuple[list[int], int, int]]]:
    """``programs[w][round] = (step-local samples, cp_size, cp_rank)`` for every world rank."""
    local = {int(g): i for i, g in enumerate(step.sample_indices)}
    return [[([local[int(g)] for g in w.samples], int(w.cp_size), int(w.cp_rank))
             for w in step.rank_program(r)] for r in range(step.world_size)]


def cp_report_check(rollouts: Rollouts, config: ScheduleConfig, model: ModelShape, *,
                    step: int = 0, modes: Sequence[str] = CP_CHECK_MODES, seed: int = 0,
                    tolerance: float = 1e-12):
    """The reports of one step without CP, with fixed CP and with dynamic CP (a table).

    ``config`` gives dp, cp and the cap (its ``cp_mode`` is ignored: both
    plans are built). Per-token values are seeded random numbers (float64,
    ``N(1, 10²)``), the masks the rollouts' own. Columns: ``mode``, ``no_cp``,
    ``fixed_cp``, ``dynamic_cp``, ``max_rel_diff`` (largest difference to
    ``no_cp`` relative to the report of ``|x|``, a scale cancellation cannot
    shrink), ``equal`` (``max_rel_diff <= tolerance``), and the dynamic
    step's ``degrees`` (micro-batches per CP degree).
    """
    import pandas as pd

    plans = {}
    with warn_once("CP modes") as tally:  # each scheduler warning once, not once per plan
        for kind in ("fixed", "dynamic"):
            with tally.case():
                sched = build_schedule(rollouts, config.with_(cp_mode=kind), model)
            plans[kind] = sched.step(step)
    st = plans["fixed"]
    idx = st.sample_indices
    if not np.array_equal(idx, plans["dynamic"].sample_indices):
        raise AssertionError("fixed and dynamic plans of a step hold different samples")
    totals = [int(t) for t in rollouts.total_len[idx]]
    responses = [int(r) for r in rollouts.response_len[idx]]
    all_masks = rollouts.masks()
    masks = [torch.as_tensor(np.asarray(all_masks[g]), dtype=torch.float64) for g in idx]
    rids = [int(r) for r in rollouts.rollout_id[idx]]
    gen = torch.Generator().manual_seed(int(seed))
    values = torch.randn(sum(responses), generator=gen, dtype=torch.float64) * 10 + 1
    programs = {k: step_programs(s) for k, s in plans.items()}
    args = (totals, responses, masks, rids)
    degrees: dict[int, int] = {}
    for p in plans["dynamic"].placements:
        degrees[p.degree] = degrees.get(p.degree, 0) + 1
    rows = []
    for mode in modes:
        base = report_under_layout(mode, values, *args)
        scale = max(abs(base), abs(report_under_layout(mode, values.abs(), *args)), 1e-300)
        fixed = report_under_plan(mode, values, *args, programs=programs["fixed"],
                                  cp_size=config.cp)
        dynamic = report_under_plan(mode, values, *args, programs=programs["dynamic"],
                                    cp_size=config.cp)
        diff = max(abs(fixed - base), abs(dynamic - base)) / scale
        rows.append({"mode": mode, "no_cp": base, "fixed_cp": fixed, "dynamic_cp": dynamic,
                     "max_rel_diff": diff, "equal": diff <= tolerance,
                     "degrees": dict(sorted(degrees.items()))})
    return pd.DataFrame(rows)
