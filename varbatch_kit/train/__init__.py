"""Training engine: megatron-core GPT, variable global batch size, reports compared across layouts.

- :class:`TrainConfig`: layout (a :class:`~varbatch_kit.ScheduleConfig`),
  report mode, and the sub-configs :class:`ModelConfig`, :class:`OptimConfig`,
  :class:`LossConfig`, :class:`DataConfig`, :class:`RunConfig`,
  :class:`CheckpointConfig`, :class:`NodesConfig`, :class:`FaultConfig`.
- :func:`run`: train one configuration in ``dp * cp * pp * tp`` ``torchrun`` workers
  (the caller stays single-process) → :class:`Run` with one report row per step.
- :func:`compare`: several configurations on the same rollouts and seed → one table.
- :func:`run_many`: like :func:`compare`, returning the :class:`Run` objects.

Devices (:mod:`varbatch_kit.train.parallel.devices`, docs/gpu.md): CUDA + NCCL when each node has a
GPU per local rank, else CPU + gloo through :mod:`varbatch_kit.train.parallel.cpu_shim`. Context
parallelism runs all-gather style (:mod:`varbatch_kit.train.parallel.cp_attention`);
``cp_impl="emulated"``
is the reference, every CP rank running the full forward (see
:mod:`varbatch_kit.train.step.train_step`).

Needs the ``[train]`` extra (``pip install 'varbatch_kit[train]'``): importing
this package without megatron-core raises an ``ImportError`` that says so.
Importing it does not import megatron-core itself (only its presence is
checked); the workers import it.
"""

from varbatch_kit._extras import require

require(__name__, "train", ("megatron.core",))

from varbatch_kit.train.config.model_config import ModelConfig  # noqa: E402  (after the check)
from varbatch_kit.train.config.sub_configs import (  # noqa: E402
    CheckpointConfig,
    DataConfig,
    FaultConfig,
    LossConfig,
    NodesConfig,
    OptimConfig,
    RunConfig,
)
from varbatch_kit.train.config.train_config import TrainConfig  # noqa: E402
from varbatch_kit.train.rl.rl_loop import RLLoopResult, rl_loop  # noqa: E402
from varbatch_kit.train.runs.comparison import compare  # noqa: E402
from varbatch_kit.train.runs.launch import run, run_many  # noqa: E402
from varbatch_kit.train.runs.results import Run, param_rel_diff  # noqa: E402
from varbatch_kit.train.runs.supervise import TrainingError, TrainingTimeout  # noqa: E402

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "FaultConfig",
    "LossConfig",
    "ModelConfig",
    "NodesConfig",
    "OptimConfig",
    "RLLoopResult",
    "Run",
    "RunConfig",
    "TrainConfig",
    "TrainingError",
    "TrainingTimeout",
    "compare",
    "param_rel_diff",
    "rl_loop",
    "run",
    "run_many",
]
