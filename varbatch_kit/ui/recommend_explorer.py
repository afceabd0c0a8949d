"""The recommend explorer: which slime flags to run, searched and simulated as you edit them.

Built on :class:`~varbatch_kit.ui.explorer_engine.Explorer`; the search is
:func:`varbatch_kit.compat.slime.recommend`. Made by
:func:`varbatch_kit.ui.widgets.recommend_explorer`.

Controls: ``slime_args`` (the user's slime command line, a Textarea),
``model`` (a preset), ``max_tokens_headroom`` (how far ``--max-tokens-per-gpu``
may grow), ``global_batch_size`` (``auto``, ``keep`` or ``vary``: ``recommend``'s
``vary_global_batch_size`` None, False or True) and, when the simulator is
installed, ``hardware``. The view: the candidates tried (the user's row and the best one
marked), the explanation, and the recommended slime command line to paste.
A command line slime would refuse shows its error in the error box, the last
valid result stays.

:meth:`RecommendExplorer.config` is the :class:`~varbatch_kit.ScheduleConfig`
the typed flags describe; with the other controls it keys the cache, so going
back to a setting seen before is instant.
"""

from __future__ import annotations

import html
import time

import ipywidgets as W
import plotly.graph_objects as go

from varbatch_kit.core.config import ScheduleConfig
from varbatch_kit.core.flops import ModelShape, available_presets
from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.ui.explorer_controls import _check_batch_and_preset, _hardware_profiles
from varbatch_kit.ui.explorer_engine import ComputeKey, Explorer, span

__all__ = ["RECOMMEND_COLUMNS", "RecommendExplorer"]

#: recommend's vary_global_batch_size -> the batch-size control's value, and back
_VARY = {None: "auto", False: "keep", True: "vary"}
_VARY_BACK = {v: k for k, v in _VARY.items()}

#: the candidate table's columns the explorer shows, in order
RECOMMEND_COLUMNS = ("policy", "batching", "max_tokens_per_gpu", "micro_batch_size",
                     "global_batch_size", "num_steps_per_rollout", "time_s", "above_bound",
                     "oversize", "safe")


