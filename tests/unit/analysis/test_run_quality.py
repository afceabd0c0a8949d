"""Quality per rollout step of a run (:func:`varbatch_kit.analysis.run_quality.run_quality_table`):
each row equals the core's figures for that dump scheduled alone."""

import shutil

import numpy as np
import pytest
from _paths import GOLDEN

from varbatch_kit import ModelShape, ScheduleConfig, build_schedule
from varbatch_kit.analysis.quality import step_quality
from varbatch_kit.analysis.run_quality import (
    RUN_QUALITY_COLUMNS,
    run_policies,
    run_quality_table,
)
from varbatch_kit.analysis.simulate import simulate
from varbatch_kit.compat.slime import SLIME_FLAGS
from varbatch_kit.core.run_dumps import read_run

MODEL = ModelShape.preset("qwen3-8b")
CONFIG = ScheduleConfig(dp=2, global_batch_size=4, max_tokens_per_gpu=64)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("run")
    for k in (3, 1, 13):  # rollout 13 holds 3 rollouts: fewer than global_batch_size
        shutil.copy(GOLDEN / "dumps" / f"rollout_{k}.pt", folder / f"rollout_{k}.pt")
    return read_run(folder)


def test_a_row_per_step_and_policy_with_the_cores_figures(run):
    table = run_quality_table(run, CONFIG, MODEL, flag_names=SLIME_FLAGS)
    assert list(table.columns) == [*RUN_QUALITY_COLUMNS, "slime"]
    assert table["rollout_id"].tolist() == [1, 1, 3, 3, 13, 13]
    assert table["policy"].tolist() == ["first_fit + strided", "balanced + balanced"] * 3
    assert table["slime"].tolist()[:2] == ["--use-dynamic-batch-size", ""]
    for _, row in table[table["rollout_id"] != 13].iterrows():
        cfg = CONFIG.with_(packing=row["packing"], distribution=row["distribution"])
        sched = build_schedule(run.step(row["rollout_id"]), cfg, MODEL)
        q, t = step_quality(sched), simulate(sched).step_times
        assert row["steps"] == sched.num_steps and row["samples"] == len(sched.rollouts)
        assert row["micro_batches"] == q["micro_batches"].sum()
        assert row["dropped_samples"] == sched.dropped_samples.size
        assert row["flops_imbalance"] == pytest.approx(q["flops_imbalance"].max())
        assert row["makespan_ratio"] == pytest.approx(q["makespan_ratio"].mean())
        assert row["time_s"] == pytest.approx(t["time_s"].sum())
        assert row["above_bound_pct"] == pytest.approx(
            100 * (t["time_s"].sum() / t["bound_s"].sum() - 1))
    # balanced is never behind first-fit on the simulated time of a step
    ff, bal = (table[table["policy"] == p].set_index("rollout_id") for p in
               ("first_fit + strided", "balanced + balanced"))
    assert (bal["time_s"].loc[[1, 3]] <= ff["time_s"].loc[[1, 3]] + 1e-12).all()
    # rollout 13 cannot fill one step of 4 rollouts: a row with the message, numbers NaN
    bad = table[table["rollout_id"] == 13]
    assert bad["error"].str.contains("global_batch_size=4").all()
    assert bad["time_s"].isna().all() and bad["steps"].isna().all()


def test_the_default_policies_and_errors(run):
    assert run_policies(CONFIG) == [("first_fit", "strided"), ("balanced", "balanced")]
    assert run_policies(CONFIG.with_(packing="balanced", distribution="balanced")) == [
        ("balanced", "balanced")]
    static = ScheduleConfig(dp=2, global_batch_size=2, micro_batch_size=1)
    t = run_quality_table(run, static, MODEL)
    assert t["policy"].tolist()[:2] == ["static + strided", "balanced + balanced"]
    assert (t["error"].iloc[1::2].str.contains("token cap")).all()  # balanced needs a cap
    assert np.isfinite(t["time_s"].iloc[0])
    with pytest.raises(ValueError, match="model shape"):
        run_quality_table(run, CONFIG, None)
    with pytest.raises(ValueError, match="policies is empty"):
        run_quality_table(run, CONFIG, MODEL, [])
