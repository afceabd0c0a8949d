"""A step's context-parallel plan: ranks x rounds, each micro-batch drawn over its CP group.

Works the same for both CP modes: every step has placements
(:attr:`varbatch_kit.core.step.Step.placements`); a fixed-CP step's are DP rank
``d``'s ``j``-th micro-batch in round ``j`` over world ranks ``d*cp ..
d*cp+cp-1``, all of degree ``cp``. So the two can be put side by side or toggled.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go

from varbatch_kit.core.placement import Placement
from varbatch_kit.core.schedule import Schedule
from varbatch_kit.ui.figures.style import LEGEND_BELOW, TEMPLATE

__all__ = ["DEGREE_COLORS", "cp_plan_figure", "cp_plan_table", "step_placements"]

#: colour of each CP degree (others: grey); light for c = 1, darker as c grows
DEGREE_COLORS = {1: "#9ecae1", 2: "#fdae6b", 3: "#c7e9c0", 4: "#e6550d", 6: "#74c476",
                 8: "#a63603", 12: "#31a354", 16: "#54278f"}
IDLE_COLOR = "#f0f0f0"


def step_placements(schedule: Schedule, step: int = 0) -> list[Placement]:
    """The step's placements, one per micro-batch in bin order (the same for both CP modes)."""
    return list(schedule.step(step).placements)


def cp_plan_table(schedule: Schedule, step: int = 0, *, below_rank: int | None = None):
    """One row per micro-batch of the step: ``bin, round, degree, ranks, samples, tokens,
    tokens_per_rank`` (a pandas DataFrame, in bin order). ``below_rank``: only the
    micro-batches whose group holds a rank below it."""
    import pandas as pd

    st = schedule.step(step)
    lengths = schedule.rollouts.total_len
    rows = []
    for p in st.placements:
        if below_rank is not None and min(p.ranks) >= below_rank:
            continue
        mb = st.micro_batches[p.bin]
        t = int(lengths[mb].sum())
        rows.append({"bin": p.bin, "round": p.round, "degree": p.degree,
                     "ranks": tuple(p.ranks), "samples": int(mb.size), "tokens": t,
                     "tokens_per_rank": t / p.degree})
    return pd.DataFrame(rows)


def _runs(ranks: tuple[int, ...]) -> list[tuple[int, int]]:
    """Contiguous runs ``(first, last)`` of the sorted ranks of a group."""
    out: list[tuple[int, int]] = []
    for r in sorted(ranks):
        if out and r == out[-1][1] + 1:
            out[-1] = (out[-1][0], r)
        else:
            out.append((r, r))
    return out


