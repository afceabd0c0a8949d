"""ipywidgets explorers: move a control, see the schedule change.

This module makes them (:func:`packing_explorer`, :func:`balance_explorer`)
and says how they behave; the explorers themselves are
:class:`~varbatch_kit.ui.packing_explorer.PackingExplorer` and
:class:`~varbatch_kit.ui.balance_explorer.BalanceExplorer`, built on
:mod:`varbatch_kit.ui.explorer_engine` (with
:func:`~varbatch_kit.ui.explorer_engine.measure_latency`).

:func:`packing_explorer` shows how one step is packed into micro-batches and
spread over DP ranks; :func:`balance_explorer` shows the per-rank FLOPs and
tokens of every step against their lower bound. Both draw on a
``plotly.graph_objects.Figure`` that is updated in place (the trace arrays
are replaced) and shown in an ``ipywidgets.Output`` that is redrawn after
each update (:mod:`varbatch_kit.ui.figure_output`: plotly's ``FigureWidget``
stays empty when its front end loads slowly).

Responsiveness
--------------
In a live kernel a control change is debounced (``debounce_s``) and the
schedule is computed on a worker thread, so the kernel keeps answering
while a slow policy runs; changes that arrive meanwhile are coalesced and
the latest values win. Schedules are cached per configuration, so moving the
step selector or going back to an earlier setting only redraws. Outside a
running event loop (scripts, tests) every change updates synchronously.

Errors
------
An impossible layout (e.g. more DP ranks than samples in a step) shows the
scheduler's message in the explorer's ``error`` widget; the figure keeps the
last valid layout and says so in its title. No traceback is printed.

Driving from Python (tests, notebooks)
--------------------------------------
``explorer.controls[name].value = v`` behaves like a user moving the
control. ``explorer.set(cap=8192, dp=32)`` sets several controls and updates
once, synchronously, returning the timings. ``explorer.update()`` recomputes
from the current control values. ``explorer.timings`` holds the last
update's split (``schedule_ms``, ``stats_ms``, ``figure_ms``, ``total_ms``)
and ``explorer.state`` the numbers the summary line shows.
``explorer.config()`` is the ``config`` passed, changed by the controls
(:meth:`~varbatch_kit.core.config.ScheduleConfig.with_batching`): the fields
no control shows (``pp``, ``microbatch_order``, ``alignment_fallback``,
``cp_sizes``, ...) are kept, and the cache is keyed on that config.

Stable hooks for browser tests
------------------------------
CSS classes: the root box ``vbk-explorer`` plus ``vbk-packing-explorer`` or
``vbk-balance-explorer``; every control ``vbk-control`` plus
``vbk-control-<name>`` (names below); the figure ``vbk-figure``; the summary
line ``vbk-summary`` (its numbers are in ``<span>`` elements with classes
``vbk-step``, ``vbk-micro-batches``, ``vbk-mb-bound``, ``vbk-over-cap``,
``vbk-oversize-alone`` (only when a sample longer than the cap sits alone),
``vbk-imbalance``, ``vbk-makespan``, and ``vbk-predicted`` in the balance
explorer with the simulator; ``computing…`` appears in the line while a
background update runs); the error box ``vbk-error`` (hidden
when there is no error; the message is in ``.vbk-error-text``). Control
names (also their ``description``): see
:data:`varbatch_kit.ui.packing_explorer.PACKING_CONTROLS` and
:data:`varbatch_kit.ui.balance_explorer.BALANCE_CONTROLS`. In the packing figure
the second bar trace (``"micro-batches"``) has exactly one bar per
micro-batch of the shown step.
"""

from __future__ import annotations

from typing import Any

from varbatch_kit.core.flops import ModelShape
from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.ui import balance_explorer as _balance
from varbatch_kit.ui import packing_explorer as _packing
from varbatch_kit.ui import planner_explorer as _planner
from varbatch_kit.ui import recommend_explorer as _recommend

__all__ = ["balance_explorer", "packing_explorer", "planner_explorer", "recommend_explorer"]


def packing_explorer(rollouts: Rollouts, model: ModelShape | None = None, **kwargs: Any
                     ) -> _packing.PackingExplorer:
    """An interactive view of one step's packing.

    Returns a :class:`~varbatch_kit.ui.packing_explorer.PackingExplorer` (its
    controls, ``state`` keys and figures are described there).

    Parameters
    ----------
    rollouts:
        The batch to schedule.
    model:
        Model shape for FLOPs (hover, imbalance, FLOPs-balanced policies).
    config:
        Initial :class:`ScheduleConfig` (default: dp 8, cap 16384, four
        steps, ``flops_kk`` distribution when a model is given).
    step:
        Initial step.
    debounce_s, background:
        Responsiveness knobs (see the module docstring).
    """
    return _packing.PackingExplorer(rollouts, model, **kwargs)


def balance_explorer(rollouts: Rollouts, model: str = "qwen3-8b", **kwargs: Any
                     ) -> _balance.BalanceExplorer:
    """An interactive view of per-rank FLOPs balance.

    Returns a :class:`~varbatch_kit.ui.balance_explorer.BalanceExplorer` (its
    controls and ``state`` keys are described there).

    Parameters
    ----------
    rollouts:
        The batch to schedule.
    model:
        Initial model preset name (see :func:`varbatch_kit.core.flops.available_presets`).
    config:
        Initial token-capped :class:`ScheduleConfig` (default dp 16, cap
        16384, four steps, ``flops_kk`` distribution).
    """
    return _balance.BalanceExplorer(rollouts, model, **kwargs)


def recommend_explorer(rollouts: Rollouts, slime_args: str, model: str = "qwen3-8b",
                       **kwargs: Any) -> _recommend.RecommendExplorer:
    """Which slime flags to run: :func:`varbatch_kit.compat.slime.recommend` as you edit them.

    Returns a :class:`~varbatch_kit.ui.recommend_explorer.RecommendExplorer`.

    Parameters
    ----------
    rollouts:
        One rollout batch (a trace or a slime dump).
    slime_args:
        Your slime command line (one string).
    model:
        Model preset name (see :func:`varbatch_kit.core.flops.available_presets`).
    max_tokens_headroom, vary_global_batch_size:
        As for :func:`~varbatch_kit.compat.slime.recommend` (initial control values).
    """
    return _recommend.RecommendExplorer(rollouts, slime_args, model, **kwargs)


def planner_explorer(rollouts: Rollouts, model: str = "qwen3-8b", gpus: int = 16,
                     **kwargs: Any) -> _planner.PlannerExplorer:
    """Which layout to run on ``gpus`` GPUs: :func:`varbatch_kit.compat.slime.planner.plan_layouts`
    as you change the GPUs, the model, the caps or the hardware.

    Returns a :class:`~varbatch_kit.ui.planner_explorer.PlannerExplorer`; ``kwargs``:
    ``global_batch_size`` (rollouts per step, default all), ``caps`` (the
    ``--max-tokens-per-gpu`` values to try), ``hardware`` (initial control values).
    """
    return _planner.PlannerExplorer(rollouts, model, gpus, **kwargs)
