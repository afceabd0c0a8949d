"""The per-rollout-step figure of a run (:func:`varbatch_kit.ui.viz.run_quality_figure`)."""

import numpy as np
import pandas as pd
import pytest

from varbatch_kit.ui import viz
from varbatch_kit.ui.figures.run import RUN_PANELS


def table():
    rows = []
    for rid in (1, 2, 5):
        for i, policy in enumerate(("first_fit + strided", "balanced + balanced")):
            rows.append({"rollout_id": rid, "policy": policy, "time_s": rid + 0.5 * i,
                         "flops_imbalance": 1.0 + 0.1 * rid - 0.05 * i})
    rows[-1].update(time_s=np.nan, flops_imbalance=np.nan)  # a policy that could not run
    return pd.DataFrame(rows[::-1])  # any row order


def test_one_trace_per_policy_per_panel_with_the_steps_on_x():
    fig = viz.run_quality_figure(table())
    assert len(fig.data) == 2 * len(RUN_PANELS)
    for r, (col, _) in enumerate(RUN_PANELS):
        axis = "x" if r == 0 else f"x{r + 1}"
        panel = [t for t in fig.data if t.xaxis == axis]
        # the policies in the table's order (the reversed table starts with balanced)
        assert [t.name for t in panel] == ["balanced + balanced", "first_fit + strided"]
        for t in panel:
            assert list(t.x) == [1, 2, 5]
            want = table().query("policy == @t.name").sort_values("rollout_id")[col]
            np.testing.assert_array_equal(np.asarray(t.y, dtype=float), want.to_numpy())
    assert [t.showlegend for t in fig.data] == [True, False, True, False]
    assert fig.layout.xaxis2.title.text == "rollout step (rollout_id)"
    assert "3 rollout steps" in fig.layout.title.text


def test_a_table_without_the_columns_is_refused():
    with pytest.raises(ValueError, match=r"needs column\(s\) \['time_s'\]"):
        viz.run_quality_figure(table().drop(columns="time_s"))
    with pytest.raises(ValueError, match="empty"):
        viz.run_quality_figure(table().iloc[:0])
