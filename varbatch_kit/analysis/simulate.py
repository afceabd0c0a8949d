"""A step-time model: predicted seconds per training step for a schedule.

The model is deliberately simple and explicit, so that policies can be
compared in seconds rather than FLOPs ratios:

- a micro-batch of forward FLOPs ``F`` costs ``F / (tp * cp * pp)`` per GPU
  on each pipeline stage for the forward pass and ``backward_factor`` times
  that for the backward pass, at ``peak_flops * efficiency`` FLOP/s;
- every micro-batch adds a fixed ``microbatch_overhead_s`` on every stage
  (kernel launches, packing, host work), half to its forward and half to
  its backward pass: many small micro-batches are not free;
- with ``pp > 1`` stages a DP rank runs the non-interleaved 1F1B schedule
  (each stage: warm-up forwards, then one-forward-one-backward, then
  cool-down backwards), simulated operation by operation
  (:func:`varbatch_kit.policies.pipeline.one_f_one_b`), so the pipeline
  bubble grows with unequal micro-batches and with few micro-batches;
- all DP ranks synchronise at the end of the step (gradient all-reduce):
  the step takes as long as the slowest rank; the others wait
  (*straggler wait*); ``step_overhead_s`` adds a fixed cost per step.

With ``cp > 1`` every micro-batch also pays the part of its context-parallel
ring communication that the attention does not hide, plus a latency per
ring step (:class:`~varbatch_kit.policies.dynamic_cp.CPCostModel`, with the
profile's ``cp_bandwidth_Bps``, ``cp_latency_s`` and ``cp_overlap``): a third
of it on the forward pass, two thirds on the backward pass, split over the
pipeline stages. With ``cp = 1`` nothing changes. A schedule with a step whose
placements are not the fixed-CP shape (a dynamic-CP plan, ``cp_mode="dynamic"``;
``pp = 1`` only) is simulated group by group on the pool of ``dp * cp`` ranks
(:mod:`varbatch_kit.analysis.simulate_dynamic_cp`); :func:`compare_cp_modes`
times both CP modes of one layout.

The *bound* of a step is the same model applied to a perfect schedule: every
rank gets ``max(step FLOPs / dp, largest sample's FLOPs)`` in the fewest
micro-batches the token cap allows (``ceil(tokens / cap)`` rounded up to
the alignment; the schedule's own count on the static path), all of equal
size. With ``pp = 1`` no schedule can beat it.

A measured :class:`~varbatch_kit.analysis.cost_model.MicroBatchCostModel`
can stand in for the hardware profile (``simulate(schedule, hardware=model)``:
:func:`varbatch_kit.analysis.simulate_cost_model.simulate_with_cost_model`).
The result of every path is a
:class:`~varbatch_kit.analysis.simulate_common.SimulationResult`. The model's settings
(hardware, efficiency, overheads, ``pp``, ``tp``, ``backward_factor``) are one
:class:`~varbatch_kit.analysis.simulate_common.SimulationSettings`: :func:`simulate`,
:func:`simulated_step_time_bound` and :func:`compare_cp_modes` take its fields as their own
arguments, or the object as ``settings=``.
"""

from __future__ import annotations

import inspect
import math

import numpy as np

from varbatch_kit.analysis.quality import micro_batch_arrays
from varbatch_kit.analysis.simulate_common import (
    SimulationResult,
    SimulationSettings,
    _cost,
    _fixed_shape,
    _mb_sq_tokens,
    _Params,
    _resolve,
    _run_steps,
)
from varbatch_kit.analysis.simulate_cost_model import (
    simulate_with_cost_model as _simulate_with_cost_model,  # its one import path is its module
)
from varbatch_kit.analysis.simulate_dynamic_cp import _dynamic_bound, _simulate_dynamic
from varbatch_kit.analysis.warn_once import warn_once
from varbatch_kit.core.build import build_schedule
from varbatch_kit.core.config import ScheduleConfig
from varbatch_kit.core.flops import ModelShape
from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.core.schedule import Schedule
from varbatch_kit.policies.order import apply_order
from varbatch_kit.policies.packers import aligned_count
from varbatch_kit.policies.pipeline import one_f_one_b

__all__ = ["compare_cp_modes", "simulate", "simulated_step_time_bound"]


def _fixed_cp_comm(schedule: Schedule, step, a: dict, p: _Params, cost) -> np.ndarray:
    """Exposed ring seconds per micro-batch (bin order) of a fixed-CP step (0 at cp=1)."""
    cp = schedule.config.cp
    if cp == 1 or cost is None:
        return np.zeros(len(step.micro_batches))
    return cost.exposed_comm(a["tokens"], _mb_sq_tokens(schedule, step), cp)


