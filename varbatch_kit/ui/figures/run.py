"""A whole run's rollout steps: how each policy's simulated time and imbalance move over them."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from varbatch_kit.ui.figures.style import LEGEND_BELOW, TEMPLATE

#: the panels of :func:`run_quality_figure`, top to bottom: (column, axis title)
RUN_PANELS = (
    ("time_s", "simulated time (s)"),
    ("flops_imbalance", "FLOPs imbalance (busiest / mean rank)"),
)


def run_quality_figure(table, *, title: str | None = None) -> go.Figure:
    """Simulated time and FLOPs imbalance per rollout step, one line per policy.

    ``table`` is :func:`varbatch_kit.analysis.run_quality.run_quality_table`'s
    (columns ``rollout_id, policy`` and those of :data:`RUN_PANELS`): x is the
    rollout step (slime's ``rollout_id``), the top panel the simulated time of
    the step's training steps, the bottom one the worst training step's FLOPs
    imbalance (1 = even). Each panel has one trace per policy, in the table's
    order (a shared legend entry each); a policy that could not run a step
    leaves a gap there.
    """
    import pandas as pd

    df = pd.DataFrame(table)
    need = [c for c in ("rollout_id", "policy", *(c for c, _ in RUN_PANELS))
            if c not in df.columns]
    if need:
        raise ValueError(f"run_quality_figure needs column(s) {need}; pass the table of "
                         f"run_quality_table (columns are {list(df.columns)})")
    if df.empty:
        raise ValueError("the table is empty: run_quality_table gives one row per rollout step "
                         "and policy")
    fig = make_subplots(rows=len(RUN_PANELS), cols=1, shared_xaxes=True, vertical_spacing=0.1,
                        subplot_titles=[t for _, t in RUN_PANELS])
    policies = list(dict.fromkeys(df["policy"]))
    for i, policy in enumerate(policies):
        rows = df[df["policy"] == policy].sort_values("rollout_id", kind="stable")
        color = qualitative.D3[i % len(qualitative.D3)]
        for r, (col, _) in enumerate(RUN_PANELS, start=1):
            fmt = "%{y:.4f} s" if col == "time_s" else "%{y:.4f}"
            fig.add_trace(go.Scatter(
                x=rows["rollout_id"].to_numpy(np.int64),
                y=rows[col].to_numpy(np.float64), mode="lines+markers", name=policy,
                legendgroup=policy, showlegend=r == 1, line={"color": color},
                hovertemplate=f"rollout step %{{x}}: {fmt}<extra>{policy}</extra>"),
                row=r, col=1)
    fig.add_hline(y=1.0, line={"dash": "dot", "color": "#888", "width": 1},
                  row=len(RUN_PANELS), col=1)
    # a tick per step while they are few; plotly's own ticks beyond
    fig.update_xaxes(dtick=1 if df["rollout_id"].nunique() <= 20 else None)
    fig.update_xaxes(title_text="rollout step (rollout_id)", row=len(RUN_PANELS), col=1)
    fig.update_yaxes(rangemode="tozero", row=1, col=1)
    fig.update_layout(template=TEMPLATE, height=560, legend=LEGEND_BELOW,
                      title=title or f"the run's {df['rollout_id'].nunique()} rollout steps: "
                                     "simulated time and imbalance per policy")
    return fig
