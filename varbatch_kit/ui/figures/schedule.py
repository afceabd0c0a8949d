"""Figures of one rollout batch and its schedule: lengths, one step's micro-batches on
DP ranks (packing), per-rank FLOPs and tokens against the bound (balance), step sizes."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from varbatch_kit.analysis.quality import CAP_VIOLATIONS, OVERSIZE_ALONE
from varbatch_kit.core.flops import ModelShape
from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.core.schedule import Schedule
from varbatch_kit.ui.figures.style import (
    HEADROOM,
    LEGEND_BELOW,
    OVER_CAP_COLOR,
    PALETTE,
    ROLLOUT_COLORS,
    SINGLE_SAMPLE_COLOR,
    TEMPLATE,
    headroom,
)

# Trace order of the packing figure (fixed, so widgets can update in place).
PACKING_TRACE_NAMES = ("samples", "micro-batches", "over cap", "token cap",
                       "single-sample rollouts")
#: the legend entry that says what grey means (shown when a step has grey samples)
SINGLE_SAMPLE_LEGEND = "grey: single-sample rollouts (a multi-sample rollout has one colour)"
#: The two bounds on the busiest rank, named the same way in the figures, the tables
#: (``mean_mb_makespan_ratio`` / ``mean_makespan_ratio``) and notebook 02.
BOUND_THIS_PACKING = "bound for this packing"  # max(step / dp, largest micro-batch)
BOUND_ANY_PACKING = "bound for any packing"  # max(step / dp, largest sample)
# Trace order of the balance figure.
BALANCE_TRACE_NAMES = ("rank FLOPs", f"{BOUND_THIS_PACKING}: max(step FLOPs / dp, largest "
                       "micro-batch)", "rank tokens", f"tokens {BOUND_THIS_PACKING}")



def length_figure(rollouts: Rollouts, model: ModelShape | None = None, *, bins: int = 40
                  ) -> go.Figure:
    """Length distribution of a batch, and how FLOPs weigh long samples.

    Left: per length bin, the share of samples, of tokens and (with a model)
    of forward FLOPs. Long samples carry a larger share of FLOPs than of
    tokens because attention grows with ``L**2``. Right (with a model):
    forward FLOPs per token against length, ``c1 + c2*L``, split into the
    linear part ``c1`` (projections, MLP, LM head) and the attention term
    ``c2*L``; the annotation gives the attention share of the batch's FLOPs.

    Parameters
    ----------
    rollouts:
        The batch.
    model:
        Model shape for the FLOPs panels; ``None`` draws the token shares only.
    bins:
        Number of length bins.
    """
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins!r}")
    lengths = rollouts.total_len.astype(np.float64)
    lo, hi = float(lengths.min()), float(lengths.max())
    edges = np.linspace(lo, hi if hi > lo else lo + 1, bins + 1)
    idx = np.clip(np.searchsorted(edges, lengths, side="right") - 1, 0, bins - 1)
    centers = (edges[:-1] + edges[1:]) / 2
    width = float(edges[1] - edges[0])
    count = np.bincount(idx, minlength=bins)
    tokens = np.bincount(idx, weights=lengths, minlength=bins)
    labels = [f"{int(a)}-{int(b)}" for a, b in itertools.pairwise(edges)]

    cols = 2 if model is not None else 1
    fig = make_subplots(
        rows=1, cols=cols, horizontal_spacing=0.12,
        subplot_titles=("share per length bin",) + (("forward FLOPs per token",)
                                                   if model is not None else ()),
    )
    shares = [("samples", count / count.sum(), "#7f7f7f"),
              ("tokens", tokens / tokens.sum(), "#1f77b4")]
    if model is not None:
        flops = model.forward_flops(lengths)
        fl = np.bincount(idx, weights=flops, minlength=bins)
        shares.append(("FLOPs", fl / fl.sum(), "#d62728"))
    for name, y, color in shares:
        fig.add_trace(go.Bar(
            x=centers, y=100 * y, name=f"% of {name}", marker_color=color, width=width / 3.2,
            customdata=labels, hovertemplate="length %{customdata}: %{y:.2f}% of " + name +
            "<extra></extra>"), row=1, col=1)
    fig.update_layout(barmode="group", bargap=0.05)
    fig.update_xaxes(title_text="sample length (prompt + response tokens)", row=1, col=1)
    fig.update_yaxes(title_text="% of batch", range=headroom(*(100 * y for _, y, _ in shares)),
                     row=1, col=1)
    title = (f"{len(rollouts)} samples, {rollouts.num_rollouts} rollouts, "
             f"median {int(np.median(lengths))} tokens, max {int(hi)}")
    if model is not None:
        c1, c2 = model.flops_coefficients()
        grid = np.linspace(0, hi, 200)
        fig.add_trace(go.Scatter(
            x=grid, y=np.full_like(grid, c1), name="linear part c1 (GEMMs, LM head)",
            mode="lines", line={"color": "#1f77b4", "dash": "dash"},
            hovertemplate="linear: %{y:.3s} FLOPs/token<extra></extra>"), row=1, col=2)
        fig.add_trace(go.Scatter(
            x=grid, y=c1 + c2 * grid, name="c1 + c2*L (with attention)", mode="lines",
            fill="tonexty", line={"color": "#d62728"},
            hovertemplate="L=%{x:.0f}: %{y:.3s} FLOPs/token<extra></extra>"), row=1, col=2)
        share = float((c2 * lengths ** 2).sum() / flops.sum())
        at_max = float(c2 * hi / (c1 + c2 * hi))
        fig.add_annotation(
            xref="x2 domain", yref="y2 domain", x=0.02, y=0.98, showarrow=False, align="left",
            xanchor="left", yanchor="top",
            text=(f"attention L² term: {100 * share:.1f}% of the batch's FLOPs<br>"
                  f"{100 * at_max:.1f}% of a {int(hi)}-token sample's"))
        fig.update_xaxes(title_text="sample length L (tokens)", row=1, col=2)
        fig.update_yaxes(title_text="forward FLOPs per token", rangemode="tozero", row=1, col=2)
        title += f" — {model.name}"
    fig.update_layout(title=title, template=TEMPLATE, height=460, legend=LEGEND_BELOW)
    return fig


def rollout_colors(step_rollout_ids: np.ndarray, sample_rollout_ids: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Per sample: its colour index in :data:`ROLLOUT_COLORS` and its rollout's size.

    Every sample of a rollout gets the same colour. When the step has
    rollouts of several samples (compact / sub-agent flows), those get the
    palette's colours, cycling in the step's rollout order (neighbours differ),
    and single-sample rollouts the grey ``len(PALETTE)``, so the siblings of
    one rollout stand out wherever the packing put them; otherwise every
    rollout cycles through the palette. The second array is the number of
    samples of each sample's rollout in the step (what the hover shows).
    """
    step_ids = np.asarray(step_rollout_ids)
    rid = np.asarray(sample_rollout_ids)
    sorter = np.argsort(step_ids, kind="stable")
    pos = sorter[np.searchsorted(step_ids, rid, sorter=sorter)]  # rollout's place in the step
    sizes = np.bincount(pos, minlength=step_ids.size)
    multi = sizes > 1
    if multi.any():
        rank = np.cumsum(multi) - 1  # place among the multi-sample rollouts
        per_rollout = np.where(multi, rank % len(PALETTE), len(PALETTE))
    else:
        per_rollout = np.arange(step_ids.size) % len(PALETTE)
    return per_rollout[pos].astype(np.int64), sizes[pos].astype(np.int64)