def _stage_times(flops: np.ndarray, p: _Params, cp: int):
    per_gpu = flops / (p.tp * cp * p.pp * p.rate)
    half = p.microbatch_overhead_s / 2.0
    return per_gpu + half, p.backward_factor * per_gpu + half


def _bound_for_step(schedule: Schedule, step, a: dict, p: _Params) -> float:
    cfg = schedule.config
    dp = cfg.dp
    flops = schedule.sample_flops
    total = float(np.nansum(a["flops"]))
    work = max(total / dp, float(flops[step.sample_indices].max()))
    if cfg.cap is not None:
        tokens = int(a["tokens"].sum())
        m = aligned_count(max(1, math.ceil(tokens / cfg.cap)), cfg.align) // dp
    else:
        m = len(step.micro_batches) // dp
    tf, tb = _stage_times(np.full((1, m), work / m), p, cfg.cp)
    return float(one_f_one_b(tf, tb, p.pp)[2][0]) + p.step_overhead_s


def _check_schedule(schedule: Schedule) -> None:
    if not isinstance(schedule, Schedule):
        raise ValueError(  # noqa: TRY004 - the project reports bad input as ValueError
            f"schedule must be a varbatch_kit Schedule, got {type(schedule).__name__}")
    if schedule.sample_flops is None:
        raise ValueError("the step-time model needs FLOPs: build the schedule with a model shape, "
                         "e.g. build_schedule(rollouts, config, ModelShape.preset('qwen3-8b'))")


def _settings(args: tuple, kwargs: dict, settings: SimulationSettings | None
              ) -> SimulationSettings:
    """The model's settings of a call: given as arguments, or as ``settings=``."""
    if settings is None:
        return SimulationSettings(*args, **kwargs)
    if not isinstance(settings, SimulationSettings):
        raise ValueError(f"settings must be a SimulationSettings, got {type(settings).__name__}")
    if args or kwargs:
        given = [repr(a) for a in args] + sorted(kwargs)
        raise ValueError(f"settings=... and the settings' own arguments ({', '.join(given)}) "
                         "given together; pass one or the other")
    return settings


def _takes_settings(fn):
    """Show :class:`SimulationSettings`' parameters where ``fn`` takes ``*args, **kwargs``.

    ``fn``'s own positional parameters, then the settings' (positional or keyword as in
    the dataclass), then ``fn``'s keyword-only ones: the signature ``help()`` and tab
    completion show, and what a call binds to (``_settings``).
    """
    sig = inspect.signature(fn)
    own = [q for q in sig.parameters.values()
           if q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD)]
    shared = list(inspect.signature(SimulationSettings).parameters.values())
    fn.__signature__ = sig.replace(parameters=[
        *(q for q in own if q.kind is not q.KEYWORD_ONLY), *shared,
        *(q for q in own if q.kind is q.KEYWORD_ONLY)])
    return fn


@_takes_settings
def simulated_step_time_bound(schedule: Schedule, *args,
                              settings: SimulationSettings | None = None,
                              **kwargs) -> np.ndarray:
    """Per step, the simulated time of a perfect schedule of the same step (see module doc).

    The model's settings as :func:`simulate` takes them (:class:`SimulationSettings`); the
    result is ``simulate``'s ``step_times["bound_s"]``.
    """
    settings = _settings(args, kwargs, settings)
    if settings.measured:
        return simulate(schedule, settings=settings, timelines=False).step_times[
            "bound_s"].to_numpy()
    _check_schedule(schedule)
    p = _resolve(settings, schedule.config.pp)
    if not _fixed_shape(schedule):
        return np.array([_dynamic_bound(schedule, st, _cost(schedule.model, p), p)
                         for st in schedule.steps])
    return np.array([_bound_for_step(schedule, st, micro_batch_arrays(schedule, st), p)
                     for st in schedule.steps])


