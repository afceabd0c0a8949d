"""viz: every picture on small hand-checked inputs (trace count, axis titles, values)."""

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest
from _factories import TINY, rollouts
from hypothesis import given
from hypothesis import strategies as st

from varbatch_kit import ScheduleConfig, build_schedule
from varbatch_kit.analysis import sweeps
from varbatch_kit.ui import viz
from varbatch_kit.ui.figures.style import headroom


def trace(fig, name):
    return next(t for t in fig.data if t.name is not None and t.name.startswith(name))


# ------------------------------------------------------------------ lengths
def test_length_figure_with_model_has_shares_and_flops_curves():
    r = rollouts([10, 20, 30, 40, 1000])
    fig = viz.length_figure(r, TINY, bins=4)
    assert isinstance(fig, go.Figure)
    assert [t.name for t in fig.data] == [
        "% of samples", "% of tokens", "% of FLOPs", "linear part c1 (GEMMs, LM head)",
        "c1 + c2*L (with attention)"]
    assert fig.layout.xaxis.title.text == "sample length (prompt + response tokens)"
    assert fig.layout.yaxis.title.text == "% of batch"
    assert fig.layout.xaxis2.title.text == "sample length L (tokens)"
    assert fig.layout.yaxis2.title.text == "forward FLOPs per token"
    # bins of width 247.5: four samples in the first bin, one in the last
    np.testing.assert_allclose(fig.data[0].y, [80, 0, 0, 20])
    np.testing.assert_allclose(fig.data[1].y, [100 / 11, 0, 0, 1000 / 11])
    flops = TINY.forward_flops(np.array([10, 20, 30, 40, 1000]))
    np.testing.assert_allclose(fig.data[2].y[-1], 100 * flops[-1] / flops.sum())
    # the long sample carries more of the FLOPs than of the tokens: the quadratic term
    assert fig.data[2].y[-1] > fig.data[1].y[-1]
    c1, c2 = TINY.flops_coefficients()
    np.testing.assert_allclose(fig.data[3].y, c1)
    np.testing.assert_allclose(fig.data[4].y, c1 + c2 * np.asarray(fig.data[4].x))
    share = (c2 * np.array([10, 20, 30, 40, 1000.0]) ** 2).sum() / flops.sum()
    assert f"{100 * share:.1f}% of the batch's FLOPs" in fig.layout.annotations[-1].text


def test_length_figure_without_model_draws_tokens_only():
    fig = viz.length_figure(rollouts([5, 6, 7]), None, bins=2)
    assert [t.name for t in fig.data] == ["% of samples", "% of tokens"]
    with pytest.raises(ValueError, match="bins"):
        viz.length_figure(rollouts([5]), None, bins=0)


# ------------------------------------------------------------------ packing
def test_packing_figure_stacks_samples_per_micro_batch_grouped_by_rank():
    # first-fit with cap 10: bins [0,1,3] (5+3+2), [2,5] (8+1), [4] (7), [6,7] (4+6)
    r = rollouts([5, 3, 8, 2, 7, 1, 4, 6], rollout_id=[0, 0, 1, 2, 3, 4, 5, 6])
    s = build_schedule(r, ScheduleConfig(dp=2, global_batch_size=7, max_tokens_per_gpu=10), TINY)
    fig = viz.packing_figure(s, 0)
    assert tuple(t.name.split(" (")[0] for t in fig.data[:3]) == ("samples", "micro-batches",
                                                                  "over cap")
    assert fig.data[3].name == "token cap 10"
    assert fig.layout.xaxis.title.text == "micro-batches, grouped by DP rank"
    assert fig.layout.yaxis.title.text == "tokens per micro-batch"
    samples, mbs = fig.data[0], fig.data[1]
    # strided: rank 0 gets bins 0, 2; rank 1 bins 1, 3; x leaves a gap slot between ranks
    np.testing.assert_array_equal(mbs.x, [0, 1, 3, 4])
    np.testing.assert_array_equal(mbs.y, [10, 7, 9, 10])
    np.testing.assert_array_equal(samples.x, [0, 0, 0, 1, 3, 3, 4, 4])
    np.testing.assert_array_equal(samples.y, [5, 3, 2, 7, 8, 1, 4, 6])
    np.testing.assert_array_equal(samples.base, [0, 5, 8, 0, 0, 8, 0, 4])
    custom = np.asarray(samples.customdata)
    np.testing.assert_array_equal(custom[:, 0], [0, 1, 3, 4, 2, 5, 6, 7])  # sample ids
    np.testing.assert_array_equal(custom[:, 1], [0, 0, 2, 3, 1, 4, 5, 6])  # rollout ids
    np.testing.assert_allclose(custom[:, 2], TINY.forward_flops(np.array([5, 3, 2, 7, 8, 1, 4,
                                                                          6])))
    np.testing.assert_array_equal(custom[:, 3], [0, 0, 0, 0, 1, 1, 1, 1])  # rank
    np.testing.assert_array_equal(custom[:, 4], [0, 0, 0, 1, 0, 0, 1, 1])  # position on rank
    np.testing.assert_array_equal(custom[:, 5], [10, 10, 10, 7, 9, 9, 10, 10])  # its tokens
    # samples of rollout 0 share a colour
    assert samples.marker.color[0] == samples.marker.color[1]
    assert len(fig.data[2].x) == 0  # nothing over the cap
    np.testing.assert_array_equal(fig.data[3].y, [10, 10])
    assert next(t.text for t in [fig.layout.title]).startswith("step 0: 8 samples, 36 tokens in "
                                                                "4 micro-batches")