def packing_traces(schedule: Schedule, step: int = 0) -> dict[str, Any]:
    """The data of :func:`packing_figure` as plain arrays (what a widget applies in place).

    Returns a dict with ``traces`` (one update dict per name in
    :data:`PACKING_TRACE_NAMES`, in that order), ``layout`` (a layout update)
    and ``info`` (``micro_batches``, ``over_cap``, ``samples``, ``tokens``,
    ``cap``, ``dp``).
    """
    st = schedule.step(step)
    s = st.index
    cfg = schedule.config
    dp = cfg.dp
    m = st.num_microbatches
    order = [b for bins in st.dp_rank_bins for b in bins]  # micro-batches DP rank after rank
    mbs = [st.micro_batches[b] for b in order]
    sizes = np.fromiter((mb.size for mb in mbs), dtype=np.int64, count=len(mbs))
    members = np.concatenate(mbs)
    k = len(mbs)
    mb_of = np.repeat(np.arange(k), sizes)
    rank_of_mb = np.repeat(np.arange(dp), m)
    pos_in_rank = np.tile(np.arange(m), dp)
    x_mb = rank_of_mb * (m + 1) + pos_in_rank  # one-slot gap between ranks

    tokens = schedule.rollouts.total_len[members]
    csum = np.cumsum(tokens)
    mb_end = np.cumsum(np.bincount(mb_of, weights=tokens, minlength=k)).astype(np.int64)
    mb_tokens = np.diff(np.concatenate(([0], mb_end)))
    base = csum - tokens - (mb_end - mb_tokens)[mb_of]
    flops = (schedule.sample_flops[members] if schedule.sample_flops is not None
             else np.full(members.size, np.nan))
    rid = schedule.rollouts.rollout_id[members]
    color, siblings = rollout_colors(st.rollout_ids, rid)
    # hover columns: sample, rollout id, FLOPs, rank, micro-batch, micro-batch tokens,
    # samples of the rollout in this step
    custom = np.column_stack([members, rid, flops, rank_of_mb[mb_of], pos_in_rank[mb_of],
                              mb_tokens[mb_of], siblings]).astype(np.float64)

    cap = cfg.cap
    over = (mb_tokens > cap) if cap is not None else np.zeros(k, dtype=bool)
    violations = int((over & (sizes > 1)).sum())  # step_quality's cap_violations
    alone = int((over & (sizes == 1)).sum())  # and its oversize_alone
    line_width = np.where(over, 2.5, 0.8)
    x_lo, x_hi = -0.6, float(x_mb[-1]) + 0.6
    y_top = float(mb_tokens.max()) if k else 0.0
    if cap is not None:
        y_top = max(y_top, float(cap))
    traces = [
        # int32/float arrays travel to the browser as binary buffers (int64 would be lists)
        {"x": x_mb[mb_of].astype(np.int32), "y": tokens.astype(np.int32),
             "base": base.astype(np.int32), "customdata": custom,
             "marker": {"color": ROLLOUT_COLORS[color].tolist()}},
        {"x": x_mb.astype(np.int32), "y": mb_tokens.astype(np.int32),
             "marker": {"line": {"color": over.astype(np.int32), "width": line_width}}},
        # red: two or more samples over the cap (a cap violation); orange: one sample longer
        # than the cap, alone in its micro-batch (oversize (alone): unavoidable)
        {"x": x_mb[over].astype(np.int32), "y": mb_tokens[over] + 0.03 * y_top,
             "customdata": np.column_stack([mb_tokens[over], sizes[over]]).astype(np.float64),
             "marker": {"color": (sizes[over] == 1).astype(np.int32)},
             "name": f"over cap (▼ red: {violations} {CAP_VIOLATIONS}, orange: {alone} "
                     f"{OVERSIZE_ALONE})"},
        {"x": [x_lo, x_hi] if cap is not None else [],
             "y": [cap, cap] if cap is not None else [],
             "name": f"token cap {cap}" if cap is not None else "no token cap (static)"},
        {"showlegend": bool((color == len(PALETTE)).any())},  # grey in this step
    ]
    n_ticks = dp if dp <= 32 else 16
    tick_ranks = np.unique(np.linspace(0, dp - 1, n_ticks).round().astype(int))
    policy = f"{cfg.packing} + {cfg.distribution}"
    title = (f"step {s}: {st.num_samples} samples, {int(tokens.sum())} tokens in {k} "
             f"micro-batches ({m} per rank × dp {dp})<br>{policy}")
    if over.any():  # the words and counts of the tables' cap_violations, oversize_alone
        title += f" — {violations} {CAP_VIOLATIONS}, {alone} {OVERSIZE_ALONE}"
    layout = {
        "title": {"text": title},
        "xaxis": {"tickvals": (tick_ranks * (m + 1) + (m - 1) / 2).tolist(),
                   "ticktext": [f"r{r}" for r in tick_ranks], "range": [x_lo, x_hi]},
        # head-room above the tallest bar and its over-cap marker (drawn at +3%)
        "yaxis": {"range": [0, (1.03 + HEADROOM) * y_top if y_top else 1]},
    }
    info = {"micro_batches": k, "over_cap": int(over.sum()), "cap_violations": violations,
            "oversize_alone": alone, "samples": int(members.size), "tokens": int(tokens.sum()),
            "cap": cap, "dp": dp, "step": s}
    return {"traces": traces, "layout": layout, "info": info}


