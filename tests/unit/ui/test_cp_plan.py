"""viz.cp_plan_figure: a step's CP plan, ranks x rounds, blocks over CP groups coloured by
degree."""

import numpy as np
import plotly.graph_objects as go
import pytest
from _factories import TINY, rollouts

from varbatch_kit import Rollouts, ScheduleConfig, build_schedule
from varbatch_kit.core.schedule import Schedule
from varbatch_kit.core.step import Step
from varbatch_kit.ui import viz
from varbatch_kit.ui.figures.cp import DEGREE_COLORS, IDLE_COLOR


def hand_plan() -> Schedule:
    """dp=1 cp=4: a 400-token sample over ranks 0-3 in round 0; then 3 singles, rank 3 idle."""
    r = rollouts([400, 100, 90, 80])
    cfg = ScheduleConfig(dp=1, cp=4, global_batch_size=4, max_tokens_per_gpu=100,
                         cp_mode="dynamic")
    base = build_schedule(r, cfg, TINY)
    st0 = base.steps[0]
    st = Step.from_placements(0, st0.rollout_ids, st0.sample_indices,
                              [np.array([0]), np.array([1]), np.array([2]), np.array([3])],
                              [(0, (0, 1, 2, 3)), (1, (0,)), (1, (1,)), (1, (2,))], dp=1, cp=4)
    return Schedule(cfg, r, [st], base.dropped_rollout_ids, base.dropped_samples, TINY,
                    base.sample_flops).check()


def test_cp_plan_draws_each_micro_batch_over_its_group_coloured_by_degree():
    fig = viz.cp_plan_figure(hand_plan(), step=0)
    assert isinstance(fig, go.Figure)
    names = [t.name for t in fig.data]
    assert names == ["idle", "c = 1 (3 micro-batches)", "c = 4 (1 micro-batches)",
                     "CP groups", "tokens per rank"]
    idle, c1, c4, groups, labels = fig.data
    # one closed outline per group: the first spans ranks 0..3 of round 0
    assert list(groups.x[:6]) == [0.05, 0.95, 0.95, 0.05, 0.05, None]
    assert list(groups.y[:6]) == [-0.5, -0.5, 3.5, 3.5, -0.5, None]
    assert len(groups.x) == 6 * 4
    # the 400-token micro-batch: one cell on each of ranks 0..3 in round 0
    assert list(c4.y) == [0, 1, 2, 3] and list(c4.base) == [0.05] * 4
    assert c4.marker.color == DEGREE_COLORS[4] and c1.marker.color == DEGREE_COLORS[1]
    assert list(c1.y) == [0, 1, 2] and list(c1.base) == [1.05] * 3
    assert list(idle.y) == [3] and list(idle.base) == [1.05]
    assert idle.marker.color == IDLE_COLOR
    # one label per micro-batch: tokens per rank, centred on its group
    assert list(labels.text) == ["100", "100", "90", "80"]
    assert labels.y[0] == 1.5 and labels.x[0] == 0.5
    assert "CP degree 4 on ranks 0, 1, 2, 3" in labels.customdata[0]
    title = fig.layout.title.text
    assert "4 micro-batches on 4 ranks" in title and "dynamic CP" in title
    assert "2 rounds" in title and "cap 100" in title
    assert fig.layout.yaxis.range == (3.5, -0.5)  # rank 0 on top


def test_cp_plan_table_of_a_hand_plan():
    t = viz.cp_plan_table(hand_plan(), 0)
    assert t["degree"].tolist() == [4, 1, 1, 1]
    assert t["round"].tolist() == [0, 1, 1, 1]
    assert t["ranks"].tolist() == [(0, 1, 2, 3), (0,), (1,), (2,)]
    assert t["tokens_per_rank"].tolist() == [100.0, 100.0, 90.0, 80.0]


def test_fixed_cp_is_drawn_as_its_plan():
    """Fixed dp=2 cp=2, 2 micro-batches per DP rank: DP rank d's j-th mb on ranks 2d, 2d+1."""
    r = rollouts([50, 30, 80, 20, 70, 10, 40, 60])
    cfg = ScheduleConfig(dp=2, cp=2, global_batch_size=8, micro_batch_size=2)
    sched = build_schedule(r, cfg, TINY)
    st = sched.steps[0]
    t = viz.cp_plan_table(sched, 0)
    assert set(t["degree"]) == {2}
    for d, bins in enumerate(st.dp_rank_bins):
        for j, b in enumerate(bins):
            row = t[t.bin == b].iloc[0]
            assert row["round"] == j and row["ranks"] == (2 * d, 2 * d + 1)
    fig = viz.cp_plan_figure(sched)
    assert [x.name for x in fig.data] == ["idle", "c = 2 (4 micro-batches)", "CP groups",
                                          "tokens per rank"]
    assert len(fig.data[0].y) == 0 and fig.data[0].showlegend is False
    assert "fixed CP" in fig.layout.title.text


def test_dynamic_plan_of_the_planner_is_drawn_and_covers_every_micro_batch():
    r = rollouts([4000, 300, 200, 250, 100, 350, 150, 220])
    cfg = ScheduleConfig(dp=2, cp=2, global_batch_size=8, max_tokens_per_gpu=2048,
                         cp_mode="dynamic")
    sched = build_schedule(r, cfg, TINY).check()
    st = sched.steps[0]
    fig = viz.cp_plan_figure(sched, 0)
    cells = sum(len(t.y) for t in fig.data if t.name.startswith("c = "))
    assert cells == sum(p.degree for p in st.placements)
    assert len(fig.data[-1].text) == len(st.micro_batches)


