"""Explorers driven from Python: a control moves, the figure data and summary follow."""

import asyncio

import numpy as np
import pytest
from _factories import TINY, background_error

from varbatch_kit import ModelShape, Rollouts, ScheduleConfig, build_schedule
from varbatch_kit.analysis.quality import step_quality
from varbatch_kit.policies.registry import PACKERS
from varbatch_kit.ui import widgets
from varbatch_kit.ui.explorer_engine import measure_latency
from varbatch_kit.ui.packing_explorer import PACKING_CONTROLS


@pytest.fixture(scope="module")
def batch():
    return Rollouts.synthetic(256, samples_per_rollout=(1, 3), prompt_len=(16, 128),
                              response_len=300.0, max_response_len=2048, seed=3)


@pytest.fixture()
def explorer(batch):
    ex = widgets.packing_explorer(batch, TINY, config=ScheduleConfig(
        dp=4, global_batch_size=64, max_tokens_per_gpu=2048, distribution="flops_kk"))
    yield ex
    ex.close()


def expected(batch, step=0, **cfg):
    base = {"dp": 4, "global_batch_size": 64, "max_tokens_per_gpu": 2048,
            "distribution": "flops_kk"}
    s = build_schedule(batch, ScheduleConfig(**{**base, **cfg}), TINY)
    return s, step_quality(s).iloc[step]


def test_initial_state_matches_the_core(explorer, batch):
    s, q = expected(batch)
    st = explorer.state
    assert st["micro_batches"] == q["micro_batches"] == len(explorer.figure.data[1].x)
    assert st["mb_lower_bound"] == q["mb_lower_bound"]
    assert st["flops_imbalance"] == pytest.approx(q["flops_imbalance"])
    assert st["steps"] == s.num_steps == 4
    assert list(explorer.controls["step"].options) == [0, 1, 2, 3]
    assert len(explorer.figure.data[0].x) == s.steps[0].num_samples
    assert f'<span class="vbk-micro-batches">{st["micro_batches"]}</span>' in \
        explorer.summary.value
    assert explorer.last_error is None and explorer.error.layout.display == "none"
    # the summary says over-cap micro-batches in the figure's and the tables' words
    assert (f'<span class="vbk-over-cap">{st["cap_violations"]}</span> cap violations'
            in explorer.summary.value) and "over the cap" not in explorer.summary.value


def test_moving_the_cap_slider_redraws(explorer, batch):
    before = np.asarray(explorer.figure.data[1].y).copy()
    explorer.controls["max_tokens_per_gpu"].value = 1024  # like a user: observer fires
    _, q = expected(batch, max_tokens_per_gpu=1024)
    assert explorer.state["micro_batches"] == q["micro_batches"]
    after = np.asarray(explorer.figure.data[1].y)
    assert len(after) == q["micro_batches"] != len(before)
    assert after.max() <= 1024 or explorer.state["over_cap"] > 0
    assert explorer.figure.data[3].name == "token cap 1024"
    assert list(explorer.figure.data[3].y) == [1024, 1024]
    assert f'<span class="vbk-micro-batches">{int(q["micro_batches"])}</span>' in \
        explorer.summary.value
    assert set(explorer.timings) == {"schedule_ms", "stats_ms", "figure_ms", "total_ms"}
    assert explorer.timings["schedule_ms"] > 0


def test_step_selector_and_cache(explorer, batch):
    s, q = expected(batch, step=2)
    t = explorer.set(step=2)
    assert explorer.state["step"] == 2
    assert explorer.state["micro_batches"] == q["micro_batches"]
    np.testing.assert_array_equal(np.sort(np.asarray(explorer.figure.data[0].customdata)[:, 0]),
                                  np.sort(s.steps[2].sample_indices))
    assert t["schedule_ms"] == 0.0  # same layout: the cached schedule is reused
    assert "schedule and stats from cache" in explorer.timing_label.value
    explorer.set(max_tokens_per_gpu=explorer.controls["max_tokens_per_gpu"].value + 1024)
    assert "schedule and stats from cache" not in explorer.timing_label.value
    assert "ms · stats" in explorer.timing_label.value


