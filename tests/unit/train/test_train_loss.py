"""The real-data path: hand-derived GRPO advantages, validation of token sequences at the
boundary. (The per-token loss terms: tests/unit/report/test_objective_terms.py.)"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from varbatch_kit import Rollouts
from varbatch_kit.train.data import (
    RolloutData,
    ToyData,
    group_advantages,
    has_tokens,
    make_training_data,
    rollout_training_data,
    validate_rollout_data,
)


# --------------------------------------------------------------------------- advantages
def test_group_advantages_by_hand():
    r = np.array([1.0, 0.0, 0.0, 0.5, 0.5, 1.0])
    g = np.array([0, 0, 0, 1, 1, 2])  # groups of 3, 2 (equal rewards) and 1
    adv = group_advantages(r, g)
    mean, std = 1 / 3, np.std([1.0, 0.0, 0.0], ddof=1)  # std = 0.57735
    assert adv[:3] == pytest.approx([(1 - mean) / (std + 1e-6), -mean / (std + 1e-6),
                                     -mean / (std + 1e-6)])
    assert adv[:3] == pytest.approx([1.1547, -0.57735, -0.57735], abs=1e-4)
    assert adv[3:].tolist() == [0.0, 0.0, 0.0]
    # labels need not be adjacent
    assert group_advantages(r[[0, 3, 1, 4, 2, 5]], g[[0, 3, 1, 4, 2, 5]]) == pytest.approx(
        adv[[0, 3, 1, 4, 2, 5]])


def _real(extra: dict, rid=(0, 0, 1, 2, 3), prompt=(2, 3, 2, 2, 2), resp=(2, 1, 2, 3, 1)):
    n = len(rid)
    tokens = [list(range(1, p + r + 1)) for p, r in zip(prompt, resp)]
    return Rollouts(np.array(prompt), np.array(resp), np.array(rid),
                    extra=pd.DataFrame({"tokens": tokens, **extra}, index=range(n)))


def test_grpo_from_rewards_groups_of_n_samples_per_prompt():
    # rollout 0 has two samples (rewards 1 and 0 -> rollout reward 0.5)
    r = _real({"reward": [1.0, 0.0, 1.0, 0.0, 0.0]})
    d = rollout_training_data(r, vocab_size=16, n_samples_per_prompt=2)
    assert isinstance(d, RolloutData) and d.advantage_source == "grpo"
    assert d.rollout_reward.tolist() == [0.5, 1.0, 0.0, 0.0]
    s = np.std([0.5, 1.0], ddof=1)  # group (0, 1); group (2, 3) has equal rewards
    a0, a1 = -0.25 / (s + 1e-6), 0.25 / (s + 1e-6)
    assert d.sample_advantage == pytest.approx([a0, a0, a1, 0.0, 0.0])
    assert d.old_logprobs is None
    assert [t.tolist() for t in d.tokens] == [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4],
                                             [1, 2, 3, 4, 5], [1, 2, 3]]


def test_grpo_from_group_index_and_advantage_column_wins():
    rewards = [1.0, 1.0, 0.0, 0.0, 1.0]  # rollout rewards 1, 0, 0, 1
    # prompt groups {rollout 0, 2} and {1, 3}: not consecutive
    r = _real({"reward": rewards, "group_index": [7, 7, 9, 7, 9]})
    d = rollout_training_data(r, vocab_size=16, n_samples_per_prompt=2)
    a = 0.5 / (np.std([1.0, 0.0], ddof=1) + 1e-6)
    assert d.sample_advantage == pytest.approx([a, a, -a, -a, a])
    assert d.group_of_rollout.tolist() == ["7", "9", "7", "9"]
    given = [0.3, 0.3, -1.0, 2.0, 0.0]
    d = rollout_training_data(_real({"reward": rewards, "advantage": given}), vocab_size=16,
                              n_samples_per_prompt=2)
    assert d.advantage_source == "advantage" and d.sample_advantage.tolist() == given
    # advantages alone are enough (rewards then unknown: NaN)
    d = rollout_training_data(_real({"advantage": given}), vocab_size=16, n_samples_per_prompt=2)
    assert np.isnan(d.rollout_reward).all()


def test_old_logprobs_columns():
    old = [[-0.1, -0.2], [-0.3], [-0.4, -0.5], [-0.6, -0.7, -0.8], [-0.9]]
    for column in ("old_logprobs", "rollout_log_probs"):
        d = rollout_training_data(_real({"advantage": [1.0] * 5, column: old}), vocab_size=16,
                                  n_samples_per_prompt=1)
        assert [x.tolist() for x in d.old_logprobs] == old
    bad = [x[:-1] or [0.0, 0.0] for x in old]
    with pytest.raises(ValueError, match=r"has 1 log-probs but response_len\[0\] = 2"):
        rollout_training_data(_real({"advantage": [1.0] * 5, "old_logprobs": bad}),
                              vocab_size=16, n_samples_per_prompt=1)


@pytest.mark.parametrize(("change", "match"), [
    ({"tokens": [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 3]]},
     r"tokens of sample 2 has 3 ids but prompt_len \+ response_len = 2 \+ 2 = 4"),
    ({"tokens": [[1, 2, 3, 4], [1, 2, 3, 99], [1, 2, 3, 4], [1, 2, 3, 4, 5], [1, 2, 3]]},
     r"tokens of sample 1: id 99 at position 3 is outside the model's vocabulary \[0, 16\)"),
    ({"tokens": [[1, 2, 3, 4], [1, 2, 3, -1], [1, 2, 3, 4], [1, 2, 3, 4, 5], [1, 2, 3]]},
     "id -1 at position 3"),
    ({"tokens": [[1, 2, 3, 4], None, [1, 2, 3, 4], [1, 2, 3, 4, 5], [1, 2, 3]]},
     r"Rollouts.extra\['tokens'\] is missing for sample 1"),
    ({"tokens": [[1, 2, 3, 4], [1, 2.5, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4, 5], [1, 2, 3]]},
     "integer token ids"),
    ({"reward": None}, "neither an 'advantage' column nor a 'reward' column"),
    ({"reward": [1.0, float("nan"), 0.0, 1.0, 0.0]},
     r"Rollouts.extra\['reward'\] is missing for sample 1"),
    ({"reward": [1.0, "x", 0.0, 1.0, 0.0]}, r"Rollouts.extra\['reward'\]\[1\] = 'x'"),
    ({"advantage": [1.0, 2.0, float("inf"), 0.0, 0.0]}, "is not finite"),
    ({"group_index": [0, 1, 0, 1, 1]},
     r"rollout 0: its samples \[0, 1\] have different group_index values"),
])
def test_real_data_is_validated_with_clear_errors(change, match):
    extra = {"reward": [1.0, 1.0, 0.0, 1.0, 0.0]}
    change = dict(change)
    tokens = change.pop("tokens", None)
    extra.update({k: v for k, v in change.items() if v is not None})
    for k, v in change.items():
        if v is None:
            extra.pop(k)
    r = _real(extra)
    if tokens is not None:
        r = Rollouts(r.prompt_len, r.response_len, r.rollout_id,
                     extra=r.extra.assign(tokens=pd.Series(tokens, dtype=object)))
    with pytest.raises(ValueError, match=match):
        rollout_training_data(r, vocab_size=16, n_samples_per_prompt=2)
    with pytest.raises(ValueError, match=match):
        validate_rollout_data(r, vocab_size=16, n_samples_per_prompt=2)


def test_without_tokens_the_toy_task_trains():
    r = Rollouts([2, 3], [3, 2], extra=pd.DataFrame({"reward": [1.0, 0.0]}))
    assert not has_tokens(r)
    validate_rollout_data(r, vocab_size=16)  # nothing to check
    d = make_training_data(r, vocab_size=16, seed=0, n_samples_per_prompt=2)
    assert isinstance(d, ToyData) and d.source == "toy" and d.old_logprobs is None
    assert has_tokens(_real({"reward": [0.0] * 5}))
    d = make_training_data(_real({"reward": [0.0] * 5}), vocab_size=16, seed=0,
                           n_samples_per_prompt=2)
    assert isinstance(d, RolloutData) and d.source == "rollouts"
    with pytest.raises(ValueError, match="no token sequences"):
        rollout_training_data(r, vocab_size=16, n_samples_per_prompt=2)