def test_packing_figure_marks_exactly_the_over_cap_micro_batches():
    # flops_kk packing ignores the cap: 2 bins (ceil(36/20)) of ~18 tokens... with cap 12
    r = rollouts([11, 9, 8, 8])
    s = build_schedule(r, ScheduleConfig(dp=1, global_batch_size=4, max_tokens_per_gpu=12,
                                         packing="flops_kk", distribution="flops_kk"), TINY)
    fig = viz.packing_figure(s)
    tokens = np.asarray(fig.data[1].y)
    over = tokens > 12
    assert over.any()
    np.testing.assert_array_equal(fig.data[2].x, np.asarray(fig.data[1].x)[over])
    np.testing.assert_array_equal(np.asarray(fig.data[2].customdata)[:, 0], tokens[over])
    sizes = np.asarray(fig.data[2].customdata)[:, 1]  # samples of each marked micro-batch
    assert sizes.size == int(over.sum())
    assert fig.data[2].name == (f"over cap (▼ red: {int((sizes > 1).sum())} cap violations, "
                                f"orange: {int((sizes == 1).sum())} oversize (alone))")
    np.testing.assert_array_equal(np.asarray(fig.data[1].marker.line.color), over.astype(int))


def test_packing_figure_lone_oversize_sample_is_marked_in_its_own_colour():
    r = rollouts([30, 4, 5])  # 30 > cap 10 sits alone
    s = build_schedule(r, ScheduleConfig(dp=1, global_batch_size=3, max_tokens_per_gpu=10), TINY)
    fig = viz.packing_figure(s)
    assert list(fig.data[1].y) == [30, 9]
    assert list(fig.data[2].x) == [0]
    assert list(fig.data[2].marker.color) == [1]  # 1 = single sample, 0 = violation


def test_static_packing_figure_has_no_cap_line():
    s = build_schedule(rollouts([1, 2, 3, 4]),
                       ScheduleConfig(dp=2, global_batch_size=4, micro_batch_size=1))
    fig = viz.packing_figure(s)
    assert len(fig.data[3].x) == 0 and fig.data[3].name == "no token cap (static)"
    assert np.isnan(np.asarray(fig.data[0].customdata)[:, 2]).all()  # no model: no FLOPs


def test_packing_figure_rejects_a_bad_step():
    s = build_schedule(rollouts([1, 2]), ScheduleConfig(global_batch_size=1,
                                                        max_tokens_per_gpu=10))
    with pytest.raises(ValueError, match="step=2 is out of range"):
        viz.packing_figure(s, 2)


@given(st.lists(st.integers(1, 60), min_size=4, max_size=40), st.integers(5, 50),
       st.sampled_from(["first_fit", "flops_kk"]), st.integers(1, 2))
def test_over_cap_marker_appears_exactly_when_a_bin_exceeds_the_cap(lengths, cap, packing, dp):
    r = rollouts(lengths)
    cfg = ScheduleConfig(dp=dp, global_batch_size=len(lengths), max_tokens_per_gpu=cap,
                         packing=packing, distribution="flops_kk")
    try:
        s = build_schedule(r, cfg, TINY)
    except ValueError:
        return  # impossible layout (too few samples to split)
    fig = viz.packing_figure(s)
    step = s.steps[0]
    order = [b for bins in step.rank_bins for b in bins]
    bin_tokens = np.array([int(r.total_len[step.micro_batches[b]].sum()) for b in order])
    np.testing.assert_array_equal(fig.data[1].y, bin_tokens)
    over_x = set(np.asarray(fig.data[2].x).tolist())
    assert over_x == set(np.asarray(fig.data[1].x)[bin_tokens > cap].tolist())
    assert len(fig.data[0].x) == len(lengths)


def test_packing_figure_is_pure():
    r = rollouts([5, 3, 8, 2, 7, 1, 4, 6])
    s = build_schedule(r, ScheduleConfig(dp=2, global_batch_size=4, max_tokens_per_gpu=10), TINY)
    a = viz.packing_figure(s, 1).to_json()
    viz.packing_figure(s, 0)
    assert viz.packing_figure(s, 1).to_json() == a


