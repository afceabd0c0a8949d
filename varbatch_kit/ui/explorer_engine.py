"""The engine under every explorer: controls → (debounced, cached, background) compute → figure.

:class:`Explorer` holds the controls, a ``plotly`` ``Figure`` updated in place (shown by
:class:`~varbatch_kit.ui.figure_output.FigureOutput`), the summary line and the error
box; a subclass says which controls it has (``_make_controls``), what a setting computes
(``_compute``) and how the result is drawn (``_render``). What a compute depends on is a
:class:`ComputeKey`: the :class:`~varbatch_kit.core.config.ScheduleConfig` the controls
describe (``config()``, built from the config the user passed, so the fields no control
shows are kept) plus any other named inputs (``_inputs()``); the cache is keyed on it.
See :mod:`varbatch_kit.ui.widgets` for the behaviour users see (debouncing, caching,
errors, CSS hooks).
"""

from __future__ import annotations

import asyncio
import html
import time
import traceback
from collections import OrderedDict
from collections.abc import Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ipywidgets as W
import plotly.graph_objects as go

from varbatch_kit.ui.figure_output import FigureOutput

if TYPE_CHECKING:
    from varbatch_kit.core.config import ScheduleConfig

__all__ = ["ComputeKey", "Explorer", "measure_latency", "running_loop", "span"]


_CACHE_SIZE = 8
_ERROR_STYLE = ("color:#a00; background:#fff0f0; border:1px solid #e0a0a0; padding:6px 8px; "
                "white-space:pre-wrap; font-family:monospace; font-size:12px")


def running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def span(cls: str, text: Any) -> str:
    return f'<span class="{cls}">{html.escape(str(text))}</span>'


@dataclass(frozen=True)
class ComputeKey:
    """What one explorer compute depends on; the cache key (hashable, equal by value).

    Attributes
    ----------
    config : ScheduleConfig
        The config the controls describe (a frozen, hashable dataclass).
    inputs : tuple of (name, value)
        The other inputs of the compute by name (a model preset, a hardware
        profile), sorted by name; read one with ``key["name"]``.
    """

    config: ScheduleConfig
    inputs: tuple[tuple[str, Hashable], ...] = ()

    @classmethod
    def of(cls, config: ScheduleConfig, **inputs: Hashable) -> ComputeKey:
        """The key of ``config`` and the named ``inputs``."""
        return cls(config, tuple(sorted(inputs.items())))

    def __getitem__(self, name: str) -> Any:
        for key, value in self.inputs:
            if key == name:
                return value
        raise KeyError(f"no input {name!r}; the inputs are {[k for k, _ in self.inputs]}")


class Explorer:
    """Shared machinery: controls → (debounced, threaded) compute → figure + summary.

    Subclasses define ``_make_controls()``, ``config()`` (control values →
    the :class:`~varbatch_kit.core.config.ScheduleConfig`, changed from the
    user's with ``with_``/``with_batching``; ``ValueError`` if the controls
    describe no valid config), ``_inputs()`` (the other named inputs of a
    compute; none by default), ``_compute(key)`` (pure, given the
    :class:`ComputeKey`; may raise ``ValueError``) and ``_render(result)``
    (writes the figure and summary in place).

    Attributes
    ----------
    controls : dict[str, ipywidgets.Widget]
        The controls by name.
    figure : plotly.graph_objects.Figure
        The figure, updated in place.
    figure_output : FigureOutput
        Shows :attr:`figure` (an ``ipywidgets.Output``, CSS class ``vbk-figure``),
        redrawn after every update.
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
        # a plain Figure edited in place, shown through an Output widget (figure_output.py
        # says why not a FigureWidget)
        self.figure = go.Figure(self._skeleton())
        self._last_good: Any = None
        self.update()
        self.figure_output = FigureOutput(self.figure, "vbk-figure")
        self.widget = W.VBox(
            [self._control_box(), self.summary, self.error, self.figure_output.widget,
             self.timing_label],
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

    def config(self) -> ScheduleConfig:
        """The config the controls describe (``ValueError`` if they describe none)."""
        raise NotImplementedError

    def _inputs(self) -> dict[str, Hashable]:
        """The compute's inputs besides the config, by name (hashable values)."""
        return {}

    def _compute(self, params: ComputeKey) -> tuple[Any, dict[str, float]]:
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
        try:
            result, timing = self._cached_compute(self._key())
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
        for out in self._figure_outputs():
            out.redraw()
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

    def _figure_outputs(self) -> list[FigureOutput]:
        """The figures' outputs to redraw after an update (none before the first one)."""
        out = getattr(self, "figure_output", None)
        return [out] if out is not None else []

    def _key(self) -> ComputeKey:
        """The cache key of the current controls (``ValueError`` if they describe no config)."""
        return ComputeKey.of(self.config(), **self._inputs())

    def _key_or_none(self) -> ComputeKey | None:
        try:
            return self._key()
        except Exception:  # noqa: BLE001 - update() shows it
            return None

    def _cached_compute(self, key: ComputeKey) -> tuple[Any, dict[str, float]]:
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key], {"schedule_ms": 0.0, "stats_ms": 0.0, "cached": True}
        result, timing = self._compute(key)
        self._store(key, result)
        return result, timing

    def _store(self, key: ComputeKey, result: Any) -> None:
        self._cache[key] = result
        while len(self._cache) > _CACHE_SIZE:
            self._cache.popitem(last=False)

    # --------------------------------------------------- live-kernel path
    def _on_change(self, change: dict) -> None:
        if self._suspend:
            return
        self._sync_controls(change)
        loop = running_loop()
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
        params = self._key_or_none()
        t0 = time.perf_counter()
        if params is None or params in self._cache or not self.background:
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

    def _safe_compute(self, params: ComputeKey) -> tuple[Any, Any, dict[str, float]]:
        try:
            result, timing = self._compute(params)
            return result, None, timing
        except Exception as e:  # noqa: BLE001
            return None, e, {"schedule_ms": 0.0, "stats_ms": 0.0}

    def _done(self, fut: asyncio.Future, params: ComputeKey, t0: float,
              loop: asyncio.AbstractEventLoop) -> None:
        self._busy = False
        result, err, timing = fut.result()
        if self._dirty or params != self._key_or_none():
            # the controls moved while we computed: cache this one, compute the latest
            if result is not None:
                self._store(params, result)
            self._dirty = False
            self._kick(loop)
            return
        if err is not None:
            self._show_error(err)
            self._finish(None, timing, t0)
            return
        self._store(params, result)
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

    def snapshot_figures(self) -> list:
        """The figures :meth:`static_html` draws, top to bottom (the explorer's main one;
        an explorer with more figures below it lists them too)."""
        return [self.figure]

    def static_html(self) -> str:
        """The summary, error and current figures as self-contained HTML (no controls).

        Every figure of :meth:`snapshot_figures` is drawn, so a title that points
        to a figure below it ("dynamic plan below") finds it there. Expects
        plotly.js to be loaded by the page (``window.Plotly``).
        """
        div = "".join(go.Figure(f).to_html(full_html=False, include_plotlyjs=False)
                      for f in self.snapshot_figures())
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
        for out in self._figure_outputs():
            out.close()
        for w in [self.widget, self.summary, self.error, self.timing_label,
                  *self.controls.values()]:
            w.close()


# ================================================================== packing


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