class RecommendExplorer(Explorer):
    """The best slime flags for a batch, next to the user's (see the module docstring).

    ``state`` keys: ``user_s``, ``best_s`` (simulated seconds of the rollout
    batch), ``speedup``, ``command`` (the recommended command line),
    ``changes`` (flag -> new value), ``candidates``, ``search_s``.
    """

    kind = "recommend-explorer"

    def __init__(self, rollouts: Rollouts, slime_args: str, model: str = "qwen3-8b", *,
                 max_tokens_headroom: float = 1.0, vary_global_batch_size: bool | None = None,
                 debounce_s: float = 0.3, background: bool = True) -> None:
        _check_batch_and_preset(rollouts, model)
        if not isinstance(slime_args, str) or not slime_args.strip():
            raise ValueError("slime_args must be your slime command line as one string, e.g. "
                             "'--actor-num-gpus-per-node 8 --global-batch-size 64 "
                             "--use-dynamic-batch-size --max-tokens-per-gpu 8192'")
        self.rollouts = rollouts
        if vary_global_batch_size not in _VARY:
            raise ValueError(f"vary_global_batch_size={vary_global_batch_size!r}: give None "
                             "(auto), False (keep) or True (vary)")
        self._initial = (slime_args, model, float(max_tokens_headroom),
                         _VARY[vary_global_batch_size])
        self.result = None
        # the candidate table, the explanation and the command line (HTML under the summary)
        self.details = W.HTML(value="", layout=W.Layout(width="100%"))
        self.details.add_class("vbk-recommend")
        super().__init__(debounce_s=debounce_s, background=background)
        # no figure: the result is a table
        self.widget.children = [self._control_box(), self.summary, self.error, self.details,
                                self.timing_label]

    def _make_controls(self) -> dict[str, W.Widget]:
        args, model, headroom, vary = self._initial
        style = {"description_width": "initial"}
        hardware = _hardware_profiles()
        extra = {} if not hardware else {
            "hardware": W.Dropdown(options=hardware, value=hardware[0], description="hardware",
                                   style=style, layout=W.Layout(width="170px"))}
        return {
            "slime_args": W.Textarea(value=args, description="slime flags", style=style,
                                     layout=W.Layout(width="760px", height="64px")),
            "model": W.Dropdown(options=available_presets(), value=model, description="model",
                                style=style, layout=W.Layout(width="230px")),
            "max_tokens_headroom": W.BoundedFloatText(
                value=headroom, min=1.0, max=8.0, step=0.25, description="cap headroom (x)",
                style=style, layout=W.Layout(width="200px")),
            "global_batch_size": W.Dropdown(options=list(_VARY_BACK), value=vary,
                                            description="batch size", style=style,
                                            layout=W.Layout(width="170px")),
            **extra,
        }

    def _control_box(self) -> W.Widget:
        c = self.controls
        row = [c[k] for k in ("model", "max_tokens_headroom", "global_batch_size",
                              "hardware") if k in c]
        return W.VBox([c["slime_args"], W.HBox(row)])

    def _skeleton(self) -> go.Figure:
        fig = go.Figure()
        fig.update_layout(height=40, margin=dict(l=0, r=0, t=0, b=0))  # the table is HTML
        return fig

    def config(self) -> ScheduleConfig:
        """The layout the typed slime flags describe (ValueError naming a bad flag)."""
        from varbatch_kit.compat.slime.flag_search import recommended_config

        return recommended_config(self.controls["slime_args"].value)

    def _inputs(self) -> dict:
        c = self.controls
        return {"slime_args": c["slime_args"].value, "model": c["model"].value,
                "max_tokens_headroom": float(c["max_tokens_headroom"].value),
                "vary_global_batch_size": _VARY_BACK[c["global_batch_size"].value],
                "hardware": c["hardware"].value if "hardware" in c else None}

    def _compute(self, params: ComputeKey):
        from varbatch_kit.compat.slime import recommend

        t0 = time.perf_counter()
        kw = {} if params["hardware"] is None else {"hardware": params["hardware"]}
        rec = recommend(self.rollouts, params["slime_args"], ModelShape.preset(params["model"]),
                        max_tokens_headroom=params["max_tokens_headroom"],
                        vary_global_batch_size=params["vary_global_batch_size"], **kw)
        return rec, {"search_ms": 1e3 * (time.perf_counter() - t0)}

    def _render(self, rec) -> None:
        self.result = rec
        table = rec.table
        cols = [c for c in RECOMMEND_COLUMNS if c in table.columns]
        shown = table[cols].copy()
        shown.insert(0, "", ["best" if b else ("you" if u else "")
                             for b, u in zip(table["best"], table["user"])])
        self.state = {"user_s": float(rec.user["time_s"]), "best_s": float(rec.best["time_s"]),
                      "speedup": float(rec.speedup), "command": rec.command,
                      "changes": dict(rec.changes), "candidates": len(table),
                      "search_s": float(rec.search_s)}
        s = self.state
        self.summary.value = " · ".join([
            '<span class="vbk-status"></span>yours '
            + span("vbk-user-time", f"{s['user_s']:.3f} s"),
            "recommended " + span("vbk-best-time", f"{s['best_s']:.3f} s")
            + f" ({s['speedup']:.3f}x)",
            f"{s['candidates']} candidates in {s['search_s']:.1f} s",
        ])
        explain = html.escape(rec.explain())
        self.details.value = (
            shown.to_html(index=False, float_format=lambda x: f"{x:.4g}", na_rep="",
                          classes="vbk-recommend-table", border=0)
            + f'<pre class="vbk-explain">{explain}</pre>'
            + f'<pre class="vbk-command">{html.escape(rec.command)}</pre>')

    def snapshot_figures(self) -> list:
        return []

    def static_html(self) -> str:
        """The summary, error, candidate table and command line as HTML (no controls)."""
        err = self.error.value if self.last_error else ""
        note = ('<p style="color:#888;font-size:12px">Static snapshot of the explorer; run the '
                "notebook in Jupyter for the controls.</p>")
        return f'<div class="vbk-static">{self.summary.value}{err}{self.details.value}{note}</div>'

    def close(self) -> None:
        super().close()
        self.details.close()
