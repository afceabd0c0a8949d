"""The step-time simulator on a measured micro-batch cost model instead of FLOPs and a profile.

With a :class:`~varbatch_kit.analysis.cost_model.MicroBatchCostModel`
(``simulate(schedule, hardware=model)`` or :func:`simulate_with_cost_model`)
a micro-batch of samples of lengths ``L_i`` costs
``c0 + (c1 * sum L_i + c2 * sum L_i^2) / cp`` seconds on each of its CP ranks
(forward + backward, split by the model's ``forward_share``; no ring
communication term), divided by ``pp`` on each pipeline stage; no FLOPs
estimate is needed. The ranks run 1F1B and meet at the end of the step as in
:func:`varbatch_kit.analysis.simulate.simulate`. Fixed CP only.
"""

from __future__ import annotations

import math

import numpy as np

from varbatch_kit.analysis.cost_model import MicroBatchCostModel
from varbatch_kit.analysis.simulate_common import SimulationResult, _fixed_shape, _run_steps
from varbatch_kit.checks import positive_int
from varbatch_kit.core.schedule import Schedule
from varbatch_kit.policies.order import apply_order
from varbatch_kit.policies.packers import aligned_count
from varbatch_kit.policies.pipeline import one_f_one_b

__all__ = ["simulate_with_cost_model"]


def _cost_stage_times(seconds: np.ndarray, model: MicroBatchCostModel, pp: int):
    per_stage = seconds / pp
    return model.forward_share * per_stage, (1.0 - model.forward_share) * per_stage


def _cost_micro_batch_seconds(schedule: Schedule, step, model: MicroBatchCostModel,
                              cp: int) -> np.ndarray:
    """Seconds (forward + backward, one CP rank, all stages) of each micro-batch of ``step``."""
    lengths = schedule.rollouts.total_len.astype(np.float64)
    s1 = np.array([lengths[mb].sum() for mb in step.micro_batches])
    s2 = np.array([(lengths[mb] ** 2).sum() for mb in step.micro_batches])
    return model.c0 + (model.c1 * s1 + model.c2 * s2) / cp


def _cost_bound(schedule: Schedule, step, model: MicroBatchCostModel, pp: int) -> float:
    """A perfect schedule under the cost model: the fewest micro-batches per rank the cap
    allows, the step's token and squared-token work spread evenly (at least the longest
    sample in one micro-batch), every micro-batch of equal cost."""
    cfg = schedule.config
    dp, cp = cfg.dp, cfg.cp
    L = schedule.rollouts.total_len[step.sample_indices].astype(np.float64)
    if cfg.cap is not None:
        m = aligned_count(max(1, math.ceil(int(L.sum()) / cfg.cap)), cfg.align) // dp
    else:
        m = len(step.micro_batches) // dp
    m = max(m, 1)
    spread = (model.c1 * L.sum() + model.c2 * (L * L).sum()) / (dp * cp)
    longest = (model.c1 * L.max() + model.c2 * L.max() ** 2) / cp
    work = m * model.c0 + max(spread, longest)
    tf, tb = _cost_stage_times(np.full((1, m), work / m), model, pp)
    return float(one_f_one_b(tf, tb, pp)[2][0])


def simulate_with_cost_model(
    schedule: Schedule,
    model: MicroBatchCostModel,
    pp: int | None = None,
    *,
    step_overhead_s: float = 0.0,
    timelines: bool = True,
    order: str | None = None,
) -> SimulationResult:
    """``simulate`` with a measured micro-batch cost model in place of FLOPs and a profile.

    Every micro-batch of samples of total lengths ``L_i`` costs
    ``model.c0 + (model.c1 * sum L_i + model.c2 * sum L_i^2) / cp`` seconds
    (forward + backward; ``cp`` from the schedule's config, 1 for a model
    measured on the emulated-CP engine with ``cp = 1``), split into forward and
    backward by ``model.forward_share`` and divided by ``pp`` on every
    pipeline stage (1F1B as in ``simulate``; ``pp`` defaults to
    ``config.pp``; ``order`` as in ``simulate``, chosen on these stage
    times). The ranks meet at the end of the step; ``step_overhead_s`` adds a
    fixed cost per step (optimizer, gradient all-reduce). Same result tables
    as ``simulate`` (the timelines' ``flops`` column is NaN when the
    schedule has no FLOPs). Fixed CP only (``cp_mode="fixed"``).
    """

    if not isinstance(schedule, Schedule):
        raise ValueError(  # noqa: TRY004 - the project reports bad input as ValueError
            f"schedule must be a varbatch_kit Schedule, got {type(schedule).__name__}")
    if not isinstance(model, MicroBatchCostModel):
        raise ValueError(  # noqa: TRY004
            f"model must be a MicroBatchCostModel, got {type(model).__name__}")
    if not _fixed_shape(schedule):
        raise ValueError(f"cp_mode={schedule.config.cp_mode!r}: a MicroBatchCostModel simulates "
                         "fixed-CP plans only (every step's placements the fixed shape); use a "
                         "hardware profile for dynamic CP")
    pp = schedule.config.pp if pp is None else pp
    positive_int("pp", pp)
    if not (isinstance(step_overhead_s, (int, float)) and step_overhead_s >= 0
            and math.isfinite(step_overhead_s)):
        raise ValueError(f"step_overhead_s must be a finite number of seconds >= 0, "
                         f"got {step_overhead_s!r}")
    if order is not None:
        apply_order(order, np.zeros(0), np.zeros(0), int(pp))  # validates the name
    pp, cfg = int(pp), schedule.config

    def stage_times(step, a, grid, ordering):
        secs = _cost_micro_batch_seconds(schedule, step, model, cfg.cp)
        return _cost_stage_times(secs[grid], model, pp)

    step_times, rank_times, tl = _run_steps(
        schedule, stage_times,
        lambda step, a: _cost_bound(schedule, step, model, pp) + step_overhead_s,
        pp=pp, step_overhead_s=step_overhead_s, order=order, timelines=timelines)
    return SimulationResult(
        step_times=step_times, rank_times=rank_times, timelines=tl,
        params={"hardware": "cost_model", "c0": model.c0, "c1": model.c1, "c2": model.c2,
                "forward_share": model.forward_share, "device": model.device,
                "source": model.source, "pp": pp, "cp": cfg.cp,
                "step_overhead_s": float(step_overhead_s)},
    )