# ------------------------------------------------------------------ balance
def test_balance_figure_per_rank_values_and_lower_bound():
    r = rollouts([5, 3, 8, 2, 7, 1, 4, 6])
    s = build_schedule(r, ScheduleConfig(dp=2, global_batch_size=8, max_tokens_per_gpu=10), TINY)
    fig = viz.balance_figure(s)
    assert [t.name for t in fig.data] == list(viz.BALANCE_TRACE_NAMES)
    assert fig.layout.yaxis.title.text.startswith("FLOPs")
    assert fig.layout.yaxis2.title.text.startswith("tokens")
    assert fig.layout.xaxis2.title.text == "DP ranks, grouped by step"
    f = TINY.forward_flops(r.total_len)
    step = s.steps[0]
    rank_tok = [sum(int(r.total_len[step.micro_batches[b]].sum()) for b in bins)
                for bins in step.rank_bins]
    rank_fl = [sum(float(f[step.micro_batches[b]].sum()) for b in bins) for bins in step.rank_bins]
    assert rank_tok == [17, 19]  # bins 10+7 and 9+10
    np.testing.assert_array_equal(fig.data[2].y, rank_tok)
    np.testing.assert_allclose(fig.data[0].y, rank_fl)
    mb_fl = [float(f[mb].sum()) for mb in step.micro_batches]
    bound = max(sum(rank_fl) / 2, max(mb_fl))
    assert fig.data[1].y[0] == pytest.approx(bound) and fig.data[1].y[1] == pytest.approx(bound)
    assert fig.data[3].y[0] == max(36 / 2, 10)


def test_balance_traces_report_the_worst_step():
    r = rollouts([5, 3, 8, 2, 7, 1, 4, 6])
    s = build_schedule(r, ScheduleConfig(dp=2, global_batch_size=4, max_tokens_per_gpu=10), TINY)
    info = viz.balance_traces(s)["info"]
    assert info["steps"] == [0, 1]
    assert info["worst_makespan_ratio"] == max(info["makespan_ratio"]) >= 1.0
    assert len(viz.balance_figure(s, steps=[1]).data[0].y) == 2


# ------------------------------------------------------------------ sweeps
def test_sweep_heatmap_with_an_impossible_cell():
    r = rollouts([5, 3, 8, 2, 7, 1, 4, 6])
    base = ScheduleConfig(dp=1, global_batch_size=8, max_tokens_per_gpu=10)
    table = sweeps.sweep_table(r, base, TINY, max_tokens_per_gpu=[10, 20], dp=[1, 16])
    fig = viz.sweep_heatmap(table, "micro_batches")
    assert len(fig.data) == 1 and fig.data[0].type == "heatmap"
    assert fig.layout.xaxis.title.text == "max_tokens_per_gpu"
    assert fig.layout.yaxis.title.text == "dp"
    z = np.asarray(fig.data[0].z, dtype=float)
    assert z.shape == (2, 2) and np.isnan(z[1]).all() and z[0, 0] == 4
    assert list(fig.data[0].text[0]) == ["4", "2"]  # ceil(36/10) = 4 and ceil(36/20) = 2 bins
    assert "impossible" in fig.data[0].customdata[1][0]
    with pytest.raises(ValueError, match="not a column"):
        viz.sweep_heatmap(table, "nope")


def test_viz_no_longer_computes_schedules():
    for name in ("sweep_table", "policy_table", "policy_pairs", "SLIME_FLAGS"):
        assert not hasattr(viz, name), name
    assert "build_schedule" not in vars(viz)


# ------------------------------------------------------------------ policies
POLICY_TABLE = pd.DataFrame({
    "trace": ["math", "math", "agentic", "agentic", "agentic"],
    "packing": ["first_fit", "flops_kk", "first_fit", "flops_kk", "ffd"],
    "distribution": ["strided", "flops_kk", "strided", "flops_kk", "strided"],
    "micro_batches": [110, 100, 220, 200, np.nan],
    "mb_lower_bound": [100, 100, 200, 200, np.nan],
    "cap_violations": [0, 30, 0, 70, np.nan],
    "mean_makespan_ratio": [1.05, 1.01, 1.2, 1.02, np.nan],
    "error": ["", "", "", "", "dp too large"],
})


def test_policy_figure_values_from_the_table():
    fig = viz.policy_figure(POLICY_TABLE)
    assert [t.name for t in fig.data] == ["math"] * 3 + ["agentic"] * 3  # the error row left out
    assert list(fig.data[0].x) == ["first_fit + strided", "flops_kk + flops_kk"]
    np.testing.assert_allclose(fig.data[0].y, [5, 1])  # busiest / bound − 1, in %
    np.testing.assert_allclose(fig.data[1].y, [10, 0])  # micro-batches / bound − 1, in %
    np.testing.assert_allclose(fig.data[5].y, [0, 70])
    assert [t.showlegend for t in fig.data] == [True, False, False, True, False, False]
    r = rollouts([5, 3, 8, 2, 7, 1, 4, 6])
    cfg = ScheduleConfig(dp=2, global_batch_size=8, max_tokens_per_gpu=10)
    table = sweeps.policy_table(r, cfg, TINY, [("first_fit", "strided"), ("flops_kk", "flops_kk")])
    fig = viz.policy_figure(table)
    assert len(fig.data) == 3 and not any(t.showlegend for t in fig.data)
    assert list(fig.data[0].x) == ["first_fit + strided", "flops_kk + flops_kk"]


