"""Step-time model: hand-computed times, 1F1B bubble, stragglers, errors, its settings."""

import inspect
from dataclasses import fields

import numpy as np
import pytest
from _factories import TINY

from varbatch_kit import Rollouts, ScheduleConfig, build_schedule
from varbatch_kit.analysis.cost_model import MicroBatchCostModel
from varbatch_kit.analysis.simulate import compare_cp_modes, simulate, simulated_step_time_bound
from varbatch_kit.analysis.simulate_common import SimulationSettings
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


# --------------------------------------------------------------------------- the settings
SETTINGS = [f.name for f in fields(SimulationSettings)]


@pytest.mark.parametrize("fn", [simulate, simulated_step_time_bound, compare_cp_modes])
def test_the_simulators_take_the_settings_in_their_signature(fn):
    """The settings' list is written once (the dataclass); each function shows it as its own."""
    assert SETTINGS == ["hardware", "efficiency", "microbatch_overhead_s", "pp", "tp",
                        "step_overhead_s", "backward_factor"]
    params = inspect.signature(fn).parameters
    shared = inspect.signature(SimulationSettings).parameters
    assert [params[n] for n in SETTINGS] == [shared[n] for n in SETTINGS]  # kind and default
    assert params["tp"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["pp"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert params["settings"].default is None


def test_arguments_and_one_settings_object_give_the_same_times():
    s = schedule_of([10, 20, 30, 40], dp=2, max_tokens_per_gpu=25, cp=2)
    kw = dict(tp=2, step_overhead_s=0.25, backward_factor=1.5)
    obj = SimulationSettings(UNIT, 0.5, 0.125, 2, **kw)
    a = simulate(s, UNIT, 0.5, 0.125, 2, **kw)
    b = simulate(s, settings=obj)
    assert a.step_times.equals(b.step_times) and a.params == b.params
    bound = simulated_step_time_bound(s, UNIT, 0.5, 0.125, 2, **kw)
    assert bound.tolist() == simulated_step_time_bound(s, settings=obj).tolist()
    assert bound.tolist() == a.step_times["bound_s"].tolist()
    r = Rollouts.synthetic(32, seed=1)
    cfg = ScheduleConfig(dp=2, cp=2, global_batch_size=8, max_tokens_per_gpu=8192)
    cp_kw = dict(tp=2, backward_factor=1.5)
    assert compare_cp_modes(r, cfg, TINY, "H200", 0.5, **cp_kw).equals(
        compare_cp_modes(r, cfg, TINY, settings=SimulationSettings("H200", 0.5, **cp_kw)))


def test_the_bound_of_a_measured_cost_model_is_simulates():
    s = schedule_of([10, 20, 30, 40], dp=2, max_tokens_per_gpu=50)
    m = MicroBatchCostModel(0.01, 1e-3, 1e-6)
    want = simulate(s, hardware=m, step_overhead_s=0.5).step_times["bound_s"].tolist()
    assert simulated_step_time_bound(s, hardware=m, step_overhead_s=0.5).tolist() == want
    r = Rollouts.synthetic(16, seed=1)
    with pytest.raises(ValueError, match="not a MicroBatchCostModel"):
        compare_cp_modes(r, ScheduleConfig(cp=2, global_batch_size=8, max_tokens_per_gpu=4096),
                         TINY, hardware=m)


def test_settings_errors():
    s = schedule_of([10, 20, 30, 40], dp=2, max_tokens_per_gpu=50)
    with pytest.raises(ValueError, match="efficiency must be in"):
        SimulationSettings(efficiency=1.5)  # checked when made
    with pytest.raises(ValueError, match="unknown hardware 'TPU'"):
        SimulationSettings("TPU")
    with pytest.raises(ValueError, match="tp must be a positive integer"):
        SimulationSettings(tp=0)
    for fn in (simulate, simulated_step_time_bound):
        with pytest.raises(ValueError, match=r"settings=\.\.\. and the settings' own arguments "
                                             r"\('H200', tp\) given together"):
            fn(s, "H200", tp=2, settings=SimulationSettings())
        with pytest.raises(ValueError, match="settings must be a SimulationSettings"):
            fn(s, settings={"tp": 2})
        with pytest.raises(TypeError, match="unexpected keyword argument 'gpu'"):
            fn(s, gpu="H100")