def test_cp_plan_errors_and_rank_limit():
    sched = hand_plan()
    with pytest.raises(ValueError, match="step=3 is out of range"):
        viz.cp_plan_figure(sched, 3)
    fig = viz.cp_plan_figure(sched, 0, max_ranks=2)
    assert "first 2 of 4 ranks shown" in fig.layout.title.text
    assert all(max(t.y, default=0) < 2 for t in fig.data if t.type == "bar")


def test_cp_plan_follows_the_figure_conventions():
    fig = viz.cp_plan_figure(hand_plan())
    legend = fig.layout.legend
    assert (legend.yref, legend.y, legend.yanchor) == ("container", 0, "bottom")
    text = [fig.layout.title.text] + [t.name or "" for t in fig.data]
    text += [t.hovertemplate or "" for t in fig.data] + list(fig.data[-1].customdata)
    assert not [t for t in text if "$" in t]  # no LaTeX (offline pages have no MathJax)


# ------------------------------------------------------------ the explorer toggle
def test_packing_explorer_toggles_fixed_and_dynamic_cp():
    from varbatch_kit.ui import widgets

    lengths = [6000, 300, 200, 250, 100, 350, 150, 220] * 2
    r = Rollouts(prompt_len=np.full(len(lengths), 10), response_len=np.asarray(lengths))
    ex = widgets.packing_explorer(r, TINY, config=ScheduleConfig(
        dp=2, cp=2, global_batch_size=8, max_tokens_per_gpu=4096, packing="first_fit"))
    try:
        assert ex.controls["cp_mode"].value == "fixed"
        assert ex.cp_output.widget in ex.widget.children
        assert ex.cp_output.figure is ex.cp_figure
        assert "vbk-cp-figure" in ex.cp_output.widget._dom_classes
        assert ex.state["cp_mode"] == "fixed" and set(ex.state["degrees"]) == {2}
        assert "fixed CP" in ex.cp_figure.layout.title.text
        fixed_bars = list(ex.figure.data[1].y)
        ex.set(cp_mode="dynamic")
        assert ex.last_error is None, ex.last_error
        assert ex.state["cp_mode"] == "dynamic"
        assert "dynamic CP" in ex.cp_figure.layout.title.text
        want = build_schedule(r, ex.config(), TINY)
        assert ex.state["rounds"] == want.steps[0].num_rounds
        cells = sum(len(t.y) for t in ex.cp_figure.data if t.name.startswith("c = "))
        assert cells == sum(p.degree for p in want.steps[0].placements)
        # the packing view keeps the fixed-CP plan of the same settings, and says so
        assert list(ex.figure.data[1].y) == fixed_bars
        assert ex.figure.layout.title.text.startswith("fixed-CP plan of these settings")
        assert "dynamic CP:" in ex.summary.value
        from varbatch_kit.analysis.simulate import simulate
        fixed_s = simulate(build_schedule(r, ex.config().with_(cp_mode="fixed"), TINY),
                           timelines=False).total_time_s
        assert ex.state["fixed_s"] == fixed_s
        assert ex.state["speedup"] == fixed_s / simulate(want, timelines=False).total_time_s
        assert "vbk-cp-speedup" in ex.summary.value
        ex.set(cp_mode="fixed")
        assert "fixed CP" in ex.cp_figure.layout.title.text
        ex.controls["cp"].value = 1
        ex.set(cp_mode="dynamic")  # impossible: no degree to choose with cp=1
        assert "cp >= 2" in ex.last_error
    finally:
        ex.close()


def test_a_group_of_non_adjacent_ranks_gets_one_outline_per_run():
    r = rollouts([400, 100])
    cfg = ScheduleConfig(dp=1, cp=4, global_batch_size=2, max_tokens_per_gpu=200,
                         cp_mode="dynamic")
    base = build_schedule(r, cfg, TINY)
    st0 = base.steps[0]
    st = Step.from_placements(0, st0.rollout_ids, st0.sample_indices,
                              [np.array([0]), np.array([1])], [(0, (0, 3)), (0, (1,))], dp=1,
                              cp=4)
    sched = Schedule(cfg, r, [st], base.dropped_rollout_ids, base.dropped_samples, TINY,
                     base.sample_flops).check()
    fig = viz.cp_plan_figure(sched)
    groups = next(t for t in fig.data if t.name == "CP groups")
    assert len(groups.x) == 6 * 3  # ranks 0 and 3 (two runs) + rank 1
    assert list(fig.data[-1].text) == ["200", "100"]  # one label per micro-batch


def test_static_snapshot_draws_the_dynamic_plan_its_title_points_to():
    """The HTML snapshot (the demo's page of notebook 03) holds the CP plan figure below the
    packing figure whose title says "(dynamic plan below)"."""
    from varbatch_kit.ui import widgets

    lengths = [6000, 300, 200, 250, 100, 350, 150, 220] * 2
    r = Rollouts(prompt_len=np.full(len(lengths), 10), response_len=np.asarray(lengths))
    ex = widgets.packing_explorer(r, TINY, config=ScheduleConfig(
        dp=2, cp=2, global_batch_size=8, max_tokens_per_gpu=4096, packing="first_fit",
        cp_mode="dynamic"))
    try:
        assert ex.last_error is None, ex.last_error
        page = ex.static_html()
        assert "(dynamic plan below)" in page
        assert page.count("Plotly.newPlot") == 2
        below = page.index("(dynamic plan below)")
        cp_title = ex.cp_figure.layout.title.text.split("<")[0][:30]
        assert cp_title and page.find(cp_title, below) > below  # the CP plan comes after
        assert ex.snapshot_figures() == [ex.figure, ex.cp_figure]
    finally:
        ex.close()