def empty_packing_figure() -> go.Figure:
    """The packing figure's traces (:data:`PACKING_TRACE_NAMES`) and static layout, without
    data."""
    fig = go.Figure()
    fig.add_trace(go.Bar(
        name="samples", marker={"line": {"width": 0}},
        hovertemplate=("sample %{customdata[0]:d}, rollout %{customdata[1]:d} "
                       "(%{customdata[6]:d} sample(s) in this step)<br>"
                       "tokens %{y:d}, FLOPs %{customdata[2]:.3s}<br>"
                       "rank %{customdata[3]:d}, micro-batch %{customdata[4]:d} "
                       "(%{customdata[5]:d} tokens)<extra></extra>"),
        showlegend=False))
    fig.add_trace(go.Bar(
        name="micro-batches", hoverinfo="skip", showlegend=False,
        marker={"color": "rgba(0,0,0,0)", "line": {
            "colorscale": [[0, "#444444"], [1, OVER_CAP_COLOR]], "cmin": 0, "cmax": 1}}))
    fig.add_trace(go.Scatter(
        name="over cap", mode="markers",
        marker={"symbol": "triangle-down", "size": 9, "cmin": 0, "cmax": 1,
                    "colorscale": [[0, OVER_CAP_COLOR], [1, "#ff9f1c"]]},
        hovertemplate=("over the token cap: %{customdata[0]:d} tokens in "
                       "%{customdata[1]:d} sample(s)<extra></extra>")))
    fig.add_trace(go.Scatter(
        name="token cap", mode="lines",
        line={"color": OVER_CAP_COLOR, "dash": "dash", "width": 1.5},
        hoverinfo="skip"))
    fig.add_trace(go.Scatter(  # a legend entry only: no point of its own
        name=SINGLE_SAMPLE_LEGEND, x=[None], y=[None], mode="markers", hoverinfo="skip",
        marker={"symbol": "square", "size": 11, "color": SINGLE_SAMPLE_COLOR},
        showlegend=False))
    fig.update_layout(
        template=TEMPLATE, barmode="overlay", bargap=0.15, height=460, hovermode="closest",
        xaxis={"title": {"text": "micro-batches, grouped by DP rank"}, "showgrid": False},
        yaxis={"title": {"text": "tokens per micro-batch"}},
        # below the plot, as every figure's: its long entries stay clear of the two-line title
        legend=LEGEND_BELOW, margin={"t": 80, "r": 20, "l": 60}, uirevision="packing",
    )
    return fig


