"""ipywidgets explorers: move a control, see the schedule change.

:func:`packing_explorer` shows how one step is packed into micro-batches and
spread over DP ranks; :func:`balance_explorer` shows the per-rank FLOPs and
tokens of every step against their lower bound. Both draw on a
``plotly.graph_objects.FigureWidget`` that is updated in place (the trace
arrays are replaced, no figure is rebuilt).

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
names (also their ``description``): see :data:`PACKING_CONTROLS` and
:data:`BALANCE_CONTROLS`. In the packing figure the second bar trace
(``"micro-batches"``) has exactly one bar per micro-batch of the shown step.
"""

from varbatch_kit.ui.explorer_engine import Explorer, measure_latency
from varbatch_kit.ui.explorers import (
    BALANCE_CONTROLS,
    PACKING_CONTROLS,
    BalanceExplorer,
    PackingExplorer,
    balance_explorer,
    packing_explorer,
)

__all__ = [
    "BALANCE_CONTROLS",
    "PACKING_CONTROLS",
    "BalanceExplorer",
    "Explorer",
    "PackingExplorer",
    "balance_explorer",
    "measure_latency",
    "packing_explorer",
]
