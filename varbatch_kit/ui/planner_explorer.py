"""The planner explorer: the fastest layout that fits, searched again as you change the GPUs.

Built on :class:`~varbatch_kit.ui.explorer_engine.Explorer`; the search is
:func:`varbatch_kit.compat.slime.planner.plan_layouts`. Made by
:func:`varbatch_kit.ui.widgets.planner_explorer`.

Controls: ``model`` (a preset), ``gpus``, ``global_batch_size`` (rollouts per step),
``caps`` (the ``--max-tokens-per-gpu`` values to try, comma-separated) and ``hardware``.
The view: a summary (the fastest layout that fits, its time, peak memory and GPU-hours per
rollout batch), the top candidates with the slime flags of the fastest one slime can run,
and the figure of simulated time against predicted peak memory for every candidate.
"""

from __future__ import annotations

import html
import time

import ipywidgets as W
import plotly.graph_objects as go

from varbatch_kit.core.config import ScheduleConfig
from varbatch_kit.core.flops import ModelShape, available_presets
from varbatch_kit.core.hardware import DEFAULT_HARDWARE
from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.ui.explorer_controls import _check_batch_and_preset, _hardware_profiles
from varbatch_kit.ui.explorer_engine import ComputeKey, Explorer, span

__all__ = ["PLAN_COLUMNS", "PlannerExplorer"]

#: the candidate table's columns the explorer shows, in order
PLAN_COLUMNS = ("tp", "pp", "cp", "dp", "max_tokens_per_gpu", "packing", "recompute", "time_s",
                "peak_gib", "gpu_hours")


def _caps(text: str) -> tuple[int, ...]:
    try:
        caps = tuple(int(c) for c in str(text).split(",") if c.strip())
    except ValueError:
        caps = ()
    if not caps or any(c < 1 for c in caps):
        raise ValueError(f"caps {text!r}: give positive whole numbers separated by commas")
    return caps


