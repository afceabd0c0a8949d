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

    from varbatch_kit import bundled_traces, read_trace, simulate
    agentic = read_trace(bundled_traces()["agentic"])      # a recorded trace
    simulate(schedule, "H100").step_times                   # predicted step times

Everything else is imported from its layer module, one path per name:
``varbatch_kit.report`` (layout-invariant reports), ``varbatch_kit.analysis.sweeps``,
``varbatch_kit.analysis.quality``, ``varbatch_kit.analysis.simulate``,
``varbatch_kit.compat.slime``, and the shells, each behind an optional extra:
``varbatch_kit.ui.viz`` / ``varbatch_kit.ui.widgets`` (``[ui]``) and
``varbatch_kit.train`` (``[train]``). Importing ``varbatch_kit`` imports none
of plotly, ipywidgets or megatron-core.
"""

from varbatch_kit._version import __version__
from varbatch_kit.analysis.quality import step_quality
from varbatch_kit.analysis.simulate import simulate
from varbatch_kit.core.build import build_schedule
from varbatch_kit.core.config import ScheduleConfig
from varbatch_kit.core.flops import ModelShape, available_presets
from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.core.run_dumps import read_run
from varbatch_kit.core.schedule import Schedule, ScheduleInvariantError
from varbatch_kit.core.step import Step
from varbatch_kit.core.trace_errors import TraceError
from varbatch_kit.core.traces import bundled_traces, read_trace, write_trace

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
    "read_trace",
    "read_run",
    "write_trace",
    "bundled_traces",
    "TraceError",
    "simulate",
    "step_quality",
]
