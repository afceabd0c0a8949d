"""Step-time model: hand-computed times, 1F1B bubble, stragglers, errors."""

import numpy as np
import pytest
from _factories import TINY

from varbatch_kit import Rollouts, ScheduleConfig, build_schedule
from varbatch_kit.analysis.simulate import simulate, simulated_step_time_bound
from varbatch_kit.core.hardware import HardwareProfile

UNIT = HardwareProfile("unit", peak_flops=1.0, memory_gib=1.0)  # 1 FLOP/s: times = FLOPs


def schedule_of(lengths, **cfg):
    r = Rollouts(prompt_len=np.zeros(len(lengths), dtype=int), response_len=lengths)
    return build_schedule(r, ScheduleConfig(global_batch_size=len(lengths), **cfg), TINY)


def test_times_stragglers_and_bound_hand_computed():
    # dp 2, micro-batches [1] [2] [3] [0] strided: rank 0 trains samples 1, 3; rank 1: 2, 0
    s = schedule_of([10, 20, 30, 40], dp=2, max_tokens_per_gpu=50)
    f = TINY.forward_flops(np.array([10, 20, 30, 40]))
    o = 0.5
    sim = simulate(s, hardware=UNIT, efficiency=1.0, microbatch_overhead_s=o)
    rank = np.array([3 * (f[1] + f[3]) + 2 * o, 3 * (f[2] + f[0]) + 2 * o])
    st = sim.step_times.iloc[0]
    assert st.time_s == pytest.approx(rank.max())
    assert st.straggler_wait_s == pytest.approx((rank.max() - rank).mean())
    assert st.max_straggler_wait_s == pytest.approx(rank.max() - rank.min())
    # bound: max(total/dp, largest sample) in ceil(100/50) = 2 micro-batches -> 1 per rank
    bound = 3 * max(f.sum() / 2, f.max()) + 1 * o
    assert st.bound_s == pytest.approx(bound) and st.ratio == pytest.approx(rank.max() / bound)
    assert simulated_step_time_bound(s, UNIT, 1.0, o).tolist() == pytest.approx([bound])
    tl = sim.timelines
    assert len(tl) == 4 and tl.groupby("rank")["end_s"].max().tolist() == pytest.approx(
        rank.tolist())
    r0 = tl[tl["rank"] == 0].sort_values("micro_batch")
    assert r0["start_s"].iloc[1] == pytest.approx(r0["end_s"].iloc[0])
    assert r0["tokens"].tolist() == [20, 40]
    assert sim.rank_times["wait_s"].tolist() == pytest.approx((rank.max() - rank).tolist())
    assert sim.total_time_s == pytest.approx(rank.max())


def test_efficiency_tp_cp_and_step_overhead_scale_compute():
    s = schedule_of([10, 20, 30, 40], dp=2, max_tokens_per_gpu=25, cp=2)
    a = simulate(s, hardware=UNIT, efficiency=1.0, microbatch_overhead_s=0.0)
    b = simulate(s, hardware=UNIT, efficiency=0.5, microbatch_overhead_s=0.0, tp=4,
                 step_overhead_s=3.0)
    assert b.step_times.time_s.iloc[0] == pytest.approx(a.step_times.time_s.iloc[0] / 2 + 3.0)


def test_pipeline_adds_a_bubble_and_balanced_is_faster():
    r = Rollouts.synthetic(256, seed=4)
    cfg = ScheduleConfig(dp=4, global_batch_size=64, max_tokens_per_gpu=16384)
    base = build_schedule(r, cfg, TINY)
    bal = build_schedule(r, cfg.with_(packing="balanced", distribution="balanced"), TINY)
    for s in (base, bal):
        one = simulate(s, pp=1, microbatch_overhead_s=0.0)
        four = simulate(s, pp=4, microbatch_overhead_s=0.0)
        assert (one.step_times.bubble_s.abs() < 1e-12).all()
        assert (four.step_times.bubble_s > 0).all()
        # 4 stages split the work but add a bubble: more than a quarter of the 1-stage time
        assert (four.step_times.time_s > one.step_times.time_s / 4).all()
        assert (one.step_times.ratio >= 1 - 1e-12).all()
    assert simulate(bal).total_time_s < simulate(base).total_time_s


@pytest.mark.parametrize("kwargs,match", [
    ({"hardware": "TPU"}, "unknown hardware 'TPU'"),
    ({"efficiency": 0}, "efficiency must be in"),
    ({"microbatch_overhead_s": -1}, "microbatch_overhead_s must be"),
    ({"pp": 0}, "pp must be a positive integer"),
])
def test_errors(kwargs, match):
    s = schedule_of([10, 20, 30, 40], dp=2, max_tokens_per_gpu=50)
    with pytest.raises(ValueError, match=match):
        simulate(s, **kwargs)


def test_needs_flops():
    r = Rollouts(prompt_len=[0] * 4, response_len=[10, 20, 30, 40])
    s = build_schedule(r, ScheduleConfig(dp=2, global_batch_size=4, max_tokens_per_gpu=50))
    with pytest.raises(ValueError, match="needs FLOPs"):
        simulate(s)
    with pytest.raises(ValueError, match="must be a varbatch_kit Schedule"):
        simulate("schedule")
