"""Schedule quality figures on hand-derived schedules."""

import numpy as np
import pytest
from _factories import TINY

from varbatch_kit import Rollouts, ScheduleConfig, build_schedule
from varbatch_kit.analysis.quality import compare, micro_batch_arrays, step_quality, summary


def one_step(lengths, **cfg):
    r = Rollouts(prompt_len=np.zeros(len(lengths), dtype=int), response_len=lengths)
    return build_schedule(r, ScheduleConfig(global_batch_size=len(lengths), **cfg), TINY).check()


def test_dynamic_first_fit_hand_derived():
    # lengths 10, 20, 30, 40, cap 50: first-fit bins [0,1] [2] [3]; aligned to 4 by splitting
    # [0,1] -> [1] (in place) + [0]; strided over dp 2: rank 0 = bins 0, 2 = samples 1, 3.
    s = one_step([10, 20, 30, 40], dp=2, max_tokens_per_gpu=50)
    q = step_quality(s).iloc[0]
    assert [mb.tolist() for mb in s.steps[0].micro_batches] == [[1], [2], [3], [0]]
    assert (q.tokens, q.micro_batches, q.micro_batches_per_rank, q.mb_lower_bound) == \
        (100, 4, 2, 2)
    assert q.mb_over_bound == 2.0
    assert (q.cap_violations, q.oversize_alone, q.max_mb_tokens) == (0, 0, 40)
    assert q.token_imbalance == pytest.approx(60 / 50)
    f = TINY.forward_flops(np.array([10, 20, 30, 40]))
    ranks = np.array([f[1] + f[3], f[2] + f[0]])
    assert q.flops_imbalance == pytest.approx(ranks.max() / ranks.mean())
    assert q.flops_lower_bound == pytest.approx(max(f.sum() / 2, f.max()))
    assert q.makespan_ratio == pytest.approx(ranks.max() / max(f.sum() / 2, f.max()))
    assert q.mb_makespan_bound == pytest.approx(max(f.sum() / 2, f.max()))
    assert (q.padded_tokens, q.padding_waste) == (100, 0.0)


def test_static_padding_and_cap_override():
    # micro-batches [10, 20] and [30, 40]: padded to 2*20 + 2*40 = 120 tokens, waste 20/120
    s = one_step([10, 20, 30, 40], dp=2, micro_batch_size=2)
    q = step_quality(s).iloc[0]
    assert (q.padded_tokens, q.padding_waste) == (120, pytest.approx(20 / 120))
    assert np.isnan(q.mb_lower_bound) and q.cap_violations == 0
    # against a 50-token budget the [30, 40] micro-batch would overflow
    q50 = step_quality(s, cap=50).iloc[0]
    assert (q50.mb_lower_bound, q50.cap_violations, q50.oversize_alone) == (2, 1, 0)


def test_oversize_sample_alone_is_not_a_violation():
    s = one_step([60, 10, 10, 5], dp=2, max_tokens_per_gpu=50)
    q = step_quality(s).iloc[0]
    assert (q.cap_violations, q.oversize_alone, q.max_mb_tokens) == (0, 1, 60)
    kk = one_step([60, 10, 30, 25], dp=1, max_tokens_per_gpu=50, packing="flops_kk",
                  distribution="flops_kk")
    # ceil(125 / 50) = 3 bins by FLOPs: {60}, {30}, {10, 25} -> no violation either
    assert step_quality(kk).iloc[0].cap_violations == 0


def test_micro_batch_arrays_positions():
    s = one_step([10, 20, 30, 40], dp=2, max_tokens_per_gpu=50)
    a = micro_batch_arrays(s, s.steps[0])
    assert a["tokens"].tolist() == [20, 30, 40, 10]
    assert a["rank"].tolist() == [0, 1, 0, 1] and a["pos"].tolist() == [0, 0, 1, 1]
    assert a["samples"].tolist() == [1, 1, 1, 1] and a["max_len"].tolist() == [20, 30, 40, 10]


def test_summary_and_compare():
    r = Rollouts.synthetic(64, samples_per_rollout=(1, 3), seed=2)
    cfg = ScheduleConfig(dp=4, global_batch_size=16, max_tokens_per_gpu=8192)
    scheds = {p: build_schedule(r, cfg.with_(packing=p, distribution="balanced"), TINY)
              for p in ("first_fit", "ffd", "balanced")}
    table = compare(scheds)
    assert list(table.index) == ["first_fit", "ffd", "balanced"]
    s = summary(scheds["balanced"])
    q = step_quality(scheds["balanced"])
    assert s["steps"] == len(q) == 4
    assert s["micro_batches"] == q["micro_batches"].sum()
    assert s["mb_lower_bound"] == q["mb_lower_bound"].sum()
    assert s["mean_makespan_ratio"] == pytest.approx(q["makespan_ratio"].mean())
    assert s["max_makespan_ratio"] >= s["mean_makespan_ratio"] >= 1.0
    assert table.loc["balanced", "cap_violations"] == 0
    with pytest.raises(ValueError, match="at least one schedule"):
        compare({})