def test_policy_figure_legend_is_clear_of_the_subplot_titles():
    fig = viz.policy_figure(POLICY_TABLE)
    titles = [a for a in fig.layout.annotations if a.yref == "paper"]
    assert len(titles) == 3
    # subplot titles sit above the plot area (paper y >= 1, anchored at their bottom) ...
    assert all(a.y >= 1 and a.yanchor == "bottom" for a in titles)
    # ... and the legend at the bottom of the figure, in a margin it reserves, below the axes
    legend = fig.layout.legend
    assert legend.orientation == "h"
    assert (legend.yref, legend.y, legend.yanchor) == ("container", 0, "bottom")
    # the figure's title stays in the top margin, above the two-line subplot titles
    assert fig.layout.margin.t >= 100


def max_bar(fig, axis="y"):
    tops = [np.nanmax(np.asarray(t.y, dtype=float)) for t in fig.data
            if t.type == "bar" and (t.yaxis or "y") == axis and len(t.y)]
    return max(tops)


def test_bar_panels_have_headroom():
    fig = viz.policy_figure(POLICY_TABLE)
    for axis, name in (("y", "yaxis"), ("y2", "yaxis2"), ("y3", "yaxis3")):
        lo, hi = fig.layout[name].range
        assert lo == 0 and hi >= 1.05 * max_bar(fig, axis), name
    r = rollouts([10, 20, 30, 40, 1000])
    fig = viz.length_figure(r, TINY, bins=4)
    # the tallest bar: the long sample's share of the FLOPs (more than its 91% of the tokens)
    assert max_bar(fig) == pytest.approx(fig.data[2].y[-1]) and max_bar(fig) > 91
    assert fig.layout.yaxis.range == pytest.approx((0, 1.1 * max_bar(fig)))
    s = build_schedule(rollouts([5, 3, 8, 2, 7, 1, 4, 6]),
                       ScheduleConfig(dp=2, global_batch_size=2, max_tokens_per_gpu=10), TINY)
    fig = viz.step_sizes_figure(s)
    for axis, name in (("y", "yaxis"), ("y2", "yaxis2"), ("y3", "yaxis3")):
        assert fig.layout[name].range[1] >= 1.05 * max_bar(fig, axis), name
    fig = viz.training_figure(pd.DataFrame({"step": [0, 1], "loss": [2.0, 1.0],
                                            "samples": [7, 9]}), metrics=("loss", "samples"))
    assert fig.layout.yaxis2.range == pytest.approx([0, 9.9])
    assert fig.layout.yaxis.range is None  # a line panel keeps autorange
    fig = viz.packing_figure(build_schedule(rollouts([11, 9, 8, 8]), ScheduleConfig(
        dp=1, global_batch_size=4, max_tokens_per_gpu=12, packing="flops_kk",
        distribution="flops_kk"), TINY))
    top = max(max(fig.data[1].y), max(fig.data[2].y))  # the over-cap markers sit above bars
    assert fig.layout.yaxis.range[1] >= 1.05 * top
    times = {"a": pd.DataFrame({"step": [0, 1], "time_s": [1.0, 2.0], "bound_s": [0.9, 1.8]})}
    fig = viz.step_time_figure(times)
    assert fig.layout.yaxis.range[1] >= 1.05 * 2.0
    fig = viz.step_time_figure(times, relative=True, total=True)
    assert fig.layout.yaxis.range[1] >= 1.05 * max_bar(fig)


def test_headroom_of_negative_and_empty_values():
    assert headroom([-2.0, 8.0]) == pytest.approx([-3.0, 9.0])
    assert headroom([]) == [0.0, 1.0]
    assert headroom([0, 0]) == [0.0, 1.0]
    assert headroom([np.nan, 5.0]) == pytest.approx([0.0, 5.5])


