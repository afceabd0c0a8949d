"""cp_report_check: one step's reports without CP, with fixed and with dynamic CP, on real plans."""

import numpy as np
import pytest
from _factories import TINY

from varbatch_kit import Rollouts, ScheduleConfig, build_schedule
from varbatch_kit.analysis.cp_reports import CP_CHECK_MODES, cp_report_check, step_programs


def mixed() -> Rollouts:
    rng = np.random.default_rng(5)
    resp = rng.integers(20, 200, 32)
    resp[[0, 9, 17, 30]] = [3000, 2500, 3900, 2800]  # a few long samples among short ones
    masks = [(rng.random(r) < 0.8).astype(int) for r in resp]
    return Rollouts(rng.integers(4, 30, 32), resp, np.repeat(np.arange(16), 2), masks)


def test_planner_plans_report_like_no_cp():
    cfg = ScheduleConfig(dp=2, cp=4, global_batch_size=8, max_tokens_per_gpu=2048)
    table = cp_report_check(mixed(), cfg, TINY, step=0)
    assert table["mode"].tolist() == list(CP_CHECK_MODES)
    assert table["equal"].all(), table
    assert (table["max_rel_diff"] <= 1e-12).all()
    degrees = table["degrees"].iloc[0]
    assert len(degrees) >= 2, degrees  # the dynamic plan really mixes degrees
    with pytest.raises(ValueError, match="step=9 is out of range"):
        cp_report_check(mixed(), cfg, TINY, step=9)


def test_step_programs_of_both_modes():
    r = mixed()
    cfg = ScheduleConfig(dp=2, cp=4, global_batch_size=8, max_tokens_per_gpu=1024)
    for mode in ("fixed", "dynamic"):
        st = build_schedule(r, cfg.with_(cp_mode=mode), TINY).steps[1]
        programs = step_programs(st)
        assert len(programs) == 8 and len({len(p) for p in programs}) == 1
        seen = sorted(i for p in programs for s, c, k in p if k == 0 for i in s)
        assert seen == list(range(st.num_samples))  # CP rank 0 of every group: each sample once
