"""A training run's memory, predicted and measured: :mod:`varbatch_kit.core.memory` on the
run's own schedule, next to the peaks its ranks recorded.

- :func:`memory_layout`: the :class:`~varbatch_kit.core.memory.MemoryLayout` of a
  :class:`~varbatch_kit.train.config.train_config.TrainConfig` (its parallel layout,
  precision, distributed optimizer, interleaving group).
- :func:`predicted_memory`: per step and world rank, the bytes the run will hold, before
  any worker starts (the launcher's own plan: :func:`~varbatch_kit.train.runs.plan.plan_runs`).
- :func:`memory_table`: a finished run's prediction beside each rank's measured peak
  (``peak_memory_bytes`` in its step log: CUDA's allocator peak, or on CPU the live tensor
  bytes of ``RunConfig(track_memory=True)``) and their ratio.
"""

from __future__ import annotations

from dataclasses import replace

import pandas as pd

from varbatch_kit.core.memory import MemoryLayout, predict_memory
from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.train.config.train_config import TrainConfig

__all__ = ["memory_layout", "memory_table", "predicted_memory"]


def memory_layout(cfg: TrainConfig, device: str = "cpu") -> MemoryLayout:
    """The memory model's layout of ``cfg`` trained on ``device`` (``cpu`` or ``cuda``: the
    CPU runs in fp32 / fp64 add the word embedding's gradient row by row,
    train/model/embedding_grad.py)."""
    layout = cfg.layout
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: give 'cpu' or 'cuda'")
    return MemoryLayout(dp=layout.dp, cp=layout.cp, tp=layout.tp, pp=layout.pp,
                        vpp=layout.vpp, sequence_parallel=layout.sp, cp_impl=layout.cp_impl,
                        precision=cfg.precision, distributed_optimizer=cfg.optim.distributed,
                        mb_group=cfg.schedule.mb_group if layout.vpp > 1 else None,
                        embedding_grad_rows=device == "cpu" and cfg.precision != "bf16",
                        ep=layout.ep)


def predicted_memory(cfg: TrainConfig, rollouts: Rollouts, *, device: str = "cpu",
                     hardware_memory_gib: float | None = None) -> pd.DataFrame:
    """:func:`~varbatch_kit.core.memory.predict_memory` of the steps ``cfg`` trains on
    ``rollouts`` on ``device`` (``step`` 1-based, as the step log), for the model it
    resolves to (the toy GPT's learned position table sized as the engine sizes it)."""
    from varbatch_kit.train.runs.plan import plan_runs

    plan = plan_runs([cfg], rollouts)[0]
    shape = plan.model.shape
    if shape.position_embedding == "learned" and shape.learned_positions == 0:
        shape = replace(shape, learned_positions=int(rollouts.total_len.max()))
    table = predict_memory(plan.schedule, shape, memory_layout(cfg, device),
                           hardware_memory_gib=hardware_memory_gib,
                           steps=range(plan.num_steps))
    return table.assign(step=table["step"] + 1)


def memory_table(run, rollouts: Rollouts) -> pd.DataFrame:
    """``run`` (trained on ``rollouts``): its predicted peak per step and world rank beside
    the measured one: columns
    ``step``, ``rank``, ``predicted_bytes``, ``measured_bytes``, ``ratio`` (predicted /
    measured) and the prediction's kinds. ValueError when the run recorded no peaks (a CPU
    run without ``RunConfig(track_memory=True)``)."""
    steps = run.steps
    if "peak_memory_bytes" not in steps.columns:
        raise ValueError(f"run {run.config.name!r} recorded no memory peaks: train on CUDA, or "
                         "on CPU with RunConfig(track_memory=True) (TrainConfig.with_("
                         "track_memory=True))")
    measured = pd.DataFrame([{"step": int(s), "rank": r, "measured_bytes": int(b)}
                             for s, peaks in zip(steps["step"], steps["peak_memory_bytes"])
                             for r, b in enumerate(peaks)])
    predicted = predicted_memory(run.config, rollouts, device=run.meta.get("device", "cpu"))
    out = predicted.rename(columns={"peak_bytes": "predicted_bytes"}).merge(
        measured, on=["step", "rank"], how="inner")
    out["ratio"] = out["predicted_bytes"] / out["measured_bytes"]
    first = ["step", "rank", "predicted_bytes", "measured_bytes", "ratio"]
    return out[first + [c for c in out.columns if c not in first]]
