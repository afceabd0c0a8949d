"""Plotly figures of rollouts, schedules, sweeps and metric reports.

One function per picture. Each takes core values (a :class:`Rollouts`, a
:class:`Schedule`, a table) and returns a ``plotly.graph_objects.Figure``;
nothing is displayed and no state is kept between calls. The tables come
from the pure modules (:mod:`varbatch_kit.analysis.sweeps`, :mod:`varbatch_kit.analysis.quality`,
:mod:`varbatch_kit.analysis.simulate`, :func:`varbatch_kit.train.compare`); nothing
here builds a schedule.

Text in figures is plain Unicode (``Σ``, ``²``, ``×``, ``≥``), never LaTeX:
plotly renders ``$...$`` with MathJax, which offline HTML pages do not have.
Bar panels leave about 10% headroom above the tallest bar, and legends sit
outside the plot area, clear of the subplot titles.

Figures whose data change interactively (:func:`packing_figure`,
:func:`balance_figure`) have a fixed set of traces whose arrays are computed
by a matching ``*_traces`` function; the explorers in
:mod:`varbatch_kit.ui.widgets` apply those dicts to a ``Figure`` in place,
so a 4k-sample step is four array traces, not thousands of small ones.

Pictures
--------
- :func:`length_figure`: length distribution; share of samples, tokens and
  FLOPs per length bin, and FLOPs per token against length (the quadratic
  attention term).
- :func:`packing_figure`: one step's micro-batches as stacked bars of
  samples, grouped by DP rank, coloured by rollout, the token cap as a line
  and over-cap micro-batches marked.
- :func:`balance_figure`: FLOPs and tokens per rank per step with the lower
  bound ``max(total / dp, largest micro-batch)``.
- :func:`sweep_heatmap` (data from :func:`~varbatch_kit.analysis.sweeps.sweep_table`): a metric
  over ``max_tokens_per_gpu x dp``.
- :func:`report_figure`: reported metrics per step for several training
  configurations and their relative difference to a reference run.
- :func:`policy_figure` (data from :func:`~varbatch_kit.analysis.sweeps.policy_table`): every
  ``(packing, distribution)`` pair side by side.
- :func:`step_sizes_figure` and :func:`training_figure`: samples / tokens /
  micro-batches per step of a variable global batch size, and training
  curves from a per-step report table.
- :func:`rl_loop_figure` (data from :func:`varbatch_kit.train.rl_loop`): a closed RL
  loop's reward per iteration, staleness and ``ppo_kl`` per step, and the
  train-vs-rollout log-prob difference; :func:`rl_learning_figure`: recorded loops' reward
  curves with their intervals, sync against async (``benchmarks/rl_learning.py``).
- :func:`cp_plan_figure` (its table :func:`cp_plan_table`): one
  step's context-parallel plan, world ranks x rounds, each micro-batch a block over
  its CP group coloured by its degree; fixed and dynamic CP alike.
- :func:`step_time_figure` and :func:`timeline_figure`: simulated step times
  of several schedules and one step's per-rank timeline (from
  :mod:`varbatch_kit.analysis.simulate`).
- :func:`memory_figure` (data from :func:`~varbatch_kit.core.memory.predict_memory` or a
  run's ``memory_table``): one step's predicted peak per GPU stacked by kind, the device's
  memory as a line, measured peaks as markers.
- :func:`expert_load_figure` (data from :func:`varbatch_kit.train.compare` on a mixture of
  experts): one step's tokens per expert and layer under each layout, and each micro-batch's
  busiest expert over the mean.
- :func:`run_quality_figure` (data from
  :func:`~varbatch_kit.analysis.run_quality.run_quality_table`): a whole run's
  rollout steps, simulated time and FLOPs imbalance per step, one line per
  policy.
"""

from varbatch_kit.ui.figures.cp import cp_plan_figure, cp_plan_table
from varbatch_kit.ui.figures.experts import expert_load_figure
from varbatch_kit.ui.figures.memory import memory_figure
from varbatch_kit.ui.figures.policies import policy_figure, sweep_heatmap
from varbatch_kit.ui.figures.reports import (
    report_figure,
    rl_learning_figure,
    rl_loop_figure,
    training_figure,
)
from varbatch_kit.ui.figures.run import run_quality_figure
from varbatch_kit.ui.figures.schedule import (
    BALANCE_TRACE_NAMES,
    PACKING_TRACE_NAMES,
    apply_traces,
    balance_figure,
    balance_traces,
    empty_balance_figure,
    empty_packing_figure,
    length_figure,
    packing_figure,
    packing_traces,
    step_sizes_figure,
)
from varbatch_kit.ui.figures.timing import (
    measured_vs_predicted_figure,
    step_time_figure,
    timeline_figure,
)

__all__ = [
    "BALANCE_TRACE_NAMES",
    "PACKING_TRACE_NAMES",
    "apply_traces",
    "balance_figure",
    "balance_traces",
    "cp_plan_figure",
    "cp_plan_table",
    "empty_balance_figure",
    "empty_packing_figure",
    "expert_load_figure",
    "length_figure",
    "measured_vs_predicted_figure",
    "memory_figure",
    "packing_figure",
    "packing_traces",
    "policy_figure",
    "report_figure",
    "rl_learning_figure",
    "rl_loop_figure",
    "run_quality_figure",
    "step_sizes_figure",
    "step_time_figure",
    "sweep_heatmap",
    "timeline_figure",
    "training_figure",
]
