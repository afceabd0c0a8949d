"""recommend on a realistic dump written by slime's own Sample + save_debug_rollout_data
(scripts/record_slime_realistic_dump.py: 64 prompts x 4 rollouts, a quarter compact, lengths
up to 8k, samples without a rollout id, remove_sample, rollout log-probs): the user's flags
leave about two micro-batches per rank; the recommended slime flags are pasteable, simulate as
predicted and save more than 10 % when the batch size may change, and about 10 % keeping the
user's --num-steps-per-rollout (the default: it is the RL algorithm's)."""

import json
import warnings
from pathlib import Path

import pytest

from varbatch_kit import ModelShape, build_schedule, read_trace
from varbatch_kit.analysis.simulate import simulate
from varbatch_kit.compat.slime import recommend
from varbatch_kit.compat.slime.flag_search import recommended_config

HERE = Path(__file__).parents[2] / "golden" / "realistic_dump"
USER = ("--actor-num-gpus-per-node 8 --rollout-batch-size 64 --n-samples-per-prompt 4 "
        "--num-steps-per-rollout 4 --use-dynamic-batch-size --max-tokens-per-gpu 16384 "
        "--balance-data")


@pytest.fixture(scope="module")
def advice():
    record = json.loads((HERE / "rollout_0.json").read_text())
    assert record["slime_commit"].startswith("624b824") and record["without_rollout_id"] > 0
    r = read_trace(HERE / "rollout_0.pt")
    assert len(r) == record["samples"] and "rollout_log_probs" in r.extra
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return r, recommend(r, USER, ModelShape.preset("qwen3-8b"), vary_global_batch_size=True)


def test_the_recommended_flags_save_more_than_10_percent_and_simulate_as_predicted(advice):
    r, rec = advice
    assert rec.user["mb_per_rank"] <= 2.0  # the poorly balanced case
    assert rec.best["time_s"] < 0.9 * rec.user["time_s"] and rec.best["safe"]
    # the command line, read as slime reads it, is the schedule whose time was predicted
    cfg = recommended_config(rec.command)
    assert cfg == rec.config and cfg.dp == 8
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sim = simulate(build_schedule(r, cfg, ModelShape.preset("qwen3-8b")), timelines=False)
    assert float(sim.step_times["time_s"].sum()) == pytest.approx(rec.best["time_s"], rel=1e-9)
    # the user's other flags are kept verbatim, in order
    assert rec.command.startswith("--actor-num-gpus-per-node 8 --rollout-batch-size 64")


def test_by_default_the_steps_per_rollout_are_the_users(advice):
    r, varied = advice
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kept = recommend(r, USER, "qwen3-8b")
    assert set(kept.table["num_steps_per_rollout"]) == {4}
    assert "--num-steps-per-rollout 4" in kept.command
    assert "--num-steps-per-rollout 4" not in varied.command  # asked: the batch size moved
    assert kept.best["safe"] and kept.best["time_s"] < 0.95 * kept.user["time_s"]
