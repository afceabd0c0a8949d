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

from __future__ import annotations

import asyncio
import html
import math
import time
import traceback
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ipywidgets as W
import numpy as np
import plotly.graph_objects as go

from varbatch_kit.core.config import ScheduleConfig
from varbatch_kit.core.flops import ModelShape, available_presets
from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.core.schedule import Schedule, build_schedule
from varbatch_kit.policies.registry import DISTRIBUTIONS, PACKERS
from varbatch_kit.ui import viz

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

#: control name -> description shown next to it, packing explorer
PACKING_CONTROLS = {
    "max_tokens_per_gpu": "max_tokens_per_gpu",
    "micro_batch_size": "micro_batch_size",
    "packing": "packing",
    "distribution": "distribution",
    "dp": "dp",
    "cp": "cp",
    "vpp": "vpp",
    "mb_group": "mb_group",
    "global_batch_size": "global_batch_size",
    "step": "step",
}
#: control name -> description, balance explorer
BALANCE_CONTROLS = {  # plus "hardware" when varbatch_kit.analysis.simulate is installed
    "model": "model",
    "max_tokens_per_gpu": "max_tokens_per_gpu",
    "packing": "packing",
    "distribution": "distribution",
    "dp": "dp",
    "global_batch_size": "global_batch_size",
}

DP_CHOICES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
CP_CHOICES = [1, 2, 4, 8]
VPP_CHOICES = [1, 2, 4]
MB_GROUP_CHOICES = [1, 2, 4, 8]
_CACHE_SIZE = 8
_ERROR_STYLE = ("color:#a00; background:#fff0f0; border:1px solid #e0a0a0; padding:6px 8px; "
                "white-space:pre-wrap; font-family:monospace; font-size:12px")


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _span(cls: str, text: Any) -> str:
    return f'<span class="{cls}">{html.escape(str(text))}</span>'


def _hardware_profiles() -> list[str]:
    """Hardware profile names of the step-time simulator, or [] when it is not installed."""
    try:
        from varbatch_kit.analysis.simulate import HARDWARE
    except ImportError:
        return []
    return list(HARDWARE)


def _follow_required_distribution(explorer: Explorer) -> None:
    """A packing that works with one distribution only selects it (without a second update)."""
    spec = PACKERS.get(explorer.controls["packing"].value)
    required = getattr(spec, "requires_distribution", None)
    dist = explorer.controls["distribution"]
    if required is not None and dist.value != required and required in dist.options:
        explorer._suspend = True
        try:
            dist.value = required
        finally:
            explorer._suspend = False


def _cap_range(rollouts: Rollouts) -> tuple[int, int]:
    longest = int(rollouts.total_len.max())
    hi = max(65536, 1 << math.ceil(math.log2(2 * longest)))
    return 512, hi


