"""What the step-time simulators share: their settings, their result, the step loop.

:class:`SimulationSettings` are the step-time model's settings (hardware,
efficiency, overheads, pipeline and tensor parallel sizes), the one list that
:func:`varbatch_kit.analysis.simulate.simulate`,
:func:`~varbatch_kit.analysis.simulate.simulated_step_time_bound` and
:func:`~varbatch_kit.analysis.simulate.compare_cp_modes` take.
:class:`SimulationResult` is what ``simulate`` (fixed and dynamic CP) and
:func:`varbatch_kit.analysis.simulate_cost_model.simulate_with_cost_model`
return. The private helpers here are the pieces those simulators have in
common: the settings resolved for one schedule (``_Params``) and the
:class:`~varbatch_kit.policies.dynamic_cp.CPCostModel` they give, the test for
the fixed-CP step shape, and the fixed-shape step loop (``_run_steps``: 1F1B on
every DP rank, the ranks meet at the end of the step).
"""

from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass, field

import numpy as np

from varbatch_kit.analysis.cost_model import MicroBatchCostModel
from varbatch_kit.analysis.quality import micro_batch_arrays
from varbatch_kit.checks import positive_int
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
from varbatch_kit.core.schedule import Schedule
from varbatch_kit.policies.dynamic_cp import CPCostModel
from varbatch_kit.policies.order import apply_order
from varbatch_kit.policies.pipeline import one_f_one_b

__all__ = ["SimulationResult", "SimulationSettings"]


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


@dataclass(frozen=True)
class SimulationSettings:
    """The step-time model's settings: what ``simulate``, ``simulated_step_time_bound`` and
    ``compare_cp_modes`` (:mod:`varbatch_kit.analysis.simulate`) take.

    Each of them takes these as its own arguments, ``simulate(schedule, "H200", 0.5,
    tp=4)``, or as one object, ``simulate(schedule, settings=SimulationSettings("H200", 0.5,
    tp=4))``. Checked when made (ValueError).

    Attributes
    ----------
    hardware:
        A key of :data:`varbatch_kit.core.hardware.HARDWARE` (``"H100"``,
        ``"H200"``, ``"A100"``), a :class:`~varbatch_kit.core.hardware.HardwareProfile`,
        or a measured
        :class:`~varbatch_kit.analysis.cost_model.MicroBatchCostModel`
        (then ``efficiency``, ``microbatch_overhead_s``, ``tp`` and
        ``backward_factor`` do not apply:
        :func:`~varbatch_kit.analysis.simulate_cost_model.simulate_with_cost_model`).
    efficiency:
        Share of the peak reached by the training kernels (model FLOPs
        utilisation), in ``(0, 1]``.
    microbatch_overhead_s:
        Fixed seconds per micro-batch and pipeline stage.
    pp, tp:
        Pipeline and tensor parallel sizes of one DP replica (``cp`` comes
        from the schedule's config; ``pp`` None: the config's ``pp``).
    step_overhead_s:
        Fixed seconds per step (optimizer, gradient all-reduce).
    backward_factor:
        Backward FLOPs / forward FLOPs (2 for full backward).
    """

    hardware: str | HardwareProfile | MicroBatchCostModel = DEFAULT_HARDWARE
    efficiency: float = DEFAULT_EFFICIENCY
    microbatch_overhead_s: float = DEFAULT_MICROBATCH_OVERHEAD_S
    pp: int | None = None
    _: KW_ONLY
    tp: int = 1
    step_overhead_s: float = 0.0
    backward_factor: float = DEFAULT_BACKWARD_FACTOR

    def __post_init__(self):
        if not self.measured:
            hardware_profile(self.hardware)  # a known name or a profile
        if not (isinstance(self.efficiency, (int, float)) and 0 < self.efficiency <= 1):
            raise ValueError(
                f"efficiency must be in (0, 1] (share of peak reached), got {self.efficiency!r}")
        for name in ("microbatch_overhead_s", "step_overhead_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {v!r}")
        if self.pp is not None:
            positive_int("pp", self.pp)
        positive_int("tp", self.tp)
        if not (isinstance(self.backward_factor, (int, float)) and self.backward_factor >= 0):
            raise ValueError(f"backward_factor must be >= 0, got {self.backward_factor!r}")

    @property
    def measured(self) -> bool:
        """Whether ``hardware`` is a measured cost model (not a FLOPs profile)."""
        return isinstance(self.hardware, MicroBatchCostModel)


def _resolve(settings: SimulationSettings, default_pp: int) -> _Params:
    """The FLOPs model's parameters of ``settings``, ``pp`` defaulting to ``default_pp`` (the
    schedule's config's)."""
    if settings.measured:
        raise ValueError("this needs the FLOPs model: give a hardware profile or its name, not "
                         "a MicroBatchCostModel")
    pp = default_pp if settings.pp is None else settings.pp
    return _Params(hardware_profile(settings.hardware), float(settings.efficiency),
                   float(settings.microbatch_overhead_s), positive_int("pp", pp),
                   int(settings.tp), float(settings.step_overhead_s),
                   float(settings.backward_factor))


def _cost(model: ModelShape, p: _Params) -> CPCostModel:
    return cp_cost_model(model, p.profile, p.efficiency, p.microbatch_overhead_s, tp=p.tp,
                         backward_factor=p.backward_factor)


def _mb_sq_tokens(schedule: Schedule, step) -> np.ndarray:
    """``sum(L**2)`` of every micro-batch of a step, in bin order."""
    L = schedule.rollouts.total_len.astype(np.float64)
    return np.array([float((L[mb] ** 2).sum()) for mb in step.micro_batches])


def _fixed_shape(schedule: Schedule) -> bool:
    """Whether every step is the fixed-CP shape (DP ranks: the 1F1B model); any other plan
    (dynamic CP) is simulated on the pool of ``dp * cp`` ranks, group by group."""
    return all(st.is_fixed_shape for st in schedule.steps)


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
    """The step loop of ``simulate`` and ``simulate_with_cost_model`` (fixed-CP shape).

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