def apply_traces(fig: go.Figure, data: dict[str, Any]) -> None:
    """Write a ``*_traces`` dict into ``fig`` (a Figure) in place.

    ``fig`` must come from the matching ``empty_*_figure`` (same trace order).
    """
    for trace, update in zip(fig.data, data["traces"]):
        trace.update(update, overwrite=False)
    fig.update_layout(data["layout"])


def packing_figure(schedule: Schedule, step: int = 0) -> go.Figure:
    """One step's micro-batches as stacked bars of samples.

    Micro-batches are grouped by the DP rank that trains them (``r0``, ``r1``,
    ... on the x axis, in training order); each bar stacks its samples,
    coloured by rollout (:func:`rollout_colors`: samples of one rollout share a
    colour; with compact rollouts in the step, single-sample rollouts are grey
    so the siblings stand out, and the legend says so). Hovering a segment shows
    the sample index, its rollout id and the rollout's sample count, tokens and
    FLOPs. The dashed line is the token cap ``max_tokens_per_gpu * cp``; a
    micro-batch over it gets a red outline and a ▼ marker (trace ``"over
    cap"``): red when it holds two or more samples (a cap violation, counted in
    ``cap_violations``), orange when it is a single sample longer than the cap
    (oversize (alone), counted in ``oversize_alone``: unavoidable). The title
    and the legend give both counts in those words, as the tables do.

    The figure always has the traces of :data:`PACKING_TRACE_NAMES`:
    ``samples`` (one bar segment per sample), ``micro-batches`` (one outline
    bar per micro-batch), ``over cap`` (one marker per over-cap micro-batch,
    empty when none), ``token cap`` (empty on the static path) and the legend
    entry of the grey single-sample rollouts (hidden when the step has none).
    """
    fig = empty_packing_figure()
    apply_traces(fig, packing_traces(schedule, step))
    return fig


