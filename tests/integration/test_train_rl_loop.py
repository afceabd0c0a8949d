"""The closed RL loop on truncated SmolLM2: generate -> train -> export -> regenerate, twice."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from varbatch_kit.train import TrainConfig
from varbatch_kit.train import rl_loop

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]


def test_two_iterations_sync_the_trained_weights_bitwise(smollm2_path, tmp_path):
    config = TrainConfig().with_(path=str(smollm2_path), num_layers=2, lr=1e-4, min_lr=1e-4,
                                 lr_decay_style="constant", global_batch_size=4,
                                 max_tokens_per_gpu=256, packing="first_fit",
                                 rollout_temperature=0.8, timeout_s=600,
                                 entropy_coef=0.01)  # the 2-layer model earns no reward: the
    # entropy bonus moves the weights
    res = rl_loop(config, 2, iterations=2, out_dir=tmp_path, n_samples_per_prompt=4,
                  max_new_tokens=6, progress=False)
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
    # step 1 of every iteration is on-policy: the engine's log-probs of the sampled tokens
    # equal transformers' at the sampling temperature (two implementations, fp32)
    first = steps[steps.step == 1]
    assert (first["train_rollout_logprob_abs_diff"] < 1e-4).all(), first
    assert (first["ppo_kl"].abs() < 1e-6).all()
    # variable global batch size: 8 rollouts of 1-2 samples in steps of 4 rollouts
    assert (it["steps"] == 2).all() and (it["rollouts"] == 8).all()
    assert list(steps["policy_lag"]) == [0, 1, 0, 1]
    assert sum(it["samples_per_step"][0]) == it["samples"][0]
    # resumable: a finished loop is read back, not rerun
    again = rl_loop(config, 2, iterations=2, out_dir=tmp_path, n_samples_per_prompt=4,
                    max_new_tokens=6, progress=False, resume=True)
    pd.testing.assert_frame_equal(again.iterations, it)
    record = json.loads((tmp_path / "iter01" / "record.json").read_text())
    assert record["iteration"]["generator_hash"] == it["generator_hash"][1]
    assert np.isfinite(it["reward_mean"]).all()


def test_the_toy_gpt_has_no_checkpoint_to_loop_on(tmp_path):
    with pytest.raises(ValueError, match=r"config.model.path=None: the RL loop"):
        rl_loop(TrainConfig(), 2, out_dir=tmp_path)
    with pytest.raises(ValueError, match=r"prompts=0"):
        rl_loop(TrainConfig().with_(path=str(tmp_path)), 0, out_dir=tmp_path)
