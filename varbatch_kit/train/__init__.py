"""Training engine: megatron-core GPT, variable global batch size, reports compared across layouts.

- :class:`TrainConfig`: layout (a :class:`~varbatch_kit.ScheduleConfig`),
  report mode, model size, optimiser, debug hooks.
- :func:`run`: train one configuration in ``dp * cp`` ``torchrun`` workers
  (the caller stays single-process) → :class:`Run` with one report row per step.
- :func:`compare`: several configurations on the same rollouts and seed → one table.
- :func:`run_many`: like :func:`compare`, returning the :class:`Run` objects.

Devices: CUDA + NCCL when GPUs are present, else CPU + gloo through
:mod:`varbatch_kit.train.cpu_shim`. Context parallelism is emulated at the
loss level (see :mod:`varbatch_kit.train.loop`).

Importing this package does not import megatron-core; the workers do.
"""

from varbatch_kit.train.config import TrainConfig
from varbatch_kit.train.launch import (
    Run,
    TrainingError,
    TrainingTimeout,
    compare,
    param_rel_diff,
    run,
    run_many,
)

__all__ = [
    "Run",
    "TrainConfig",
    "TrainingError",
    "TrainingTimeout",
    "compare",
    "param_rel_diff",
    "run",
    "run_many",
]
