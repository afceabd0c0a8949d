"""``candidate_figures``: one schedule's simulated time, cap safety and quality, as one row."""

import pytest

from varbatch_kit import ModelShape, Rollouts, ScheduleConfig, build_schedule, simulate
from varbatch_kit.analysis.candidates import CANDIDATE_COLUMNS, candidate_figures
from varbatch_kit.analysis.quality import summary


@pytest.fixture(scope="module")
def sched():
    r = Rollouts(prompt_len=[0] * 8, response_len=[100, 900, 300, 50, 700, 200, 400, 650])
    return build_schedule(r, ScheduleConfig(dp=2, global_batch_size=4, max_tokens_per_gpu=600),
                          ModelShape.preset("qwen3-8b"))


def test_figures_match_the_simulator_and_the_quality_summary(sched):
    f = candidate_figures(sched)
    assert set(f) == set(CANDIDATE_COLUMNS)
    sim = simulate(sched)
    assert f["time_s"] == sim.total_time_s and f["bound_s"] == sim.total_bound_s
    assert f["step_s"] == pytest.approx(sim.total_time_s / sched.num_steps)
    s = summary(sched)
    assert f["makespan_ratio"] == pytest.approx(s["mean_makespan_ratio"])
    assert f["oversize"] == 3 == s["oversize_alone"]  # 900, 700, 650 > 600, each alone
    assert f["peak_mb_tokens"] == 900 and f["over_limit"] == 0


def test_a_tighter_memory_limit_counts_full_micro_batches(sched):
    assert candidate_figures(sched, memory_limit=350)["over_limit"] > 0
    with pytest.raises(ValueError, match="memory_limit"):
        candidate_figures(sched, memory_limit=0)
