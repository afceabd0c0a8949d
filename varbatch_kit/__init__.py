"""varbatch_kit: variable global batch size, pack-first micro-batching,
FLOPs-balanced DP distribution and layout-invariant metric reports for RL
training of LLMs (reproducing and improving slime's data scheduling).

Main entry points::

    from varbatch_kit import Rollouts, ModelShape, ScheduleConfig, build_schedule
    rollouts = Rollouts.synthetic(1024, samples_per_rollout=(1, 4), seed=0)
    config = ScheduleConfig(dp=8, global_batch_size=256, max_tokens_per_gpu=16384,
                            distribution="flops_kk")
    schedule = build_schedule(rollouts, config, ModelShape.preset("qwen3-8b")).check()
    schedule.stats()
"""

from varbatch_kit._version import __version__
from varbatch_kit.core.build import build_schedule
from varbatch_kit.core.config import ScheduleConfig
from varbatch_kit.core.flops import ModelShape, available_presets
from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.core.schedule import Schedule, ScheduleInvariantError
from varbatch_kit.core.step import Step

__all__ = [
    "__version__",
    "Rollouts",
    "ModelShape",
    "available_presets",
    "ScheduleConfig",
    "Schedule",
    "Step",
    "ScheduleInvariantError",
    "build_schedule",
]
