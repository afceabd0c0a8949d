"""The figures a schedule is ranked by when choosing between settings: time, safety, quality.

:func:`candidate_figures` puts one schedule's simulated time
(:func:`varbatch_kit.analysis.simulate.simulate`), its token-cap safety and
its distance from the bound into one flat dict, the row of a candidate in
:func:`varbatch_kit.compat.slime.recommend`'s table (that function searches
slime's flags; this module knows nothing of slime). :data:`CANDIDATE_COLUMNS`
says what each figure means.

Pure: a schedule in, numbers out.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from varbatch_kit.analysis.quality import micro_batch_arrays, step_quality
from varbatch_kit.analysis.simulate import simulate
from varbatch_kit.checks import positive_int
from varbatch_kit.core.hardware import DEFAULT_HARDWARE, hardware_profile
from varbatch_kit.core.memory import MemoryLayout, predict_memory
from varbatch_kit.core.schedule import Schedule

__all__ = ["CANDIDATE_COLUMNS", "candidate_figures", "device_bytes"]

#: the figures of :func:`candidate_figures`: name -> what it means (unit)
CANDIDATE_COLUMNS = {
    "steps": "training steps the rollout batch is cut into (count)",
    "time_s": "simulated seconds to train the whole rollout batch: sum over its steps",
    "step_s": "simulated seconds per step, mean over the steps",
    "bound_s": "simulated seconds of a perfect schedule of the same steps (bound for any "
               "packing under this cap)",
    "above_bound": "time_s / bound_s (ratio; 1 = nothing left to gain at these settings; "
                   "below 1 when samples longer than the cap make fewer micro-batches than "
                   "ceil(tokens / cap))",
    "makespan_ratio": "busiest rank's FLOPs / max(step FLOPs / dp, largest sample), mean over "
                      "steps (ratio; 1 = optimal)",
    "mb_per_rank": "micro-batches per rank, mean over steps (count)",
    "peak_mb_tokens": "tokens of the largest micro-batch (under context parallelism split "
                      "over the cp GPUs)",
    "peak_gpu_tokens": "tokens one GPU holds of the largest micro-batch: peak_mb_tokens / cp, "
                       "rounded up (memory: compare with the limit)",
    "oversize": "samples longer than the token cap, each alone in its micro-batch (count)",
    "over_limit": "micro-batches of two or more samples whose tokens per GPU (tokens / cp) "
                  "exceed the token limit (count)",
    "peak_gpu_bytes": "the busiest GPU's predicted peak memory over every step "
                      "(varbatch_kit.core.memory; bytes; NaN without a memory layout)",
    "over_memory": "(step, GPU) pairs whose predicted peak exceeds the memory budget (count; "
                   "0 = safe; NaN without a memory layout)",
}


def device_bytes(hardware: Any) -> float | None:
    """The memory of ``hardware`` (a profile or its name) in bytes; None for a measured cost
    model, which has none."""
    try:
        return hardware_profile(hardware).memory_gib * 2**30
    except ValueError:
        return None


def candidate_figures(schedule: Schedule, *, memory_limit: int | None = None,
                      hardware: Any = DEFAULT_HARDWARE, tp: int = 1,
                      memory: MemoryLayout | None = None, memory_budget: float | None = None,
                      **simulate_kwargs: Any) -> dict[str, float]:
    """The figures of :data:`CANDIDATE_COLUMNS` for one schedule (built with a model shape).

    ``memory_limit`` is the most tokens one GPU may hold of a micro-batch of two or more
    samples (default: the schedule's ``max_tokens_per_gpu``; without a cap, no limit). A
    micro-batch is split over the ``cp`` GPUs of its context-parallel group (slime's cap is
    ``max_tokens_per_gpu * cp`` per micro-batch), so it is judged by ``tokens / cp``;
    ``hardware``, ``tp`` and ``simulate_kwargs`` go to
    :func:`~varbatch_kit.analysis.simulate.simulate` (``pp`` is the config's).
    ``memory`` (a :class:`~varbatch_kit.core.memory.MemoryLayout` of the schedule's dp and
    cp): each GPU's peak bytes predicted by :func:`~varbatch_kit.core.memory.predict_memory`,
    judged against ``memory_budget`` bytes (default: ``hardware``'s memory; a measured cost
    model has none: ``over_memory`` NaN).
    """
    if memory_limit is not None:
        memory_limit = positive_int("memory_limit", memory_limit)
    cp = schedule.config.cp
    limit = schedule.config.max_tokens_per_gpu if memory_limit is None else memory_limit
    sim = simulate(schedule, hardware, tp=tp, timelines=False, **simulate_kwargs)
    q = step_quality(schedule)
    over_limit = 0
    if limit is not None:
        for step in schedule.steps:
            a = micro_batch_arrays(schedule, step)
            over_limit += int(((a["tokens"] > limit * cp) & (a["samples"] > 1)).sum())
    cap = schedule.config.cap
    if cap is not None:
        trained = np.concatenate([s.sample_indices for s in schedule.steps])
        oversize = int((schedule.rollouts.total_len[trained] > cap).sum())
    else:
        oversize = 0
    time_s, bound_s = float(sim.total_time_s), float(sim.total_bound_s)
    peak_bytes = over_memory = float("nan")
    if memory is not None:
        if schedule.model is None:
            raise ValueError("memory= needs a schedule built with a model shape")
        budget = float(memory_budget) if memory_budget is not None else device_bytes(hardware)
        table = predict_memory(schedule, schedule.model, memory)
        peak_bytes = int(table["peak_bytes"].max())
        if budget is not None:
            over_memory = int((table["peak_bytes"] > budget).sum())
    return {
        "steps": int(schedule.num_steps),
        "time_s": time_s,
        "step_s": time_s / schedule.num_steps,
        "bound_s": bound_s,
        "above_bound": time_s / bound_s,
        "makespan_ratio": float(q["makespan_ratio"].mean()),
        "mb_per_rank": float(q["micro_batches_per_rank"].mean()),
        "peak_mb_tokens": int(q["max_mb_tokens"].max()),
        "peak_gpu_tokens": -(-int(q["max_mb_tokens"].max()) // cp),
        "oversize": oversize,
        "over_limit": over_limit,
        "peak_gpu_bytes": peak_bytes,
        "over_memory": over_memory,
    }
