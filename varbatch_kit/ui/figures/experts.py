"""The expert load of a mixture-of-experts step under several layouts."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from varbatch_kit.ui.figures.style import TEMPLATE

_NEEDED = ("label", "step", "expert_tokens", "micro_batch_expert_max_over_mean")


def expert_load_figure(table, step: int = 1) -> go.Figure:
    """One step's expert load, one column per layout (a :func:`~varbatch_kit.train.compare`
    table of a mixture-of-experts model).

    Top row: the tokens routed to each expert (x) in each MoE layer (y), summed over the
    ranks: the same picture under every layout (the router sees the same tokens wherever
    they are packed). Bottom row: each of rank 0's micro-batches, its busiest expert's tokens
    over the mean (what an expert-parallel rank holding that expert waits for), which does
    depend on the packing; the dashed line is the step's busiest expert-parallel rank over
    the mean (``expert_parallel_load_max_over_mean``, 1.0 without expert parallelism).
    """
    import pandas as pd

    df = pd.DataFrame(table)
    missing = [c for c in _NEEDED if c not in df.columns]
    if missing:
        raise ValueError(f"the table lacks column(s) {missing}: pass compare()'s table of a "
                         "mixture-of-experts model (a dense model has no expert load)")
    rows = df[df["step"] == step]
    if rows.empty:
        raise ValueError(f"step={step}: the table has steps {sorted(set(df['step']))}")
    labels = list(dict.fromkeys(rows["label"]))
    fig = make_subplots(rows=2, cols=len(labels), subplot_titles=labels,
                        vertical_spacing=0.16, horizontal_spacing=0.06,
                        row_heights=[0.6, 0.4])
    top = max(float(np.max(r)) for r in rows["expert_tokens"])
    for col, label in enumerate(labels, start=1):
        row = rows[rows["label"] == label].iloc[0]
        tokens = np.asarray(row["expert_tokens"])
        fig.add_trace(go.Heatmap(z=tokens, x=[f"e{i}" for i in range(tokens.shape[1])],
                                 y=[f"layer {i}" for i in range(tokens.shape[0])],
                                 zmin=0, zmax=top, coloraxis="coloraxis",
                                 hovertemplate="%{y}, %{x}: %{z} tokens<extra></extra>"),
                      row=1, col=col)
        per_mb = list(row["micro_batch_expert_max_over_mean"])
        fig.add_trace(go.Bar(x=[f"mb {i}" for i in range(len(per_mb))], y=per_mb,
                             name=label, showlegend=False,
                             hovertemplate="%{x}: busiest expert %{y:.2f} x the mean"
                                           "<extra></extra>"),
                      row=2, col=col)
        ep = row.get("expert_parallel_load_max_over_mean")
        if ep is not None and not pd.isna(ep):
            fig.add_hline(y=float(ep), line_dash="dash", row=2, col=col)
    fig.update_yaxes(title_text="busiest / mean", row=2, col=1)
    fig.update_layout(template=TEMPLATE, coloraxis={"colorscale": "Blues",
                                                    "colorbar": {"title": "tokens"}},
                      title=f"Step {step}: tokens per expert (top) and per micro-batch "
                            "imbalance (bottom)",
                      height=520, width=max(520, 300 * len(labels)))
    return fig
