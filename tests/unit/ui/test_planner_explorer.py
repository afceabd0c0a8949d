"""The planner explorer (ui.planner_explorer): plan_layouts behind controls."""

from __future__ import annotations

import numpy as np
import pytest

from varbatch_kit import Rollouts
from varbatch_kit.compat.slime.planner import plan_layouts
from varbatch_kit.ui import widgets


def _rollouts(n=48, seed=0):
    rng = np.random.default_rng(seed)
    return Rollouts(prompt_len=rng.integers(50, 400, n),
                    response_len=np.minimum(rng.pareto(1.1, n) * 800 + 100, 9000).astype(int),
                    rollout_id=np.arange(n) // 4)


def test_the_explorer_shows_what_plan_layouts_finds_and_searches_again_on_a_change():
    ro = _rollouts()
    ex = widgets.planner_explorer(ro, "qwen2.5-0.5b", 2, global_batch_size=6, caps=(4096,),
                                  background=False)
    plan = plan_layouts(ro, "qwen2.5-0.5b", 2, global_batch_size=6, caps=(4096,))
    keys = ("tp", "pp", "cp", "dp", "max_tokens_per_gpu", "packing", "recompute")
    assert {k: ex.state["best"][k] for k in keys} == {k: plan.best[k] for k in keys}
    assert ex.state["command"].startswith("--tensor-model-parallel-size")
    assert "fastest that fits" in ex.summary.value and "vbk-plan-table" in ex.details.value
    assert len(ex.figure.data) > 0  # time against memory, every candidate
    ex.set(gpus=4)
    assert ex.state["best"]["tp"] * ex.state["best"]["pp"] * ex.state["best"]["cp"] \
        * ex.state["best"]["dp"] == 4
    ex.set(caps="a,b")  # a bad control shows its error, the last result stays
    assert "caps 'a,b'" in ex.last_error and ex.state["best"] is not None
    assert "vbk-static" in ex.static_html()


def test_bad_arguments_say_what_is_allowed():
    with pytest.raises(ValueError, match="is not a preset"):
        widgets.planner_explorer(_rollouts(), "gpt-9", 4)
