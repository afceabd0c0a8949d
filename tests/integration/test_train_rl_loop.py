"""The closed RL loop on truncated SmolLM2: generate -> train -> export -> regenerate, twice.

Notebook 07 asks the experiment cache for the same loop (:data:`_smollm2.RL_LOOP`), so the
two share one computation (one xdist group).
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from _smollm2 import CACHE, RL_LOOP, RL_LOOP_CONFIG

from varbatch_kit.cli.experiment_cache import cached_rl_loop
from varbatch_kit.train import TrainConfig, rl_loop

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600),
              pytest.mark.xdist_group("rl_loop")]


def test_two_iterations_sync_the_trained_weights_bitwise(smollm2_path):
    config = TrainConfig().with_(path=str(smollm2_path), **RL_LOOP_CONFIG)
    # the truncated model earns no reward: the loop says so (the entropy bonus still trains)
    with pytest.warns(UserWarning, match=r"2 of 2 iterations had every advantage zero"):
        res = cached_rl_loop(config, cache_dir=CACHE, progress=False, **RL_LOOP)
    it, steps = res.iterations, res.steps
    with pd.option_context("display.width", 250):
        print(it.drop(columns=["generator", "export"]).to_string())
        print(steps.to_string())
    assert list(it["iteration"]) == [0, 1]
    # the sync: the export read back equals the trainer's weights bitwise, and the next
    # iteration generates with exactly those weights
    assert it["sync_exact"].all()
    assert it["generator_hash"][1] == it["trained_hash"][0]
    assert it["trained_hash"][0] != it["generator_hash"][0]  # training moved the weights
    # the first step of every iteration is on-policy: the engine's log-probs of the sampled
    # tokens equal transformers' at the sampling temperature (two implementations, fp32)
    first = steps.groupby("iteration").head(1)
    assert len(first) == 2
    assert (first["train_rollout_logprob_abs_diff"] < 1e-4).all(), first
    assert (first["ppo_kl"].abs() < 1e-6).all()
    # variable global batch size: 8 rollouts of 1-2 samples in steps of 4 rollouts
    assert (it["steps"] == 2).all() and (it["rollouts"] == 8).all()
    # one trainer: its step numbers go on across the iterations
    assert list(steps["step"]) == [1, 2, 3, 4]
    assert list(it["first_step"]) == [1, 3] and list(it["last_step"]) == [2, 4]
    assert list(steps["policy_lag"]) == [0, 1, 0, 1]
    assert list(it["policy_lag_batches"]) == [0, 0]
    assert sum(it["samples_per_step"][0]) == it["samples"][0]
    # resumable: a finished loop is read back, not rerun
    with pytest.warns(UserWarning, match=r"every advantage zero"):
        again = rl_loop(config, out_dir=res.out_dir, progress=False, resume=True, **RL_LOOP)
    pd.testing.assert_frame_equal(again.iterations, it)
    record = json.loads((res.out_dir / "iter01" / "record.json").read_text())
    assert record["iteration"]["generator_hash"] == it["generator_hash"][1]
    assert np.isfinite(it["reward_mean"]).all()


def test_a_slime_reward_and_dapos_filter_in_the_loop(smollm2_path, tmp_path):
    """A reward with slime's custom-RM signature, by dotted path (``async def rm(args,
    sample)``: "_rewards.odd_groups_score_nothing") and DAPO's group filter: odd prompt
    groups earn nothing and are dropped, so a batch of 2 groups takes another round of
    generation; the kept groups' rewards differ within each group (the advantages are not
    all zero), the iteration logs what was kept and dropped, and training runs on the kept
    samples, renumbered."""
    import asyncio

    from _rewards import odd_groups_score_nothing

    from varbatch_kit import read_trace
    from varbatch_kit.train.rl.task import Sample

    config = TrainConfig().with_(path=str(smollm2_path), **RL_LOOP_CONFIG)
    res = rl_loop(config, 2, iterations=1, out_dir=tmp_path / "loop", n_samples_per_prompt=4,
                  max_new_tokens=6, reward="_rewards.odd_groups_score_nothing",
                  dynamic_sampling_filter="nonzero_std", progress=False)
    it = res.iterations.iloc[0]
    print(it.to_string())
    assert it["groups_kept"] == 2 and it["groups_dropped"] >= 1 and it["sampling_rounds"] >= 2
    assert it["groups_generated"] >= it["groups_kept"] + it["groups_dropped"]
    assert it["drop_reasons"].get("zero_std_0.0", 0) >= 1
    assert not it["zero_advantages"] and it["sync_exact"]
    trace = read_trace(tmp_path / "loop" / "iter00" / "rollouts.jsonl")
    frame = trace.to_frame()
    assert sorted(frame.group_index.unique()) == [0, 1] and it["rollouts"] == 8
    assert (frame.rollout_id // 4 == frame.group_index).all()
    assert it["samples"] == len(trace) == sum(it["samples_per_step"])
    for g, rows in frame.groupby("group_index"):
        assert rows.reward.nunique() > 1, g
    # every turn's reward is the function's on that turn's response (an even group there)
    for text, turn_reward in zip(trace.extra["response"], trace.extra["turn_reward"]):
        sample = Sample(index=0, group_index=0, prompt="", response=text)
        assert asyncio.run(odd_groups_score_nothing(None, sample)) == turn_reward


def test_a_loop_killed_in_its_second_iteration_resumes_to_the_same_weights(smollm2_path,
                                                                            tmp_path):
    """The trainer is killed in the first forward of step 3 (iteration 1); rl_loop(resume=True)
    regenerates iteration 1's rollouts (checked against the batch the trainer was given),
    the trainer goes on from its step-2 checkpoint, and the loop ends with the weights of
    the loop that was never killed (the cached one above), bitwise."""
    from varbatch_kit.train import TrainingError

    config = TrainConfig().with_(path=str(smollm2_path), **RL_LOOP_CONFIG)
    with pytest.warns(UserWarning, match=r"every advantage zero"):
        whole = cached_rl_loop(config, cache_dir=CACHE, progress=False, **RL_LOOP)
    out = tmp_path / "loop"
    with pytest.raises(TrainingError, match=r"rank 0"):
        rl_loop(config.with_(save_every=1, kill_at="mid_step:3"), out_dir=out, progress=False,
                **RL_LOOP)
    assert (out / "iter00" / "record.json").is_file()
    assert not (out / "iter01" / "record.json").is_file()
    with pytest.warns(UserWarning, match=r"every advantage zero"):
        again = rl_loop(config.with_(save_every=1), out_dir=out, progress=False, resume=True,
                        **RL_LOOP)
    assert list(again.iterations["trained_hash"]) == list(whole.iterations["trained_hash"])
    np.testing.assert_array_equal(again.steps["loss"], whole.steps["loss"])
    meta = json.loads((out / "trainer" / "run" / "meta.json").read_text())
    assert meta["resumed_from_step"] == 2


def test_async_generates_one_batch_behind_the_trainer(smollm2_path, tmp_path):
    """mode="async": batch k + 1 is generated from the weights before batch k (while batch k
    trains), so from iteration 1 on the generator is one batch behind: its hash is the
    export of iteration k - 2 (the initial model for k = 1), each step's policy lag counts
    the previous batch's steps, and the first step of a lagged batch is no longer on-policy
    against the generator (its old log-probs are the trainer's: ppo_kl starts at 0)."""
    config = TrainConfig().with_(path=str(smollm2_path), **RL_LOOP_CONFIG)
    with pytest.warns(UserWarning, match=r"every advantage zero"):
        res = rl_loop(config.with_(use_tis=True), out_dir=tmp_path / "loop", progress=False,
                      mode="async", **{**RL_LOOP, "iterations": 3})
    it, steps = res.iterations, res.steps
    with pd.option_context("display.width", 250):
        print(it.drop(columns=["generator", "export"]).to_string())
        print(steps.to_string())
    assert list(it["mode"]) == ["async"] * 3
    assert list(it["policy_lag_batches"]) == [0, 1, 1]
    assert it["generator_hash"][1] == it["generator_hash"][0]  # both from the initial model
    assert it["generator_hash"][2] == it["trained_hash"][0]
    assert it["sync_exact"].all()
    assert list(steps["step"]) == list(range(1, len(steps) + 1))
    for k in range(3):
        lag = list(steps[steps.iteration == k]["policy_lag"])
        behind = 0 if k == 0 else int(it["steps"][k - 1])
        assert lag == [behind + i for i in range(len(lag))], (k, lag)
    first = steps.groupby("iteration").head(1)
    assert (first["ppo_kl"].abs() < 1e-6).all()
    diff = list(first["train_rollout_logprob_abs_diff"])
    assert diff[0] < 1e-4 and min(diff[1:]) > 1e-3, diff  # stale from iteration 1 on
    assert {"tis", "tis_clipfrac"} <= set(steps.columns)
    with pytest.raises(ValueError, match=r"mode='later'"):
        rl_loop(config, out_dir=tmp_path / "other", mode="later", **RL_LOOP)


def test_the_toy_gpt_has_no_checkpoint_to_loop_on(tmp_path):
    with pytest.raises(ValueError, match=r"config.model.path=None: the RL loop"):
        rl_loop(TrainConfig(), 2, out_dir=tmp_path)
    with pytest.raises(ValueError, match=r"prompts=0"):
        rl_loop(TrainConfig().with_(path=str(tmp_path)), 0, out_dir=tmp_path)


def test_notebook_06_runs_this_loop():
    """Notebook 07 asks the cache for the same loop (so the two share one computation)."""
    import ast

    import nbformat
    from _paths import NOTEBOOKS_DIR

    nb = nbformat.read(NOTEBOOKS_DIR / "07_rl_loop.ipynb", as_version=4)
    found = {}
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for node in ast.parse(cell.source).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                    and getattr(node.value.func, "id", "") == "dict":
                name = node.targets[0].id
                if name in ("RL_LOOP_CONFIG", "RL_LOOP") and name not in found:
                    found[name] = {k.arg: ast.literal_eval(k.value) for k in node.value.keywords}
    assert found == {"RL_LOOP_CONFIG": RL_LOOP_CONFIG, "RL_LOOP": RL_LOOP}