class Explorer:
    """Shared machinery: controls → (debounced, threaded) compute → figure + summary.

    Subclasses define ``_make_controls()``, ``_params()`` (control values →
    a hashable compute key), ``_compute(params)`` (pure; may raise
    ``ValueError``) and ``_render(result)`` (writes the figure and summary
    in place, returns the figure time).

    Attributes
    ----------
    controls : dict[str, ipywidgets.Widget]
        The controls by name.
    figure : plotly.graph_objects.FigureWidget
        The figure, updated in place.
    summary : ipywidgets.HTML
        One summary line (CSS class ``vbk-summary``).
    error : ipywidgets.HTML
        The error box (CSS class ``vbk-error``); ``layout.display == "none"``
        when there is no error.
    widget : ipywidgets.VBox
        The whole UI; displaying the explorer displays this.
    timings : dict
        Split of the last update in milliseconds.
    history : list[dict]
        Timings of every update so far.
    state : dict
        The numbers shown in the summary line.
    last_error : str or None
        The message shown in the error box.
    debounce_s : float
        Seconds a control must rest before recomputing (live kernel only).
    background : bool
        Compute on a worker thread when an event loop is running.
    """

    kind = "explorer"

    def __init__(self, *, debounce_s: float = 0.05, background: bool = True) -> None:
        self.debounce_s = float(debounce_s)
        self.background = bool(background)
        self.timings: dict[str, float] = {}
        self.history: list[dict[str, float]] = []
        self.state: dict[str, Any] = {}
        self.last_error: str | None = None
        self.last_traceback: str | None = None
        self._cache: OrderedDict[Any, Any] = OrderedDict()
        self._suspend = False
        self._handle: asyncio.TimerHandle | None = None
        self._busy = False
        self._dirty = False
        self._executor: ThreadPoolExecutor | None = None
        self.controls: dict[str, W.Widget] = self._make_controls()
        for name, ctl in self.controls.items():
            ctl.add_class("vbk-control")
            ctl.add_class(f"vbk-control-{name.replace('_', '-')}")
            ctl.observe(self._on_change, names="value")
        self.summary = W.HTML(value="", layout=W.Layout(width="100%"))
        self.summary.add_class("vbk-summary")
        self.error = W.HTML(value="", layout=W.Layout(display="none", width="100%"))
        self.error.add_class("vbk-error")
        self.timing_label = W.HTML(value="")
        self.timing_label.add_class("vbk-timing")
        # The first render goes into a plain Figure and the FigureWidget starts from it
        # complete: edits sent to a FigureWidget before it has a view are partly lost when it
        # is shown inside a box (plotly's anywidget front end resets the properties an edit
        # leaves unchanged: bar names, the micro-batch bars' transparent fill, marker colours).
        self.figure = go.Figure(self._skeleton())
        self._last_good: Any = None
        self.update()
        self.figure = go.FigureWidget(self.figure)
        self.figure.add_class("vbk-figure")
        self.widget = W.VBox(
            [self._control_box(), self.summary, self.error, self.figure, self.timing_label],
            layout=W.Layout(width="100%"))
        self.widget.add_class("vbk-explorer")
        self.widget.add_class(f"vbk-{self.kind}")

    # ------------------------------------------------------- subclass hooks
    def _make_controls(self) -> dict[str, W.Widget]:
        raise NotImplementedError

    def _control_box(self) -> W.Widget:
        return W.HBox(list(self.controls.values()), layout=W.Layout(flex_flow="row wrap"))

    def _skeleton(self) -> go.Figure:
        raise NotImplementedError

    def _params(self) -> Any:
        raise NotImplementedError

    def _compute(self, params: Any) -> tuple[Any, dict[str, float]]:
        raise NotImplementedError

    def _render(self, result: Any) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------- driving
    def set(self, **values: Any) -> dict[str, float]:
        """Set several controls at once and update synchronously; returns the timings.

        Names are the keys of :attr:`controls`; unknown names raise ``ValueError``.
        """
        unknown = sorted(set(values) - set(self.controls))
        if unknown:
            raise ValueError(f"unknown control(s) {unknown}; controls are {list(self.controls)}")
        self._suspend = True
        try:
            for name, value in values.items():
                self.controls[name].value = value
                if name == "packing":
                    self._sync_controls({"owner": self.controls[name], "new": value})
        finally:
            self._suspend = False
        return self.update()

    def update(self) -> dict[str, float]:
        """Recompute from the current control values and redraw, synchronously.

        Returns the timings (ms): ``schedule_ms`` (building the schedule; 0
        when cached), ``stats_ms`` (quality numbers), ``figure_ms`` (trace
        arrays and the in-place figure update) and ``total_ms``.
        """
        t0 = time.perf_counter()
        params = self._params()
        try:
            result, timing = self._cached_compute(params)
        except Exception as e:  # noqa: BLE001 - shown in the UI, never raised at the user
            self._show_error(e)
            timing = {"schedule_ms": 0.0, "stats_ms": 0.0}
            result = None
        return self._finish(result, timing, t0)

    def _finish(self, result: Any, timing: dict[str, float], t0: float) -> dict[str, float]:
        t1 = time.perf_counter()
        if result is not None:
            try:
                self._render(result)
                self._clear_error()
                self._last_good = result
            except Exception as e:  # noqa: BLE001
                self._show_error(e)
        t2 = time.perf_counter()
        self.timings = {"schedule_ms": timing.get("schedule_ms", 0.0),
                            "stats_ms": timing.get("stats_ms", 0.0),
                            "figure_ms": 1e3 * (t2 - t1), "total_ms": 1e3 * (t2 - t0)}
        self.history.append(dict(self.timings))
        computed = ("schedule and stats from cache" if timing.get("cached") else
                    "schedule {schedule_ms:.0f} ms · stats {stats_ms:.0f} ms")
        self.timing_label.value = (
            f'<small style="color:#888">update: {computed} · figure {{figure_ms:.0f}} ms</small>'
            .format(**self.timings))
        return self.timings

    def _cached_compute(self, params: Any) -> tuple[Any, dict[str, float]]:
        key = params
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key], {"schedule_ms": 0.0, "stats_ms": 0.0, "cached": True}
        result, timing = self._compute(params)
        self._cache[key] = result
        while len(self._cache) > _CACHE_SIZE:
            self._cache.popitem(last=False)
        return result, timing

    # --------------------------------------------------- live-kernel path
    def _on_change(self, change: dict) -> None:
        if self._suspend:
            return
        self._sync_controls(change)
        loop = _running_loop()
        if loop is None or self.debounce_s <= 0 and not self.background:
            self.update()
            return
        if self._handle is not None:
            self._handle.cancel()
        self._handle = loop.call_later(max(self.debounce_s, 0.0), self._kick, loop)

    def _sync_controls(self, change: dict) -> None:
        """Enable/disable dependent controls after a change (cheap; no recompute)."""

    def _kick(self, loop: asyncio.AbstractEventLoop) -> None:
        self._handle = None
        if self._busy:
            self._dirty = True
            return
        params = self._params()
        t0 = time.perf_counter()
        if params in self._cache or not self.background:
            self.update()
            return
        self._busy = True
        self.summary.value = self.summary.value.replace(
            'class="vbk-status">', 'class="vbk-status">computing… ', 1)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1,
                                                thread_name_prefix=f"vbk-{self.kind}")
        fut = loop.run_in_executor(self._executor, self._safe_compute, params)
        fut.add_done_callback(lambda f: self._done(f, params, t0, loop))

    def _safe_compute(self, params: Any) -> tuple[Any, Any, dict[str, float]]:
        try:
            result, timing = self._compute(params)
            return result, None, timing
        except Exception as e:  # noqa: BLE001
            return None, e, {"schedule_ms": 0.0, "stats_ms": 0.0}

    def _done(self, fut: asyncio.Future, params: Any, t0: float,
              loop: asyncio.AbstractEventLoop) -> None:
        self._busy = False
        result, err, timing = fut.result()
        if self._dirty or params != self._params():
            # the controls moved while we computed: cache this one, compute the latest
            if result is not None:
                self._cache[params] = result
            self._dirty = False
            self._kick(loop)
            return
        if err is not None:
            self._show_error(err)
            self._finish(None, timing, t0)
            return
        self._cache[params] = result
        while len(self._cache) > _CACHE_SIZE:
            self._cache.popitem(last=False)
        self._finish(result, timing, t0)

    # -------------------------------------------------------------- errors
    def _show_error(self, err: BaseException) -> None:
        if isinstance(err, ValueError):
            msg = str(err)
        else:
            msg = f"internal error ({type(err).__name__}): {err}"
        self.last_error = msg
        self.last_traceback = "".join(traceback.format_exception(err))
        self.error.value = (f'<div class="vbk-error-text" style="{_ERROR_STYLE}">'
                            f"<b>impossible layout:</b> {html.escape(msg)}</div>")
        self.error.layout.display = None
        self.state = dict(self.state, error=msg)
        self.summary.value = ('<span class="vbk-status">⚠ this layout cannot be scheduled; '
                              'the message is below. The figure shows the last valid layout.'
                              '</span>')
        title = ("⚠ last valid layout shown — the selected one is impossible"
                 if self._last_good is not None else "⚠ no valid layout yet")
        with self.figure.batch_update():
            self.figure.layout.title.text = title

    def _clear_error(self) -> None:
        self.last_error = None
        self.last_traceback = None
        if self.error.value:
            self.error.value = ""
        self.error.layout.display = "none"
        self.state.pop("error", None)

    # ------------------------------------------------------------ display
    def _repr_mimebundle_(self, include=None, exclude=None):
        bundle = self.widget._repr_mimebundle_(include=include, exclude=exclude) or {}
        bundle = dict(bundle)
        # a static snapshot for viewers without a kernel (e.g. the demo's HTML export)
        bundle["text/html"] = self.static_html()
        bundle.setdefault("text/plain", repr(self))
        return bundle

    def static_html(self) -> str:
        """The summary, error and current figure as self-contained HTML (no controls).

        Expects plotly.js to be loaded by the page (``window.Plotly``).
        """
        fig = go.Figure(self.figure)
        div = fig.to_html(full_html=False, include_plotlyjs=False)
        note = ('<p style="color:#888;font-size:12px">Static snapshot of the explorer; run the '
                "notebook in Jupyter for the controls.</p>")
        err = self.error.value if self.last_error else ""
        return f'<div class="vbk-static">{self.summary.value}{err}{div}{note}</div>'

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.state}>"

    def close(self) -> None:
        """Close the widgets and stop the worker thread."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        for w in [self.widget, self.figure, self.summary, self.error, self.timing_label,
                  *self.controls.values()]:
            w.close()


# ================================================================== packing
class PackingExplorer(Explorer):
    """Explore how one step is packed into micro-batches and spread over ranks.

    Controls (``controls[name]``; the description equals the name):
    ``max_tokens_per_gpu`` (IntSlider, the token cap; disabled for static
    packing), ``micro_batch_size`` (IntSlider; static packing only),
    ``packing`` and ``distribution`` (Dropdowns listing the registered
    policies), ``dp``, ``cp``, ``vpp``, ``mb_group`` (Dropdowns),
    ``global_batch_size`` (BoundedIntText, rollouts per step) and ``step``
    (Dropdown of the schedule's steps).

    ``state`` keys (the shown step): ``step, micro_batches`` (= bars of the
    figure's ``micro-batches`` trace), ``mb_lower_bound, over_cap`` (▼
    markers: every micro-batch over the cap), ``cap_violations`` (those with
    two or more samples), ``oversize_alone`` (a single sample longer than the
    cap), ``flops_imbalance, makespan_ratio, token_imbalance, samples,
    tokens``; and over the schedule ``steps, total_micro_batches`` (plus
    ``error`` while one is shown).
    """

    kind = "packing-explorer"

    def __init__(self, rollouts: Rollouts, model: ModelShape | None = None, *,
                 config: ScheduleConfig | None = None, step: int = 0,
                 debounce_s: float = 0.05, background: bool = True) -> None:
        if not isinstance(rollouts, Rollouts):
            raise ValueError(  # noqa: TRY004 - the project reports user errors as ValueError
                f"rollouts must be a Rollouts, got {type(rollouts).__name__}")
        self.rollouts = rollouts
        self.model = model
        if config is None:
            config = ScheduleConfig(
                dp=8, global_batch_size=max(1, rollouts.num_rollouts // 4),
                max_tokens_per_gpu=16384,
                distribution="flops_kk" if model is not None else "strided")
        self._initial = config
        self._initial_step = step
        super().__init__(debounce_s=debounce_s, background=background)

    @property
    def schedule(self) -> Schedule | None:
        """The schedule shown (the last valid one)."""
        return None if self._last_good is None else self._last_good["schedule"]

    def _make_controls(self) -> dict[str, W.Widget]:
        c = self._initial
        lo, hi = _cap_range(self.rollouts)
        cap = c.max_tokens_per_gpu or 16384
        style = {"description_width": "initial"}
        wide = W.Layout(width="420px")
        small = W.Layout(width="150px")

        def dd(name, options, value, layout=small):
            opts = list(options)
            if value not in opts:
                opts.append(value)
            return W.Dropdown(options=opts, value=value, description=name, style=style,
                              layout=layout)

        n_roll = self.rollouts.num_rollouts
        controls = {
            "max_tokens_per_gpu": W.IntSlider(
                value=min(max(cap, lo), hi), min=lo, max=hi, step=512,
                description="max_tokens_per_gpu", continuous_update=True, style=style,
                layout=wide, disabled=not c.dynamic),
            "micro_batch_size": W.IntSlider(
                value=c.micro_batch_size or 4, min=1, max=64, description="micro_batch_size",
                style=style, layout=W.Layout(width="300px"), disabled=c.dynamic),
            "packing": dd("packing", PACKERS, c.packing, W.Layout(width="210px")),
            "distribution": dd("distribution", DISTRIBUTIONS, c.distribution,
                               W.Layout(width="230px")),
            "dp": dd("dp", DP_CHOICES, c.dp, W.Layout(width="140px")),
            "cp": dd("cp", CP_CHOICES, c.cp, W.Layout(width="110px")),
            "vpp": dd("vpp", VPP_CHOICES, c.vpp, W.Layout(width="110px")),
            "mb_group": dd("mb_group", MB_GROUP_CHOICES, c.mb_group, W.Layout(width="150px")),
            "global_batch_size": W.BoundedIntText(
                value=c.global_batch_size, min=1, max=max(n_roll, c.global_batch_size),
                description="global_batch_size", style=style, layout=W.Layout(width="230px")),
            "step": W.Dropdown(options=[self._initial_step], value=self._initial_step,
                               description="step", style=style, layout=W.Layout(width="130px")),
        }
        return controls

    def _control_box(self) -> W.Widget:
        c = self.controls
        return W.VBox([
            W.HBox([c["packing"], c["distribution"], c["max_tokens_per_gpu"],
                    c["micro_batch_size"]], layout=W.Layout(flex_flow="row wrap")),
            W.HBox([c["dp"], c["cp"], c["vpp"], c["mb_group"], c["global_batch_size"],
                    c["step"]], layout=W.Layout(flex_flow="row wrap")),
        ])

    def _skeleton(self) -> go.Figure:
        return viz.empty_packing_figure()

    def _sync_controls(self, change: dict) -> None:
        if change.get("owner") is self.controls["packing"]:
            spec = PACKERS.get(self.controls["packing"].value)
            dynamic = True if spec is None else spec.dynamic
            self.controls["max_tokens_per_gpu"].disabled = not dynamic
            self.controls["micro_batch_size"].disabled = dynamic
            _follow_required_distribution(self)

    def _config_params(self) -> tuple:
        v = {k: w.value for k, w in self.controls.items()}
        spec = PACKERS.get(v["packing"])
        dynamic = True if spec is None else spec.dynamic
        return (
            v["packing"], v["distribution"], int(v["dp"]), int(v["cp"]), int(v["vpp"]),
            int(v["mb_group"]), int(v["global_batch_size"]),
            int(v["max_tokens_per_gpu"]) if dynamic else None,
            None if dynamic else int(v["micro_batch_size"]),
        )

    def _params(self) -> tuple:
        return self._config_params()

    def config(self) -> ScheduleConfig:
        """The :class:`ScheduleConfig` the controls describe (raises ``ValueError`` if invalid)."""
        return self._make_config(self._config_params())

    @staticmethod
    def _make_config(p: tuple) -> ScheduleConfig:
        packing, distribution, dp, cp, vpp, mb_group, gbs, mtpg, mbs = p
        return ScheduleConfig(dp=dp, cp=cp, vpp=vpp, mb_group=mb_group, global_batch_size=gbs,
                              max_tokens_per_gpu=mtpg, micro_batch_size=mbs, packing=packing,
                              distribution=distribution)

    def _compute(self, params: tuple) -> tuple[dict, dict[str, float]]:
        from varbatch_kit.analysis.quality import step_quality

        t0 = time.perf_counter()
        schedule = build_schedule(self.rollouts, self._make_config(params), self.model)
        t1 = time.perf_counter()
        quality = step_quality(schedule)
        t2 = time.perf_counter()
        return ({"schedule": schedule, "quality": quality},
                {"schedule_ms": 1e3 * (t1 - t0), "stats_ms": 1e3 * (t2 - t1)})

    def _render(self, result: dict) -> None:
        schedule: Schedule = result["schedule"]
        q = result["quality"]
        steps = list(range(schedule.num_steps))
        step_ctl = self.controls["step"]
        step = step_ctl.value if step_ctl.value in steps else 0
        if list(step_ctl.options) != steps or step_ctl.value != step:
            self._suspend = True
            try:
                step_ctl.options = steps
                step_ctl.value = step
            finally:
                self._suspend = False
        data = viz.packing_traces(schedule, step)
        with self.figure.batch_update():
            viz.apply_traces(self.figure, data)
        row = q.iloc[step]
        info = data["info"]
        bound = row["mb_lower_bound"]
        # quality counts a lone sample longer than the cap apart from real violations
        violations = int(row["cap_violations"])
        alone = int(row["oversize_alone"]) if "oversize_alone" in row.index else 0
        self.state = {
            "step": step, "micro_batches": info["micro_batches"],
            "mb_lower_bound": None if np.isnan(bound) else int(bound),
            "over_cap": info["over_cap"], "cap_violations": violations, "oversize_alone": alone,
            "samples": info["samples"], "tokens": info["tokens"],
            "flops_imbalance": float(row["flops_imbalance"]),
            "makespan_ratio": float(row["makespan_ratio"]),
            "token_imbalance": float(row["token_imbalance"]),
            "steps": schedule.num_steps, "total_micro_batches": int(q["micro_batches"].sum()),
        }
        s = self.state
        imb = s["flops_imbalance"]
        lb = s["mb_lower_bound"] if s["mb_lower_bound"] is not None else "n/a (static)"
        over = f'{_span("vbk-over-cap", s["cap_violations"])} over the cap'
        if alone:
            over += f" (+ {_span('vbk-oversize-alone', alone)} single samples longer than it)"
        parts = [
            (f'<span class="vbk-status"></span>step {_span("vbk-step", step)}: '
             f'{_span("vbk-micro-batches", s["micro_batches"])} micro-batches '
             f'(lower bound ceil(tokens/cap) = {_span("vbk-mb-bound", lb)})'),
            over,
            ("DP FLOPs imbalance "
             + _span("vbk-imbalance", "n/a" if np.isnan(imb) else f"{imb:.4f}")),
            ("busiest rank / bound "
             + _span("vbk-makespan", "n/a" if np.isnan(imb) else f"{s['makespan_ratio']:.4f}")),
            (f"{s['samples']} samples · {s['steps']} steps, {s['total_micro_batches']} "
             "micro-batches in all"),
        ]
        self.summary.value = " · ".join(parts)


# ================================================================== balance
class BalanceExplorer(Explorer):
    """Per-rank FLOPs and tokens of every step against the lower bound.

    Controls: ``model`` (Dropdown of :func:`available_presets`),
    ``max_tokens_per_gpu`` (IntSlider), ``packing``, ``distribution``,
    ``dp`` (Dropdowns), ``global_batch_size`` (BoundedIntText) and, when
    :mod:`varbatch_kit.analysis.simulate` is installed, ``hardware`` (Dropdown of its
    profiles) for the predicted step time.

    ``state`` keys: ``steps, micro_batches, cap_violations,
    worst_flops_imbalance, worst_makespan_ratio, mean_makespan_ratio`` and,
    with the simulator, ``predicted_s`` (all steps) and ``predicted_bound_s``.
    """

    kind = "balance-explorer"

    def __init__(self, rollouts: Rollouts, model: str = "qwen3-8b", *,
                 config: ScheduleConfig | None = None, debounce_s: float = 0.05,
                 background: bool = True) -> None:
        if not isinstance(rollouts, Rollouts):
            raise ValueError(  # noqa: TRY004 - the project reports user errors as ValueError
                f"rollouts must be a Rollouts, got {type(rollouts).__name__}")
        presets = available_presets()
        if model not in presets:
            raise ValueError(f"model={model!r} is not a preset; choose one of {presets}")
        self.rollouts = rollouts
        self._models: dict[str, ModelShape] = {}
        self._initial_model = model
        if config is None:
            config = ScheduleConfig(dp=16, global_batch_size=max(1, rollouts.num_rollouts // 4),
                                    max_tokens_per_gpu=16384, distribution="flops_kk")
        if not config.dynamic:
            raise ValueError("balance_explorer explores token-capped (dynamic) packings: pass a "
                             "config with max_tokens_per_gpu")
        self._initial = config
        super().__init__(debounce_s=debounce_s, background=background)

    @property
    def schedule(self) -> Schedule | None:
        """The schedule shown (the last valid one)."""
        return None if self._last_good is None else self._last_good["schedule"]

    def model_shape(self, name: str) -> ModelShape:
        """The preset ``name`` (cached)."""
        if name not in self._models:
            self._models[name] = ModelShape.preset(name)
        return self._models[name]

    def _make_controls(self) -> dict[str, W.Widget]:
        c = self._initial
        lo, hi = _cap_range(self.rollouts)
        style = {"description_width": "initial"}
        dynamic_packers = [n for n, s in PACKERS.items() if s.dynamic]
        hardware = _hardware_profiles()
        extra = {} if not hardware else {
            "hardware": W.Dropdown(options=hardware, value=hardware[0], description="hardware",
                                   style=style, layout=W.Layout(width="170px"))}
        return {
            "model": W.Dropdown(options=available_presets(), value=self._initial_model,
                                description="model", style=style,
                                layout=W.Layout(width="230px")),
            "max_tokens_per_gpu": W.IntSlider(
                value=min(max(c.max_tokens_per_gpu, lo), hi), min=lo, max=hi, step=512,
                description="max_tokens_per_gpu", style=style, layout=W.Layout(width="420px")),
            "packing": W.Dropdown(options=dynamic_packers, value=c.packing,
                                  description="packing", style=style,
                                  layout=W.Layout(width="210px")),
            "distribution": W.Dropdown(options=list(DISTRIBUTIONS), value=c.distribution,
                                       description="distribution", style=style,
                                       layout=W.Layout(width="230px")),
            "dp": W.Dropdown(options=sorted(set(DP_CHOICES) | {c.dp}), value=c.dp,
                             description="dp", style=style, layout=W.Layout(width="140px")),
            "global_batch_size": W.BoundedIntText(
                value=c.global_batch_size, min=1,
                max=max(self.rollouts.num_rollouts, c.global_batch_size),
                description="global_batch_size", style=style, layout=W.Layout(width="230px")),
            **extra,
        }

    def _skeleton(self) -> go.Figure:
        return viz.empty_balance_figure()

    def _sync_controls(self, change: dict) -> None:
        if change.get("owner") is self.controls["packing"]:
            _follow_required_distribution(self)

    def _params(self) -> tuple:
        v = {k: w.value for k, w in self.controls.items()}
        return (v["model"], v["packing"], v["distribution"], int(v["dp"]),
                int(v["global_batch_size"]), int(v["max_tokens_per_gpu"]), v.get("hardware"))

    def config(self) -> ScheduleConfig:
        """The :class:`ScheduleConfig` the controls describe."""
        return self._make_config(self._params())

    def _make_config(self, p: tuple) -> ScheduleConfig:
        _model, packing, distribution, dp, gbs, mtpg, _hardware = p
        return self._initial.with_(packing=packing, distribution=distribution, dp=dp,
                                   global_batch_size=gbs, max_tokens_per_gpu=mtpg)

    def _compute(self, params: tuple) -> tuple[dict, dict[str, float]]:
        from varbatch_kit.analysis.quality import step_quality

        t0 = time.perf_counter()
        model = self.model_shape(params[0])
        schedule = build_schedule(self.rollouts, self._make_config(params), model)
        t1 = time.perf_counter()
        quality = step_quality(schedule)
        data = viz.balance_traces(schedule)
        predicted = None
        if params[-1] is not None:
            from varbatch_kit.analysis.simulate import simulate

            sim = simulate(schedule, hardware=params[-1], timelines=False)
            predicted = (float(sim.step_times["time_s"].sum()),
                         float(sim.step_times["bound_s"].sum()))
        t2 = time.perf_counter()
        return ({"schedule": schedule, "quality": quality, "data": data, "predicted": predicted},
                {"schedule_ms": 1e3 * (t1 - t0), "stats_ms": 1e3 * (t2 - t1)})

    def _render(self, result: dict) -> None:
        q = result["quality"]
        data = result["data"]
        with self.figure.batch_update():
            viz.apply_traces(self.figure, data)
        self.state = {
            "steps": len(q), "micro_batches": int(q["micro_batches"].sum()),
            "cap_violations": int(q["cap_violations"].sum()),
            "worst_flops_imbalance": float(q["flops_imbalance"].max()),
            "worst_makespan_ratio": float(q["makespan_ratio"].max()),
            "mean_makespan_ratio": float(q["makespan_ratio"].mean()),
        }
        parts = []
        if result.get("predicted") is not None:
            t, b = result["predicted"]
            self.state.update(predicted_s=t, predicted_bound_s=b)
            parts.append(f"predicted on {self.controls['hardware'].value}: "
                         + _span("vbk-predicted", f"{t:.2f} s")
                         + f" for all steps ({100 * (t / b - 1):.1f}% above a perfect schedule)")
        s = self.state
        self.summary.value = " · ".join([
            (f'<span class="vbk-status"></span>{s["steps"]} steps, '
            f'{_span("vbk-micro-batches", s["micro_batches"])} micro-batches'),
            f'{_span("vbk-over-cap", s["cap_violations"])} over the cap',
            "worst DP FLOPs imbalance " + _span("vbk-imbalance",
                                                f"{s['worst_flops_imbalance']:.4f}"),
            "busiest rank / bound: worst " + _span("vbk-makespan",
                                                   f"{s['worst_makespan_ratio']:.4f}")
            + f", mean {s['mean_makespan_ratio']:.4f}",
            *parts,
        ])


# ================================================================ factories
def packing_explorer(rollouts: Rollouts, model: ModelShape | None = None, **kwargs: Any
                     ) -> PackingExplorer:
    """An interactive view of one step's packing; see :class:`PackingExplorer`.

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
    return PackingExplorer(rollouts, model, **kwargs)


def balance_explorer(rollouts: Rollouts, model: str = "qwen3-8b", **kwargs: Any
                     ) -> BalanceExplorer:
    """An interactive view of per-rank FLOPs balance; see :class:`BalanceExplorer`.

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
    return BalanceExplorer(rollouts, model, **kwargs)


def measure_latency(explorer: Explorer, changes: list[dict[str, Any]]) -> Any:
    """Apply each change with :meth:`Explorer.set` and return a pandas table of timings.

    Every row is one control change: the values set and ``schedule_ms``,
    ``stats_ms``, ``figure_ms``, ``total_ms``.
    """
    import pandas as pd

    rows = []
    for ch in changes:
        t = explorer.set(**ch)
        rows.append({"change": ", ".join(f"{k}={v}" for k, v in ch.items()), **t})
    return pd.DataFrame(rows)

