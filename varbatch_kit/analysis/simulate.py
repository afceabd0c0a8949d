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
``pp = 1`` only) is simulated on the pool of ``dp * cp``
ranks: each micro-batch keeps the ``c`` ranks of its group busy for
``CPCostModel.time``; a group starts when all its ranks are free (its
collectives need every member), so a rank may idle waiting for its group;
the step ends when the last rank does. Its bound is
``max(step compute / (dp * cp), largest sample's compute / cp)``.

The *bound* of a step is the same model applied to a perfect schedule: every
rank gets ``max(step FLOPs / dp, largest sample's FLOPs)`` in the fewest
micro-batches the token cap allows (``ceil(tokens / cap)`` rounded up to
the alignment; the schedule's own count on the static path), all of equal
size. With ``pp = 1`` no schedule can beat it.

A measured :class:`~varbatch_kit.analysis.cost_model.MicroBatchCostModel`
can stand in for the hardware profile (``simulate(schedule, hardware=model)``,
:func:`simulate_with_cost_model`): a micro-batch of samples of lengths ``L_i``
then costs ``c0 + (c1 * sum L_i + c2 * sum L_i^2) / cp`` seconds on each of
its CP ranks (forward + backward, split by the model's ``forward_share``; no
ring communication term), divided by ``pp`` on each pipeline stage; no FLOPs
estimate is needed. Fixed CP only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from varbatch_kit.analysis.cost_model import MicroBatchCostModel
from varbatch_kit.analysis.quality import micro_batch_arrays
from varbatch_kit.core.build import build_schedule
from varbatch_kit.core.config import ScheduleConfig
from varbatch_kit.core.flops import ModelShape
from varbatch_kit.core.hardware import (
    DEFAULT_BACKWARD_FACTOR,
    DEFAULT_EFFICIENCY,
    DEFAULT_HARDWARE,
    DEFAULT_MICROBATCH_OVERHEAD_S,
    HardwareProfile,
    cp_cost_model,
    hardware_profile,
)
from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.core.schedule import Schedule
from varbatch_kit.policies.dynamic_cp import CPCostModel, group_timeline
from varbatch_kit.policies.order import apply_order
from varbatch_kit.policies.packers import aligned_count
from varbatch_kit.policies.pipeline import one_f_one_b

__all__ = [
    "SimulationResult",
    "compare_cp_modes",
    "simulate",
    "simulate_with_cost_model",
    "simulated_step_time_bound",
]


@dataclass(frozen=True)
class _Params:
    profile: HardwareProfile
    efficiency: float
    microbatch_overhead_s: float
    pp: int
    tp: int
    step_overhead_s: float
    backward_factor: float

    @property
    def rate(self) -> float:
        """Effective FLOP/s of one GPU."""
        return self.profile.peak_flops * self.efficiency


def _params(hardware, efficiency, microbatch_overhead_s, pp, tp, step_overhead_s,
            backward_factor) -> _Params:
    prof = hardware_profile(hardware)
    if not (isinstance(efficiency, (int, float)) and 0 < efficiency <= 1):
        raise ValueError(
            f"efficiency must be in (0, 1] (share of peak reached), got {efficiency!r}")
    for name, v in (("microbatch_overhead_s", microbatch_overhead_s),
                    ("step_overhead_s", step_overhead_s)):
        if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
            raise ValueError(f"{name} must be a finite number of seconds >= 0, got {v!r}")
    for name, v in (("pp", pp), ("tp", tp)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if not (isinstance(backward_factor, (int, float)) and backward_factor >= 0):
        raise ValueError(f"backward_factor must be >= 0, got {backward_factor!r}")
    return _Params(prof, float(efficiency), float(microbatch_overhead_s), int(pp), int(tp),
                   float(step_overhead_s), float(backward_factor))


def _cost(model: ModelShape, p: _Params) -> CPCostModel:
    return cp_cost_model(model, p.profile, p.efficiency, p.microbatch_overhead_s, tp=p.tp,
                         backward_factor=p.backward_factor)


def _mb_sq_tokens(schedule: Schedule, step) -> np.ndarray:
    """``sum(L**2)`` of every micro-batch of a step, in bin order."""
    L = schedule.rollouts.total_len.astype(np.float64)
    return np.array([float((L[mb] ** 2).sum()) for mb in step.micro_batches])


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


def _fixed_shape(schedule: Schedule) -> bool:
    """Whether every step is the fixed-CP shape (DP ranks: the 1F1B model); any other plan
    (dynamic CP) is simulated on the pool of ``dp * cp`` ranks, group by group."""
    return all(st.is_fixed_shape for st in schedule.steps)


def simulated_step_time_bound(
    schedule: Schedule,
    hardware: str | HardwareProfile = DEFAULT_HARDWARE,
    efficiency: float = DEFAULT_EFFICIENCY,
    microbatch_overhead_s: float = DEFAULT_MICROBATCH_OVERHEAD_S,
    pp: int | None = None,
    *,
    tp: int = 1,
    step_overhead_s: float = 0.0,
    backward_factor: float = DEFAULT_BACKWARD_FACTOR,
) -> np.ndarray:
    """Per step, the simulated time of a perfect schedule of the same step (see module doc)."""
    _check_schedule(schedule)
    pp = schedule.config.pp if pp is None else pp
    p = _params(hardware, efficiency, microbatch_overhead_s, pp, tp, step_overhead_s,
                backward_factor)
    if not _fixed_shape(schedule):
        return np.array([_dynamic_bound(schedule, st, _cost(schedule.model, p), p)
                         for st in schedule.steps])
    return np.array([_bound_for_step(schedule, st, micro_batch_arrays(schedule, st), p)
                     for st in schedule.steps])


@dataclass(frozen=True, eq=False)
class SimulationResult:
    """Predicted times of a schedule.

    Attributes
    ----------
    step_times:
        One row per step: ``step, start_s`` (since the first step),
        ``time_s, bound_s, ratio`` (time / bound), ``busiest_rank_s`` (the
        slowest rank's span), ``compute_s`` (its busy time on one stage),
        ``bubble_s`` (its pipeline idle time: span - busy),
        ``straggler_wait_s`` (mean wait of a rank for the slowest one),
        ``max_straggler_wait_s``, ``micro_batches_per_rank``.
    rank_times:
        One row per step × rank: ``busy_s, end_s, wait_s``.
    timelines:
        One row per step × rank × micro-batch: ``start_s, end_s`` (from the
        start of the step; with ``pp > 1`` the first stage's forward start
        and backward end), ``compute_s`` (forward + backward on one stage,
        overhead included), ``flops``, ``tokens``, ``samples``.
    params:
        The model's parameters.
    """

    step_times: object
    rank_times: object
    timelines: object
    params: dict = field(default_factory=dict)

    @property
    def total_time_s(self) -> float:
        """Sum of the step times."""
        return float(self.step_times["time_s"].sum())

    @property
    def total_bound_s(self) -> float:
        """Sum of the step bounds."""
        return float(self.step_times["bound_s"].sum())

    def summary(self) -> dict:
        """Total time, total bound, their ratio and the mean straggler wait."""
        st = self.step_times
        return {"time_s": self.total_time_s, "bound_s": self.total_bound_s,
                    "ratio": self.total_time_s / self.total_bound_s,
                    "straggler_wait_s": float(st["straggler_wait_s"].mean()),
                    "bubble_s": float(st["bubble_s"].mean())}


def _run_steps(schedule: Schedule, stage_times, bound_of, *, pp: int, step_overhead_s: float,
               order, timelines: bool):
    """The step loop of :func:`simulate` and :func:`simulate_with_cost_model` (fixed CP).

    ``stage_times(step, arrays, grid, ordering)`` gives the ``(dp, m)`` per-stage forward
    and backward seconds of the micro-batches at ``grid`` (``ordering=True``: the times the
    ``order`` is chosen on); ``bound_of(step, arrays)`` the step's bound. Each rank runs 1F1B
    on ``pp`` stages; the step ends with its slowest rank, plus ``step_overhead_s``.
    Returns the step, rank and timeline tables.
    """
    import pandas as pd

    dp = schedule.config.dp
    step_rows, rank_frames, tl_frames = [], [], []
    clock = 0.0
    for step in schedule.steps:
        a = micro_batch_arrays(schedule, step)
        m = len(step.micro_batches) // dp
        grid = np.empty((dp, m), dtype=np.int64)  # bin at (rank, position)
        grid[a["rank"], a["pos"]] = np.arange(len(step.micro_batches))
        if order is not None:
            tf, tb = stage_times(step, a, grid, True)
            for r in range(dp):
                grid[r] = grid[r][apply_order(order, tf[r], tb[r], pp)]
        tf, tb = stage_times(step, a, grid, False)
        start, end, finish = one_f_one_b(tf, tb, pp)
        busy = (tf + tb).sum(axis=1)
        slow = int(np.argmax(finish))
        span = float(finish[slow])
        time_s = span + step_overhead_s
        wait = span - finish
        bound = bound_of(step, a)
        step_rows.append({
            "step": step.index, "start_s": clock, "time_s": time_s, "bound_s": bound,
            "ratio": time_s / bound, "busiest_rank_s": span, "compute_s": float(busy[slow]),
            "bubble_s": span - float(busy[slow]),
            "straggler_wait_s": float(wait.mean()), "max_straggler_wait_s": float(wait.max()),
            "micro_batches_per_rank": m})
        rank_frames.append(pd.DataFrame({"step": step.index, "rank": np.arange(dp),
                                         "busy_s": busy, "end_s": finish, "wait_s": wait}))
        if timelines:
            tl_frames.append(pd.DataFrame({
                "step": step.index,
                "rank": np.repeat(np.arange(dp), m),
                "micro_batch": np.tile(np.arange(m), dp),
                "start_s": start.ravel(), "end_s": end.ravel(), "compute_s": (tf + tb).ravel(),
                "flops": a["flops"][grid].ravel(), "tokens": a["tokens"][grid].ravel(),
                "samples": a["samples"][grid].ravel()}))
        clock += time_s
    tl_cols = ["step", "rank", "micro_batch", "start_s", "end_s", "compute_s", "flops", "tokens",
               "samples"]
    return (pd.DataFrame(step_rows), pd.concat(rank_frames, ignore_index=True),
            pd.concat(tl_frames, ignore_index=True) if tl_frames else pd.DataFrame(columns=tl_cols))


def simulate(
    schedule: Schedule,
    hardware: str | HardwareProfile = DEFAULT_HARDWARE,
    efficiency: float = DEFAULT_EFFICIENCY,
    microbatch_overhead_s: float = DEFAULT_MICROBATCH_OVERHEAD_S,
    pp: int | None = None,
    *,
    tp: int = 1,
    step_overhead_s: float = 0.0,
    backward_factor: float = DEFAULT_BACKWARD_FACTOR,
    timelines: bool = True,
    order: str | None = None,
) -> SimulationResult:
    """Predict the time of every step of ``schedule``.

    Parameters
    ----------
    schedule:
        Built with a model shape (its FLOPs drive the model).
    hardware:
        A key of :data:`varbatch_kit.core.hardware.HARDWARE` (``"H100"``,
        ``"H200"``, ``"A100"``), a :class:`~varbatch_kit.core.hardware.HardwareProfile`,
        or a measured
        :class:`~varbatch_kit.analysis.cost_model.MicroBatchCostModel`
        (then ``efficiency``, ``microbatch_overhead_s``, ``tp`` and
        ``backward_factor`` do not apply: :func:`simulate_with_cost_model`).
    efficiency:
        Share of the peak reached by the training kernels (model FLOPs
        utilisation), in ``(0, 1]``.
    microbatch_overhead_s:
        Fixed seconds per micro-batch and pipeline stage.
    pp, tp:
        Pipeline and tensor parallel sizes of one DP replica (``cp`` comes
        from the schedule's config; ``pp`` defaults to ``config.pp``).
    step_overhead_s:
        Fixed seconds per step (optimizer, gradient all-reduce).
    backward_factor:
        Backward FLOPs / forward FLOPs (2 for full backward).
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
    if isinstance(hardware, MicroBatchCostModel):  # measured seconds instead of FLOPs
        return simulate_with_cost_model(schedule, hardware, pp=pp, step_overhead_s=step_overhead_s,
                                        timelines=timelines, order=order)
    _check_schedule(schedule)
    pp = schedule.config.pp if pp is None else pp
    p = _params(hardware, efficiency, microbatch_overhead_s, pp, tp, step_overhead_s,
                backward_factor)
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


def compare_cp_modes(rollouts: Rollouts, config: ScheduleConfig, model: ModelShape,
                     hardware: str | HardwareProfile = DEFAULT_HARDWARE,
                     efficiency: float = DEFAULT_EFFICIENCY,
                     microbatch_overhead_s: float = DEFAULT_MICROBATCH_OVERHEAD_S, *, tp: int = 1,
                     backward_factor: float = DEFAULT_BACKWARD_FACTOR):
    """Fixed vs dynamic CP for one layout: a pandas table indexed ``fixed``, ``dynamic``.

    Both schedules use ``config`` (its ``cp_mode`` replaced); the dynamic one is
    planned with the cost model of these simulator settings
    (:func:`varbatch_kit.core.hardware.cp_cost_model`). Columns: ``time_s``, ``bound_s``, ``ratio``
    (time / bound), ``micro_batches`` (all steps), ``rounds`` (per step, mean),
    ``share_c1`` (share of samples trained without CP), ``speedup`` (fixed
    time / this time).
    """
    import pandas as pd

    if not isinstance(config, ScheduleConfig):
        raise ValueError(f"config must be a ScheduleConfig, got {type(config).__name__}")
    kw = dict(hardware=hardware, efficiency=efficiency, microbatch_overhead_s=microbatch_overhead_s,
              tp=tp, backward_factor=backward_factor)
    cost = cp_cost_model(model, **kw)
    rows = {}
    for mode in ("fixed", "dynamic"):
        sched = build_schedule(rollouts, config.with_(cp_mode=mode), model,
                               cp_cost=cost if mode == "dynamic" else None)
        sim = simulate(sched, timelines=False, **kw)
        sizes = np.concatenate([s.sample_cp_sizes() for s in sched.steps])
        rows[mode] = {"time_s": sim.total_time_s, "bound_s": sim.total_bound_s,
                      "ratio": sim.total_time_s / sim.total_bound_s,
                      "micro_batches": int(sum(len(s.micro_batches) for s in sched.steps)),
                      "rounds": float(np.mean([s.num_rounds for s in sched.steps])),
                      "share_c1": float((sizes == 1).mean())}
    out = pd.DataFrame.from_dict(rows, orient="index")
    out["speedup"] = out.loc["fixed", "time_s"] / out["time_s"]
    return out


# ----------------------------------------------------------------------------- measured model
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
    """:func:`simulate` with a measured micro-batch cost model in place of FLOPs and a profile.

    Every micro-batch of samples of total lengths ``L_i`` costs
    ``model.c0 + (model.c1 * sum L_i + model.c2 * sum L_i^2) / cp`` seconds
    (forward + backward; ``cp`` from the schedule's config, 1 for a model
    measured on the emulated-CP engine with ``cp = 1``), split into forward and
    backward by ``model.forward_share`` and divided by ``pp`` on every
    pipeline stage (1F1B as in :func:`simulate`; ``pp`` defaults to
    ``config.pp``; ``order`` as in :func:`simulate`, chosen on these stage
    times). The ranks meet at the end of the step; ``step_overhead_s`` adds a
    fixed cost per step (optimizer, gradient all-reduce). Same result tables
    as :func:`simulate` (the timelines' ``flops`` column is NaN when the
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
    if isinstance(pp, bool) or not isinstance(pp, (int, np.integer)) or pp < 1:
        raise ValueError(f"pp must be a positive integer, got {pp!r}")
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