def _strings(obj):
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _strings(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _strings(v)


def every_figure():
    r = rollouts([5, 3, 8, 2, 7, 1, 4, 6], rollout_id=[0, 0, 1, 2, 3, 4, 5, 6])
    s = build_schedule(r, ScheduleConfig(dp=2, global_batch_size=4, max_tokens_per_gpu=10), TINY)
    table = sweeps.sweep_table(r, s.config, TINY, max_tokens_per_gpu=[10], dp=[1, 2])
    reports = {"a": pd.DataFrame({"step": [0, 1], "loss": [2.0, 1.0]}),
               "b": pd.DataFrame({"step": [0, 1], "loss": [2.0, 1.1]})}
    times = {"a": pd.DataFrame({"step": [0, 1], "time_s": [1.0, 2.0], "bound_s": [0.9, 1.8]})}
    tl = pd.DataFrame({"step": 0, "rank": [0, 0, 1], "micro_batch": [0, 1, 0],
                       "start_s": [0.0, 1.0, 0.0], "end_s": [1.0, 3.0, 2.0]})
    return {
        "length": viz.length_figure(r, TINY), "packing": viz.packing_figure(s),
        "balance": viz.balance_figure(s), "sweep": viz.sweep_heatmap(table, "mb_ratio"),
        "policy": viz.policy_figure(POLICY_TABLE), "report": viz.report_figure(reports),
        "step_sizes": viz.step_sizes_figure(s),
        "training": viz.training_figure(pd.DataFrame({"step": [0, 1], "loss": [1.0, 0.5]})),
        "step_time": viz.step_time_figure(times), "timeline": viz.timeline_figure(tl),
        "empty_packing": viz.empty_packing_figure(), "empty_balance": viz.empty_balance_figure(),
    }


def test_no_latex_in_any_figure_text():
    """plotly renders $...$ with MathJax, which offline HTML pages do not load."""
    for name, fig in every_figure().items():
        text = list(_strings(fig.to_plotly_json()["layout"]))
        for trace in fig.data:
            text += [trace.name or "", trace.hovertemplate or ""]
            text += [str(t) for t in np.asarray(getattr(trace, "text", None) or []).ravel()]
        assert text, name
        offending = [t for t in text if "$" in t]
        assert not offending, (name, offending)


def test_every_legend_sits_below_the_plot():
    for name, fig in every_figure().items():
        legend = fig.layout.legend
        shown = fig.layout.showlegend is not False and any(
            t.showlegend is not False for t in fig.data)
        if not shown or name == "sweep":
            continue  # no legend (the heat-map has a colour bar)
        assert (legend.yref, legend.y, legend.yanchor) == ("container", 0, "bottom"), name


# ------------------------------------------------------------------ reports
def test_report_figure_relative_difference_to_the_reference():
    reports = {
        "dp1": pd.DataFrame({"step": [0, 1, 2], "loss": [2.0, 1.0, 0.5]}),
        "dp2": pd.DataFrame({"step": [0, 1, 2], "loss": [2.0, 1.0, 0.5]}),
        "naive": pd.DataFrame({"step": [0, 1, 2], "loss": [2.2, 1.0, 0.25]}),
    }
    fig = viz.report_figure(reports, "loss")
    assert [t.name for t in fig.data] == ["dp1", "dp2", "dp2", "naive", "naive"]
    np.testing.assert_allclose(fig.data[2].y, [0, 0, 0])
    np.testing.assert_allclose(fig.data[4].y, [0.1, 0, -0.5])
    assert fig.layout.xaxis2.title.text == "training step"
    assert fig.layout.yaxis.title.text == "loss"
    long = pd.concat([df.assign(config=k) for k, df in reports.items()])
    fig2 = viz.report_figure(long, "loss", reference="naive")
    np.testing.assert_allclose(fig2.data[1].y, [2 / 2.2 - 1, 0, 1.0])
    with pytest.raises(ValueError, match="reference"):
        viz.report_figure(reports, "loss", reference="x")
    with pytest.raises(ValueError, match="no column"):
        viz.report_figure(reports, "grad_norm")


# ------------------------------------------------------------------ simulation
def test_step_time_and_timeline_figures_from_tables():
    times = {"a": pd.DataFrame({"step": [0, 1], "time_s": [1.0, 2.0], "bound_s": [0.9, 1.8]}),
             "b": pd.DataFrame({"step": [0, 1], "time_s": [1.1, 2.1], "bound_s": [0.9, 1.8]})}
    fig = viz.step_time_figure(times)
    assert [t.name for t in fig.data] == ["a", "b", "bound (perfect schedule)"]
    assert fig.layout.yaxis.title.text == "seconds"
    fig = viz.step_time_figure(times, relative=True, total=True)
    assert list(fig.data[1].x) == ["b"]
    assert fig.data[1].y[0] == pytest.approx(100 * (3.2 / 2.7 - 1))
    assert fig.layout.yaxis.title.text == "% above the bound"
    tl = pd.DataFrame({"step": 0, "rank": [0, 0, 1], "micro_batch": [0, 1, 0],
                       "start_s": [0.0, 1.0, 0.0], "end_s": [1.0, 3.0, 2.0]})
    fig = viz.timeline_figure(tl, 0)
    assert [t.name for t in fig.data] == ["micro-batch", "waiting for the slowest rank"]
    np.testing.assert_allclose(fig.data[0].x, [1, 2, 2])
    np.testing.assert_allclose(fig.data[1].x, [0, 1])  # rank 1 ends at 2 s, waits 1 s
    with pytest.raises(ValueError, match="no rows"):
        viz.timeline_figure(tl, 3)


def test_simulated_views_on_a_real_schedule():
    sim_mod = pytest.importorskip("varbatch_kit.analysis.simulate")
    r = rollouts([5, 3, 8, 2, 7, 1, 4, 6])
    s = build_schedule(r, ScheduleConfig(dp=2, global_batch_size=4, max_tokens_per_gpu=10), TINY)
    sim = sim_mod.simulate(s, hardware="H100")
    fig = viz.step_time_figure({"x": sim.step_times})
    np.testing.assert_allclose(fig.data[0].y, sim.step_times["time_s"])
    fig = viz.timeline_figure(sim.timelines, 1)
    assert len(fig.data[0].x) == len(sim.timelines[sim.timelines.step == 1])


def test_packing_figure_colours_samples_by_rollout_and_compact_siblings_stand_out():
    """In the figure's JSON: one colour per rollout; compact rollouts in the palette's
    colours (neighbours differ), single-sample rollouts grey; hover names rollout and sample."""
    import json

    from varbatch_kit.ui.figures.style import PALETTE, SINGLE_SAMPLE_COLOR

    # rollouts 7 (3 samples), 8 (1), 9 (2), 10 (1); first fit spreads the siblings
    r = rollouts([6, 5, 9, 4, 7, 3, 8], rollout_id=[7, 8, 7, 9, 10, 9, 7])
    s = build_schedule(r, ScheduleConfig(dp=2, global_batch_size=4, max_tokens_per_gpu=12), TINY)
    data = json.loads(viz.packing_figure(s).to_json())["data"][0]
    color = np.asarray(plotly_array(data["marker"]["color"]))
    custom = np.asarray(plotly_array(data["customdata"]))
    sample, rid, n = custom[:, 0].astype(int), custom[:, 1].astype(int), custom[:, 6].astype(int)
    assert sorted(sample) == list(range(7))
    by_rollout = {int(i): set(color[rid == i].tolist()) for i in np.unique(rid)}
    assert all(len(c) == 1 for c in by_rollout.values())  # one colour per rollout
    # compact: palette, in order; single samples: grey (colour strings, not numbers)
    assert by_rollout[7] == {PALETTE[0]} and by_rollout[9] == {PALETTE[1]}
    assert by_rollout[8] == by_rollout[10] == {SINGLE_SAMPLE_COLOR}
    assert dict(zip(rid.tolist(), n.tolist())) == {7: 3, 8: 1, 9: 2, 10: 1}
    assert "rollout %{customdata[1]:d}" in data["hovertemplate"]
    assert "sample %{customdata[0]:d}" in data["hovertemplate"]
    # one-sample rollouts only: every rollout cycles through the palette
    s1 = build_schedule(rollouts([3, 4, 5, 6]), ScheduleConfig(dp=2, global_batch_size=4,
                                                               max_tokens_per_gpu=12), TINY)
    d1 = json.loads(viz.packing_figure(s1).to_json())["data"][0]
    c1 = np.asarray(plotly_array(d1["marker"]["color"]))
    ids = np.asarray(plotly_array(d1["customdata"]))[:, 1].astype(int)
    assert dict(zip(ids.tolist(), c1.tolist())) == dict(enumerate(PALETTE[:4]))


def plotly_array(value):
    """A plotly JSON array: a list, or a typed binary buffer ``{"dtype", "bdata", "shape"}``."""
    if isinstance(value, dict) and "bdata" in value:
        import base64

        arr = np.frombuffer(base64.b64decode(value["bdata"]), dtype=np.dtype(value["dtype"]))
        shape = value.get("shape")
        if shape:
            arr = arr.reshape([int(x) for x in str(shape).split(",")])
        return arr
    return value


def test_policy_figure_all_zero_over_cap_panel_says_so():
    table = POLICY_TABLE.assign(cap_violations=[0, 0, 0, 0, np.nan],
                                oversize_alone=[3, 3, 0, 0, np.nan])
    fig = viz.policy_figure(table)
    notes = [a.text for a in fig.layout.annotations if a.xref == "x3 domain"]
    assert len(notes) == 1 and notes[0].startswith("no micro-batch of two or more")
    assert "6 lone samples longer" in notes[0]
    assert not any(a.xref == "x3 domain" for a in viz.policy_figure(POLICY_TABLE)
                   .layout.annotations)  # 30 and 70 violations: bars, no note


def test_the_two_bounds_have_one_name_each_in_figures_and_tables():
    """'bound for this packing' (largest micro-batch) in the balance figure, 'bound for any
    packing' (largest sample) in the policy figure and the CLI legend, as the table columns."""
    from varbatch_kit.cli.schedule import COLUMN_LEGEND

    r = rollouts([5, 3, 8, 2, 7, 1, 4, 6])
    s = build_schedule(r, ScheduleConfig(dp=2, global_batch_size=8, max_tokens_per_gpu=10), TINY)
    bal = viz.balance_figure(s)
    assert "above the bound for this packing (worst step)" in bal.layout.title.text
    assert bal.data[1].name.startswith("bound for this packing: max(step FLOPs / dp, largest "
                                       "micro-batch")
    pol = viz.policy_figure(POLICY_TABLE)
    assert any("busiest rank / bound for any packing" in a.text for a in pol.layout.annotations)
    assert "the bound for any packing, max(step FLOPs / dp, largest sample)" in \
        COLUMN_LEGEND["mean_makespan_ratio"]
    assert "the bound for this packing, max(step FLOPs / dp, largest micro-batch)" in \
        COLUMN_LEGEND["mean_mb_makespan_ratio"]
    texts = [bal.layout.title.text, *(t.name or "" for t in bal.data),
             *(a.text for a in pol.layout.annotations)]
    assert not any("lower bound" in t for t in texts)


def test_measured_vs_predicted_figure_in_the_shared_style():
    import json as _json

    from varbatch_kit.analysis.cost_model import fit_with_holdout
    from varbatch_kit.resources import data_dir
    from varbatch_kit.ui.figures.style import LEGEND_BELOW, PALETTE, TEMPLATE

    rows = _json.loads(data_dir("timing").joinpath("cpu_toy_calibration.json").read_text())[
        "measurements"]
    fit = fit_with_holdout([r["sum_len"] for r in rows], [r["sum_len_sq"] for r in rows],
                           [r["time_s"] for r in rows], heldout_mask=[r["heldout"] for r in rows])
    fig = viz.measured_vs_predicted_figure(fit, [str(i) for i in range(len(rows))])
    assert fig.layout.template == go.Figure(layout={"template": TEMPLATE}).layout.template
    assert fig.layout.legend.orientation == LEGEND_BELOW["orientation"]
    assert fig.layout.legend.yref == "container"
    assert [t.name for t in fig.data] == ["fitted (grid)", "held out (random)",
                                          "measured = predicted"]
    assert [t.marker.color for t in fig.data[:2]] == list(PALETTE[:2])
    np.testing.assert_allclose(fig.data[1].x, fit.predicted_s[fit.heldout_index])
    np.testing.assert_allclose(fig.data[1].y, fit.measured_s[fit.heldout_index])


def test_notebook_02_names_the_two_bounds_and_04_uses_the_shared_figure():
    import json as _json

    from _paths import REPO

    def text_of(name):
        nb = _json.loads((REPO / "notebooks" / name).read_text())
        assert all(not c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code")
        return "\n".join("".join(c["source"]) for c in nb["cells"])

    text = text_of("02_dp_flops_balance.ipynb")
    assert "bound for this packing = max(step FLOPs ∕ dp, largest micro-batch)" in text
    assert "bound for any packing = max(step FLOPs ∕ dp, largest sample)" in text
    assert "lower bound" not in text.replace("mb_lower_bound", "")
    flags = text_of("04_tune_slime_flags.ipynb")  # the calibration moved there from 02
    for t in (text, flags):
        assert "go.Figure()" not in t
    assert "viz.measured_vs_predicted_figure(" in flags


def test_report_figure_keeps_equal_curves_visible():
    """Notebook 06's dp 2 runs report equal values: 4 configurations, 4 distinguishable
    curves (each its own dash and marker; later ones, on top, thinner and smaller)."""
    same = pd.DataFrame({"step": [0, 1, 2], "loss": [2.0, 1.0, 0.5]})
    reports = {f"dp2 layout {k}": same for k in range(4)}
    fig = viz.report_figure(reports, "loss")
    top = [t for t in fig.data if t.xaxis == "x"]
    assert [t.name for t in top] == list(reports)
    assert len({t.line.dash for t in top}) == 4
    assert len({t.marker.symbol for t in top}) == 4
    widths = [t.line.width for t in top]
    sizes = [t.marker.size for t in top]
    assert widths == sorted(widths, reverse=True) and len(set(widths)) == 4
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == 4
    assert all(t.marker.symbol.endswith("-open") for t in top[1:])  # the ones below show through
    bottom = [t for t in fig.data if t.xaxis == "x2"]
    assert [(t.line.dash, t.marker.symbol) for t in bottom] == [
        (t.line.dash, t.marker.symbol) for t in top[1:]]  # same style in both panels


# ------------------------------------------------------------- words, legend, colours
def test_packing_figure_says_cap_violations_and_oversize_alone_as_the_tables_do():
    """A micro-batch of two samples over the cap is a cap violation, a lone sample longer
    than it is oversize (alone): the title, the legend, the tables and their help texts use
    these words and the same counts."""
    import warnings

    from varbatch_kit.analysis.quality import OVER_CAP_HELP, step_quality
    from varbatch_kit.analysis.run_quality import RUN_QUALITY_COLUMNS
    from varbatch_kit.cli.schedule import COLUMN_LEGEND

    r = rollouts([20, 7, 7, 7, 7])  # flops_kk, cap 12: [20] alone, [7, 7] over, [7], [7]
    cfg = ScheduleConfig(dp=1, global_batch_size=5, max_tokens_per_gpu=12, packing="flops_kk",
                         distribution="flops_kk")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = build_schedule(r, cfg, TINY)
        row = sweeps.policy_table(r, cfg, TINY, [("flops_kk", "flops_kk")]).iloc[0]
    q = step_quality(s).iloc[0]
    assert (q.cap_violations, q.oversize_alone) == (row.cap_violations, row.oversize_alone)
    assert (row.cap_violations, row.oversize_alone) == (1, 1)
    data = viz.packing_traces(s)
    assert data["layout"]["title"]["text"].endswith("— 1 cap violations, 1 oversize (alone)")
    assert data["traces"][2]["name"] == ("over cap (▼ red: 1 cap violations, orange: 1 "
                                         "oversize (alone))")
    assert (data["info"]["cap_violations"], data["info"]["oversize_alone"]) == (1, 1)
    assert "over the cap" not in data["layout"]["title"]["text"]
    for legend in (COLUMN_LEGEND, RUN_QUALITY_COLUMNS, OVER_CAP_HELP):
        assert legend["cap_violations"].startswith("cap violations: micro-batches of two or "
                                                   "more samples over the token cap")
        assert legend["oversize_alone"].startswith("oversize (alone): single samples longer "
                                                   "than the token cap")
    fig = viz.policy_figure(sweeps.policy_table(r, cfg.with_(max_tokens_per_gpu=30), TINY,
                                                [("flops_kk", "flops_kk")]))
    assert fig.layout.annotations[2].text.startswith("cap violations: micro-batches of")


def test_packing_figure_legend_says_what_grey_means():
    from varbatch_kit.ui.figures.style import SINGLE_SAMPLE_COLOR

    cfg = ScheduleConfig(dp=2, global_batch_size=4, max_tokens_per_gpu=12)
    compact = build_schedule(rollouts([6, 5, 9, 4, 7, 3, 8], rollout_id=[7, 8, 7, 9, 10, 9, 7]),
                             cfg, TINY)  # rollouts 8 and 10 hold one sample: grey
    grey = viz.packing_figure(compact).data[4]
    assert grey.showlegend is True and grey.name.startswith("grey: single-sample rollouts")
    assert grey.marker.color == SINGLE_SAMPLE_COLOR and grey.marker.symbol == "square"
    assert tuple(viz.PACKING_TRACE_NAMES) == ("samples", "micro-batches", "over cap",
                                              "token cap", "single-sample rollouts")
    plain = build_schedule(rollouts([3, 4, 5, 6]), cfg, TINY)  # no grey: no entry
    assert viz.packing_figure(plain).data[4].showlegend is False


def _bars_with_numeric_colours(fig_json: dict) -> list[str]:
    """The bar traces whose ``marker.color`` holds numbers (plotly.js maps them through a
    colorscale but first warns "Invalid color specifier" once per bar)."""
    bad = []
    for i, t in enumerate(fig_json["data"]):
        color = (t.get("marker") or {}).get("color")
        if t.get("type") != "bar" or color is None or isinstance(color, str):
            continue
        values = plotly_array(color)
        if isinstance(values, np.ndarray) or not all(isinstance(c, str) for c in values):
            bad.append(f"{t.get('name')} (trace {i})")
    return bad


def test_figures_render_without_warnings_and_give_bars_colour_strings(caplog):
    """Building, to_json and to_html say nothing; no bar gets numeric colours (the packing
    figure's ~70 "Invalid color specifier" lines in the browser console)."""
    import json
    import logging
    import warnings

    figures = every_figure()  # their schedules may warn (trailing rollouts): not the figures
    big = build_schedule(rollouts(np.arange(1, 41) % 13 + 3, rollout_id=np.arange(40) // 3),
                         ScheduleConfig(dp=2, global_batch_size=4, max_tokens_per_gpu=16), TINY)
    caplog.clear()
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.DEBUG):
        warnings.simplefilter("always")
        figures["packing (compact rollouts)"] = viz.packing_figure(big, 1)
        rendered = {name: (fig.to_json(), fig.to_html(include_plotlyjs=False))
                    for name, fig in figures.items()}
    assert not [str(w.message) for w in caught]
    assert not [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.WARNING]
    for name, (js, _) in rendered.items():
        assert not _bars_with_numeric_colours(json.loads(js)), name


def test_rl_learning_figure_draws_each_mode_with_its_interval():
    from varbatch_kit.ui import viz

    rows = [{"iteration": k, "reward_mean": 0.2 + 0.1 * k, "lo": 0.1 + 0.1 * k,
             "hi": 0.4 + 0.1 * k} for k in range(3)]
    record = {"modes": {"sync": {"iterations": rows, "wall_s": 600.0},
                        "async": {"iterations": rows[:2], "wall_s": 420.0}}}
    fig = viz.rl_learning_figure(record)
    assert [t.name for t in fig.data] == ["sync (10.0 min)", "async (7.0 min)"]
    sync = fig.data[0]
    np.testing.assert_allclose(sync.error_y.array, [0.2, 0.2, 0.2])  # hi - mean
    np.testing.assert_allclose(sync.error_y.arrayminus, [0.1, 0.1, 0.1])  # mean - lo
    with pytest.raises(ValueError, match="no 'modes'"):
        viz.rl_learning_figure({})
    with pytest.raises(ValueError, match="reward_mean, lo and hi"):
        viz.rl_learning_figure({"modes": {"sync": {"iterations": [{"iteration": 0}]}}})


def test_the_recorded_learning_run_the_package_ships_draws():
    """data/runs/rl_loop_smollm2_cpu.json (benchmarks/rl_learning.py --record) is what
    notebook 07 plots: it holds both modes, every iteration with its interval."""
    import json

    from varbatch_kit.resources import data_dir
    from varbatch_kit.ui import viz

    record = json.loads(data_dir("runs").joinpath("rl_loop_smollm2_cpu.json").read_text())
    assert set(record["modes"]) == {"sync", "async"}
    for run in record["modes"].values():
        assert len(run["iterations"]) >= 8
        assert all(r["lo"] <= r["reward_mean"] <= r["hi"] for r in run["iterations"])
    assert len(viz.rl_learning_figure(record).data) == 2
