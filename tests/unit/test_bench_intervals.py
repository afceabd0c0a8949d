"""The pure parts of the measured and peers benchmarks: 95 % intervals over rounds, which
rankings they resolve, the large-gain verdict, and the peers table's calibrated-row verdict."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from benchmarks._intervals import (
    Interval,
    gain_verdict,
    interval,
    order_agrees,
    ranking,
    separated,
    t_975,
)
from benchmarks.peers import CALIBRATED, calibrated_verdict


def test_t_quantiles():
    assert t_975(1) == 12.7062 and t_975(2) == 4.3027 and t_975(30) == 2.0423
    # the expansion beyond the table: t(40) = 2.0211, t(120) = 1.9799, -> 1.96
    assert t_975(40) == pytest.approx(2.0211, abs=2e-4)
    assert t_975(120) == pytest.approx(1.9799, abs=1e-4)
    assert t_975(10**6) == pytest.approx(1.959964, abs=1e-5)
    with pytest.raises(ValueError, match="df must be an integer >= 1, got 0"):
        t_975(0)


def test_interval_by_hand():
    # values 1, 2, 3: mean 2, sd 1, half width t(2) * 1 / sqrt(3) = 4.3027 / 1.7321 = 2.4842
    iv = interval([1.0, 2.0, 3.0])
    assert (iv.mean, iv.n) == (2.0, 3)
    assert iv.half_width == pytest.approx(4.3027 / math.sqrt(3), rel=1e-12)
    assert (iv.lo, iv.hi) == pytest.approx((2.0 - 2.48417, 2.0 + 2.48417), abs=1e-5)
    assert iv.text() == "2.000 ±2.484"
    same = interval([5.0, 5.0])
    assert (same.lo, same.hi) == (5.0, 5.0)
    one = interval([4.0])
    assert one.mean == 4.0 and math.isnan(one.lo) and one.text() == "4.000 ±?"
    with pytest.raises(ValueError, match="at least one value"):
        interval([])
    with pytest.raises(ValueError, match="finite"):
        interval([1.0, math.nan])


def iv(mean, hw, n=3):
    return Interval(mean, mean - hw, mean + hw, n)


def test_separated_and_ranking():
    a, b, c = iv(1.0, 0.1), iv(1.15, 0.1), iv(1.5, 0.1)
    assert not separated(a, b) and separated(a, c) and separated(c, a)
    assert not separated(iv(1.0, 0.1), iv(1.2, 0.1))  # touching ends: not separated
    assert not separated(interval([1.0]), iv(9.0, 0.1))  # one round: never resolved
    assert ranking({"c": c, "a": a, "b": b}) == ("a ≈ b < c", False)
    assert ranking({"c": c, "a": a}) == ("a < c", True)


def test_the_predicted_order_is_checked_on_resolved_pairs_only():
    measured = {"x": iv(2.58, 0.05), "y": iv(2.65, 0.05), "z": iv(2.84, 0.05)}
    # x and y overlap: the predicted y < x does not contradict; z is resolved slowest
    assert order_agrees(measured, {"x": 2.7, "y": 2.6, "z": 3.0})
    assert not order_agrees(measured, {"x": 2.7, "y": 2.6, "z": 2.5})


def test_gain_verdict():
    slime, ours = iv(1.50, 0.05), iv(1.10, 0.05)
    v = gain_verdict(slime, ours, 1.6, 1.0)  # predicted 60 %, measured 36.4 %
    assert v["predicted_gain"] == pytest.approx(0.6)
    assert v["measured_gain"] == pytest.approx(1.5 / 1.1 - 1)
    assert v["resolved"] and v["ok"]
    assert v["measured_gain_lo"] == pytest.approx(1.45 / 1.15 - 1)
    assert v["share_of_predicted"] == pytest.approx((1.5 / 1.1 - 1) / 0.6)
    # the same means, but less than half the predicted gain
    assert not gain_verdict(slime, ours, 2.0, 1.0)["ok"]
    # half or more of the predicted gain, but the intervals overlap: not resolved, not ok
    wide = gain_verdict(iv(1.5, 0.3), iv(1.1, 0.2), 1.6, 1.0)
    assert not wide["resolved"] and not wide["ok"] and math.isnan(wide["measured_gain_lo"])
    # ours slower: never ok
    assert not gain_verdict(iv(1.0, 0.01), iv(1.2, 0.01), 1.6, 1.0)["ok"]


def test_the_peers_calibrated_verdict_compares_with_the_best_other_scheduler_of_each_cell():
    df = pd.DataFrame([
        {"batch": "a", "dp": 16, "scheduler": "verl", "sim_s": 10.0},
        {"batch": "a", "dp": 16, "scheduler": "balanced+balanced", "sim_s": 11.0},
        {"batch": "a", "dp": 16, "scheduler": CALIBRATED, "sim_s": 10.05},
        {"batch": "a", "dp": 64, "scheduler": "areal", "sim_s": 5.0},
        {"batch": "a", "dp": 64, "scheduler": "nemo_rl", "sim_s": float("nan")},  # refused
        {"batch": "a", "dp": 64, "scheduler": CALIBRATED, "sim_s": 5.2},
    ])
    v = calibrated_verdict(df)
    assert v["ratios"] == pytest.approx({"a dp=16": 1.005, "a dp=64": 1.04})
    assert v["worst_cell"] == "a dp=64" and not v["ok"]
    assert calibrated_verdict(df.iloc[:3])["ok"]


def test_the_large_gain_case_is_one_micro_batch_per_rank_with_a_large_predicted_gain():
    # the case of benchmarks.measured_gain, simulated with this CPU's bundled calibration and a
    # toy model shape: slime's best flag (recommend) against balanced with that workload
    import json

    from _paths import REPO

    from benchmarks import measured_gain as mg
    from varbatch_kit import ModelShape, build_schedule
    from varbatch_kit.analysis.cost_model import MicroBatchCostModel
    from varbatch_kit.analysis.simulate import simulate

    model = MicroBatchCostModel.from_dict(
        json.loads((REPO / "data" / "timing" / "cpu_toy_calibration.json").read_text())["model"])
    shape = ModelShape(num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=4,
                       vocab_size=64, ffn_hidden_size=512, kv_channels=32)
    r = mg.compact_rollouts(mg.FULL["rollouts"])
    assert (r.num_rollouts, r.num_samples) == (71, 214)
    flags = mg.user_flags(r.num_rollouts, mg.FULL)
    assert "--rollout-batch-size 69 --n-samples-per-prompt 1 --num-steps-per-rollout 23" in flags
    rec, slime, ours = mg.schedules(r, mg.FULL, model, shape)
    assert ours.workload == model.workload() and ours.packing == "balanced"
    assert (ours.dp, ours.global_batch_size, ours.max_tokens_per_gpu) == (2, 3, 32768)
    assert slime.global_batch_size == 3 and slime.workload is None
    times = {}
    for name, cfg in (("slime", slime), ("ours", ours)):
        sched = build_schedule(r, cfg, shape)
        assert max(st.num_microbatches for st in sched.steps) == 1  # per rank
        times[name] = float(simulate(sched, hardware=model, timelines=False).total_time_s)
    assert times["slime"] == pytest.approx(rec.best["time_s"], rel=1e-9)
    assert times["slime"] / times["ours"] > 1.08  # predicted gain: ~10 %


def _fake_run(step_times, busy, straggler):
    """A run-like object: ``steps`` with the columns benchmarks.measured reads."""
    from types import SimpleNamespace

    rows = [{"step": s + 1, "step_time_s": t, "busy_s": b, "straggler_s": g}
            for s, (t, b, g) in enumerate(zip(step_times, busy, straggler))]
    return SimpleNamespace(steps=pd.DataFrame(rows))


def test_measured_rows_carry_intervals_over_rounds_and_the_resolved_order():
    from benchmarks.measured import ci, measured_row, resolved_ranking

    # two rounds of three steps; step 1 is warm-up. Round means of the timed steps: policy a
    # 1.0 and 1.2 (mean 1.1, sd 0.1414, half width 12.7062 * 0.1 = 1.2706); b 2.0 and 2.0
    a = [_fake_run([9.0, 1.0, 1.0], [[1, 1]] * 3, [[0, 0.2]] * 3),
         _fake_run([9.0, 1.1, 1.3], [[1, 1]] * 3, [[0, 0.4]] * 3)]
    b = [_fake_run([9.0, 2.0, 2.0], [[1, 1]] * 3, [[0, 0.0]] * 3)] * 2
    ra, rb = measured_row(a), measured_row(b)
    assert ra["measured_step_s"] == pytest.approx(1.1) and ra["steps_timed"] == 2
    assert ci(ra, "measured_step_s").half_width == pytest.approx(12.7062 * 0.1, rel=1e-9)
    assert ci(ra, "measured_straggler_s").mean == pytest.approx(0.15)  # mean over ranks, rounds
    assert ci(rb, "measured_step_s").half_width == 0.0
    rows = [{"policy": "a", **ra, "predicted_step_s": 1.0},
            {"policy": "b", **rb, "predicted_step_s": 2.0}]
    assert resolved_ranking(rows) == {"ranking_text": "a ≈ b", "fully_resolved": False,
                                      "order_agrees_where_resolved": True}