def test_dp_cp_and_policy_controls(explorer, batch):
    explorer.set(dp=8, cp=2)
    _, q = expected(batch, dp=8, cp=2)
    assert explorer.state["micro_batches"] == q["micro_batches"]
    assert explorer.figure.data[3].name == "token cap 4096"  # max_tokens_per_gpu * cp
    explorer.set(cp=1, packing="flops_kk")
    _, q = expected(batch, dp=8, packing="flops_kk")
    assert explorer.state["cap_violations"] == q["cap_violations"]
    assert explorer.state["over_cap"] == len(explorer.figure.data[2].x)
    assert "flops_kk + flops_kk" in explorer.figure.layout.title.text


def test_static_packing_switches_the_size_controls():
    one = Rollouts.synthetic(128, seed=1)  # one sample per rollout: 32 samples per step
    ex = widgets.packing_explorer(one, TINY, config=ScheduleConfig(
        dp=4, global_batch_size=32, max_tokens_per_gpu=4096))
    ex.controls["packing"].value = "static"
    assert ex.controls["max_tokens_per_gpu"].disabled
    assert not ex.controls["micro_batch_size"].disabled
    ex.set(micro_batch_size=4)
    assert ex.last_error is None
    assert ex.state["micro_batches"] == 8  # 32 samples / 4 per micro-batch
    assert ex.state["mb_lower_bound"] is None
    assert ex.figure.data[3].name == "no token cap (static)"
    ex.set(micro_batch_size=3)  # 11 micro-batches: not a multiple of dp=4
    assert "micro_batch_size=3" in ex.last_error
    ex.close()


def test_impossible_layout_shows_the_scheduler_message(explorer, batch):
    good = np.asarray(explorer.figure.data[1].y).copy()
    explorer.controls["dp"].value = 4096
    with pytest.raises(ValueError) as err:
        build_schedule(batch, ScheduleConfig(dp=4096, global_batch_size=64,
                                             max_tokens_per_gpu=2048,
                                             distribution="flops_kk"), TINY)
    assert explorer.last_error == str(err.value)
    assert explorer.error.layout.display is None  # visible
    assert "vbk-error-text" in explorer.error.value
    assert "dp=4096" in explorer.error.value and "Traceback" not in explorer.error.value
    assert "cannot be scheduled" in explorer.summary.value
    # the figure keeps the last valid layout and says so
    np.testing.assert_array_equal(explorer.figure.data[1].y, good)
    assert "last valid layout" in explorer.figure.layout.title.text
    assert explorer.state["error"] == explorer.last_error
    explorer.controls["dp"].value = 4
    assert explorer.last_error is None and explorer.error.layout.display == "none"
    assert "error" not in explorer.state


def test_packing_that_requires_a_distribution_selects_it(explorer):
    needy = [n for n, s in PACKERS.items() if getattr(s, "requires_distribution", None)]
    if not needy:
        pytest.skip("no registered packing requires a distribution")
    explorer.controls["packing"].value = needy[0]
    assert explorer.controls["distribution"].value == PACKERS[needy[0]].requires_distribution
    assert explorer.last_error is None


def test_css_hooks_and_descriptions(explorer):
    assert "vbk-explorer" in explorer.widget._dom_classes
    assert "vbk-packing-explorer" in explorer.widget._dom_classes
    assert "vbk-summary" in explorer.summary._dom_classes
    assert "vbk-error" in explorer.error._dom_classes
    assert "vbk-figure" in explorer.figure_output.widget._dom_classes
    assert list(explorer.controls) == list(PACKING_CONTROLS)
    for name, ctl in explorer.controls.items():
        assert ctl.description == PACKING_CONTROLS[name]
        assert f"vbk-control-{name.replace('_', '-')}" in ctl._dom_classes
    bundle = explorer._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert 'class="vbk-static"' in bundle["text/html"] and "Plotly.newPlot" in bundle["text/html"]


