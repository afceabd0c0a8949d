"""Figures of policy comparisons: a quality metric over a sweep of caps and dp, and every
(packing, distribution) pair side by side."""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from varbatch_kit.analysis.quality import CAP_VIOLATIONS, OVERSIZE_ALONE
from varbatch_kit.ui.figures.style import (
    LEGEND_BELOW,
    TEMPLATE,
    headroom,
)

SWEEP_METRICS = {
    "flops_imbalance": "DP FLOPs imbalance (max rank / mean, worst step)",
    "makespan_ratio": "busiest rank / bound for any packing (worst step)",
    "micro_batches": "micro-batches (all steps)",
    "mb_ratio": "micro-batches / ceil(tokens / cap)",
    "cap_violations": f"{CAP_VIOLATIONS} (micro-batches of two or more samples over the cap)",
    "token_imbalance": "DP token imbalance (worst step)",
}


def sweep_heatmap(table, metric: str = "flops_imbalance", *, title: str | None = None
                  ) -> go.Figure:
    """A heat-map of one column of :func:`~varbatch_kit.analysis.sweeps.sweep_table` over
    ``max_tokens_per_gpu × dp``.

    Cells print their value; impossible layouts are blank and their hover
    shows the scheduler's error.

    Parameters
    ----------
    table:
        The output of :func:`varbatch_kit.analysis.sweeps.sweep_table` (or any table with columns
        ``max_tokens_per_gpu``, ``dp``, ``metric`` and optionally ``error``).
    metric:
        Column to colour by; one of :data:`SWEEP_METRICS` or any numeric column.
    """
    if metric not in table.columns:
        raise ValueError(f"metric={metric!r} is not a column of the sweep table; choose one of "
                         f"{[c for c in table.columns if c not in ('dp', 'max_tokens_per_gpu')]}")
    z = table.pivot(index="dp", columns="max_tokens_per_gpu", values=metric)
    err = (table.pivot(index="dp", columns="max_tokens_per_gpu", values="error")
           if "error" in table.columns else None)
    zv = z.to_numpy(dtype=np.float64)
    integer = metric in ("micro_batches", "cap_violations")
    text = [["" if not np.isfinite(v) else (f"{int(v)}" if integer else f"{v:.3f}")
             for v in row] for row in zv]
    hover = [[(f"cap {c}, dp {d}: " + (text[i][j] if np.isfinite(zv[i, j]) else
                                        "impossible: " + str(err.iloc[i, j])[:160]))
              for j, c in enumerate(z.columns)] for i, d in enumerate(z.index)]
    fig = go.Figure(go.Heatmap(
        z=zv, x=[str(c) for c in z.columns], y=[str(d) for d in z.index], text=text,
        texttemplate="%{text}", customdata=hover, hovertemplate="%{customdata}<extra></extra>",
        colorscale="Viridis" if metric in ("micro_batches",) else "RdYlGn_r",
        colorbar={"title": {"text": metric}}))
    fig.update_layout(
        template=TEMPLATE, height=420,
        title=title or SWEEP_METRICS.get(metric, metric),
        xaxis={"title": {"text": "max_tokens_per_gpu"}, "type": "category"},
        yaxis={"title": {"text": "dp"}, "type": "category"})
    return fig


def policy_figure(table, *, title: str | None = None) -> go.Figure:
    """Policies side by side: busiest rank vs its bound, micro-batches vs theirs, cap violations.

    Parameters
    ----------
    table:
        The output of :func:`varbatch_kit.analysis.sweeps.policy_table` (optionally with a ``trace``
        column: one group of bars per trace).
    """
    import pandas as pd

    df = pd.DataFrame(table)
    df = df[df["error"].fillna("") == ""] if "error" in df.columns else df
    label = df["packing"] + " + " + df["distribution"]
    groups = list(dict.fromkeys(df["trace"])) if "trace" in df.columns else [None]
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.09, subplot_titles=(
        "busiest rank / bound for any packing − 1<br>(mean over steps)",
        "micro-batches / ceil(tokens / cap) − 1<br>(all steps)",
        f"{CAP_VIOLATIONS}: micro-batches of<br>two or more samples over the cap"))
    panels: list[list[Any]] = [[], [], []]
    for i, g in enumerate(groups):
        sel = df if g is None else df[df["trace"] == g]
        lab = label[sel.index]
        color = qualitative.D3[i % 10]
        name = "policy" if g is None else str(g)
        cols = [100 * (sel["mean_makespan_ratio"] - 1),
                100 * (sel["micro_batches"] / sel["mb_lower_bound"] - 1),
                sel["cap_violations"]]
        for j, y in enumerate(cols):
            panels[j].append(y)
            fig.add_trace(go.Bar(x=lab, y=y, name=name, legendgroup=name, marker_color=color,
                                 showlegend=j == 0 and g is not None,
                                 hovertemplate="%{x}: %{y:.3g}<extra>" + name + "</extra>"),
                          row=1, col=j + 1)
    for j, ytitle in enumerate(("% above the bound", "% above the bound", "micro-batches")):
        fig.update_yaxes(title_text=ytitle, range=headroom(*panels[j]), row=1, col=j + 1)
    over = pd.concat(panels[2]) if panels[2] else pd.Series(dtype=float)
    if not (over.fillna(0) > 0).any():  # an all-zero panel would draw as an empty plot
        alone = int(df["oversize_alone"].fillna(0).sum()) if "oversize_alone" in df else 0
        note = "no micro-batch of two or more<br>samples over the cap"
        if alone:
            note += f"<br>({alone} lone samples longer<br>than the cap: {OVERSIZE_ALONE})"
        fig.add_annotation(text=note, xref="x3 domain", yref="y3 domain", x=0.5, y=0.5,
                           showarrow=False, font={"size": 13})
        fig.update_yaxes(range=[0, 1], showticklabels=False, row=1, col=3)
    fig.update_xaxes(tickangle=-45)
    fig.update_annotations(font_size=13)  # the subplot titles
    fig.update_layout(template=TEMPLATE, barmode="group", height=520,
                      title=title or "scheduling policies compared",
                      legend={**LEGEND_BELOW, "title": {"text": "trace "}},
                      margin={"t": 120})
    return fig
