"""The toy task's training data and its advantages (train/data/rollout_data.py)."""

from __future__ import annotations

import numpy as np
import pytest

from varbatch_kit import Rollouts
from varbatch_kit.train.config.sub_configs import DataConfig, LossConfig
from varbatch_kit.train.data.rollout_advantages import token_advantages
from varbatch_kit.train.data.rollout_data import make_toy_data


def test_toy_advantages_take_slimes_path_over_samples():
    """Each sample's reward is its rollout's; the advantages are slime's over the samples:
    groups of n_samples_per_prompt consecutive samples when the batch holds
    rollout_batch_size * n of them, else one group of the whole batch."""
    single = Rollouts.synthetic(6, samples_per_rollout=(1, 1), prompt_len=(2, 5), response_len=6,
                                max_response_len=10, seed=2)
    data, loss = DataConfig(n_samples_per_prompt=3), LossConfig()
    d = make_toy_data(single, vocab_size=32, seed=5, data=data, loss=loss)
    assert d.group_of_sample.tolist() == [0, 0, 0, 1, 1, 1]
    adv = [a[0] for a in token_advantages(d, single, loss=loss, data_cfg=data)]
    for g in (slice(0, 3), slice(3, 6)):
        r = d.sample_reward[g]
        want = (r - r.mean()) / (np.std(r, ddof=1) + 1e-6)
        assert np.allclose(adv[g], want, atol=1e-5)
    # multi-sample rollouts: 18 samples != 2 prompts * 3, one group over every sample
    multi = Rollouts.synthetic(6, samples_per_rollout=(2, 4), prompt_len=(2, 5), response_len=6,
                               max_response_len=10, seed=2)
    d = make_toy_data(multi, vocab_size=32, seed=5, data=data, loss=loss)
    assert len(multi) > 6 and d.group_of_sample.tolist() == [0] * len(multi)
    adv = token_advantages(d, multi, loss=loss, data_cfg=data)
    r = d.sample_reward
    want = (r - r.mean()) / (np.std(r, ddof=1) + 1e-6)
    assert np.allclose([a[0] for a in adv], want, atol=1e-5)
    assert all((a == a[0]).all() for a in adv)
    # good rollouts (quality 0.9) get positive advantages, sloppy ones (0.1) negative
    _ids, members = multi.rollout_order()
    for k, m in enumerate(members):
        assert np.sign(adv[int(m[0])][0]) == np.sign(d.rollout_reward[k] - r.mean())


def test_toy_data_is_seeded_per_rollout_and_follows_the_rule():
    r = Rollouts.synthetic(8, samples_per_rollout=(1, 3), prompt_len=(2, 5), response_len=6,
                           max_response_len=10, seed=1)
    cfg = dict(data=DataConfig(n_samples_per_prompt=4), loss=LossConfig())
    d = make_toy_data(r, vocab_size=32, seed=5, **cfg)
    # rule bookkeeping: follows_rule marks exactly the tokens equal to previous + 1
    for i, seq in enumerate(d.tokens):
        p = int(r.prompt_len[i])
        assert seq.size == r.total_len[i]
        assert np.array_equal(d.follows_rule[i], seq[p:] == (seq[p - 1:-1] + 1) % 32)
    # reward = fraction of rule tokens over the rollout's samples (all-ones masks), and
    # every sample carries its rollout's reward
    _ids, groups = r.rollout_order()
    for k, members in enumerate(groups):
        hits = sum(int(d.follows_rule[i].sum()) for i in members)
        total = sum(int(r.response_len[i]) for i in members)
        assert d.rollout_reward[k] == pytest.approx(hits / total)
        assert np.all(d.sample_reward[members] == d.rollout_reward[k])
    assert d.rollout_log_probs is None and d.given_advantages is None
    # a rollout's tokens do not depend on the other rollouts in the batch
    last = r.subset(groups[-1])
    d2 = make_toy_data(last, vocab_size=32, seed=5, **cfg)
    for j, i in enumerate(groups[-1]):
        assert np.array_equal(d2.tokens[j], d.tokens[i])
    # and the seed matters
    d3 = make_toy_data(r, vocab_size=32, seed=6, **cfg)
    assert any(not np.array_equal(a, b) for a, b in zip(d.tokens, d3.tokens))