@_takes_settings
def simulate(
    schedule: Schedule,
    *args,
    settings: SimulationSettings | None = None,
    timelines: bool = True,
    order: str | None = None,
    **kwargs,
) -> SimulationResult:
    """Predict the time of every step of ``schedule``.

    Parameters
    ----------
    schedule:
        Built with a model shape (its FLOPs drive the model).
    hardware, efficiency, microbatch_overhead_s, pp, tp, step_overhead_s, backward_factor:
        The model's settings, :class:`~varbatch_kit.analysis.simulate_common.SimulationSettings`
        (``hardware`` may be a measured
        :class:`~varbatch_kit.analysis.cost_model.MicroBatchCostModel`); or all of them as
        one object, ``settings=``.
    timelines:
        Build the per-micro-batch table (skip it for very large schedules
        when only step times are needed).
    order:
        None (default): each rank trains its micro-batches in the schedule's
        order. A name of :data:`varbatch_kit.policies.order.ORDERS`
        (``"arrival"``, ``"small_ends"``, ``"min_bubble"``): simulate each
        rank's micro-batches of a step in that order instead, chosen on this
        model's own stage times (overhead and ``backward_factor`` included)
        and ``pp``; the timelines then list them in that order. What-if
        only: the schedule is not changed (``ScheduleConfig.microbatch_order``
        changes it).
    """
    settings = _settings(args, kwargs, settings)
    if settings.measured:  # measured seconds instead of FLOPs
        return _simulate_with_cost_model(schedule, settings.hardware, pp=settings.pp,
                                         step_overhead_s=settings.step_overhead_s,
                                         timelines=timelines, order=order)
    _check_schedule(schedule)
    p = _resolve(settings, schedule.config.pp)
    if order is not None:
        apply_order(order, np.zeros(0), np.zeros(0), p.pp)  # validates the name
    cfg = schedule.config
    if not _fixed_shape(schedule):
        return _simulate_dynamic(schedule, p, timelines)
    cost = _cost(schedule.model, p) if cfg.cp > 1 and schedule.model is not None else None

    def stage_times(step, a, grid, ordering):
        tf, tb = _stage_times(a["flops"][grid], p, cfg.cp)
        if cost is not None and not ordering:  # the ring's exposed seconds: 1/3 fwd, 2/3 bwd
            comm = _fixed_cp_comm(schedule, step, a, p, cost)[grid] / p.pp
            tf, tb = tf + comm / 3.0, tb + 2.0 * comm / 3.0
        return tf, tb

    step_times, rank_times, tl = _run_steps(
        schedule, stage_times, lambda step, a: _bound_for_step(schedule, step, a, p),
        pp=p.pp, step_overhead_s=p.step_overhead_s, order=order, timelines=timelines)
    return SimulationResult(
        step_times=step_times, rank_times=rank_times, timelines=tl,
        params={"hardware": p.profile.name, "peak_flops": p.profile.peak_flops,
                    "efficiency": p.efficiency, "microbatch_overhead_s": p.microbatch_overhead_s,
                    "pp": p.pp, "tp": p.tp, "cp": cfg.cp, "step_overhead_s": p.step_overhead_s,
                    "backward_factor": p.backward_factor},
    )


@_takes_settings
def compare_cp_modes(rollouts: Rollouts, config: ScheduleConfig, model: ModelShape, *args,
                     settings: SimulationSettings | None = None, **kwargs):
    """Fixed vs dynamic CP for one layout: a pandas table indexed ``fixed``, ``dynamic``.

    Both schedules use ``config`` (its ``cp_mode`` replaced) and are timed with the model's
    settings as :func:`simulate` takes them (:class:`SimulationSettings`, a hardware profile:
    the dynamic plan needs the FLOPs model); the dynamic one is planned with the cost model
    of these settings (:func:`varbatch_kit.core.hardware.cp_cost_model`). Columns:
    ``time_s``, ``bound_s``, ``ratio`` (time / bound), ``micro_batches`` (all steps),
    ``rounds`` (per step, mean), ``share_c1`` (share of samples trained without CP),
    ``speedup`` (fixed time / this time).
    """
    import pandas as pd

    if not isinstance(config, ScheduleConfig):
        raise ValueError(f"config must be a ScheduleConfig, got {type(config).__name__}")
    settings = _settings(args, kwargs, settings)
    cost = _cost(model, _resolve(settings, config.pp))
    rows = {}
    with warn_once("CP modes") as tally:  # each scheduler warning once, not once per mode
        scheds = {}
        for mode in ("fixed", "dynamic"):
            with tally.case():
                scheds[mode] = build_schedule(rollouts, config.with_(cp_mode=mode), model,
                                              cp_cost=cost if mode == "dynamic" else None)
    for mode, sched in scheds.items():
        sim = simulate(sched, settings=settings, timelines=False)
        sizes = np.concatenate([s.sample_cp_sizes() for s in sched.steps])
        rows[mode] = {"time_s": sim.total_time_s, "bound_s": sim.total_bound_s,
                      "ratio": sim.total_time_s / sim.total_bound_s,
                      "micro_batches": int(sum(len(s.micro_batches) for s in sched.steps)),
                      "rounds": float(np.mean([s.num_rounds for s in sched.steps])),
                      "share_c1": float((sizes == 1).mean())}
    out = pd.DataFrame.from_dict(rows, orient="index")
    out["speedup"] = out.loc["fixed", "time_s"] / out["time_s"]
    return out
