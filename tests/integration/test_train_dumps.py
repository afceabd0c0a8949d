"""slime's own debug dumps trained end to end (recorded by slime's ``save_debug_rollout_data``,
``tests/golden/dumps``): the rollout log-probs drive the PPO ratio and TIS, dict rewards train
through ``reward_key``, and the reports stay the same at dp 1 and dp 2.

The model is the toy GPT with a vocabulary large enough for the dumps' real token ids
(< 32000): the point is the data path and the objective, not the weights.
"""

from __future__ import annotations

import numpy as np
import pytest
from _factories import TINY_GPT
from _paths import REPO

from varbatch_kit import ScheduleConfig
from varbatch_kit.core.traces import read_trace
from varbatch_kit.train import LossConfig, TrainConfig, compare

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

DUMPS = REPO / "tests" / "golden" / "dumps"
MODEL = {**TINY_GPT, "vocab_size": 32000}
METRICS = ("loss", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy_loss",
           "train_rollout_logprob_abs_diff", "ois", "tis", "tis_clipfrac", "tis_abs")


def test_a_dump_with_rollout_log_probs_trains_with_the_ppo_ratio_and_tis(tmp_path):
    r = read_trace(DUMPS / "rollout_10.pt")
    assert "rollout_log_probs" in r.extra
    loss = LossConfig(eps_clip_high=0.28, use_tis=True, tis_clip=1.5, tis_clip_low=0.5,
                      use_rollout_logprobs=True, entropy_coef=0.01)
    base = TrainConfig(loss=loss).with_(lr=1e-3, min_lr=1e-3, lr_decay_style="constant",
                                        max_steps=2, **MODEL)
    configs = [base.with_(schedule=ScheduleConfig(dp=dp, global_batch_size=6,
                                                  max_tokens_per_gpu=64))
               for dp in (1, 2)]
    # TIS against the rollout log-probs, the ratio against the log-prob pass's; and the same
    # with the pass packed under its own, larger cap (slime's --log-probs-max-tokens-per-gpu)
    configs.append(configs[0].with_(use_rollout_logprobs=False, label="pass ratio + TIS"))
    configs.append(configs[-1].with_(log_probs_max_tokens_per_gpu=512, label="pass cap 512"))
    table = compare(configs, r, out_dir=tmp_path, progress=False)
    cols = ["label", "step", "samples", "loss", "ppo_kl", "pg_clipfrac", "tis", "tis_clipfrac"]
    print(table[cols].to_string())
    dp1, dp2, pass_ratio, pass_cap = (table[table.config == k] for k in range(4))
    # the dump's rollout log-probs (another model's, about -0.5 a token; the toy model's are
    # about -log 32000) are the old policy: the ratio is far from 1 at step 1, the clip and the
    # TIS bounds act
    assert (dp1["ppo_kl"].abs() > 1e-3).all() and (dp1["pg_clipfrac"] > 0).all()
    assert (dp1["tis_clipfrac"] > 0).all()
    assert (dp1["train_rollout_logprob_abs_diff"] > 1e-3).all()
    # the same step values at dp 2, for the loss and every metric
    for key in METRICS:
        assert np.allclose(dp2[key], dp1[key], rtol=1e-5, atol=1e-9), (key, dp1[key], dp2[key])
    assert dp2["grad_norm_rel_diff"].max() < 1e-5
    # the log-prob pass's old policy at step 1 is the model itself: ratio 1, no clip; TIS still
    # compares it with the rollout engine's
    one = pass_ratio[pass_ratio.step == 1]
    assert (one["ppo_kl"] == 0).all() and (one["pg_clipfrac"] == 0).all()
    assert (one["tis_clipfrac"] > 0).all()
    # other micro-batches for the pass (float rounding apart), the same training
    assert (pass_cap["step"] == 1).any() and abs(float(pass_cap["ppo_kl"].iloc[0])) < 1e-6
    for key in METRICS:
        assert np.allclose(pass_cap[key], pass_ratio[key], rtol=1e-5, atol=1e-6), key


def test_a_dump_with_dict_rewards_trains_on_the_reward_key(tmp_path):
    r = read_trace(DUMPS / "rollout_8.pt")
    assert all(isinstance(x, dict) for x in r.extra["reward"])
    base = TrainConfig().with_(lr=1e-3, min_lr=1e-3, max_steps=2, label="score",
                               schedule=ScheduleConfig(dp=1, global_batch_size=3,
                                                       max_tokens_per_gpu=64), **MODEL)
    configs = [base.with_(reward_key=key, label=key) for key in ("score", "format")]
    # the first step alone: a rollout batch is the schedule's, whatever max_steps trains of it
    configs.append(configs[0].with_(max_steps=1, label="score, 1 step"))
    table = compare(configs, r, out_dir=tmp_path, progress=False)
    score = np.array([x["score"] for x in r.extra["reward"]])
    fmt = np.array([x["format"] for x in r.extra["reward"]])
    first, alone = table[(table.config == 0) & (table.step == 1)], table[table.config == 2]
    for key in ("loss", "pg_loss", "advantage", "grad_norm", "reward"):
        assert alone[key].tolist() == first[key].tolist(), key
    for k, values in enumerate((score, fmt)):
        t = table[table.config == k]
        assert t["step"].tolist() == [1, 2]
        # the reported reward: the mean over the step's rollouts of each rollout's mean reward
        steps = [sorted(set(r.rollout_id.tolist()))[:3], sorted(set(r.rollout_id.tolist()))[3:6]]
        want = [np.mean([values[r.rollout_id == rid].mean() for rid in ids]) for ids in steps]
        assert t["reward"].tolist() == pytest.approx(want, rel=1e-12)
        assert np.isfinite(t["loss"]).all() and (t["grad_norm"] > 0).all()
    # another key is another reward, so other advantages and another gradient
    assert not np.allclose(table[table.config == 0]["grad_norm"],
                           table[table.config == 1]["grad_norm"])
    with pytest.raises(ValueError, match="reward_key"):
        compare([base], r, out_dir=tmp_path / "no-key", progress=False)
