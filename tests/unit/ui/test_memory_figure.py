"""memory_figure: one step's predicted peak per GPU stacked by kind (core.memory's table)."""

from __future__ import annotations

import numpy as np
import pytest

from varbatch_kit import ModelShape, Rollouts, ScheduleConfig, build_schedule
from varbatch_kit.core.memory import MemoryLayout, predict_memory
from varbatch_kit.ui.viz import memory_figure

MODEL = ModelShape(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                   vocab_size=1000)


def _table():
    rng = np.random.default_rng(1)
    ro = Rollouts(prompt_len=rng.integers(4, 20, 16), response_len=rng.integers(5, 200, 16),
                  rollout_id=np.arange(16) // 2)
    sched = build_schedule(ro, ScheduleConfig(dp=2, global_batch_size=4,
                                              max_tokens_per_gpu=300), MODEL)
    return predict_memory(sched, MODEL, MemoryLayout(dp=2, pp=2))


def test_bars_per_gpu_stack_to_the_peak_with_the_device_line():
    table = _table()
    fig = memory_figure(table, hardware_memory_gib=1e-3)
    step = int(table.loc[table["peak_bytes"].idxmax(), "step"])  # the default step
    rows = table[table.step == step].sort_values("rank")
    bars = [t for t in fig.data if t.type == "bar"]
    assert {t.name for t in bars} >= {"parameters", "gradients", "activations in flight"}
    total = np.sum([np.asarray(t.y) for t in bars], axis=0)
    np.testing.assert_allclose(total, rows["peak_bytes"].to_numpy() / 2**30)
    assert list(bars[0].x) == list(rows["rank"]) == [0, 1, 2, 3]  # dp 2 x pp 2
    assert fig.layout.barmode == "stack" and "step" in fig.layout.title.text
    assert any("device memory" in a.text for a in fig.layout.annotations)
    # measured peaks (a run's memory_table) become markers
    measured = table.rename(columns={"peak_bytes": "predicted_bytes"}).assign(
        measured_bytes=lambda t: t["predicted_bytes"] * 1.05)
    marks = [t for t in memory_figure(measured, step=0).data if t.type == "scatter"]
    assert len(marks) == 1 and marks[0].name == "measured peak"


def test_bad_tables_and_steps_say_what_is_wanted():
    with pytest.raises(ValueError, match="the table lacks"):
        memory_figure(_table().drop(columns=["activations"]))
    with pytest.raises(ValueError, match="step=99 is not in the table"):
        memory_figure(_table(), step=99)


def test_the_packing_explorer_shows_the_predicted_peak_and_headroom():
    from varbatch_kit.ui import widgets

    rng = np.random.default_rng(2)
    ro = Rollouts(prompt_len=rng.integers(4, 20, 16), response_len=rng.integers(5, 200, 16),
                  rollout_id=np.arange(16) // 2)
    config = ScheduleConfig(dp=2, global_batch_size=4, max_tokens_per_gpu=300)
    ex = widgets.packing_explorer(ro, MODEL, config=config, background=False)
    sched = build_schedule(ro, config, MODEL)
    expected = predict_memory(sched, MODEL, MemoryLayout(dp=2, precision="bf16",
                                                         distributed_optimizer=True))
    step = ex.state["step"]
    peak = expected[expected.step == step]["peak_bytes"].max() / 2**30
    assert ex.state["peak_gib"] == pytest.approx(peak)
    assert ex.state["headroom_gib"] == pytest.approx(80 - peak)
    assert "predicted peak per GPU" in ex.summary.value and "vbk-peak" in ex.summary.value
    # without a model there are no FLOPs and no memory line
    bare = widgets.packing_explorer(ro, config=config, background=False)
    assert "peak_gib" not in bare.state and "predicted peak" not in bare.summary.value


def test_a_layout_the_model_cannot_split_says_why_in_the_summary():
    from varbatch_kit.ui import widgets

    three = ModelShape(**{**MODEL.to_dict(), "num_layers": 3})
    rng = np.random.default_rng(3)
    ro = Rollouts(prompt_len=rng.integers(4, 20, 16), response_len=rng.integers(5, 200, 16),
                  rollout_id=np.arange(16) // 2)
    ex = widgets.packing_explorer(ro, three, config=ScheduleConfig(
        dp=1, pp=2, global_batch_size=4, max_tokens_per_gpu=300), background=False)
    assert "peak_gib" not in ex.state
    assert "predicted peak per GPU: n/a (3 layers do not split evenly" in ex.summary.value
