"""A deterministic, learnable toy RL task over a :class:`~varbatch_kit.Rollouts` batch.

The rule to learn: **the next token is the previous token plus one** (modulo
the vocabulary). Every rollout has a hidden quality ``q``, 0.9 or 0.1 with
equal odds (a good or a sloppy rollout); each of its response tokens follows
the rule with probability ``q`` and is a uniformly random token otherwise
(prompts are random tokens).
The reward of a rollout is the fraction of its loss-bearing response tokens,
over all of its samples, that follow the rule.

Advantages are GRPO-style: rollouts, in order of first appearance, form groups
of ``n_samples_per_prompt``; a rollout's advantage is its reward minus the
group mean, divided by the group's (unbiased) standard deviation plus 1e-6. A
group of one rollout (a trailing remainder) gets advantage 0. Every sample of
a rollout shares its rollout's advantage.

A policy-gradient step on ``-advantage * log p(response token)`` pushes the
model towards the rule (good rollouts follow it more often), so the
policy-gradient loss decreases as the model learns to tell the rule from
noise; the negative log-likelihood of rule-following tokens falls too.

Everything is seeded per rollout from ``(seed, rollout_id)``: a rollout's
tokens do not depend on which other rollouts are in the batch, nor on the
parallel layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from varbatch_kit.core.rollouts import Rollouts

__all__ = ["ToyData", "grpo_advantages", "make_toy_data"]


@dataclass(frozen=True, eq=False)
class ToyData:
    """Token sequences, rewards and advantages for every sample of a batch.

    Attributes
    ----------
    tokens:
        ``tokens[i]``: int64 array of ``prompt_len[i] + response_len[i]`` tokens.
    follows_rule:
        ``follows_rule[i]``: bool per response token of sample i.
    rollout_ids:
        Rollout ids in order of first appearance.
    rollout_reward, rollout_advantage:
        Per rollout (same order as ``rollout_ids``).
    sample_advantage, sample_reward:
        Per sample (each sample carries its rollout's value).
    """

    tokens: list[np.ndarray]
    follows_rule: list[np.ndarray]
    rollout_ids: np.ndarray
    rollout_reward: np.ndarray
    rollout_advantage: np.ndarray
    sample_reward: np.ndarray
    sample_advantage: np.ndarray


def _rollout_rng(seed: int, rollout_id: int) -> np.random.Generator:
    # SeedSequence needs non-negative entropy; map any int64 id onto uint64 bijectively
    return np.random.default_rng(np.random.SeedSequence([int(seed), int(rollout_id) % 2**64]))


def grpo_advantages(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """Group-normalised advantages over consecutive groups of ``group_size`` rewards.

    ``(r - mean) / (std + 1e-6)`` with the unbiased standard deviation; groups
    of one get 0.
    """
    if isinstance(group_size, bool) or int(group_size) != group_size or group_size < 1:
        raise ValueError(f"n_samples_per_prompt must be a positive integer, got {group_size!r}")
    rewards = np.asarray(rewards, dtype=np.float64)
    adv = np.zeros_like(rewards)
    for lo in range(0, rewards.size, int(group_size)):
        g = rewards[lo:lo + int(group_size)]
        if g.size > 1:
            adv[lo:lo + g.size] = (g - g.mean()) / (g.std(ddof=1) + 1e-6)
    return adv


def make_toy_data(
    rollouts: Rollouts, *, vocab_size: int, seed: int, n_samples_per_prompt: int
) -> ToyData:
    """Generate the toy task's tokens, rewards and advantages for ``rollouts``."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    n = len(rollouts)
    tokens: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * n
    follows: list[np.ndarray] = [np.empty(0, dtype=bool)] * n
    masks = rollouts.masks()
    ids, groups = rollouts.rollout_order()
    reward = np.zeros(ids.size)
    for k, (rid, members) in enumerate(zip(ids, groups)):
        rng = _rollout_rng(seed, rid)
        quality = 0.9 if rng.random() < 0.5 else 0.1
        hits = total = 0
        for i in members:
            p, r = int(rollouts.prompt_len[i]), int(rollouts.response_len[i])
            seq = np.empty(p + r, dtype=np.int64)
            seq[:p] = rng.integers(0, vocab_size, size=p)
            keep = rng.random(r) < quality
            noise = rng.integers(0, vocab_size, size=r)
            for j in range(r):
                prev = seq[p + j - 1] if p + j > 0 else 0
                seq[p + j] = (prev + 1) % vocab_size if keep[j] else noise[j]
            prev = np.concatenate([[seq[p - 1] if p > 0 else -1], seq[p:p + r - 1]])
            ok = seq[p:] == (prev + 1) % vocab_size
            tokens[i], follows[i] = seq, ok
            m = masks[i].astype(bool)
            hits += int(ok[m].sum())
            total += int(m.sum())
        reward[k] = hits / total if total else 0.0
    adv = grpo_advantages(reward, n_samples_per_prompt)
    # sample -> its rollout's position in first-appearance order
    pos = np.empty(n, dtype=np.int64)
    for k, members in enumerate(groups):
        pos[members] = k
    return ToyData(
        tokens=tokens,
        follows_rule=follows,
        rollout_ids=ids,
        rollout_reward=reward,
        rollout_advantage=adv,
        sample_reward=reward[pos],
        sample_advantage=adv[pos],
    )
