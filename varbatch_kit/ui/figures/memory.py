"""Figure of predicted memory: each GPU's bytes at its peak in one step, stacked by kind
(from :func:`varbatch_kit.core.memory.predict_memory` or
:func:`varbatch_kit.train.runs.memory_report.memory_table`, whose measured peaks it marks)."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from varbatch_kit.ui.figures.style import LEGEND_BELOW, OVER_CAP_COLOR, PALETTE, TEMPLATE, headroom

#: the kinds of bytes, bottom to top, and their legend names
MEMORY_KINDS = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer states",
                "activations": "activations in flight", "cp_kv": "CP's gathered K/V",
                "logits": "logits and log-probs", "backward": "backward working set",
                "buffers": "buffers"}


def memory_figure(table: Any, *, step: int | None = None,
                  hardware_memory_gib: float | None = None,
                  title: str | None = None) -> go.Figure:
    """One step's predicted peak per GPU as bars stacked by kind (GiB), the device's memory
    as a line, and (a :func:`~varbatch_kit.train.runs.memory_report.memory_table`) each GPU's
    measured peak as a marker. ``step``: the step to draw (default: the one with the
    highest peak). The hover names the phase and the micro-batches in flight."""
    missing = [c for c in ("step", "rank", "peak_bytes", *MEMORY_KINDS)
               if c not in table.columns and not (c == "peak_bytes"
                                                  and "predicted_bytes" in table.columns)]
    if missing:
        raise ValueError(f"the table lacks {', '.join(missing)}: give predict_memory's or "
                         "memory_table's table")
    peak_col = "peak_bytes" if "peak_bytes" in table.columns else "predicted_bytes"
    if step is None:
        step = int(table.loc[table[peak_col].idxmax(), "step"])
    rows = table[table["step"] == step].sort_values("rank")
    if rows.empty:
        raise ValueError(f"step={step} is not in the table (steps {sorted(set(table['step']))})")
    gib = 2**30
    fig = go.Figure()
    for i, (kind, name) in enumerate(MEMORY_KINDS.items()):
        if not rows[kind].any():
            continue
        fig.add_bar(x=rows["rank"], y=rows[kind] / gib, name=name,
                    marker_color=PALETTE[i % len(PALETTE)],
                    customdata=rows[["peak_phase"]].assign(
                        mbs=rows["peak_micro_batches"].map(str)).to_numpy(),
                    hovertemplate=f"GPU %{{x}}: {name} %{{y:.3f}} GiB<br>peak in "
                                  "%{customdata[0]}, micro-batches %{customdata[1]}"
                                  "<extra></extra>")
    tops = [float(rows[peak_col].max()) / gib]
    if "measured_bytes" in rows.columns:
        fig.add_scatter(x=rows["rank"], y=rows["measured_bytes"] / gib, mode="markers",
                        name="measured peak", marker={"symbol": "diamond", "size": 9,
                                                      "color": "black"})
        tops.append(float(rows["measured_bytes"].max()) / gib)
    if hardware_memory_gib is not None:
        fig.add_hline(y=hardware_memory_gib, line_color=OVER_CAP_COLOR, line_dash="dash",
                      annotation_text=f"device memory {hardware_memory_gib:g} GiB")
        tops.append(hardware_memory_gib)
    fig.update_layout(barmode="stack", template=TEMPLATE, legend=LEGEND_BELOW,
                      title=title or f"predicted peak memory per GPU, step {step}",
                      xaxis_title="GPU (world rank)", yaxis_title="GiB",
                      yaxis_range=headroom(*tops))
    return fig
