"""ScheduleConfig.microbatch_order and simulate(order=): a permutation of each rank's work."""

import numpy as np
import pytest

from varbatch_kit import ModelShape, ScheduleConfig, build_schedule
from varbatch_kit.analysis.simulate import simulate
from varbatch_kit.core.traces import bundled_traces, read_trace
from varbatch_kit.policies.pipeline import pipeline_makespan

MODEL = ModelShape.preset("qwen3-8b")


@pytest.fixture(scope="module")
def rollouts():
    roll = read_trace(bundled_traces()["long_context"])
    return roll.subset(np.flatnonzero(roll.rollout_id < 128))


@pytest.mark.parametrize("name", ["small_ends", "min_bubble"])
def test_order_permutes_each_ranks_micro_batches_only(rollouts, name):
    base = ScheduleConfig(dp=4, global_batch_size=64, max_tokens_per_gpu=16384, pp=4)
    arrival = build_schedule(rollouts, base, MODEL)
    ordered = build_schedule(rollouts, base.with_(microbatch_order=name), MODEL).check()
    assert ordered.num_microbatches == arrival.num_microbatches
    moved = 0
    for a, b in zip(arrival.steps, ordered.steps, strict=True):
        assert [m.tolist() for m in a.micro_batches] == [m.tolist() for m in b.micro_batches]
        for ra, rb in zip(a.rank_bins, b.rank_bins, strict=True):
            assert sorted(ra) == sorted(rb)
            moved += ra != rb
            if name == "min_bubble":  # never a longer pipeline than arrival, on FLOPs
                fa = np.array([arrival.sample_flops[a.micro_batches[i]].sum() for i in ra])
                fb = np.array([arrival.sample_flops[a.micro_batches[i]].sum() for i in rb])
                assert pipeline_makespan(fb, 2 * fb, 4) <= pipeline_makespan(fa, 2 * fa, 4) * (
                    1 + 1e-12)
    assert moved > 0


def test_simulate_order_is_a_what_if_never_slower_than_arrival(rollouts):
    cfg = ScheduleConfig(dp=4, global_batch_size=64, max_tokens_per_gpu=16384)
    s = build_schedule(rollouts, cfg, MODEL)
    base = simulate(s, pp=4).step_times
    same = simulate(s, pp=4, order="arrival").step_times
    best = simulate(s, pp=4, order="min_bubble").step_times
    np.testing.assert_allclose(same["time_s"], base["time_s"], rtol=0)
    assert (best["time_s"] <= base["time_s"] * (1 + 1e-12)).all()
    assert best["bubble_s"].sum() < base["bubble_s"].sum()


def test_simulate_pp_defaults_to_the_configs(rollouts):
    cfg = ScheduleConfig(dp=4, global_batch_size=64, max_tokens_per_gpu=16384, pp=4)
    s = build_schedule(rollouts, cfg, MODEL)
    np.testing.assert_array_equal(simulate(s).step_times["time_s"],
                                  simulate(s, pp=4).step_times["time_s"])
    assert simulate(s).params["pp"] == 4


def test_bad_order_names():
    with pytest.raises(ValueError, match="unknown microbatch_order 'reverse'"):
        ScheduleConfig(global_batch_size=2, micro_batch_size=1, microbatch_order="reverse")
    with pytest.raises(ValueError, match="pp must be a positive integer"):
        ScheduleConfig(global_batch_size=2, micro_batch_size=1, pp=0)