def test_debounced_background_updates_coalesce_to_the_latest_value(batch):
    async def drive():
        ex = widgets.packing_explorer(batch, TINY, config=ScheduleConfig(
            dp=4, global_batch_size=64, max_tokens_per_gpu=2048), debounce_s=0.02)
        n0 = len(ex.history)
        for cap in (1024, 1536, 3072, 4096):  # a drag: only the last value matters
            ex.controls["max_tokens_per_gpu"].value = cap
        assert len(ex.history) == n0  # nothing computed synchronously
        for _ in range(200):
            await asyncio.sleep(0.02)
            if ex._handle is None and not ex._busy and len(ex.history) > n0:
                break
        ex.close()
        return ex, n0

    ex, n0 = asyncio.run(drive())
    _, q = expected(batch, max_tokens_per_gpu=4096, distribution="strided")
    assert len(ex.history) == n0 + 1
    assert ex.state["micro_batches"] == q["micro_batches"]
    assert ex.figure.data[3].name == "token cap 4096"


def test_background_errors_reach_the_error_box(batch):
    ex = background_error(lambda: widgets.packing_explorer(batch, TINY, debounce_s=0.0),
                          lambda ex: setattr(ex.controls["dp"], "value", 8192))
    assert "dp=8192" in ex.last_error and ex.error.layout.display is None


def test_balance_explorer_follows_model_and_dp(batch):
    ex = widgets.balance_explorer(batch, "qwen3-8b", config=ScheduleConfig(
        dp=4, global_batch_size=64, max_tokens_per_gpu=2048, distribution="flops_kk"))
    assert "vbk-balance-explorer" in ex.widget._dom_classes
    q8 = step_quality(build_schedule(batch, ex.config(), ModelShape.preset("qwen3-8b")))
    assert ex.state["worst_makespan_ratio"] == pytest.approx(q8["makespan_ratio"].max())
    ex.set(model="qwen2.5-0.5b", dp=8)
    model = ModelShape.preset("qwen2.5-0.5b")
    s = build_schedule(batch, ex.config(), model)
    assert ex.config().dp == 8
    f = model.forward_flops(batch.total_len)
    rank_flops = [sum(float(f[s.steps[0].micro_batches[b]].sum()) for b in bins)
                  for bins in s.steps[0].rank_bins]
    np.testing.assert_allclose(np.asarray(ex.figure.data[0].y)[:8], rank_flops)
    if "hardware" in ex.controls:
        assert ex.state["predicted_s"] >= ex.state["predicted_bound_s"] > 0
    with pytest.raises(ValueError, match="preset"):
        widgets.balance_explorer(batch, "gpt-17")
    with pytest.raises(ValueError, match="unknown control"):
        ex.set(colour="red")
    ex.close()


def test_measure_latency_table(explorer):
    table = measure_latency(explorer, [{"max_tokens_per_gpu": 4096}, {"step": 1}])
    assert list(table.change) == ["max_tokens_per_gpu=4096", "step=1"]
    assert (table.total_ms >= table.figure_ms).all()
    assert table.schedule_ms.iloc[1] == 0.0


def test_each_explorer_name_has_one_import_path():
    """widgets makes the explorers; the classes, control tables and engine live in their modules."""
    from varbatch_kit.ui import (
        balance_explorer,
        explorer_engine,
        packing_explorer,
        planner_explorer,
        recommend_explorer,
    )

    assert widgets.__all__ == ["balance_explorer", "packing_explorer", "planner_explorer",
                               "recommend_explorer"]
    for name in ("PackingExplorer", "BalanceExplorer", "RecommendExplorer", "PlannerExplorer",
                 "PACKING_CONTROLS", "BALANCE_CONTROLS", "RECOMMEND_COLUMNS", "PLAN_COLUMNS",
                 "Explorer", "measure_latency"):
        assert not hasattr(widgets, name), name
    assert recommend_explorer.__all__ == ["RECOMMEND_COLUMNS", "RecommendExplorer"]
    assert planner_explorer.__all__ == ["PLAN_COLUMNS", "PlannerExplorer"]
    assert packing_explorer.__all__ == ["PACKING_CONTROLS", "PackingExplorer"]
    assert balance_explorer.__all__ == ["BALANCE_CONTROLS", "BalanceExplorer"]
    assert "measure_latency" in explorer_engine.__all__
