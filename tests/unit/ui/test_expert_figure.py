"""viz.expert_load_figure on a hand-made compare table (no training)."""

from __future__ import annotations

import pandas as pd
import pytest

from varbatch_kit.ui import viz


def _table():
    tokens = [[3, 1, 2, 2], [2, 2, 2, 2]]  # 2 layers x 4 experts
    return pd.DataFrame([
        dict(label="dp1", step=1, expert_tokens=tokens, micro_batch_expert_max_over_mean=[2.0],
             expert_parallel_load_max_over_mean=1.0),
        dict(label="dp2 ep2", step=1, expert_tokens=tokens,
             micro_batch_expert_max_over_mean=[1.5, 4.0], expert_parallel_load_max_over_mean=1.25),
        dict(label="dp1", step=2, expert_tokens=tokens, micro_batch_expert_max_over_mean=[1.0],
             expert_parallel_load_max_over_mean=1.0),
    ])


def test_one_heatmap_and_one_bar_chart_per_layout():
    fig = viz.expert_load_figure(_table(), step=1)
    heat = [t for t in fig.data if t.type == "heatmap"]
    bars = [t for t in fig.data if t.type == "bar"]
    assert len(heat) == 2 and len(bars) == 2
    assert heat[0].z.tolist() == [[3, 1, 2, 2], [2, 2, 2, 2]]
    assert list(bars[1].y) == [1.5, 4.0]
    assert [a.text for a in fig.layout.annotations][:2] == ["dp1", "dp2 ep2"]
    dashed = [s for s in fig.layout.shapes if s.line.dash == "dash"]
    assert sorted(s.y0 for s in dashed) == [1.0, 1.25]


def test_a_dense_table_or_a_missing_step_is_refused():
    with pytest.raises(ValueError, match="mixture-of-experts"):
        viz.expert_load_figure(pd.DataFrame({"label": ["a"], "step": [1]}))
    with pytest.raises(ValueError, match=r"step=3: the table has steps \[1, 2\]"):
        viz.expert_load_figure(_table(), step=3)