def cp_plan_figure(schedule: Schedule, step: int = 0, *, max_ranks: int = 128) -> go.Figure:
    """One step's CP plan: world ranks (rows) x rounds (columns).

    Every micro-batch is a block over the ranks of its CP group in its round,
    outlined (trace ``"CP groups"``; a group of non-adjacent ranks is drawn as
    several outlined blocks with one label),
    coloured by its CP degree ``c`` (one legend entry per degree present);
    its label gives the tokens per rank ``Σ L / c``; hovering a block shows
    the micro-batch, its samples, tokens, degree and group. Light grey cells
    are idle rounds. The title compares the busiest rank's tokens with the
    cap ``max_tokens_per_gpu`` per rank. At most ``max_ranks`` ranks are
    drawn (the title says so when the pool is larger).
    """
    st = schedule.step(step)
    s = st.index
    cfg = schedule.config
    world = cfg.dp * cfg.cp
    shown = min(world, int(max_ranks))
    table = cp_plan_table(schedule, s, below_rank=shown)
    rounds = st.num_rounds
    busy = np.zeros((world, max(rounds, 1)), dtype=bool)

    fig = go.Figure()
    by_degree: dict[int, dict[str, list[Any]]] = {}
    labels: dict[str, list[Any]] = {"x": [], "y": [], "text": [], "customdata": []}
    outline: dict[str, list[Any]] = {"x": [], "y": []}
    for row in table.itertuples(index=False):
        group = ", ".join(str(r) for r in row.ranks)
        hover = (f"micro-batch {row.bin} · round {row.round}<br>{row.samples} samples, "
                 f"{row.tokens} tokens<br>CP degree {row.degree} on ranks {group}<br>"
                 f"{row.tokens_per_rank:.0f} tokens per rank")
        d = by_degree.setdefault(row.degree, {"x": [], "y": [], "base": [], "text": []})
        for w in row.ranks:
            busy[w, row.round] = True
            if w < shown:
                d["x"].append(0.9)
                d["y"].append(w)
                d["base"].append(row.round + 0.05)
                d["text"].append(hover)
        for lo, hi in _runs(row.ranks):  # one outline per contiguous run of the group
            if lo >= shown:
                continue
            x0, x1, y0, y1 = row.round + 0.05, row.round + 0.95, lo - 0.5, min(hi, shown - 1) + 0.5
            outline["x"] += [x0, x1, x1, x0, x0, None]
            outline["y"] += [y0, y0, y1, y1, y0, None]
        first, last = _runs(row.ranks)[0]
        if first < shown:
            labels["x"].append(row.round + 0.5)
            labels["y"].append((first + min(last, shown - 1)) / 2)
            labels["text"].append(f"{row.tokens_per_rank:.0f}")
            labels["customdata"].append(hover)
    idle = np.argwhere(~busy[:shown, :rounds])
    fig.add_trace(go.Bar(
        name="idle", orientation="h", x=[0.9] * len(idle), y=idle[:, 0].tolist(),
        base=(idle[:, 1] + 0.05).tolist(), marker={"color": IDLE_COLOR, "line": {"width": 0}},
        hovertemplate="rank %{y} idle<extra></extra>", showlegend=bool(len(idle))))
    for c in sorted(by_degree):
        d = by_degree[c]
        n_mb = int((table["degree"] == c).sum())
        fig.add_trace(go.Bar(
            name=f"c = {c} ({n_mb} micro-batches)", orientation="h", x=d["x"], y=d["y"],
            base=d["base"], hovertext=d["text"], hovertemplate="%{hovertext}<extra></extra>",
            marker={"color": DEGREE_COLORS.get(c, "#969696"), "line": {"width": 0}}))
    fig.add_trace(go.Scatter(
        name="CP groups", mode="lines", x=outline["x"], y=outline["y"],
        line={"color": "#333333", "width": 1.2}, hoverinfo="skip", showlegend=False))
    fig.add_trace(go.Scatter(
        name="tokens per rank", mode="text", x=labels["x"], y=labels["y"], text=labels["text"],
        customdata=labels["customdata"], hovertemplate="%{customdata}<extra></extra>",
        textfont={"size": 10}, showlegend=False))

    per_rank = np.zeros(world)
    for row in table.itertuples(index=False):
        for w in row.ranks:
            per_rank[w] += row.tokens_per_rank
    mode = cfg.cp_mode
    title = (f"step {s}: {len(st.micro_batches)} micro-batches on {world} ranks (dp {cfg.dp} × cp "
             f"{cfg.cp}, {mode} CP) in {rounds} rounds")
    if cfg.max_tokens_per_gpu is not None and len(table):
        worst = float(table["tokens_per_rank"].max())
        title += (f"<br>largest share {worst:.0f} tokens per rank (cap "
                  f"{cfg.max_tokens_per_gpu}); busiest rank {per_rank.max():.0f} tokens in all")
    if shown < world:
        title += f" — first {shown} of {world} ranks shown"
    fig.update_layout(
        title={"text": title}, template=TEMPLATE, barmode="overlay", bargap=0.0,
        height=max(260, 60 + 22 * shown), hovermode="closest", legend=LEGEND_BELOW,
        xaxis={"title": {"text": "round (every rank runs one micro-batch or idles per round)"},
               "range": [0, max(rounds, 1)], "showgrid": False,
               "tickvals": [k + 0.5 for k in range(rounds)],
               "ticktext": [str(k) for k in range(rounds)]},
        yaxis={"title": {"text": "world rank"}, "dtick": 1 if
               shown <= 32 else None, "range": [shown - 0.5, -0.5]},
        margin={"t": 80, "r": 20, "l": 60, "b": 90}, uirevision="cp-plan",
    )
    return fig

