"""The real-data path: the data read from ``Rollouts.extra``, validation of token sequences
at the boundary (the advantages computed from it: ``test_train_advantages.py``; the per-token
loss terms: ``tests/unit/report/test_objective_terms.py``)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from varbatch_kit import Rollouts
from varbatch_kit.train import DataConfig, LossConfig
from varbatch_kit.train.data.rollout_data import (
    RolloutData,
    ToyData,
    has_tokens,
    make_training_data,
    rollout_training_data,
    validate_rollout_data,
)

DATA, LOSS = DataConfig(n_samples_per_prompt=2), LossConfig()


def _real(extra: dict, rid=(0, 0, 1, 2, 3), prompt=(2, 3, 2, 2, 2), resp=(2, 1, 2, 3, 1)):
    n = len(rid)
    tokens = [list(range(1, p + r + 1)) for p, r in zip(prompt, resp)]
    return Rollouts(np.array(prompt), np.array(resp), np.array(rid),
                    extra=pd.DataFrame({"tokens": tokens, **extra}, index=range(n)))


def _read(r, data=DATA, loss=LOSS):
    return rollout_training_data(r, vocab_size=16, data=data, loss=loss)


def test_rewards_are_per_sample_and_reported_per_rollout():
    # rollout 0 has two samples (rewards 1 and 0 -> rollout reward 0.5)
    r = _real({"reward": [1.0, 0.0, 1.0, 0.0, 0.0]})
    d = _read(r)
    assert isinstance(d, RolloutData) and d.given_advantages is None
    assert d.sample_reward.tolist() == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert d.rollout_reward.tolist() == [0.5, 1.0, 0.0, 0.0]
    assert d.rollout_ids.tolist() == [0, 1, 2, 3]
    # 5 samples != rollout_batch_size (4 rollouts // 2) * 2: slime's one group
    assert d.group_of_sample.tolist() == [0, 0, 0, 0, 0]
    assert d.rollout_log_probs is None
    assert [t.tolist() for t in d.tokens] == [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4],
                                             [1, 2, 3, 4, 5], [1, 2, 3]]
    for a in (d.sample_reward, d.group_of_sample, *d.tokens):
        assert not a.flags.writeable


def test_group_index_groups_by_prompt_and_advantage_column_is_kept():
    rewards = [1.0, 1.0, 0.0, 0.0, 1.0]
    # prompt groups {rollout 0, 2} and {1, 3}: not consecutive
    r = _real({"reward": rewards, "group_index": [7, 7, 9, 7, 9]})
    d = _read(r, loss=LossConfig(advantage_grouping="prompt"))
    assert d.group_of_sample.tolist() == [0, 0, 1, 0, 1]
    given = [0.3, 0.3, -1.0, 2.0, 0.0]
    d = _read(_real({"reward": rewards, "advantage": given}))
    assert d.given_advantages.tolist() == given and d.sample_reward.tolist() == rewards
    # advantages alone are enough (rewards then unknown: NaN)
    d = _read(_real({"advantage": given}))
    assert np.isnan(d.rollout_reward).all() and np.isnan(d.sample_reward).all()
    # with given advantages a missing reward is only unreported
    d = _read(_real({"advantage": given, "reward": [1.0, None, 0.0, 0.0, 1.0]}))
    assert np.isnan(d.sample_reward[1]) and np.isnan(d.rollout_reward[0])


def test_rollout_log_probs_columns():
    old = [[-0.1, -0.2], [-0.3], [-0.4, -0.5], [-0.6, -0.7, -0.8], [-0.9]]
    for column in ("rollout_log_probs", "old_logprobs"):
        d = _read(_real({"advantage": [1.0] * 5, column: old}))
        assert [x.tolist() for x in d.rollout_log_probs] == old
        assert all(x.dtype == np.float64 and not x.flags.writeable for x in d.rollout_log_probs)
    # rollout_log_probs wins over the legacy name
    d = _read(_real({"advantage": [1.0] * 5, "old_logprobs": [[0.0] * len(x) for x in old],
                     "rollout_log_probs": old}))
    assert [x.tolist() for x in d.rollout_log_probs] == old
    bad = [x[:-1] or [0.0, 0.0] for x in old]
    with pytest.raises(ValueError, match=r"has 1 log-probs but response_len\[0\] = 2"):
        _read(_real({"advantage": [1.0] * 5, "rollout_log_probs": bad}))


def test_dict_rewards_are_read_with_reward_key():
    rewards = [{"acc": 1.0, "fmt": 0.5}, {"acc": 0.0, "fmt": 1.0}, {"acc": 1.0, "fmt": 0.0},
               {"acc": 0.0, "fmt": 0.0}, {"acc": 1.0, "fmt": 1.0}]
    d = _read(_real({"reward": rewards}), loss=LossConfig(reward_key="acc"))
    assert d.sample_reward.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert d.rollout_reward.tolist() == [0.5, 1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match=r"\['acc', 'fmt'\]; set loss.reward_key"):
        _read(_real({"reward": rewards}))


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
    ({"reward": [1.0, {"acc": 1.0}, 0.0, 1.0, 0.0]},
     r"Rollouts.extra\['reward'\]\[1\] is a dict reward with keys \['acc'\]"),
    ({"advantage": [1.0, 2.0, float("inf"), 0.0, 0.0]}, "is not finite"),
    ({"group_index": [0, 1, 0, 1, 1]},
     r"rollout 0: its samples \[0, 1\] have different group_index values"),
    ({"group_index": [0, 0, 0, 1, None], "loss": LossConfig(advantage_grouping="prompt")},
     r"Rollouts.extra\['group_index'\] is missing for sample 4"),
    ({"loss": LossConfig(use_tis=True)}, r"loss.use_tis=True needs the rollout engine's"),
    ({"data": DataConfig(n_samples_per_prompt=1, rollout_batch_size=5)},
     r"sample 0 is alone in its reward group"),
])
def test_real_data_is_validated_with_clear_errors(change, match):
    extra = {"reward": [1.0, 1.0, 0.0, 1.0, 0.0]}
    change = dict(change)
    data, loss = change.pop("data", DATA), change.pop("loss", LOSS)
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
        rollout_training_data(r, vocab_size=16, data=data, loss=loss)
    with pytest.raises(ValueError, match=match):
        validate_rollout_data(r, vocab_size=16, data=data, loss=loss)


def test_configs_must_be_given():
    r = _real({"reward": [0.0] * 5})
    with pytest.raises(ValueError, match="data=.*give a DataConfig"):
        make_training_data(r, vocab_size=16, seed=0, data=None, loss=LOSS)
    with pytest.raises(ValueError, match="loss=.*give a LossConfig"):
        validate_rollout_data(r, vocab_size=16, data=DATA, loss={"reward_key": "acc"})


def test_without_tokens_the_toy_task_trains():
    r = Rollouts([2, 3], [3, 2], extra=pd.DataFrame({"reward": [1.0, 0.0]}))
    assert not has_tokens(r)
    validate_rollout_data(r, vocab_size=16, data=DATA, loss=LOSS)  # its reward groups only
    d = make_training_data(r, vocab_size=16, seed=0, data=DATA, loss=LOSS)
    assert isinstance(d, ToyData) and d.source == "toy"
    assert d.rollout_log_probs is None and d.given_advantages is None
    assert has_tokens(_real({"reward": [0.0] * 5}))
    d = make_training_data(_real({"reward": [0.0] * 5}), vocab_size=16, seed=0, data=DATA,
                           loss=LOSS)
    assert isinstance(d, RolloutData) and d.source == "rollouts"
    with pytest.raises(ValueError, match="no token sequences"):
        rollout_training_data(r, vocab_size=16, data=DATA, loss=LOSS)


def test_token_id_map_modulo_folds_a_dumps_real_ids_into_a_small_vocabulary():
    """A slime dump's real ids (< 32000) on vocab 64: refused by default, id % 64 with
    DataConfig(token_id_map='modulo')."""
    from _paths import REPO

    from varbatch_kit import read_trace

    r = read_trace(REPO / "tests" / "golden" / "dumps" / "rollout_1.pt")
    real = [np.asarray(t) for t in r.extra["tokens"]]
    assert max(int(t.max()) for t in real) >= 64  # real ids, beyond the toy vocabulary
    assert DataConfig().token_id_map is None  # off by default
    with pytest.raises(ValueError, match=r"outside the model's vocabulary \[0, 64\).*"
                                         r"token_id_map='modulo'"):
        rollout_training_data(r, vocab_size=64, data=DataConfig(), loss=LOSS)
    d = rollout_training_data(r, vocab_size=64, data=DataConfig(token_id_map="modulo"),
                              loss=LOSS)
    assert len(d.tokens) == len(real)
    for got, ids in zip(d.tokens, real):
        assert got.tolist() == (ids % 64).tolist()
    with pytest.raises(ValueError, match=r"data.token_id_map='hash': choose one of"):
        DataConfig(token_id_map="hash")