class PlannerExplorer(Explorer):
    """The fastest layouts that fit (see the module docstring).

    ``state`` keys: ``best`` (the fastest fitting candidate, a dict; None when nothing
    fits), ``command`` (the slime flags of the fastest candidate slime can run, or None),
    ``candidates``, ``fitting``, ``search_s``.
    """

    kind = "planner-explorer"

    def __init__(self, rollouts: Rollouts, model: str = "qwen3-8b", gpus: int = 16, *,
                 global_batch_size: int | None = None, caps=(16384,),
                 hardware: str = DEFAULT_HARDWARE, debounce_s: float = 0.3,
                 background: bool = True) -> None:
        _check_batch_and_preset(rollouts, model)
        self.rollouts = rollouts
        gbs = global_batch_size or rollouts.num_rollouts
        self._initial = (model, int(gpus), int(gbs), ",".join(str(int(c)) for c in caps),
                         hardware)
        self.result = None
        self.details = W.HTML(value="", layout=W.Layout(width="100%"))
        self.details.add_class("vbk-plan")
        super().__init__(debounce_s=debounce_s, background=background)
        self.widget.children = [self._control_box(), self.summary, self.error, self.details,
                                self.figure_output.widget, self.timing_label]

    def _make_controls(self) -> dict[str, W.Widget]:
        model, gpus, gbs, caps, hardware = self._initial
        style = {"description_width": "initial"}
        profiles = _hardware_profiles() or [hardware]
        return {
            "model": W.Dropdown(options=available_presets(), value=model, description="model",
                                style=style, layout=W.Layout(width="230px")),
            "gpus": W.BoundedIntText(value=gpus, min=1, max=4096, description="GPUs",
                                     style=style, layout=W.Layout(width="140px")),
            "global_batch_size": W.BoundedIntText(
                value=gbs, min=1, max=max(gbs, self.rollouts.num_rollouts),
                description="rollouts per step", style=style, layout=W.Layout(width="220px")),
            "caps": W.Text(value=caps, description="caps", style=style,
                           layout=W.Layout(width="220px")),
            "hardware": W.Dropdown(options=profiles, value=hardware if hardware in profiles
                                   else profiles[0], description="hardware", style=style,
                                   layout=W.Layout(width="170px")),
        }

    def _skeleton(self) -> go.Figure:
        fig = go.Figure()
        fig.update_layout(height=420, template="plotly_white")
        return fig

    def config(self) -> ScheduleConfig:
        """The step size and smallest cap searched (ValueError for bad caps)."""
        c = self.controls
        return ScheduleConfig(dp=1, global_batch_size=int(c["global_batch_size"].value),
                              max_tokens_per_gpu=min(_caps(c["caps"].value)))

    def _inputs(self) -> dict:
        c = self.controls
        return {"model": c["model"].value, "gpus": int(c["gpus"].value),
                "caps": _caps(c["caps"].value), "hardware": c["hardware"].value}

    def _compute(self, params: ComputeKey):
        from varbatch_kit.compat.slime.planner import plan_layouts

        t0 = time.perf_counter()
        plan = plan_layouts(self.rollouts, ModelShape.preset(params["model"]), params["gpus"],
                            hardware=params["hardware"],
                            global_batch_size=params.config.global_batch_size,
                            caps=params["caps"])
        return plan, {"search_ms": 1e3 * (time.perf_counter() - t0)}

    def _render(self, plan) -> None:
        self.result = plan
        fits = plan.top(len(plan.table)) if not plan.table.empty else plan.table
        slime = fits[fits["command"].notna()] if len(fits) else fits
        command = None if slime.empty else str(slime.iloc[0]["command"])
        self.state = {"best": plan.best, "command": command, "candidates": len(plan.table),
                      "fitting": int(len(fits)), "search_s": float(plan.search_s)}
        b = plan.best
        if b is None:
            head = "no candidate fits: more GPUs, smaller caps or a larger device"
        else:
            head = (f"fastest that fits: tp {b['tp']} pp {b['pp']} cp {b['cp']} dp {b['dp']}, "
                    f"cap {b['max_tokens_per_gpu']}, {b['packing']}, recompute "
                    f"{b['recompute']}: " + span("vbk-plan-time", f"{b['time_s']:.2f} s")
                    + f" per rollout batch, peak {b['peak_gib']:.1f} GiB of "
                    f"{plan.memory_gib:g}, {b['gpu_hours']:.3f} GPU-hours")
        self.summary.value = " · ".join([
            '<span class="vbk-status"></span>' + head,
            f"{len(fits)} of {len(plan.table)} candidates fit ({plan.search_s:.1f} s)"])
        shown = fits.head(8)[[c for c in PLAN_COLUMNS if c in fits.columns]]
        self.details.value = (
            shown.to_html(index=False, float_format=lambda x: f"{x:.4g}", na_rep="",
                          classes="vbk-plan-table", border=0)
            + (f'<pre class="vbk-command">{html.escape(command)}</pre>' if command else ""))
        fig = plan.figure() if not plan.table.dropna(subset=["peak_gib"]).empty else None
        with self.figure.batch_update():
            self.figure.data = []
            if fig is not None:
                self.figure.add_traces(list(fig.data))
                self.figure.update_layout(fig.layout)

    def static_html(self) -> str:
        """The summary, error, candidate table and figure as HTML (no controls)."""
        div = go.Figure(self.figure).to_html(full_html=False, include_plotlyjs=False)
        err = self.error.value if self.last_error else ""
        note = ('<p style="color:#888;font-size:12px">Static snapshot of the explorer; run the '
                "notebook in Jupyter for the controls.</p>")
        return (f'<div class="vbk-static">{self.summary.value}{err}{self.details.value}{div}'
                f"{note}</div>")

    def close(self) -> None:
        super().close()
        self.details.close()