def balance_traces(schedule: Schedule, steps: Sequence[int] | None = None) -> dict[str, Any]:
    """The data of :func:`balance_figure` as plain arrays (see :func:`packing_traces`).

    ``info`` holds per step ``flops_imbalance`` (max rank / mean rank),
    ``makespan_ratio`` (max rank FLOPs / the bound for this packing, ``max(step
    FLOPs / dp, largest micro-batch)``) and their worst values.
    """
    cfg = schedule.config
    dp = cfg.dp
    steps = list(range(schedule.num_steps)) if steps is None else [
        schedule.step(s).index for s in steps]
    tokens_all = schedule.rollouts.total_len
    flops_all = schedule.sample_flops
    xs, rf, rt, step_of = [], [], [], []
    bx, bf, bt = [], [], []
    ratio, imb = [], []
    for j, s in enumerate(steps):
        st = schedule.step(s)
        mb_t = np.array([int(tokens_all[mb].sum()) for mb in st.micro_batches], dtype=np.float64)
        mb_f = (np.array([float(flops_all[mb].sum()) for mb in st.micro_batches])
                if flops_all is not None else np.full(mb_t.size, np.nan))
        r_t = np.array([mb_t[b].sum() for b in st.dp_rank_bins])
        r_f = np.array([mb_f[b].sum() for b in st.dp_rank_bins])
        x0 = j * (dp + 1)
        xs.append(x0 + np.arange(dp))
        rf.append(r_f)
        rt.append(r_t)
        step_of.append(np.full(dp, s))
        lb_f = max(r_f.sum() / dp, mb_f.max()) if flops_all is not None else np.nan
        lb_t = max(r_t.sum() / dp, mb_t.max())
        bx += [x0 - 0.45, x0 + dp - 0.55, None]
        bf += [lb_f, lb_f, None]
        bt += [lb_t, lb_t, None]
        ratio.append(float(r_f.max() / lb_f) if flops_all is not None else np.nan)
        imb.append(float(r_f.max() / r_f.mean()) if flops_all is not None else np.nan)
    x = np.concatenate(xs)
    step_arr = np.concatenate(step_of)
    rank_arr = np.tile(np.arange(dp), len(steps))
    color = np.where(np.arange(len(steps)).repeat(dp) % 2 == 0, "#1f77b4", "#6baed6")
    f = np.concatenate(rf)
    t = np.concatenate(rt)
    lbf = np.repeat([bf[3 * j] for j in range(len(steps))], dp)
    lbt = np.repeat([bt[3 * j] for j in range(len(steps))], dp)
    custom_f = np.column_stack([step_arr, rank_arr, f / lbf]).astype(np.float64)
    custom_t = np.column_stack([step_arr, rank_arr, t / lbt]).astype(np.float64)
    traces = [
        {"x": x, "y": f, "customdata": custom_f, "marker": {"color": color}},
        {"x": bx, "y": bf},
        {"x": x, "y": t, "customdata": custom_t, "marker": {"color": color}},
        {"x": bx, "y": bt},
    ]
    n_ticks = min(len(steps), 16)
    tick_idx = np.unique(np.linspace(0, len(steps) - 1, n_ticks).round().astype(int))
    tickvals = (tick_idx * (dp + 1) + (dp - 1) / 2).tolist()
    ticktext = [f"step {steps[i]}" for i in tick_idx]
    worst = float(np.nanmax(ratio)) if flops_all is not None else float("nan")
    title = (f"DP balance, dp {dp}, {cfg.packing} + {cfg.distribution}:<br>busiest rank "
             f"{'n/a' if math.isnan(worst) else f'{100 * (worst - 1):.2f}%'} above the "
             f"{BOUND_THIS_PACKING} (worst step)")

    def zoom(values: np.ndarray, bounds: list) -> list[float] | None:
        """A y range around the bars' tops: the differences are a few percent."""
        b = np.asarray([v for v in bounds if v is not None], dtype=np.float64)
        v = np.concatenate([values, b])
        v = v[np.isfinite(v)]
        if v.size == 0:
            return None
        lo, hi = float(v.min()), float(v.max())
        pad = max(hi - lo, 0.01 * hi)
        return [max(0.0, lo - 0.6 * pad), hi + 0.25 * pad]

    layout = {
        "title": {"text": title},
        "xaxis": {"tickvals": tickvals, "ticktext": ticktext},
        "xaxis2": {"tickvals": tickvals, "ticktext": ticktext},
        "yaxis": {"range": zoom(f, bf)},
        "yaxis2": {"range": zoom(t, bt)},
    }
    info = {"steps": steps, "makespan_ratio": ratio, "flops_imbalance": imb,
                "worst_makespan_ratio": worst,
                "worst_flops_imbalance": float(np.nanmax(imb)) if flops_all is not None else np.nan}
    return {"traces": traces, "layout": layout, "info": info}


