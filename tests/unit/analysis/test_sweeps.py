"""sweeps: the pure tables behind the notebooks, the demo and the schedule CLI.

Values are checked against what the core gives directly (build_schedule +
quality / simulate) or against hand-made tables. The invariance verdict is
:mod:`varbatch_kit.analysis.invariance` (``test_invariance.py``).
"""

import math
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from _factories import TINY, rollouts

from varbatch_kit import Rollouts, ScheduleConfig, build_schedule
from varbatch_kit.analysis import sweeps
from varbatch_kit.analysis.quality import step_quality
from varbatch_kit.compat.slime.flags import SLIME_FLAGS
from varbatch_kit.policies.registry import PACKERS

R8 = rollouts([5, 3, 8, 2, 7, 1, 4, 6])


# ------------------------------------------------------------------ purity
def test_sweeps_imports_neither_plotly_nor_torch():
    code = ("import sys\n"
            "from varbatch_kit import Rollouts, ScheduleConfig\n"
            "from varbatch_kit.analysis import sweeps\n"
            "r = Rollouts.synthetic(64, seed=0)\n"
            "sweeps.policy_table(r, ScheduleConfig(dp=2, global_batch_size=16, "
            "max_tokens_per_gpu=4096), None)\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'plotly', 'torch', "
            "'ipywidgets'}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "[]"


# ------------------------------------------------------------------ sweep
def test_sweep_table_values_and_an_impossible_cell():
    base = ScheduleConfig(dp=1, global_batch_size=8, max_tokens_per_gpu=10)
    table = sweeps.sweep_table(R8, base, TINY, max_tokens_per_gpu=[10, 20], dp=[1, 16])
    assert list(table.columns) == ["max_tokens_per_gpu", "dp", "error", "micro_batches",
                                   "mb_lower_bound", "mb_ratio", "cap_violations",
                                   "flops_imbalance", "token_imbalance", "makespan_ratio"]
    assert list(zip(table.dp, table.max_tokens_per_gpu)) == [(1, 10), (1, 20), (16, 10),
                                                             (16, 20)]
    for cap in (10, 20):
        row = table[(table.dp == 1) & (table.max_tokens_per_gpu == cap)].iloc[0]
        q = step_quality(build_schedule(R8, base.with_(max_tokens_per_gpu=cap), TINY))
        assert row.micro_batches == q["micro_batches"].sum()
        assert row.mb_lower_bound == q["mb_lower_bound"].sum() == math.ceil(36 / cap)
        assert row.mb_ratio == pytest.approx(row.micro_batches / row.mb_lower_bound)
        assert row.makespan_ratio == pytest.approx(q["makespan_ratio"].max())
        assert row.error == ""
    ok = table[(table.dp == 1) & (table.max_tokens_per_gpu == 10)].iloc[0]
    assert ok.micro_batches == 4  # first fit: 5+3+2, 8+1, 7, 4+6
    bad = table[table.dp == 16]
    assert bad.micro_batches.isna().all() and bad.makespan_ratio.isna().all()
    assert bad.error.str.contains("dp=16").all()


# ------------------------------------------------------------------ policies
def test_policy_pairs_follow_the_registries():
    pairs = sweeps.policy_pairs(TINY)
    assert ("first_fit", "strided") in pairs and ("flops_kk", "flops_kk") in pairs
    assert all(PACKERS[p].dynamic for p, _ in pairs)
    for p, d in pairs:
        required = getattr(PACKERS[p], "requires_distribution", None)
        assert required in (None, d)
    assert all(not PACKERS[p].needs_flops for p, _ in sweeps.policy_pairs(None))
    assert sweeps.policy_pairs(None, dynamic=False) == [("static", "strided")]


def test_policy_table_rows_equal_the_core_for_every_policy():
    cfg = ScheduleConfig(dp=2, global_batch_size=4, max_tokens_per_gpu=10)
    table = sweeps.policy_table(R8, cfg, TINY)
    assert [tuple(x) for x in table[["packing", "distribution"]].to_numpy()] == \
        sweeps.policy_pairs(TINY)
    for _, row in table.iterrows():
        s = build_schedule(R8, cfg.with_(packing=row.packing, distribution=row.distribution),
                           TINY)
        q = step_quality(s)
        assert row.error == ""
        assert row.steps == s.num_steps == 2
        assert row.micro_batches == q["micro_batches"].sum()
        assert row.mb_lower_bound == q["mb_lower_bound"].sum()
        assert row.cap_violations == q["cap_violations"].sum()
        assert row.oversize_alone == q["oversize_alone"].sum()
        assert row.max_flops_imbalance == pytest.approx(q["flops_imbalance"].max(), rel=1e-12)
        assert row.mean_makespan_ratio == pytest.approx(q["makespan_ratio"].mean(), rel=1e-12)
        assert row.max_makespan_ratio == pytest.approx(q["makespan_ratio"].max(), rel=1e-12)
        assert row.schedule_s >= 0


def test_policy_table_slime_flags_and_an_impossible_layout():
    cfg = ScheduleConfig(dp=2, global_batch_size=8, max_tokens_per_gpu=10)
    pairs = [("first_fit", "strided"), ("flops_kk", "flops_kk")]
    assert "slime" not in sweeps.policy_table(R8, cfg, TINY, pairs).columns
    table = sweeps.policy_table(R8, cfg, TINY, pairs, flag_names=SLIME_FLAGS)
    assert list(table.packing) == ["first_fit", "flops_kk"]
    assert table.slime.tolist() == ["--use-dynamic-batch-size",
                                    "--use-dynamic-batch-size --balance-by-flops"]
    row = table.iloc[0]
    assert row.micro_batches == 4 and row.mb_lower_bound == 4 and row.cap_violations == 0
    bad = sweeps.policy_table(R8, cfg.with_(dp=64), TINY, [("first_fit", "strided")])
    assert "dp=64" in bad.error.iloc[0] and math.isnan(bad.micro_batches.iloc[0])


def test_policy_table_by_trace_stacks_one_policy_table_per_trace():
    traces = {"a": Rollouts.synthetic(42, seed=1), "b": Rollouts.synthetic(48, seed=2)}
    pairs = [("first_fit", "strided"), ("first_fit", "flops_kk")]
    table = sweeps.policy_table_by_trace(traces, TINY, dp=2, max_tokens_per_gpu=4096, steps=4,
                                         policies=pairs)
    assert table.trace.tolist() == ["a", "a", "b", "b"]
    for name, r in traces.items():
        cfg = ScheduleConfig(dp=2, global_batch_size=r.num_rollouts // 4,
                             max_tokens_per_gpu=4096)
        want = sweeps.policy_table(r, cfg, TINY, pairs).drop(columns="schedule_s")
        got = table[table.trace == name].drop(columns=["schedule_s", "trace"])
        pd.testing.assert_frame_equal(got.reset_index(drop=True), want)
    assert (table.error == "").all()
    assert (table.steps == 4).all()  # 42 // 4 = 10 (2 left over) and 48 // 4 = 12 per step
    with pytest.raises(ValueError, match="steps must be"):
        sweeps.policy_table_by_trace(traces, TINY, steps=0)
    with pytest.raises(ValueError, match="traces is empty"):
        sweeps.policy_table_by_trace({}, TINY)


def test_policy_pivot_on_a_hand_made_table():
    table = pd.DataFrame({
        "trace": ["t2", "t2", "t1", "t1"],
        "packing": ["ff", "kk", "ff", "kk"],
        "distribution": ["strided", "kk", "strided", "kk"],
        "mean_makespan_ratio": [1.25, 1.01, 1.5, np.nan],
        "cap_violations": [0.0, 7.0, 2.0, np.nan],
        "error": ["", "", "", "cannot"],
    })
    pivot = sweeps.policy_pivot(table)
    assert pivot.index.tolist() == ["ff + strided", "kk + kk"]  # the table's order
    assert pivot.index.name == "policy"
    assert pivot.columns.tolist() == ["t1 busiest/bound", "t1 over cap", "t2 busiest/bound",
                                      "t2 over cap"]
    assert pivot.loc["ff + strided", "t2 busiest/bound"] == 1.25
    assert pivot.loc["ff + strided", "t1 busiest/bound"] == 1.5
    assert pivot.loc["kk + kk", "t2 over cap"] == 7
    assert str(pivot["t1 over cap"].dtype) == "Int64"
    assert pd.isna(pivot.loc["kk + kk", "t1 over cap"])
    assert math.isnan(pivot.loc["kk + kk", "t1 busiest/bound"])
    with pytest.raises(ValueError, match="trace"):
        sweeps.policy_pivot(table.drop(columns="trace"))


def test_policy_pivot_of_a_policy_table_by_trace():
    traces = {"x": Rollouts.synthetic(32, seed=3), "y": Rollouts.synthetic(32, seed=4)}
    table = sweeps.policy_table_by_trace(traces, TINY, dp=2, max_tokens_per_gpu=2048)
    pivot = sweeps.policy_pivot(table)
    assert len(pivot) == len(sweeps.policy_pairs(TINY))
    for _, row in table.iterrows():
        policy = f"{row.packing} + {row.distribution}"
        assert pivot.loc[policy, f"{row.trace} busiest/bound"] == row.mean_makespan_ratio
        assert pivot.loc[policy, f"{row.trace} over cap"] == row.cap_violations


# ------------------------------------------------------------------ simulation
def test_simulated_comparison_sums_simulate_per_policy():
    from varbatch_kit.analysis.simulate import simulate

    r = Rollouts.synthetic(64, samples_per_rollout=(1, 3), seed=5)
    cfg = ScheduleConfig(dp=2, global_batch_size=16, max_tokens_per_gpu=4096)
    pairs = [("first_fit", "strided"), ("first_fit", "flops_kk"), ("flops_kk", "flops_kk")]
    comp = sweeps.simulated_comparison(r, cfg, TINY, pairs, hardware="H200")
    assert set(comp.step_times) == {f"{p} + {d}" for p, d in pairs}
    assert comp.errors == {}
    for p, d in pairs:
        sim = simulate(build_schedule(r, cfg.with_(packing=p, distribution=d), TINY),
                       hardware="H200")
        pd.testing.assert_frame_equal(comp.step_times[f"{p} + {d}"], sim.step_times)
        row = comp.totals.loc[f"{p} + {d}"]
        assert row.time_s == pytest.approx(sim.step_times["time_s"].sum(), rel=1e-12)
        assert row.bound_s == pytest.approx(sim.step_times["bound_s"].sum(), rel=1e-12)
        assert row.above_bound_pct == pytest.approx(100 * (row.time_s / row.bound_s - 1))
    assert comp.totals.index.name == "policy"
    assert comp.totals.above_bound_pct.is_monotonic_increasing


def test_simulated_comparison_reports_an_impossible_policy_and_needs_a_model():
    cfg = ScheduleConfig(dp=2, global_batch_size=8, max_tokens_per_gpu=10)
    comp = sweeps.simulated_comparison(R8, cfg.with_(dp=64), TINY, [("first_fit", "strided")])
    assert list(comp.step_times) == [] and comp.totals.empty
    assert "dp=64" in comp.errors["first_fit + strided"]
    with pytest.raises(ValueError, match="model"):
        sweeps.simulated_comparison(R8, cfg, None)


# ------------------------------------------------------------------ one path per name
def test_the_invariance_names_live_in_invariance_alone():
    from varbatch_kit.analysis import invariance

    for name in invariance.__all__:
        assert not hasattr(sweeps, name), f"{name} has a second import path in sweeps"


def test_policy_table_counts_samples_longer_than_the_cap():
    """Two samples of 12 and 11 tokens under a cap of 10: 2 lone over-cap micro-batches."""
    r = rollouts([5, 12, 8, 2, 11, 1, 4, 6])
    cfg = ScheduleConfig(dp=2, global_batch_size=4, max_tokens_per_gpu=10)
    with pytest.warns(UserWarning, match="2 of 8 samples"):
        table = sweeps.policy_table(r, cfg, TINY, [("first_fit", "strided"), ("ffd", "strided")])
    assert table.oversize_alone.tolist() == [2, 2]
    assert table.cap_violations.tolist() == [0, 0]
