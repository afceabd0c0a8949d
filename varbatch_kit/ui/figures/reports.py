"""Figures of training reports: metrics per step across configurations with their
relative difference to a reference, and training curves."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from varbatch_kit.ui.figures.style import (
    LEGEND_BELOW,
    TEMPLATE,
    headroom,
)


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


#: per configuration (in order): a line dash and a marker symbol, so equal curves stay apart
REPORT_DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
REPORT_SYMBOLS = ("circle", "square", "diamond", "x", "triangle-up", "cross", "star",
                  "triangle-down")


def report_style(i: int) -> tuple[dict, dict]:
    """The ``line`` and ``marker`` of the ``i``-th configuration of :func:`report_figure`.

    Sound reductions give equal values under every layout, so the curves lie
    on each other: each configuration gets its own dash and marker symbol,
    and later ones (drawn on top) a thinner line and a smaller, open marker,
    so the ones under them still show around them.
    """
    color = qualitative.D3[i % len(qualitative.D3)]
    line = {"color": color, "dash": REPORT_DASHES[i % len(REPORT_DASHES)],
            "width": max(1.0, 3.5 - 0.75 * i)}
    marker = {"symbol": REPORT_SYMBOLS[i % len(REPORT_SYMBOLS)] + ("-open" if i else ""),
              "size": max(5, 13 - 2 * i), "color": color, "line": {"width": 1.5}}
    return line, marker


def report_figure(reports, metric: str = "loss", reference: str | None = None, *,
                  title: str | None = None) -> go.Figure:
    """Reported metric per step for several configurations, and the relative difference.

    Top: the metric each configuration reported per step. Bottom: ``(value -
    reference) / |reference|`` per step; sound reductions sit on the zero
    line (up to float rounding), layout-dependent ones drift. Each
    configuration has its own dash, marker and width (:func:`report_style`),
    so curves that coincide are all visible.

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
        line, marker = report_style(i)
        fig.add_trace(go.Scatter(x=s.index, y=s.to_numpy(), name=name, mode="lines+markers",
                                 legendgroup=name, line=line, marker=marker), row=1, col=1)
        if name == ref:
            continue
        common = s.index.intersection(ref_s.index)
        r = ref_s.loc[common].to_numpy()
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = (s.loc[common].to_numpy() - r) / np.abs(r)
        fig.add_trace(go.Scatter(x=common, y=rel, name=name, mode="lines+markers",
                                 legendgroup=name, showlegend=False,
                                 line=line, marker=marker,
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
            fig.update_yaxes(range=headroom(df[m]), row=1, col=i + 1)
    fig.update_layout(template=TEMPLATE, height=330, showlegend=False,
                      title=title or "training curves")
    return fig


def rl_loop_figure(iterations, steps, *, title: str | None = None) -> go.Figure:
    """A closed RL loop per iteration (:func:`varbatch_kit.train.rl_loop`'s result).

    Three panels: the mean reward of each iteration's rollouts; per training step, its
    staleness (``policy_lag``: optimizer steps between the weights that generated the
    rollouts and the weights the step starts from) and ``ppo_kl``; and the
    train-vs-rollout log-prob difference (``train_rollout_logprob_abs_diff``). Steps are
    numbered across iterations; hover names the iteration and the generator's weights.
    """
    import pandas as pd

    it, st = pd.DataFrame(iterations), pd.DataFrame(steps)
    for name, df, cols in (("iterations", it, ("iteration", "reward_mean")),
                           ("steps", st, ("iteration", "step", "policy_lag"))):
        missing = [c for c in cols if c not in df.columns]
        if missing:
            raise ValueError(f"{name}: no column(s) {missing}; give rl_loop(...).{name}")
    st = st.reset_index(drop=True)
    x = np.arange(1, len(st) + 1)
    hover = [f"iteration {i}, step {s}, generator {h}" for i, s, h in
             zip(st["iteration"], st["step"], st.get("generator_hash", [""] * len(st)))]
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.08,
                        subplot_titles=("reward per iteration", "staleness and ppo_kl per step",
                                        "train vs rollout log-prob"),
                        specs=[[{}, {"secondary_y": True}, {}]])
    fig.add_trace(go.Scatter(x=it["iteration"], y=it["reward_mean"], mode="lines+markers",
                             name="reward mean", marker_color=qualitative.D3[0]), row=1, col=1)
    fig.add_trace(go.Bar(x=x, y=st["policy_lag"], name="policy lag (steps)", text=hover,
                         hovertemplate="%{text}: lag %{y}<extra></extra>",
                         marker_color=qualitative.D3[1], opacity=0.6), row=1, col=2)
    if "ppo_kl" in st:
        fig.add_trace(go.Scatter(x=x, y=st["ppo_kl"], mode="lines+markers", name="ppo_kl",
                                 text=hover, marker_color=qualitative.D3[2],
                                 hovertemplate="%{text}: ppo_kl %{y:.3g}<extra></extra>"),
                      row=1, col=2, secondary_y=True)
    if "train_rollout_logprob_abs_diff" in st:
        fig.add_trace(go.Scatter(x=x, y=st["train_rollout_logprob_abs_diff"],
                                 mode="lines+markers", name="|train - rollout| log-prob",
                                 text=hover, marker_color=qualitative.D3[3],
                                 hovertemplate="%{text}: %{y:.3g}<extra></extra>"),
                      row=1, col=3)
    fig.update_xaxes(title_text="iteration", dtick=1, row=1, col=1)
    fig.update_xaxes(title_text="training step (all iterations)", row=1, col=2)
    fig.update_xaxes(title_text="training step (all iterations)", row=1, col=3)
    fig.update_yaxes(title_text="policy lag", row=1, col=2, secondary_y=False)
    fig.update_yaxes(title_text="ppo_kl", row=1, col=2, secondary_y=True)
    fig.update_layout(template=TEMPLATE, height=360, legend=LEGEND_BELOW,
                      title=title or "closed RL loop: reward and staleness")
    return fig


def rl_learning_figure(record: dict, *, title: str | None = None) -> go.Figure:
    """The reward curve of recorded RL loops, one line per mode (sync, async).

    ``record``: what ``benchmarks/rl_learning.py`` writes (``{"modes": {mode: {"iterations":
    [{"iteration", "reward_mean", "lo", "hi"}, ...], "wall_s"}}}``; the package ships one run as
    ``data/runs/rl_loop_smollm2_cpu.json``). Each point is an iteration's mean reward over its
    prompt groups with the 95 % interval as error bars; the legend gives each mode's wall time.
    """
    modes = record.get("modes") if isinstance(record, dict) else None
    if not modes:
        raise ValueError("record: no 'modes'; give the JSON benchmarks/rl_learning.py writes")
    fig = go.Figure()
    for k, (mode, run) in enumerate(modes.items()):
        rows = run.get("iterations") or []
        missing = [c for c in ("iteration", "reward_mean", "lo", "hi") if rows and c not in rows[0]]
        if not rows or missing:
            raise ValueError(f"record['modes'][{mode!r}]: no iterations with iteration, "
                             "reward_mean, lo and hi")
        x = [r["iteration"] for r in rows]
        y = np.array([r["reward_mean"] for r in rows], dtype=float)
        lo = np.array([r["lo"] for r in rows], dtype=float)
        hi = np.array([r["hi"] for r in rows], dtype=float)
        wall = run.get("wall_s")
        name = mode + (f" ({wall / 60:.1f} min)" if wall else "")
        fig.add_trace(go.Scatter(
            x=x, y=y, mode="lines+markers", name=name,
            marker_color=qualitative.D3[k % len(qualitative.D3)],
            error_y=dict(type="data", symmetric=False, array=hi - y, arrayminus=y - lo),
            hovertemplate="iteration %{x}: reward %{y:.3f}<extra>" + mode + "</extra>"))
    fig.update_xaxes(title_text="iteration", dtick=1)
    fig.update_yaxes(title_text="reward mean (95 % interval over prompt groups)")
    fig.update_layout(template=TEMPLATE, height=380, legend=LEGEND_BELOW,
                      title=title or "does the loop learn? reward per iteration")
    return fig
