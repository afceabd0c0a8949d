"""Training engine: megatron-core GPT, variable global batch size, reports compared across layouts.

- :class:`TrainConfig`: layout (a :class:`~varbatch_kit.ScheduleConfig`),
  report mode, and the sub-configs :class:`ModelConfig`, :class:`OptimConfig`,
  :class:`LossConfig`, :class:`DataConfig`, :class:`RunConfig`,
  :class:`CheckpointConfig`, :class:`NodesConfig`, :class:`FaultConfig`.
- :func:`run`: train one configuration in ``dp * cp`` ``torchrun`` workers
  (the caller stays single-process) → :class:`Run` with one report row per step.
- :func:`compare`: several configurations on the same rollouts and seed → one table.
- :func:`run_many`: like :func:`compare`, returning the :class:`Run` objects.

Devices: CUDA + NCCL when GPUs are present, else CPU + gloo through
:mod:`varbatch_kit.train.cpu_shim`. Context parallelism is emulated at the
loss level (see :mod:`varbatch_kit.train.step`).

Importing this package does not import megatron-core; the workers do.
"""

from varbatch_kit.train.config import (
    CheckpointConfig,
    DataConfig,
    FaultConfig,
    LossConfig,
    ModelConfig,
    NodesConfig,
    OptimConfig,
    RunConfig,
    TrainConfig,
)
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
    "CheckpointConfig",
    "DataConfig",
    "FaultConfig",
    "LossConfig",
    "ModelConfig",
    "NodesConfig",
    "OptimConfig",
    "Run",
    "RunConfig",
    "TrainConfig",
    "TrainingError",
    "TrainingTimeout",
    "compare",
    "param_rel_diff",
    "run",
    "run_many",
]
