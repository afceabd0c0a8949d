"""Figures of simulated step times: per policy (absolute or relative to the bound), a
rank timeline of one step, and a cost model's measured against predicted micro-batch times."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.colors import qualitative

from varbatch_kit.ui.figures.style import (
    LEGEND_BELOW,
    PALETTE,
    TEMPLATE,
    headroom,
)


def step_time_figure(step_times: Mapping[str, Any], *, relative: bool = False,
                     total: bool = False, title: str | None = None) -> go.Figure:
    """Simulated step times of several schedules, with the bound of a perfect schedule.

    Parameters
    ----------
    step_times:
        ``name -> per-step table`` with columns ``step`` and ``time_s`` (and
        optionally ``bound_s``, the step time of a perfect schedule), e.g.
        ``{policy: simulate(schedule).step_times}``.
    relative:
        Draw ``100 * (time / bound - 1)``, the percent above the bound, instead
        of seconds (needs ``bound_s``): the differences between policies are
        a few percent of a step.
    total:
        One bar per schedule for the sum over steps, instead of grouped bars
        per step.
    """
    import pandas as pd

    if not step_times:
        raise ValueError("step_times is empty: pass name -> per-step table")
    frames = {}
    for name, df in step_times.items():
        df = pd.DataFrame(df)
        col = next((c for c in ("time_s", "step_time_s") if c in df.columns), None)
        if col is None or "step" not in df.columns:
            raise ValueError(f"step times of {name!r} need columns step and time_s; "
                             f"columns are {list(df.columns)}")
        if relative and "bound_s" not in df.columns:
            raise ValueError(f"relative=True needs a bound_s column; {name!r} has none")
        frames[name] = df.rename(columns={col: "time_s"})
    unit = "% above the bound" if relative else "seconds"

    def values(df):
        t, b = df["time_s"].to_numpy(np.float64), df.get("bound_s")
        if total:
            t = np.array([t.sum()])
            b = None if b is None else np.array([b.to_numpy(np.float64).sum()])
        elif b is not None:
            b = b.to_numpy(np.float64)
        return 100 * (t / b - 1) if relative else t, b

    fig = go.Figure()
    names = list(frames)
    tops = []
    for i, name in enumerate(names):
        y, _ = values(frames[name])
        tops.append(y)
        x = [name] if total else frames[name]["step"].astype(str)
        fmt = "%{y:.2f}%" if relative else "%{y:.3f} s"
        fig.add_trace(go.Bar(x=x, y=y, name=name, marker_color=qualitative.D3[i % 10],
                             showlegend=not total,
                             hovertemplate=("%{x}: " if total else "step %{x}: ") + fmt
                             + "<extra>" + name + "</extra>"))
    first = frames[names[0]]
    if "bound_s" in first.columns and not relative:
        _, b = values(first)
        tops.append(b)
        fig.add_trace(go.Scatter(x=names if total else first["step"].astype(str),
                                 y=np.repeat(b, len(names)) if total else b, mode="markers",
                                 name="bound (perfect schedule)",
                                 marker={"symbol": "line-ew-open", "size": 40, "color": "#000",
                                             "line": {"width": 2}},
                                 hovertemplate="bound %{y:.3f} s<extra></extra>"))
    fig.update_layout(template=TEMPLATE, barmode="group", height=420,
                      title=title or ("simulated time, all steps" if total
                                      else "simulated step time"),
                      xaxis={"title": {"text": "policy" if total else "step"},
                                 "type": "category"},
                      yaxis={"title": {"text": unit}, "range": headroom(*tops)},
                      legend=LEGEND_BELOW)
    return fig


def timeline_figure(timelines, step: int = 0, *, title: str | None = None) -> go.Figure:
    """One step's simulated per-rank timeline: micro-batches as bars, then the wait.

    Each rank's micro-batches are drawn one after the other (alternating
    shades mark their boundaries; hover for FLOPs, tokens and samples); the
    grey bar is the time a rank waits for the slowest one before the
    gradient all-reduce.

    Parameters
    ----------
    timelines:
        A table with one row per (step, rank, micro-batch) and columns
        ``step, rank, start_s, end_s`` (optionally ``micro_batch, flops,
        tokens, samples``), as ``varbatch_kit.analysis.simulate.simulate(...).timelines``.
    step:
        Which step to draw.
    """
    import pandas as pd

    df = pd.DataFrame(timelines)
    need = [c for c in ("step", "rank", "start_s", "end_s") if c not in df.columns]
    if need:
        raise ValueError(f"timelines lack column(s) {need}; columns are {list(df.columns)}")
    df = df[df["step"] == step]
    if df.empty:
        raise ValueError(f"timelines have no rows for step={step!r}")
    ranks = df["rank"].to_numpy()
    mb = df["micro_batch"].to_numpy() if "micro_batch" in df.columns else np.zeros(len(df))
    extra = [df[c].to_numpy(dtype=np.float64) if c in df.columns else np.full(len(df), np.nan)
             for c in ("flops", "tokens", "samples")]
    custom = np.column_stack([mb, df["start_s"], df["end_s"], *extra]).astype(np.float64)
    fig = go.Figure()
    fig.add_trace(go.Bar(
        y=ranks.astype(str), x=(df["end_s"] - df["start_s"]).to_numpy(),
        base=df["start_s"].to_numpy(), orientation="h", name="micro-batch",
        # colour strings (numbers and a colorscale make plotly.js warn once per bar)
        marker={"color": np.where(mb % 2 == 0, "#1f77b4", "#6baed6").tolist(),
                "line": {"width": 0}},
        customdata=custom,
        hovertemplate=("rank %{y}, micro-batch %{customdata[0]:d}: %{customdata[1]:.3f}–"
                       "%{customdata[2]:.3f} s<br>%{customdata[3]:.3s} FLOPs, "
                       "%{customdata[4]:d} tokens, %{customdata[5]:d} samples<extra></extra>")))
    ends = df.groupby("rank")["end_s"].max()
    end = float(ends.max())
    fig.add_trace(go.Bar(
        y=ends.index.astype(str), x=(end - ends).to_numpy(), base=ends.to_numpy(),
        orientation="h", name="waiting for the slowest rank", marker={"color": "#d9d9d9"},
        hovertemplate="rank %{y} waits %{x:.3f} s<extra></extra>"))
    fig.add_vline(x=end, line={"color": "#d62728", "dash": "dash"},
                  annotation_text=f"all-reduce at {end:.3f} s")
    n_ranks = int(df["rank"].nunique())
    fig.update_layout(template=TEMPLATE, barmode="overlay", height=max(300, 16 * n_ranks + 160),
                      title=title or f"simulated timeline of step {step}",
                      xaxis={"title": {"text": "seconds from the start of the step"},
                             "range": headroom(end, frac=0.08)},
                      yaxis={"title": {"text": "DP rank"}, "autorange": "reversed",
                                 "type": "category"},
                      legend=LEGEND_BELOW)
    return fig


def measured_vs_predicted_figure(fit: Any, labels: Any = None, *,
                                 title: str = "micro-batch time: measured vs predicted"
                                 ) -> go.Figure:
    """A fitted cost model's micro-batch times: measured (y) against predicted (x).

    ``fit``: what :func:`varbatch_kit.analysis.cost_model.fit_with_holdout`
    returns (``predicted_s``, ``measured_s``, ``fit_index``, ``heldout_index``);
    ``labels``: one hover text per micro-batch (optional). The fitted points and
    the held-out ones are two marker series; the dotted diagonal is
    ``measured = predicted``. Drawn in the shared style (template, palette,
    legend row below the plot) like every other figure.
    """
    predicted = np.asarray(fit.predicted_s, dtype=np.float64)
    measured = np.asarray(fit.measured_s, dtype=np.float64)
    fig = go.Figure()
    for j, (name, idx) in enumerate((("fitted (grid)", fit.fit_index),
                                     ("held out (random)", fit.heldout_index))):
        idx = np.asarray(idx, dtype=np.int64)
        fig.add_scatter(x=predicted[idx], y=measured[idx], mode="markers", name=name,
                        marker={"color": PALETTE[j], "size": 7},
                        text=None if labels is None else [labels[i] for i in idx],
                        hovertemplate=("predicted %{x:.4f} s, measured %{y:.4f} s"
                                       + ("<br>%{text}" if labels is not None else "")
                                       + "<extra>" + name + "</extra>"))
    top = float(max(predicted.max(), measured.max())) * 1.05 if predicted.size else 1.0
    fig.add_scatter(x=[0, top], y=[0, top], mode="lines", name="measured = predicted",
                    line={"dash": "dot", "color": "grey"}, hoverinfo="skip")
    fig.update_layout(template=TEMPLATE, title=title, height=420, legend=LEGEND_BELOW,
                      xaxis={"title": {"text": "predicted (s)"}, "range": [0, top]},
                      yaxis={"title": {"text": "measured (s)"}, "range": [0, top]})
    return fig