def test_without_model_flops_columns_are_nan():
    r = Rollouts(prompt_len=[0] * 4, response_len=[10, 20, 30, 40])
    s = build_schedule(r, ScheduleConfig(dp=2, global_batch_size=4, max_tokens_per_gpu=50))
    q = step_quality(s).iloc[0]
    assert np.isnan(q.flops_imbalance) and np.isnan(q.makespan_ratio)
    assert q.token_imbalance == pytest.approx(1.2)


# ------------------------------------------------------------------ the figures peers log
from varbatch_kit.analysis.quality import (  # noqa: E402
    bin_efficiency,
    load_cv,
    load_imbalance,
    load_spread,
    peer_quality,
    peer_step_quality,
    plan_quality,
    slot_imbalance,
)


def test_peer_load_figures_hand_derived():
    loads = [10, 20, 30, 40]  # mean 25, population std sqrt(125)
    assert load_spread(loads) == 30
    assert load_imbalance(loads) == pytest.approx(40 / 25)
    assert load_cv(loads) == pytest.approx(np.sqrt(125) / 25)
    assert bin_efficiency(100, 50, 4) == 0.5 and bin_efficiency(101, 50, 3) == 1.0
    assert np.isnan(bin_efficiency(100, None, 4))
    # slots: rank 0 runs 4, 2; rank 1 runs 2 only -> slot 0: max 4 / mean 3; slot 1: 2 / 1
    assert slot_imbalance([[4, 2], [2]]).tolist() == pytest.approx([4 / 3, 2.0])
    with pytest.raises(ValueError, match="loads"):
        load_spread([])


def test_plan_quality_hand_derived():
    lengths = [10, 20, 30, 40]
    # rank 0: [0, 3] (50 tokens), rank 1: [1], [2] (20, 30) against cap 40
    plan = [[np.array([0, 3])], [np.array([1]), np.array([2])]]
    q = plan_quality(plan, lengths, cap=40)
    assert (q["micro_batches"], q["mb_lower_bound"], q["cap_violations"]) == (3, 3, 1)
    assert q["bin_efficiency"] == 1.0
    assert (q["token_spread"], q["token_imbalance"]) == (0.0, 1.0)
    assert q["token_cv"] == 0.0 and np.isnan(q["cost_imbalance"])
    # slots by tokens: slot 0 = (50, 20): 50/35; slot 1 = (0, 30): 30/15
    assert q["slot_imbalance_mean"] == pytest.approx((50 / 35 + 2.0) / 2)
    assert q["slot_imbalance_max"] == pytest.approx(2.0)
    costs = [1.0, 1.0, 1.0, 5.0]  # rank costs 6 and 2: spread 4, max/mean 1.5, cv 0.5
    q = plan_quality(plan, lengths, cap=40, costs=costs)
    assert (q["cost_spread"], q["cost_imbalance"], q["cost_cv"]) == (4.0, 1.5, 0.5)
    assert q["slot_imbalance_max"] == pytest.approx(2.0)  # slot 1: (0, 1)


def test_peer_quality_of_a_schedule_matches_plan_quality():
    # first-fit [1] [2] [3] [0] over dp 2 strided (see test_dynamic_first_fit_hand_derived)
    s = one_step([10, 20, 30, 40], dp=2, max_tokens_per_gpu=50)
    step = s.steps[0]
    f = s.sample_flops
    want = plan_quality(step.ranks, s.rollouts.total_len, cap=50, costs=f)
    row = peer_step_quality(s).iloc[0]
    for key, val in want.items():
        assert row[key] == pytest.approx(val, nan_ok=True), key
    assert row.bin_efficiency == 0.5  # ceil(100/50) = 2 of 4 micro-batches
    assert row.token_spread == 20 and row.token_imbalance == pytest.approx(60 / 50)
    summ = peer_quality(s)
    assert summ["bin_efficiency"] == 0.5 and summ["mean_token_spread"] == 20
    assert summ["max_cost_imbalance"] == pytest.approx(row.cost_imbalance)
