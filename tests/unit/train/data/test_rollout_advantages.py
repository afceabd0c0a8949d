"""slime's advantages on the engine's data (:mod:`varbatch_kit.train.data.rollout_advantages`).

Two kinds of checks: random batches against the slime-signature adapters of
:mod:`varbatch_kit.compat.slime.objective` (``post_process_rewards`` +
``compute_advantages_and_returns``, themselves replayed against vectors
recorded from slime's code in ``tests/unit/compat/test_golden_objective.py``),
so ``token_advantages`` is checked against slime; and hand-derived numbers.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from varbatch_kit import Rollouts
from varbatch_kit.compat.slime import objective as so
from varbatch_kit.report.objective import GROUP_NORMALIZED_ESTIMATORS
from varbatch_kit.train import DataConfig, LossConfig
from varbatch_kit.train.config.sub_configs import ADVANTAGE_ESTIMATORS
from varbatch_kit.train.data.rollout_advantages import (
    default_rollout_batch_size,
    post_processed_rewards,
    reward_groups,
    token_advantages,
)
from varbatch_kit.train.data.rollout_data import make_training_data, validate_rollout_data

F32_EPS = 1e-6


def batch(rng, counts, *, n_per: int | None = None, fully_masked=(), extra=None) -> Rollouts:
    """Rollouts of ``counts[k]`` samples each, with tokens, rewards and group_index (the prompt
    of rollout k is k // n_per when given); samples in ``fully_masked`` have all-zero masks."""
    rid = np.repeat(np.arange(len(counts)), counts)
    n = rid.size
    prompt, resp = rng.integers(1, 4, n), rng.integers(1, 7, n)
    masks = [(rng.random(q) < 0.8).astype(int) for q in resp]
    for i, m in enumerate(masks):
        m[-1] = 1 if i not in fully_masked else 0
        if i in fully_masked:
            m[:] = 0
    cols = {"tokens": [rng.integers(0, 16, p + q).tolist() for p, q in zip(prompt, resp)],
            "reward": rng.random(n).round(3).tolist()}
    if n_per:
        cols["group_index"] = (rid // n_per).tolist()
    cols.update(extra or {})
    return Rollouts(prompt, resp, rid, masks, extra=pd.DataFrame(cols))


def log_probs(rng, r: Rollouts) -> list[np.ndarray]:
    return [-rng.random(int(q)) * 3 for q in r.response_len]


def slime_advantages(r: Rollouts, rewards, data: DataConfig, loss: LossConfig, *, lp=None,
                     ref=None, rollout_lp=None) -> list[torch.Tensor]:
    """What slime computes: compat's post_process_rewards on the samples (Sample.to_dict()
    form), then compute_advantages_and_returns on the rollout data."""
    rbs = data.rollout_batch_size or default_rollout_batch_size(r, data.n_samples_per_prompt)
    args = SimpleNamespace(
        advantage_estimator=loss.advantage_estimator,
        rewards_normalization=loss.rewards_normalization,
        grpo_std_normalization=loss.grpo_std_normalization,
        n_samples_per_prompt=data.n_samples_per_prompt, rollout_batch_size=rbs,
        reward_key=loss.reward_key, kl_coef=loss.kl_coef, kl_loss_type=loss.kl_loss_type,
        use_rollout_logprobs=loss.use_rollout_logprobs,
        normalize_advantages=loss.normalize_advantages, gamma=loss.gamma, lambd=1.0)
    _, post = so.post_process_rewards(args, [{"reward": x} for x in rewards])
    t = lambda xs: None if xs is None else [torch.as_tensor(x, dtype=torch.float32) for x in xs]  # noqa: E731
    rollout_data = {"rewards": post, "loss_masks": t(r.masks()), "log_probs": t(lp),
                    "ref_log_probs": t(ref), "rollout_log_probs": t(rollout_lp),
                    "response_lengths": r.response_len.tolist(),
                    "total_lengths": r.total_len.tolist()}
    if rollout_data["log_probs"] is None:  # the engine's log-prob pass always runs in slime
        rollout_data["log_probs"] = [torch.zeros(int(q)) for q in r.response_len]
    so.compute_advantages_and_returns(args, rollout_data)
    return rollout_data["advantages"]


def ours(r, data, loss, **kw):
    d = make_training_data(r, vocab_size=16, seed=0, data=data, loss=loss)
    return d, token_advantages(d, r, loss=loss, data_cfg=data, **kw)


def same(got: list[np.ndarray], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == np.float64 and g.shape == tuple(w.shape)
        np.testing.assert_array_equal(g, w.double().numpy())


# --------------------------------------------------------------------------- against slime
CASES = [(e, norm, rn, std, kl)
         for e in ADVANTAGE_ESTIMATORS for norm in (False, True) for rn in (True, False)
         for std in (True, False) for kl in (0.0, 0.05)
         if not (kl and e not in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"))]


@pytest.mark.parametrize(("estimator", "normalize", "rewards_norm", "std_norm", "kl_coef"), CASES)
def test_token_advantages_are_slimes_on_random_batches(estimator, normalize, rewards_norm,
                                                         std_norm, kl_coef):
    rng = np.random.default_rng([ADVANTAGE_ESTIMATORS.index(estimator), normalize, rewards_norm,
                                 std_norm])
    for trial in range(6):
        n_per = int(rng.integers(2, 4))
        if trial % 2:  # one sample per rollout, full prompt groups: slime's grouped case
            counts = [1] * (n_per * int(rng.integers(1, 4)))
        else:  # multi-sample rollouts: the sample count is not rbs * n, one group
            counts = rng.integers(1, 4, int(rng.integers(2, 7))).tolist()
        masked = () if estimator == "reinforce_plus_plus" else (0,)  # slime asserts there
        r = batch(rng, counts, n_per=n_per, fully_masked=masked)
        data = DataConfig(n_samples_per_prompt=n_per)
        loss = LossConfig(advantage_estimator=estimator, normalize_advantages=normalize,
                          rewards_normalization=rewards_norm, grpo_std_normalization=std_norm,
                          kl_coef=kl_coef, kl_loss_type=["k1", "k2", "k3", "low_var_kl"][trial % 4],
                          gamma=[1.0, 0.9][trial % 2])
        lp, ref = log_probs(rng, r), log_probs(rng, r)
        d, got = ours(r, data, loss, log_probs=lp, ref_log_probs=ref)
        want = slime_advantages(r, d.sample_reward.tolist(), data, loss, lp=lp, ref=ref)
        same(got, want)
        if trial % 2 and estimator in GROUP_NORMALIZED_ESTIMATORS and rewards_norm:
            assert d.group_of_sample.tolist() == (np.arange(len(r)) // n_per).tolist()


@pytest.mark.parametrize("estimator", GROUP_NORMALIZED_ESTIMATORS)
@pytest.mark.parametrize("normalize", [False, True])
def test_prompt_grouping_is_slimes_normalisation_within_each_prompt(estimator, normalize):
    """advantage_grouping='prompt': slime's post-processing on each group_index group's
    samples (one slime group each), then slime's train-side step on the whole batch."""
    rng = np.random.default_rng([GROUP_NORMALIZED_ESTIMATORS.index(estimator), normalize])
    for _ in range(4):
        counts = rng.integers(1, 4, int(rng.integers(4, 9))).tolist()
        r = batch(rng, counts, n_per=2, fully_masked=(1,))
        data = DataConfig(n_samples_per_prompt=2)
        loss = LossConfig(advantage_estimator=estimator, advantage_grouping="prompt",
                          normalize_advantages=normalize)
        labels = np.asarray(r.extra["group_index"])
        if min(np.bincount(labels)) < 2:
            continue
        d, got = ours(r, data, loss)
        post = np.empty(len(r))
        for g in np.unique(labels):
            members = np.flatnonzero(labels == g)
            args = SimpleNamespace(advantage_estimator=estimator, rewards_normalization=True,
                                   grpo_std_normalization=True, n_samples_per_prompt=1,
                                   rollout_batch_size=0, reward_key=None)
            post[members] = so.post_process_rewards(
                args, [{"reward": x} for x in d.sample_reward[members]])[1]
        raw = LossConfig(advantage_estimator=estimator, rewards_normalization=False,
                         normalize_advantages=normalize)
        same(got, slime_advantages(r, post.tolist(), data, raw))


def test_rollout_batch_size_given_and_default():
    rng = np.random.default_rng(3)
    r = batch(rng, [1] * 6, n_per=3)
    assert default_rollout_batch_size(r, 3) == 2  # two group_index values
    loss = LossConfig()
    assert reward_groups(r, data=DataConfig(n_samples_per_prompt=3), loss=loss)[0].tolist() == \
        [0, 0, 0, 1, 1, 1]
    # rollout_batch_size=3 with 3 per prompt wants 9 samples: one group of the 6
    data = DataConfig(n_samples_per_prompt=3, rollout_batch_size=3)
    groups, size = reward_groups(r, data=data, loss=loss)
    assert groups.tolist() == [0] * 6 and size is None
    d, got = ours(r, data, loss)
    same(got, slime_advantages(r, d.sample_reward.tolist(), data, loss))
    # without group_index: rollouts // n_samples_per_prompt
    plain = Rollouts(r.prompt_len, r.response_len, r.rollout_id,
                     extra=r.extra.drop(columns="group_index"))
    assert default_rollout_batch_size(plain, 2) == 3 and default_rollout_batch_size(plain, 4) == 1


def test_use_rollout_logprobs_takes_the_kl_from_the_rollout_log_probs():
    rng = np.random.default_rng(5)
    r0 = batch(rng, [2, 1, 1])
    rollout_lp = log_probs(rng, r0)
    r = Rollouts(r0.prompt_len, r0.response_len, r0.rollout_id, r0.loss_masks,
                 extra=r0.extra.assign(rollout_log_probs=[x.tolist() for x in rollout_lp]))
    data = DataConfig()
    loss = LossConfig(advantage_estimator="reinforce_plus_plus", kl_coef=0.1,
                      use_rollout_logprobs=True, gamma=0.9)
    ref = log_probs(rng, r)
    d, got = ours(r, data, loss, log_probs=log_probs(rng, r), ref_log_probs=ref)
    same(got, slime_advantages(r, d.sample_reward.tolist(), data, loss, ref=ref,
                               rollout_lp=rollout_lp))


# --------------------------------------------------------------------------- by hand
def f32(x):
    return float(np.float32(x))


def hand(rewards, *, counts=None, masks=None, extra=None, resp=None):
    n = len(rewards)
    counts = counts or [1] * n
    rid = np.repeat(np.arange(len(counts)), counts)
    resp = np.array(resp or [2] * n)
    cols = {"tokens": [[1] * (1 + q) for q in resp], "reward": list(rewards), **(extra or {})}
    return Rollouts(np.ones(n, dtype=int), resp, rid, masks, extra=pd.DataFrame(cols))


def scalars(adv):
    for a in adv:
        assert (a == a[0]).all()  # one value on every token (grpo family)
    return [float(a[0]) for a in adv]


def test_equal_groups_by_hand():
    r = hand([1.0, 0.0, 0.5, 0.5], extra={"group_index": [0, 0, 1, 1]})
    _, adv = ours(r, DataConfig(n_samples_per_prompt=2), LossConfig())
    s = np.float32(np.std([0.5, -0.5], ddof=1))  # 0.70710677
    a = f32(np.float32(0.5) / (s + np.float32(1e-6)))
    assert scalars(adv) == [a, -a, 0.0, 0.0]
    assert a == pytest.approx(0.7071058, abs=1e-7)
    # mean only: Dr. GRPO, and REINFORCE++-baseline (never divides by the std)
    for loss in (LossConfig(grpo_std_normalization=False),
                 LossConfig(advantage_estimator="reinforce_plus_plus_baseline")):
        assert scalars(ours(r, DataConfig(n_samples_per_prompt=2), loss)[1]) == \
            [0.5, -0.5, 0.0, 0.0]
    # no normalisation: the raw rewards
    assert scalars(ours(r, DataConfig(n_samples_per_prompt=2),
                        LossConfig(rewards_normalization=False))[1]) == [1.0, 0.0, 0.5, 0.5]


def test_unequal_groups_are_one_group_under_slimes_rule_and_per_prompt_with_prompt():
    # rollout 0 has two samples: 5 samples != 2 prompts * 2, so slime normalises all five
    rewards = [1.0, 0.0, 1.0, 0.0, 0.5]
    r = hand(rewards, counts=[2, 1, 1, 1], extra={"group_index": [7, 7, 7, 9, 9]})
    data = DataConfig(n_samples_per_prompt=2)
    d, adv = ours(r, data, LossConfig(grpo_std_normalization=False))
    assert d.group_of_sample.tolist() == [0] * 5
    assert scalars(adv) == pytest.approx([0.5, -0.5, 0.5, -0.5, 0.0], abs=1e-7)
    # by prompt: {1, 0, 1} (mean 2/3) and {0, 0.5} (mean 1/4)
    d, adv = ours(r, data, LossConfig(grpo_std_normalization=False, advantage_grouping="prompt"))
    assert d.group_of_sample.tolist() == [0, 0, 0, 1, 1]
    assert scalars(adv) == pytest.approx([1 / 3, -2 / 3, 1 / 3, -0.25, 0.25], abs=1e-7)
    # with the std: each prompt group is one slime group of its own samples
    loss = LossConfig(advantage_grouping="prompt")
    d, adv = ours(r, data, loss)
    args = SimpleNamespace(advantage_estimator="grpo", rewards_normalization=True,
                           grpo_std_normalization=True, n_samples_per_prompt=1,
                           rollout_batch_size=0, reward_key=None)
    want = (so.post_process_rewards(args, [{"reward": x} for x in rewards[:3]])[1]
            + so.post_process_rewards(args, [{"reward": x} for x in rewards[3:]])[1])
    assert scalars(adv) == want
    # the reported reward is the rollout mean of the samples' rewards
    assert d.rollout_reward.tolist() == [0.5, 1.0, 0.0, 0.5]
    assert d.sample_reward.tolist() == rewards


def test_prompt_grouping_needs_group_index():
    r = hand([1.0, 0.0])
    with pytest.raises(ValueError, match="'group_index'.*advantage_grouping='slime'"):
        ours(r, DataConfig(), LossConfig(advantage_grouping="prompt"))


def test_one_sample_groups_with_the_std_are_refused_not_nan():
    r = hand([1.0, 0.0, 0.5])  # n_samples_per_prompt=1, 3 rollouts: groups of one sample
    for call in (lambda: ours(r, DataConfig(), LossConfig()),
                 lambda: validate_rollout_data(r, vocab_size=16, data=DataConfig(),
                                               loss=LossConfig())):
        with pytest.raises(ValueError, match=r"sample 0 is alone.*n_samples_per_prompt"):
            call()
    # without the std (or with another estimator) a group of one is just 0 / the reward
    assert scalars(ours(r, DataConfig(), LossConfig(grpo_std_normalization=False))[1]) == \
        [0.0, 0.0, 0.0]
    assert scalars(ours(r, DataConfig(), LossConfig(advantage_estimator="reinforce_plus_plus"))
                   [1]) == [1.0, 0.0, 0.5]


def test_reinforce_plus_plus_with_kl_coef_by_hand():
    # one sample, 3 response tokens, mask [1, 1, 0]: the reward sits on token 1 (the last
    # unmasked one); k1 KL = lp - ref per token, token rewards -kl_coef * kl * mask
    r = hand([2.0], resp=[3], masks=[np.array([1, 1, 0])])
    lp, ref = [np.array([-1.0, -2.0, -0.5])], [np.array([-1.5, -1.0, -0.5])]
    loss = LossConfig(advantage_estimator="reinforce_plus_plus", kl_coef=0.1, gamma=0.5,
                      kl_loss_type="k1")
    _, (adv,) = ours(r, DataConfig(), loss, log_probs=lp, ref_log_probs=ref)
    kl = np.array([0.5, -1.0, 0.0])
    tok = -0.1 * kl * np.array([1, 1, 0]) + np.array([0, 2.0, 0])  # [-0.05, 2.1, 0]
    want = [tok[0] + 0.5 * tok[1], tok[1], 0.0]  # discounted with gamma 0.5
    assert adv.tolist() == pytest.approx(want, abs=1e-6)
    assert adv.dtype == np.float64
    with pytest.raises(ValueError, match="ref_log_probs"):
        ours(r, DataConfig(), loss, log_probs=lp)
    with pytest.raises(ValueError, match="log_probs.*kl_coef=0"):
        ours(r, DataConfig(), loss)
    with pytest.raises(ValueError, match=r"log_probs\[0\] has shape \(2,\)"):
        ours(r, DataConfig(), loss, log_probs=[lp[0][:2]], ref_log_probs=ref)
    # baseline: scalar - kl_coef * kl on every token (the raw reward without a group mean
    # when rewards_normalization is off)
    loss = LossConfig(advantage_estimator="reinforce_plus_plus_baseline", kl_coef=0.1,
                      kl_loss_type="k1", rewards_normalization=False)
    _, (adv,) = ours(r, DataConfig(), loss, log_probs=lp, ref_log_probs=ref)
    assert adv.tolist() == pytest.approx((2.0 - 0.1 * kl).tolist(), abs=1e-6)


def test_fully_masked_samples():
    masks = [np.array([1, 1]), np.array([0, 0]), np.array([1, 0]), np.array([0, 1])]
    r = hand([1.0, 0.0, 0.5, 0.5], masks=masks, extra={"group_index": [0, 0, 1, 1]})
    data = DataConfig(n_samples_per_prompt=2)
    # GRPO: the masked sample still counts in its group's statistics (slime normalises every
    # sample's reward) and gets its broadcast value
    s = np.float32(np.std([0.5, -0.5], ddof=1))
    a = f32(np.float32(0.5) / (s + np.float32(1e-6)))
    assert scalars(ours(r, data, LossConfig())[1]) == [a, -a, 0.0, 0.0]
    # whitening only over loss tokens: tokens a, a (sample 0), 0 (sample 2), 0 (sample 3)
    _, adv = ours(r, data, LossConfig(normalize_advantages=True))
    vals = np.array([a, a, 0.0, 0.0], dtype=np.float32)
    mean, var = vals.mean(), vals.var(ddof=1)
    assert adv[0].tolist() == pytest.approx([(a - mean) / np.sqrt(var + 1e-8)] * 2, rel=1e-6)
    assert adv[1].tolist() == pytest.approx([(-a - mean) / np.sqrt(var + 1e-8)] * 2, rel=1e-6)
    # REINFORCE++ (slime asserts on a fully masked sample): returns 0 there, the rest slime's
    loss = LossConfig(advantage_estimator="reinforce_plus_plus", gamma=0.5)
    _, adv = ours(r, data, loss)
    assert [x.tolist() for x in adv] == [[0.5, 1.0], [0.0, 0.0], [0.5, 0.0], [0.25, 0.5]]
    live = r.subset([0, 2, 3])
    d = make_training_data(live, vocab_size=16, seed=0, data=data, loss=loss)
    same([adv[0], adv[2], adv[3]], slime_advantages(live, d.sample_reward.tolist(), data, loss))


def test_dict_rewards_with_reward_key():
    rewards = [{"acc": 1.0, "fmt": 0.5}, {"acc": 0.0, "fmt": 1.0}, {"acc": 0.0, "fmt": 0.0},
               {"acc": 1.0, "fmt": 0.25}]
    r = hand(rewards)
    data = DataConfig(n_samples_per_prompt=2)
    d, adv = ours(r, data, LossConfig(reward_key="fmt", grpo_std_normalization=False))
    assert d.sample_reward.tolist() == [0.5, 1.0, 0.0, 0.25]
    assert scalars(adv) == [-0.25, 0.25, -0.125, 0.125]
    with pytest.raises(ValueError,
                       match=r"dict reward with keys \['acc', 'fmt'\]; set loss.reward_key"):
        ours(r, data, LossConfig())
    bad = hand([{"acc": 1.0}, {"fmt": 1.0}])
    with pytest.raises(ValueError, match=r"reward_key='acc' is not a key of the reward of "
                                         r"sample 1; its keys are \['fmt'\]"):
        ours(bad, data, LossConfig(reward_key="acc"))
    with pytest.raises(ValueError, match="reward_key='acc'.*is not a dict"):
        ours(hand([1.0, 0.0]), data, LossConfig(reward_key="acc"))


def test_given_advantages_are_used_as_they_are():
    given = [0.3, -1.0, 2.0]
    r = hand([1.0, 0.0, 0.5], counts=[2, 1], extra={"advantage": given}, resp=[2, 3, 1])
    d, adv = ours(r, DataConfig(), LossConfig())  # groups of one would be refused for rewards
    assert d.given_advantages.tolist() == given
    assert [x.tolist() for x in adv] == [[0.3, 0.3], [-1.0] * 3, [2.0]]
    _, adv = ours(r, DataConfig(), LossConfig(normalize_advantages=True))
    flat = np.concatenate(adv)
    assert flat.mean() == pytest.approx(0.0, abs=1e-6)
    assert flat.var(ddof=1) == pytest.approx(1.0, rel=1e-5)


def test_rollout_log_probs_needed_by_the_loss_are_checked_before_training():
    r = hand([1.0, 0.0])
    for flag in ("use_tis", "use_rollout_logprobs"):
        loss = LossConfig(**{flag: True})
        with pytest.raises(ValueError, match=f"loss.{flag}=True needs the rollout engine's "
                                             "log-probs.*'rollout_log_probs'"):
            validate_rollout_data(r, vocab_size=16, data=DataConfig(n_samples_per_prompt=2),
                                  loss=loss)
        toy = Rollouts([2, 2], [3, 2], [0, 0])
        with pytest.raises(ValueError, match=f"loss.{flag}=True"):
            validate_rollout_data(toy, vocab_size=16, data=DataConfig(), loss=loss)
        with pytest.raises(ValueError, match=f"loss.{flag}=True"):
            make_training_data(toy, vocab_size=16, seed=0, data=DataConfig(), loss=loss)
    with_lp = hand([1.0, 0.0], extra={"rollout_log_probs": [[-0.5, -1.0], [-2.0, -0.1]]})
    validate_rollout_data(with_lp, vocab_size=16, data=DataConfig(n_samples_per_prompt=2),
                          loss=LossConfig(use_tis=True))


def test_post_processed_rewards_checks_the_count():
    r = hand([1.0, 0.0])
    with pytest.raises(ValueError, match="3 rewards for 2 samples"):
        post_processed_rewards([1.0, 0.0, 1.0], r, loss=LossConfig(), data_cfg=DataConfig())


# --------------------------------------------------------------------------- properties
@st.composite
def prompt_batches(draw):
    n_groups = draw(st.integers(1, 4))
    sizes = draw(st.lists(st.integers(2, 4), min_size=n_groups, max_size=n_groups))
    labels = [g for g, s in enumerate(sizes) for _ in range(s)]
    rewards = draw(st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0]), min_size=len(labels),
                            max_size=len(labels)))
    perm = draw(st.permutations(range(len(labels))))
    return labels, rewards, perm


@settings(max_examples=40, deadline=None)
@given(prompt_batches(), st.booleans())
def test_prompt_grouping_does_not_depend_on_sample_order(case, std):
    labels, rewards, perm = case
    loss = LossConfig(advantage_grouping="prompt", grpo_std_normalization=std)
    r = hand(rewards, extra={"group_index": labels})
    shuffled = hand([rewards[i] for i in perm], extra={"group_index": [labels[i] for i in perm]})
    a = scalars(ours(r, DataConfig(), loss)[1])
    b = scalars(ours(shuffled, DataConfig(), loss)[1])
    assert b == pytest.approx([a[i] for i in perm], abs=1e-5)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 4), st.integers(1, 4), st.data(), st.booleans())
def test_slime_rule_permutes_within_its_groups(size, n_groups, draw, one_group):
    """Under slime's rule the advantages follow a sample moved inside its group of
    n_samples_per_prompt consecutive samples, or anywhere when the batch is one group (a
    rollout_batch_size that does not match the sample count). Moving a sample to another
    consecutive group is not such a symmetry: it changes the groups."""
    n = size * n_groups
    rewards = draw.draw(st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0]), min_size=n,
                                 max_size=n))
    if one_group:
        perm = draw.draw(st.permutations(range(n)))
    else:
        perm = [g * size + j for g in range(n_groups)
                for j in draw.draw(st.permutations(range(size)))]
    data = DataConfig(n_samples_per_prompt=size, rollout_batch_size=n_groups + one_group)
    loss = LossConfig(grpo_std_normalization=False)
    a = scalars(ours(hand(rewards), data, loss)[1])
    b = scalars(ours(hand([rewards[i] for i in perm]), data, loss)[1])
    assert b == pytest.approx([a[i] for i in perm], abs=1e-6)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(-2, 2, allow_nan=False), min_size=3, max_size=8),
       st.sampled_from(ADVANTAGE_ESTIMATORS))
def test_whitened_advantages_have_masked_mean_0_and_variance_1(rewards, estimator):
    if len(set(rewards)) < 2:
        return
    masks = [np.array([1, i % 2]) for i in range(len(rewards))]
    r = hand(rewards, masks=masks)
    loss = LossConfig(advantage_estimator=estimator, normalize_advantages=True,
                      rewards_normalization=False)
    data = DataConfig(n_samples_per_prompt=len(rewards))
    _, adv = ours(r, data, loss)
    _, raw = ours(r, data, replace(loss, normalize_advantages=False))
    live = np.concatenate([a[m.astype(bool)] for a, m in zip(adv, masks)])
    var = np.concatenate([a[m.astype(bool)] for a, m in zip(raw, masks)]).var(ddof=1)
    if var < 1e-4:  # (x - mean) / sqrt(var + 1e-8): the epsilon shows below that
        return
    assert live.mean() == pytest.approx(0.0, abs=1e-4)
    assert live.var(ddof=1) == pytest.approx(1.0, rel=1e-3)
