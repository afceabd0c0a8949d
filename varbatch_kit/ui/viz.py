"""Plotly figures of rollouts, schedules, sweeps and metric reports.

One function per picture. Each takes core values (a :class:`Rollouts`, a
:class:`Schedule`, a table) and returns a ``plotly.graph_objects.Figure``;
nothing is displayed and no state is kept between calls. The tables come
from the pure modules (:mod:`varbatch_kit.analysis.sweeps`, :mod:`varbatch_kit.analysis.quality`,
:mod:`varbatch_kit.analysis.simulate`, :func:`varbatch_kit.train.compare`); nothing
here builds a schedule.

Text in figures is plain Unicode (``Σ``, ``²``, ``×``, ``≥``), never LaTeX:
plotly renders ``$...$`` with MathJax, which offline HTML pages do not have.
Bar panels leave about 10% headroom above the tallest bar, and legends sit
outside the plot area, clear of the subplot titles.

Figures whose data change interactively (:func:`packing_figure`,
:func:`balance_figure`) have a fixed set of traces whose arrays are computed
by a matching ``*_traces`` function; the explorers in
:mod:`varbatch_kit.ui.widgets` apply those dicts to a ``FigureWidget`` in place,
so a 4k-sample step is four array traces, not thousands of small ones.

Pictures
--------
- :func:`length_figure`: length distribution; share of samples, tokens and
  FLOPs per length bin, and FLOPs per token against length (the quadratic
  attention term).
- :func:`packing_figure`: one step's micro-batches as stacked bars of
  samples, grouped by DP rank, coloured by rollout, the token cap as a line
  and over-cap micro-batches marked.
- :func:`balance_figure`: FLOPs and tokens per rank per step with the lower
  bound ``max(total / dp, largest micro-batch)``.
- :func:`sweep_heatmap` (data from :func:`~varbatch_kit.analysis.sweeps.sweep_table`): a metric
  over ``max_tokens_per_gpu x dp``.
- :func:`report_figure`: reported metrics per step for several training
  configurations and their relative difference to a reference run.
- :func:`policy_figure` (data from :func:`~varbatch_kit.analysis.sweeps.policy_table`): every
  ``(packing, distribution)`` pair side by side.
- :func:`step_sizes_figure` and :func:`training_figure`: samples / tokens /
  micro-batches per step of a variable global batch size, and training
  curves from a per-step report table.
- :func:`step_time_figure` and :func:`timeline_figure`: simulated step times
  of several schedules and one step's per-rank timeline (from
  :mod:`varbatch_kit.analysis.simulate`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from varbatch_kit.core.flops import ModelShape
from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.core.schedule import Schedule

__all__ = [
    "BALANCE_TRACE_NAMES",
    "PACKING_TRACE_NAMES",
    "apply_traces",
    "balance_figure",
    "balance_traces",
    "empty_balance_figure",
    "empty_packing_figure",
    "length_figure",
    "packing_figure",
    "packing_traces",
    "policy_figure",
    "report_figure",
    "step_sizes_figure",
    "step_time_figure",
    "sweep_heatmap",
    "timeline_figure",
    "training_figure",
]

PALETTE = qualitative.Dark24
OVER_CAP_COLOR = "#d62728"
TEMPLATE = "plotly_white"

# Trace order of the packing figure (fixed, so widgets can update in place).
PACKING_TRACE_NAMES = ("samples", "micro-batches", "over cap", "token cap")
# Trace order of the balance figure.
BALANCE_TRACE_NAMES = ("rank FLOPs", "lower bound max(total/dp, largest micro-batch)",
                       "rank tokens", "tokens lower bound")


def _discrete_colorscale(colors: Sequence[str]) -> list[list[Any]]:
    """A step colorscale mapping integer ``i`` (with cmin=-0.5, cmax=n-0.5) to ``colors[i]``."""
    n = len(colors)
    scale: list[list[Any]] = []
    for i, c in enumerate(colors):
        scale.append([i / n, c])
        scale.append([(i + 1) / n, c])
    return scale


ROLLOUT_COLORSCALE = _discrete_colorscale(PALETTE)


#: Legend placement of every figure: a horizontal row at the bottom of the figure, in a
#: margin it reserves (``yref="container"``), so tick labels and axis titles are pushed
#: above it and it never covers a subplot title, an axis title or a bar.
LEGEND_BELOW = {"orientation": "h", "yref": "container", "y": 0, "yanchor": "bottom",
                "x": 0.5, "xanchor": "center"}
#: Head-room above the tallest bar of a bar panel (fraction of the data span).
HEADROOM = 0.1


def _headroom(*values: Any, frac: float = HEADROOM) -> list[float]:
    """A y range from 0 (or ``frac`` below the lowest negative value) to ``frac`` above the
    tallest value, so bars never touch the top of their panel."""
    arrays = [np.asarray(v, dtype=np.float64).ravel() for v in values]
    v = np.concatenate(arrays) if arrays else np.zeros(0)
    v = v[np.isfinite(v)]
    hi = max(float(v.max()), 0.0) if v.size else 0.0
    lo = min(float(v.min()), 0.0) if v.size else 0.0
    span = hi - lo
    if span == 0:
        return [0.0, 1.0]
    return [lo - frac * span if lo < 0 else 0.0, hi + frac * span]


def _si(value: float) -> str:
    """A compact engineering form: 1.23e12 -> '1.23T'."""
    if value is None or not np.isfinite(value):
        return "n/a"
    for div, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= div:
            return f"{value / div:.3g}{suffix}"
    return f"{value:.3g}"


# --------------------------------------------------------------- lengths
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
    fig.update_yaxes(title_text="% of batch", range=_headroom(*(100 * y for _, y, _ in shares)),
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


# --------------------------------------------------------------- packing
def _check_step(schedule: Schedule, step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not (
            0 <= step < schedule.num_steps):
        raise ValueError(f"step={step!r} is out of range: the schedule has steps "
                         f"0..{schedule.num_steps - 1}")
    return int(step)


def packing_traces(schedule: Schedule, step: int = 0) -> dict[str, Any]:
    """The data of :func:`packing_figure` as plain arrays (what a widget applies in place).

    Returns a dict with ``traces`` (one update dict per name in
    :data:`PACKING_TRACE_NAMES`, in that order), ``layout`` (a layout update)
    and ``info`` (``micro_batches``, ``over_cap``, ``samples``, ``tokens``,
    ``cap``, ``dp``).
    """
    s = _check_step(schedule, step)
    st = schedule.steps[s]
    cfg = schedule.config
    dp = cfg.dp
    m = st.num_microbatches
    order = [b for bins in st.rank_bins for b in bins]  # micro-batches rank after rank
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
    # colour by the rollout's position inside the step, so neighbouring rollouts differ
    sorter = np.argsort(st.rollout_ids, kind="stable")
    color = sorter[np.searchsorted(st.rollout_ids, rid, sorter=sorter)] % len(PALETTE)
    # hover columns: sample, rollout id, FLOPs, rank, micro-batch, micro-batch tokens
    custom = np.column_stack([members, rid, flops, rank_of_mb[mb_of], pos_in_rank[mb_of],
                              mb_tokens[mb_of]]).astype(np.float64)

    cap = cfg.cap
    over = (mb_tokens > cap) if cap is not None else np.zeros(k, dtype=bool)
    line_width = np.where(over, 2.5, 0.8)
    x_lo, x_hi = -0.6, float(x_mb[-1]) + 0.6
    y_top = float(mb_tokens.max()) if k else 0.0
    if cap is not None:
        y_top = max(y_top, float(cap))
    traces = [
        # int32/float arrays travel to the browser as binary buffers (int64 would be lists)
        {"x": x_mb[mb_of].astype(np.int32), "y": tokens.astype(np.int32),
             "base": base.astype(np.int32), "customdata": custom,
             "marker": {"color": color.astype(np.int32)}},
        {"x": x_mb.astype(np.int32), "y": mb_tokens.astype(np.int32),
             "marker": {"line": {"color": over.astype(np.int32), "width": line_width}}},
        # red: two or more samples over the cap (a violation); orange: one sample longer
        # than the cap, alone in its micro-batch (unavoidable)
        {"x": x_mb[over].astype(np.int32), "y": mb_tokens[over] + 0.03 * y_top,
             "customdata": np.column_stack([mb_tokens[over], sizes[over]]).astype(np.float64),
             "marker": {"color": (sizes[over] == 1).astype(np.int32)},
             "name": f"over cap ({int(over.sum())})"},
        {"x": [x_lo, x_hi] if cap is not None else [],
             "y": [cap, cap] if cap is not None else [],
             "name": f"token cap {cap}" if cap is not None else "no token cap (static)"},
    ]
    n_ticks = dp if dp <= 32 else 16
    tick_ranks = np.unique(np.linspace(0, dp - 1, n_ticks).round().astype(int))
    policy = f"{cfg.packing} + {cfg.distribution}"
    title = (f"step {s}: {st.num_samples} samples, {int(tokens.sum())} tokens in {k} "
             f"micro-batches ({m} per rank × dp {dp})<br>{policy}")
    if over.any():
        title += f" — {int(over.sum())} over the cap"
    layout = {
        "title": {"text": title},
        "xaxis": {"tickvals": (tick_ranks * (m + 1) + (m - 1) / 2).tolist(),
                   "ticktext": [f"r{r}" for r in tick_ranks], "range": [x_lo, x_hi]},
        # head-room above the tallest bar and its over-cap marker (drawn at +3%)
        "yaxis": {"range": [0, (1.03 + HEADROOM) * y_top if y_top else 1]},
    }
    info = {"micro_batches": k, "over_cap": int(over.sum()), "samples": int(members.size),
                "tokens": int(tokens.sum()), "cap": cap, "dp": dp, "step": s}
    return {"traces": traces, "layout": layout, "info": info}


def empty_packing_figure() -> go.Figure:
    """The packing figure's four traces and static layout, without data."""
    fig = go.Figure()
    fig.add_trace(go.Bar(
        name="samples", marker={"colorscale": ROLLOUT_COLORSCALE, "cmin": -0.5,
                                    "cmax": len(PALETTE) - 0.5, "line": {"width": 0}},
        hovertemplate=("sample %{customdata[0]:d} (rollout %{customdata[1]:d})<br>"
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
    fig.update_layout(
        template=TEMPLATE, barmode="overlay", bargap=0.15, height=460, hovermode="closest",
        xaxis={"title": {"text": "micro-batches, grouped by DP rank"}, "showgrid": False},
        yaxis={"title": {"text": "tokens per micro-batch"}},
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.0, "x": 1, "xanchor": "right"},
        margin={"t": 80, "r": 20, "l": 60, "b": 50}, uirevision="packing",
    )
    return fig


def apply_traces(fig: go.Figure, data: dict[str, Any]) -> None:
    """Write a ``*_traces`` dict into ``fig`` (a Figure or FigureWidget) in place.

    ``fig`` must come from the matching ``empty_*_figure`` (same trace order).
    """
    for trace, update in zip(fig.data, data["traces"]):
        trace.update(update, overwrite=False)
    fig.update_layout(data["layout"])


def packing_figure(schedule: Schedule, step: int = 0) -> go.Figure:
    """One step's micro-batches as stacked bars of samples.

    Micro-batches are grouped by the DP rank that trains them (``r0``, ``r1``,
    ... on the x axis, in training order); each bar stacks its samples,
    coloured by rollout (samples of one rollout share a colour). Hovering a
    segment shows the sample, its rollout id, tokens and FLOPs. The dashed
    line is the token cap ``max_tokens_per_gpu * cp``; a micro-batch over it
    gets a red outline and a ▼ marker (trace ``"over cap"``): red when it
    holds two or more samples (a cap violation), orange when it is a single
    sample longer than the cap (unavoidable).

    The figure always has the traces of :data:`PACKING_TRACE_NAMES`:
    ``samples`` (one bar segment per sample), ``micro-batches`` (one outline
    bar per micro-batch), ``over cap`` (one marker per over-cap micro-batch,
    empty when none) and ``token cap`` (empty on the static path).
    """
    fig = empty_packing_figure()
    apply_traces(fig, packing_traces(schedule, step))
    return fig


# --------------------------------------------------------------- balance
def balance_traces(schedule: Schedule, steps: Sequence[int] | None = None) -> dict[str, Any]:
    """The data of :func:`balance_figure` as plain arrays (see :func:`packing_traces`).

    ``info`` holds per step ``flops_imbalance`` (max rank / mean rank),
    ``makespan_ratio`` (max rank FLOPs / lower bound) and their worst values.
    """
    cfg = schedule.config
    dp = cfg.dp
    steps = list(range(schedule.num_steps)) if steps is None else [
        _check_step(schedule, s) for s in steps]
    tokens_all = schedule.rollouts.total_len
    flops_all = schedule.sample_flops
    xs, rf, rt, step_of = [], [], [], []
    bx, bf, bt = [], [], []
    ratio, imb = [], []
    for j, s in enumerate(steps):
        st = schedule.steps[s]
        mb_t = np.array([int(tokens_all[mb].sum()) for mb in st.micro_batches], dtype=np.float64)
        mb_f = (np.array([float(flops_all[mb].sum()) for mb in st.micro_batches])
                if flops_all is not None else np.full(mb_t.size, np.nan))
        r_t = np.array([mb_t[b].sum() for b in st.rank_bins])
        r_f = np.array([mb_f[b].sum() for b in st.rank_bins])
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
             f"{'n/a' if math.isnan(worst) else f'{100 * (worst - 1):.2f}%'} above the lower "
             "bound (worst step)")

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
        name="lower bound max(total/dp, largest micro-batch)", mode="lines",
        line={"color": "#d62728", "width": 2}, hovertemplate="bound %{y:.4s}<extra></extra>"),
        row=1, col=1)
    fig.add_trace(go.Bar(
        name="rank tokens", showlegend=False,
        hovertemplate=("step %{customdata[0]:d}, rank %{customdata[1]:d}: %{y:d} tokens, "
                       "%{customdata[2]:.4f}× the bound<extra></extra>")), row=2, col=1)
    fig.add_trace(go.Scatter(
        name="tokens lower bound", mode="lines", showlegend=False,
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
    """Per-step, per-rank forward FLOPs (top) and tokens (bottom) with their lower bound.

    The y axes are zoomed on the bars' tops (the differences are a few
    percent). The red segment over each step is the lower bound on the busiest rank,
    ``max(step total / dp, largest micro-batch)``: no distribution of these
    micro-batches does better. The gap between the tallest bar and the line
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


# --------------------------------------------------------------- sweeps
SWEEP_METRICS = {
    "flops_imbalance": "DP FLOPs imbalance (max rank / mean, worst step)",
    "makespan_ratio": "busiest rank / lower bound (worst step)",
    "micro_batches": "micro-batches (all steps)",
    "mb_ratio": "micro-batches / ceil(tokens / cap)",
    "cap_violations": "micro-batches over the cap",
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


# -------------------------------------------------------------- policies
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
        "busiest rank / its lower bound − 1<br>(mean over steps)",
        "micro-batches / ceil(tokens / cap) − 1<br>(all steps)",
        "micro-batches over the cap<br>(two or more samples)"))
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
        fig.update_yaxes(title_text=ytitle, range=_headroom(*panels[j]), row=1, col=j + 1)
    fig.update_xaxes(tickangle=-45)
    fig.update_annotations(font_size=13)  # the subplot titles
    fig.update_layout(template=TEMPLATE, barmode="group", height=520,
                      title=title or "scheduling policies compared",
                      legend={**LEGEND_BELOW, "title": {"text": "trace "}},
                      margin={"t": 120})
    return fig


# --------------------------------------------------------------- reports
def _long_reports(reports, metric: str):
    """Normalise reports into a long table ``config, step, value``."""
    import pandas as pd

    if isinstance(reports, Mapping):
        parts = []
        for name, df in reports.items():
            df = pd.DataFrame(df)
            if metric not in df.columns:
                raise ValueError(f"report {name!r} has no column {metric!r}; "
                                 f"it has {list(df.columns)}")
            step = df["step"] if "step" in df.columns else pd.Series(range(len(df)))
            parts.append(pd.DataFrame({"config": str(name), "step": step.to_numpy(),
                                       "value": df[metric].to_numpy(dtype=np.float64)}))
        return pd.concat(parts, ignore_index=True)
    df = pd.DataFrame(reports)
    name = "label" if "label" in df.columns else "config"
    missing = [c for c in (name, "step", metric) if c not in df.columns]
    if missing:
        raise ValueError(f"reports table lacks column(s) {missing}; pass a long table with "
                         "config (or label), step and the metric, or a dict name -> per-step "
                         "table")
    out = df[[name, "step", metric]].rename(columns={metric: "value", name: "config"})
    out["config"] = out["config"].astype(str)
    return out


def report_figure(reports, metric: str = "loss", reference: str | None = None, *,
                  title: str | None = None) -> go.Figure:
    """Reported metric per step for several configurations, and the relative difference.

    Top: the metric each configuration reported per step. Bottom: ``(value -
    reference) / |reference|`` per step; sound reductions sit on the zero
    line (up to float rounding), layout-dependent ones drift.

    Parameters
    ----------
    reports:
        A dict ``name -> per-step table`` (columns ``step`` and ``metric``),
        or one long table with columns ``step``, ``metric`` and ``label`` (or
        ``config``) naming the configuration, as
        :func:`varbatch_kit.train.compare` returns.
    metric:
        Column to draw.
    reference:
        Configuration to compare against (default: the first).
    """
    long = _long_reports(reports, metric)
    names = list(dict.fromkeys(long["config"]))
    if not names:
        raise ValueError("reports holds no configurations")
    ref = names[0] if reference is None else str(reference)
    if ref not in names:
        raise ValueError(f"reference={reference!r} is not one of the configurations {names}")
    ref_s = long[long["config"] == ref].set_index("step")["value"]
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.1,
                        row_heights=[0.6, 0.4],
                        subplot_titles=(f"reported {metric}", f"relative difference to {ref}"))
    for i, name in enumerate(names):
        s = long[long["config"] == name].set_index("step")["value"]
        color = qualitative.D3[i % len(qualitative.D3)]
        dash = "solid" if name == ref else ("dash" if i % 2 else "dot")
        fig.add_trace(go.Scatter(x=s.index, y=s.to_numpy(), name=name, mode="lines+markers",
                                 legendgroup=name, line={"color": color, "dash": dash},
                                 marker={"size": 5}), row=1, col=1)
        if name == ref:
            continue
        common = s.index.intersection(ref_s.index)
        r = ref_s.loc[common].to_numpy()
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = (s.loc[common].to_numpy() - r) / np.abs(r)
        fig.add_trace(go.Scatter(x=common, y=rel, name=name, mode="lines+markers",
                                 legendgroup=name, showlegend=False,
                                 line={"color": color, "dash": dash}, marker={"size": 5},
                                 hovertemplate="step %{x}: %{y:.3e}<extra>" + name +
                                 "</extra>"), row=2, col=1)
    fig.update_xaxes(title_text="training step", row=2, col=1)
    if long["step"].nunique() <= 30:
        fig.update_xaxes(dtick=1, tickformat="d")
    fig.update_yaxes(title_text=metric, row=1, col=1)
    fig.update_yaxes(title_text="(value − ref) / |ref|", exponentformat="e", row=2, col=1)
    fig.update_layout(template=TEMPLATE, height=580, title=title or f"{metric}: {len(names)} "
                      f"configurations vs {ref}", legend=LEGEND_BELOW)
    return fig


# ------------------------------------------------------------ training
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
        fig.update_yaxes(range=_headroom(y), row=1, col=c)
    fig.update_layout(template=TEMPLATE, height=330, showlegend=False,
                      title=(f"{schedule.num_steps} steps of {schedule.config.global_batch_size} "
                             f"rollouts each (dp {schedule.config.dp})"))
    return fig


def training_figure(steps, metrics: Sequence[str] = ("loss", "token_acc", "lr", "samples"), *,
                    title: str | None = None) -> go.Figure:
    """Training curves: one panel per metric of a per-step report table.

    Parameters
    ----------
    steps:
        One row per step with a ``step`` column, e.g. ``train.run(...).steps``.
    metrics:
        Columns to draw, one panel each (missing ones are skipped).
    """
    import pandas as pd

    df = pd.DataFrame(steps)
    if "step" not in df.columns:
        raise ValueError(f"the steps table needs a step column; columns are {list(df.columns)}")
    shown = [m for m in metrics if m in df.columns]
    if not shown:
        raise ValueError(f"none of metrics={list(metrics)} is a column; columns are "
                         f"{list(df.columns)}")
    fig = make_subplots(rows=1, cols=len(shown), horizontal_spacing=0.07,
                        subplot_titles=tuple(shown))
    for i, m in enumerate(shown):
        kind = go.Bar if m in ("samples", "tokens", "rollouts") else go.Scatter
        extra = {} if kind is go.Bar else {"mode": "lines+markers", "marker": {"size": 4}}
        fig.add_trace(kind(x=df["step"], y=df[m], name=m, marker_color=qualitative.D3[i % 10],
                           hovertemplate="step %{x}: %{y:.4g}<extra>" + m + "</extra>",
                           **extra), row=1, col=i + 1)
        fig.update_xaxes(title_text="step", row=1, col=i + 1)
        if kind is go.Bar:
            fig.update_yaxes(range=_headroom(df[m]), row=1, col=i + 1)
    fig.update_layout(template=TEMPLATE, height=330, showlegend=False,
                      title=title or "training curves")
    return fig


# ------------------------------------------------------------ simulation
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
                      yaxis={"title": {"text": unit}, "range": _headroom(*tops)},
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
        marker={"color": (mb % 2).astype(np.int32), "cmin": 0, "cmax": 1,
                    "colorscale": [[0, "#1f77b4"], [1, "#6baed6"]], "line": {"width": 0}},
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
                             "range": _headroom(end, frac=0.08)},
                      yaxis={"title": {"text": "DP rank"}, "autorange": "reversed",
                                 "type": "category"},
                      legend=LEGEND_BELOW)
    return fig
