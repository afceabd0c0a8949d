"""Micro-batch cost model: exact and noisy recovery, held-out R², validation, JSON, simulate."""

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from varbatch_kit import Rollouts, ScheduleConfig, build_schedule
from varbatch_kit.analysis.cost_model import (
    MicroBatchCostModel,
    fit_cost_model,
    fit_from_run,
    fit_with_holdout,
    micro_batch_rows,
    r_squared,
)
from varbatch_kit.analysis.simulate import simulate
from varbatch_kit.analysis.simulate_cost_model import simulate_with_cost_model

C = (2e-3, 3e-6, 4e-9)


def compositions(n, seed=0):
    """n micro-batches of 1-8 samples of 16-4096 tokens: sum L and sum L^2 vary independently."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        k = int(rng.integers(1, 9))
        out.append(rng.integers(16, 4097, k))
    s1 = np.array([L.sum() for L in out], dtype=float)
    s2 = np.array([(L.astype(float) ** 2).sum() for L in out])
    return out, s1, s2


def test_exact_data_recovers_the_coefficients():
    _, s1, s2 = compositions(40)
    y = C[0] + C[1] * s1 + C[2] * s2
    m = fit_cost_model(s1, s2, y, device="cpu", source="synthetic")
    np.testing.assert_allclose(m.coefficients, C, rtol=1e-9)
    assert m.r2 == pytest.approx(1.0, abs=1e-12) and m.rmse_s < 1e-12
    assert m.n_fit == 40 and m.device == "cpu" and m.source == "synthetic"


def test_noisy_data_recovers_the_coefficients_and_holds_out():
    _, s1, s2 = compositions(400, seed=1)
    y = C[0] + C[1] * s1 + C[2] * s2
    noisy = y * (1 + 0.01 * np.random.default_rng(2).standard_normal(y.size))
    fit = fit_with_holdout(s1, s2, noisy, holdout=0.25, seed=3)
    np.testing.assert_allclose(fit.model.coefficients, C, rtol=0.1)
    assert fit.fit_index.size == 300 and fit.heldout_index.size == 100
    assert set(fit.fit_index).isdisjoint(fit.heldout_index)
    assert fit.heldout_r2 > 0.95
    # held-out R² computed by hand from the model fitted on the other micro-batches
    h = fit.heldout_index
    pred = fit.model.seconds(s1[h], s2[h])
    ss_res = ((noisy[h] - pred) ** 2).sum()
    ss_tot = ((noisy[h] - noisy[h].mean()) ** 2).sum()
    assert fit.heldout_r2 == pytest.approx(1 - ss_res / ss_tot, rel=1e-12)
    np.testing.assert_allclose(fit.residuals_s, noisy - fit.model.seconds(s1, s2))
    assert fit.summary()["n_heldout"] == 100


def test_nonnegative_fit_clamps_a_negative_intercept():
    # data from a negative intercept: unconstrained LS finds it, NNLS sets c0 = 0 and refits
    s1 = np.array([100.0, 200, 300, 400, 500, 600])
    s2 = np.array([1e4, 3e4, 2e4, 9e4, 5e4, 2e5])
    y = -0.01 + 1e-4 * s1 + 1e-7 * s2
    free = fit_cost_model(s1, s2, y, nonnegative=False)
    assert free.c0 == pytest.approx(-0.01, rel=1e-9)
    nn = fit_cost_model(s1, s2, y)
    assert nn.c0 == 0.0 and nn.c1 >= 0 and nn.c2 >= 0
    X = np.column_stack([s1, s2])  # the refit on the two remaining terms
    beta, *_ = np.linalg.lstsq(X, y, rcond=None)
    np.testing.assert_allclose([nn.c1, nn.c2], beta, rtol=1e-8)


@settings(max_examples=30, deadline=None)
@given(st.floats(0, 1e-2), st.floats(0, 1e-5), st.floats(0, 1e-8), st.integers(0, 10_000))
def test_fit_recovers_any_nonnegative_coefficients(c0, c1, c2, seed):
    _, s1, s2 = compositions(12, seed=seed)
    y = c0 + c1 * s1 + c2 * s2
    m = fit_cost_model(s1, s2, y)
    np.testing.assert_allclose(m.seconds(s1, s2), y, rtol=1e-7, atol=1e-12)


def test_seconds_and_microbatch_seconds():
    m = MicroBatchCostModel(*C)
    assert m.microbatch_seconds([1000, 10]) == pytest.approx(
        C[0] + C[1] * 1010 + C[2] * (1000 ** 2 + 10 ** 2))
    assert isinstance(m.seconds(5, 25), float)
    assert m.seconds(np.array([1, 2]), np.array([1, 4])).shape == (2,)
    with pytest.raises(ValueError, match="at least one sample"):
        m.microbatch_seconds([])
    with pytest.raises(ValueError, match="positive"):
        m.microbatch_seconds([3, 0])


def test_validation_errors():
    with pytest.raises(ValueError, match="at least 3"):
        fit_cost_model([1, 2], [1, 4], [0.1, 0.2])
    with pytest.raises(ValueError, match="same length"):
        fit_cost_model([1, 2, 3], [1, 4], [0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="vary sum"):  # one sample of the same length each time
        fit_cost_model([5, 5, 5, 5], [25, 25, 25, 25], [0.1, 0.11, 0.1, 0.12])
    with pytest.raises(ValueError, match="vary sum"):  # sum(L^2) proportional to sum(L)
        fit_cost_model([10, 20, 30], [100, 200, 300], [0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="sum_len_sq < sum_len"):
        fit_cost_model([10, 20, 30], [1, 2, 3], [0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="non-finite"):
        fit_cost_model([1, 2, 3], [1, 4, 9], [0.1, math.nan, 0.3])
    with pytest.raises(ValueError, match="holdout"):
        fit_with_holdout([1, 2, 3], [1, 4, 9], [0.1, 0.2, 0.3], holdout=1.0)
    with pytest.raises(ValueError, match="finite number"):
        MicroBatchCostModel(math.inf, 0, 0)
    with pytest.raises(ValueError, match="forward_share"):
        MicroBatchCostModel(0, 0, 0, forward_share=1.5)
    assert math.isnan(r_squared([1.0], [1.0])) and math.isnan(r_squared([2.0, 2.0], [1, 3]))


def test_json_round_trip(tmp_path):
    m = MicroBatchCostModel(*C, r2=0.99, rmse_s=1e-3, n_fit=12, device="cpu", source="x",
                            forward_share=0.4)
    assert MicroBatchCostModel.from_dict(m.to_dict()) == m
    path = m.save(tmp_path / "sub" / "cost.json")
    assert json.loads(path.read_text())["format"] == "varbatch_kit.cost_model/1"
    assert MicroBatchCostModel.load(path) == m
    bare = MicroBatchCostModel(*C)  # NaN r2 / rmse survive as null
    back = MicroBatchCostModel.load(bare.save(tmp_path / "bare.json"))
    assert back.c2 == C[2] and math.isnan(back.r2)
    assert "NaN" not in (tmp_path / "bare.json").read_text()
    with pytest.raises(ValueError, match="unknown cost model keys"):
        MicroBatchCostModel.from_dict({**m.to_dict(), "c3": 1.0})
    with pytest.raises(ValueError, match="lacks"):
        MicroBatchCostModel.from_dict({"c0": 1.0})
    with pytest.raises(ValueError, match="format"):
        MicroBatchCostModel.from_dict({**m.to_dict(), "format": "other/9"})
    with pytest.raises(ValueError, match="no cost model file"):
        MicroBatchCostModel.load(tmp_path / "missing.json")


def _records():
    """Two steps of dp=2 timing records, generated from the known model."""
    m = MicroBatchCostModel(*C)
    mbs, _, _ = compositions(16, seed=5)
    recs = []
    for step in (1, 2):
        per_rank = []
        for r in range(2):
            rank_mbs = mbs[(step - 1) * 8 + 4 * r:(step - 1) * 8 + 4 * r + 4]
            per_rank.append([{"lengths": L.tolist(), "fwd_s": m.microbatch_seconds(L) / 3,
                              "bwd_s": 2 * m.microbatch_seconds(L) / 3} for L in rank_mbs])
        recs.append({"step": step, "device": "cpu", "micro_batch_timing": per_rank})
    return recs


def test_rows_and_fit_from_a_steps_jsonl(tmp_path):
    recs = _records()
    rows = micro_batch_rows(recs + [{"step": 3}])  # a record without timing gives no rows
    assert len(rows) == 16
    assert rows[5]["step"] == 1 and rows[5]["rank"] == 1 and rows[5]["position"] == 1
    L = np.array(recs[0]["micro_batch_timing"][1][1]["lengths"])
    assert rows[5]["sum_len"] == L.sum() and rows[5]["sum_len_sq"] == (L * L).sum()
    assert rows[5]["time_s"] == pytest.approx(rows[5]["fwd_s"] + rows[5]["bwd_s"])
    (tmp_path / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    fit = fit_from_run(tmp_path, holdout=0.25, skip_first_steps=0)
    np.testing.assert_allclose(fit.model.coefficients, C, rtol=1e-7)
    assert fit.model.forward_share == pytest.approx(1 / 3)
    assert fit.model.device == "cpu" and fit.heldout_index.size == 4
    assert fit_from_run([tmp_path, rows], skip_first_steps=1).fit_index.size == 12
    with pytest.raises(ValueError, match="no micro-batch timing"):
        fit_from_run([{"step": 1}])


def test_simulate_with_a_cost_model_hand_computed():
    # dp 2, cap 5000; first_fit: [3000] [1000, 500, 2000]? no: first fit in order -> bins
    # [3000, 1000, 500] (4500) and [2000]; strided: rank 0 gets bin 0, rank 1 bin 1
    r = Rollouts(prompt_len=np.zeros(4, dtype=int), response_len=np.array([3000, 1000, 500, 2000]))
    s = build_schedule(r, ScheduleConfig(dp=2, global_batch_size=4, max_tokens_per_gpu=5000))
    st = s.steps[0]
    assert sorted(map(sorted, (r.total_len[b].tolist() for b in st.micro_batches))) == \
        [[500, 1000, 3000], [2000]]
    m = MicroBatchCostModel(*C)
    t_big = C[0] + C[1] * 4500 + C[2] * (3000 ** 2 + 1000 ** 2 + 500 ** 2)
    t_small = C[0] + C[1] * 2000 + C[2] * 2000 ** 2
    sim = simulate(s, hardware=m, step_overhead_s=0.1)  # the simulate() entry point
    row = sim.step_times.iloc[0]
    assert row.time_s == pytest.approx(max(t_big, t_small) + 0.1, rel=1e-12)
    assert row.straggler_wait_s == pytest.approx((t_big - t_small) / 2, rel=1e-12)
    assert row.max_straggler_wait_s == pytest.approx(t_big - t_small, rel=1e-12)
    busy = sorted(sim.rank_times["busy_s"])
    assert busy == pytest.approx(sorted([t_big, t_small]))
    # bound: ceil(6500 / 5000) = 2 micro-batches -> 1 per rank, the work spread evenly
    spread = (C[1] * 6500 + C[2] * (3000 ** 2 + 1000 ** 2 + 500 ** 2 + 2000 ** 2)) / 2
    longest = C[1] * 3000 + C[2] * 3000 ** 2
    assert row.bound_s == pytest.approx(C[0] + max(spread, longest) + 0.1, rel=1e-12)
    assert sim.params["hardware"] == "cost_model" and sim.params["c2"] == C[2]
    # pp = 2: two stages of half the micro-batch each, forward a third of it
    pp2 = simulate_with_cost_model(s, m, pp=2).step_times.iloc[0]
    assert pp2.time_s == pytest.approx(max(t_big, t_small), rel=1e-12)  # 1 mb: F0 F1 B1 B0
    with pytest.raises(ValueError, match="MicroBatchCostModel"):
        simulate_with_cost_model(s, "H100")
    with pytest.raises(ValueError, match="pp"):
        simulate_with_cost_model(s, m, pp=0)


def test_cost_model_with_a_pipeline_order():
    # pp = 2, one rank: reordering the rank's micro-batches keeps its busy time, never adds
    # to the span the order is chosen on, and a bad name is refused
    r = Rollouts(prompt_len=np.zeros(6, dtype=int),
                 response_len=np.array([3000, 200, 2500, 300, 100, 1800]))
    s = build_schedule(r, ScheduleConfig(global_batch_size=6, max_tokens_per_gpu=3000))
    m = MicroBatchCostModel(*C)
    base = simulate_with_cost_model(s, m, pp=2)
    best = simulate(s, hardware=m, pp=2, order="min_bubble")
    assert best.rank_times["busy_s"].sum() == pytest.approx(base.rank_times["busy_s"].sum())
    assert best.step_times["time_s"].iloc[0] <= base.step_times["time_s"].iloc[0] + 1e-12
    with pytest.raises(ValueError):
        simulate_with_cost_model(s, m, pp=2, order="no_such_order")