def empty_balance_figure() -> go.Figure:
    """The balance figure's four traces and static layout, without data."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=("forward FLOPs per rank", "tokens per rank"))
    fig.add_trace(go.Bar(
        name="rank FLOPs", showlegend=False,
        hovertemplate=("step %{customdata[0]:d}, rank %{customdata[1]:d}: %{y:.4s} FLOPs, "
                       "%{customdata[2]:.4f}× the bound<extra></extra>")), row=1, col=1)
    fig.add_trace(go.Scatter(
        name=BALANCE_TRACE_NAMES[1], mode="lines",
        line={"color": "#d62728", "width": 2}, hovertemplate="bound %{y:.4s}<extra></extra>"),
        row=1, col=1)
    fig.add_trace(go.Bar(
        name="rank tokens", showlegend=False,
        hovertemplate=("step %{customdata[0]:d}, rank %{customdata[1]:d}: %{y:d} tokens, "
                       "%{customdata[2]:.4f}× the bound<extra></extra>")), row=2, col=1)
    fig.add_trace(go.Scatter(
        name=BALANCE_TRACE_NAMES[3], mode="lines", showlegend=False,
        line={"color": "#d62728", "width": 2}, hovertemplate="bound %{y:.0f}<extra></extra>"),
        row=2, col=1)
    fig.update_yaxes(title_text="FLOPs (axis zoomed)", exponentformat="SI", row=1, col=1)
    fig.update_yaxes(title_text="tokens (axis zoomed)", exponentformat="SI", row=2, col=1)
    fig.update_xaxes(title_text="DP ranks, grouped by step", row=2, col=1)
    fig.update_layout(template=TEMPLATE, bargap=0.1, height=560, uirevision="balance",
                      legend={**LEGEND_BELOW, "x": 1, "xanchor": "right"},
                      margin={"t": 110, "r": 20, "l": 60, "b": 50})
    return fig


def balance_figure(schedule: Schedule, steps: Sequence[int] | None = None) -> go.Figure:
    """Per-step, per-rank forward FLOPs (top) and tokens (bottom) with the bound for this packing.

    The y axes are zoomed on the bars' tops (the differences are a few
    percent). The red segment over each step is the *bound for this packing*
    on the busiest rank, ``max(step total / dp, largest micro-batch)``: no
    distribution of these micro-batches does better (the *bound for any
    packing*, ``max(step total / dp, largest sample)``, is the tables'
    ``mean_makespan_ratio``; it is lower when a micro-batch holds more than
    its largest sample). The gap between the tallest bar and the line
    is what a better distribution could still win (the title gives the worst
    step). FLOPs need a model shape on the schedule; without one the FLOPs
    panel is empty.

    Parameters
    ----------
    schedule:
        The schedule.
    steps:
        Step indices to draw (default all).
    """
    fig = empty_balance_figure()
    apply_traces(fig, balance_traces(schedule, steps))
    return fig


def step_sizes_figure(schedule: Schedule) -> go.Figure:
    """Samples, tokens and micro-batches per step: what a variable global batch size looks like.

    Every step holds ``global_batch_size`` rollouts; with multi-sample
    rollouts the number of samples (and tokens) per step varies, and so does
    the number of micro-batches each rank runs.
    """
    steps = schedule.steps
    x = [st.index for st in steps]
    samples = [st.num_samples for st in steps]
    tokens = [int(schedule.rollouts.total_len[st.sample_indices].sum()) for st in steps]
    per_rank = [st.num_microbatches for st in steps]
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.08, subplot_titles=(
        "samples per step", "tokens per step", "micro-batches per rank"))
    fig.add_trace(go.Bar(x=x, y=samples, name="samples",
                         marker_color="#1f77b4", customdata=[st.num_rollouts for st in steps],
                         hovertemplate="step %{x}: %{y} samples from %{customdata} rollouts"
                         "<extra></extra>"), row=1, col=1)
    fig.add_trace(go.Bar(x=x, y=tokens, name="tokens", marker_color="#ff7f0e",
                         hovertemplate="step %{x}: %{y} tokens<extra></extra>"), row=1, col=2)
    fig.add_trace(go.Bar(x=x, y=per_rank, name="micro-batches",
                         marker_color="#2ca02c",
                         hovertemplate="step %{x}: %{y} per rank<extra></extra>"), row=1, col=3)
    for c, y in enumerate((samples, tokens, per_rank), start=1):
        fig.update_xaxes(title_text="step", row=1, col=c)
        fig.update_yaxes(range=headroom(y), row=1, col=c)
    fig.update_layout(template=TEMPLATE, height=330, showlegend=False,
                      title=(f"{schedule.num_steps} steps of {schedule.config.global_batch_size} "
                             f"rollouts each (dp {schedule.config.dp})"))
    return fig
