"""Training data for a :class:`~varbatch_kit.Rollouts` batch: real token sequences, or a toy task.

Real data (:func:`rollout_training_data`)
----------------------------------------
When the rollouts carry per-sample ``tokens`` (a column of
``Rollouts.extra``: a JSONL / Parquet column of that name, or a slime dump's
``tokens``), the engine trains on them: ``tokens[i]`` holds the prompt and
the response token ids, ``prompt_len[i] + response_len[i]`` of them, each in
``[0, vocab_size)``. Advantages, per sample:

1. the ``advantage`` column when present;
2. else GRPO group-normalised rewards (the ``reward`` column): a rollout's
   reward is the mean of its samples' rewards; rollouts form prompt groups
   by the ``group_index`` column when present (all samples of a rollout must
   share one), else consecutive groups of ``n_samples_per_prompt`` rollouts in
   order of first appearance; a rollout's advantage is ``(r - mean(group)) /
   (std(group) + 1e-6)`` (unbiased std; a group of one gets 0), shared by all
   of its samples;
3. else a ValueError naming what is missing.

Old log-probs (an ``old_logprobs`` or ``rollout_log_probs`` column, one
float per response token) switch the loss to PPO's clipped surrogate
(:mod:`varbatch_kit.report.objective`). Everything is checked at the boundary by
:func:`validate_rollout_data` with ValueErrors naming the sample and column.

The toy task (:func:`make_toy_data`, the fallback without ``tokens``)
----------------------------------------------------------------------
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

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from varbatch_kit.checks import positive_int
from varbatch_kit.core.rollouts import Rollouts

__all__ = [
    "OLD_LOGPROB_COLUMNS",
    "RolloutData",
    "ToyData",
    "group_advantages",
    "grpo_advantages",
    "has_tokens",
    "make_toy_data",
    "make_training_data",
    "rollout_training_data",
    "validate_rollout_data",
]

#: columns of ``Rollouts.extra`` read as old (behaviour-policy) log-probs, first one present wins
OLD_LOGPROB_COLUMNS = ("old_logprobs", "rollout_log_probs")


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
    #: the toy task has no behaviour policy: the loss is on-policy
    old_logprobs: list[np.ndarray] | None = None
    source: str = "toy"
    rollout_log_probs = None


def _rollout_rng(seed: int, rollout_id: int) -> np.random.Generator:
    # SeedSequence needs non-negative entropy; map any int64 id onto uint64 bijectively
    return np.random.default_rng(np.random.SeedSequence([int(seed), int(rollout_id) % 2**64]))


def grpo_advantages(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """Group-normalised advantages over consecutive groups of ``group_size`` rewards.

    ``(r - mean) / (std + 1e-6)`` with the unbiased standard deviation; groups
    of one get 0.
    """
    positive_int("n_samples_per_prompt", group_size, whole_floats=True)
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


# --------------------------------------------------------------------------- real token data
@dataclass(frozen=True, eq=False)
class RolloutData:
    """Token sequences, rewards, advantages (and old log-probs) read from ``Rollouts.extra``.

    Same attributes as :class:`ToyData` where they overlap (the training loop
    reads ``tokens``, ``sample_advantage``, ``rollout_ids``,
    ``rollout_reward`` and ``old_logprobs``).

    Attributes
    ----------
    tokens:
        ``tokens[i]``: int64 array, prompt + response token ids of sample i.
    rollout_ids, rollout_reward, rollout_advantage:
        Per rollout in order of first appearance. ``rollout_reward`` is the
        mean of the samples' rewards (NaN without a ``reward`` column);
        ``rollout_advantage`` the mean of the samples' advantages.
    sample_reward, sample_advantage:
        Per sample.
    old_logprobs:
        ``old_logprobs[i]``: float64 per response token, or None (on-policy).
    advantage_source:
        ``"advantage"`` (the column) or ``"grpo"`` (normalised rewards).
    group_of_rollout:
        The prompt group of every rollout (``rollout_ids`` order).
    """

    tokens: list[np.ndarray]
    rollout_ids: np.ndarray
    rollout_reward: np.ndarray
    rollout_advantage: np.ndarray
    sample_reward: np.ndarray
    sample_advantage: np.ndarray
    old_logprobs: list[np.ndarray] | None
    advantage_source: str
    group_of_rollout: np.ndarray
    source: str = "rollouts"

    @property
    def rollout_log_probs(self):
        return self.old_logprobs


def _extra(rollouts: Rollouts):
    return getattr(rollouts, "extra", None)


def _missing(v: Any) -> bool:
    if v is None:
        return True
    if isinstance(v, float) and math.isnan(v):
        return True
    try:
        import pandas as pd

        return v is pd.NA or v is pd.NaT
    except ImportError:  # pragma: no cover - pandas is a dependency
        return False


def _present(rollouts: Rollouts, column: str) -> bool:
    """``column`` is in ``Rollouts.extra`` with at least one non-missing value."""
    extra = _extra(rollouts)
    return (extra is not None and column in extra.columns
            and not all(_missing(v) for v in extra[column].tolist()))


def has_tokens(rollouts: Rollouts) -> bool:
    """Whether the rollouts carry token sequences (a ``tokens`` column in ``Rollouts.extra``)."""
    return _present(rollouts, "tokens")


def _column(rollouts: Rollouts, column: str) -> list:
    """Every sample's value of ``column``; a ValueError naming the first missing one."""
    values = _extra(rollouts)[column].tolist()
    for i, v in enumerate(values):
        if _missing(v):
            raise ValueError(
                f"Rollouts.extra[{column!r}] is missing for sample {i} (of {len(values)}); "
                f"give every sample a {column!r} value, or drop the column")
    return values


def _int_array(value: Any, what: str) -> np.ndarray:
    arr = np.asarray(value.tolist() if hasattr(value, "tolist") else value)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be a flat list of token ids, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if arr.dtype == bool or not np.issubdtype(arr.dtype, np.number) or not (
                np.isfinite(arr).all() and (arr == np.round(arr)).all()):
            raise ValueError(f"{what} must hold integer token ids, got dtype {arr.dtype}")
    return arr.astype(np.int64)


def _float_array(value: Any, what: str) -> np.ndarray:
    try:
        arr = np.asarray(value.tolist() if hasattr(value, "tolist") else value, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must hold numbers, got {value!r:.80}") from None
    if arr.ndim != 1:
        raise ValueError(f"{what} must be a flat list of numbers, got shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{what} holds a non-finite value (NaN or inf)")
    return arr


def _scalars(rollouts: Rollouts, column: str, *, allow_missing: bool = False) -> np.ndarray:
    """Every sample's number in ``column`` (missing -> NaN when ``allow_missing``)."""
    values = _extra(rollouts)[column].tolist() if allow_missing else _column(rollouts, column)
    out = np.empty(len(values))
    for i, v in enumerate(values):
        if allow_missing and _missing(v):
            out[i] = np.nan
            continue
        try:
            out[i] = float(v)
        except (TypeError, ValueError):
            raise ValueError(
                f"Rollouts.extra[{column!r}][{i}] = {v!r:.80} is not a number") from None
        if not math.isfinite(out[i]):
            raise ValueError(f"Rollouts.extra[{column!r}][{i}] = {v!r} is not finite")
    return out


def group_advantages(rewards: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """GRPO advantages with explicit group labels: ``(r - mean) / (std + 1e-6)`` per group.

    ``groups[k]`` is the group of reward ``k`` (any hashable labels; members
    need not be adjacent). Unbiased std; a group of one gets 0.
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    groups = np.asarray(groups)
    if groups.shape != rewards.shape:
        raise ValueError(f"{groups.size} group labels for {rewards.size} rewards")
    adv = np.zeros_like(rewards)
    _, inverse = np.unique(groups, return_inverse=True)
    for g in range(int(inverse.max()) + 1 if inverse.size else 0):
        members = np.flatnonzero(inverse == g)
        if members.size > 1:
            r = rewards[members]
            adv[members] = (r - r.mean()) / (r.std(ddof=1) + 1e-6)
    return adv


def rollout_training_data(
    rollouts: Rollouts, *, vocab_size: int, n_samples_per_prompt: int
) -> RolloutData:
    """Read and check the token sequences, advantages and old log-probs of ``rollouts``.

    See the module docstring for the columns and the advantage rules. Raises
    ValueError naming the sample and column for: missing tokens, a token
    sequence whose length is not ``prompt_len + response_len``, token ids
    outside ``[0, vocab_size)``, non-finite rewards / advantages / old
    log-probs, old log-probs whose length is not ``response_len``, a rollout
    whose samples disagree on ``group_index``, and neither ``advantage`` nor
    ``reward`` given.
    """
    vocab_size = positive_int("vocab_size", vocab_size, whole_floats=True)
    if not has_tokens(rollouts):
        raise ValueError(
            "the rollouts carry no token sequences: Rollouts.extra needs a 'tokens' column "
            "(prompt + response token ids per sample)")
    n = len(rollouts)
    tokens: list[np.ndarray] = []
    for i, seq in enumerate(_column(rollouts, "tokens")):
        arr = _int_array(seq, f"tokens of sample {i}")
        want = int(rollouts.total_len[i])
        if arr.size != want:
            raise ValueError(
                f"tokens of sample {i} has {arr.size} ids but prompt_len + response_len = "
                f"{int(rollouts.prompt_len[i])} + {int(rollouts.response_len[i])} = {want}; "
                "the lengths and the token sequence must agree")
        bad = (arr < 0) | (arr >= vocab_size)
        if bad.any():
            j = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"tokens of sample {i}: id {int(arr[j])} at position {j} is outside the model's "
                f"vocabulary [0, {vocab_size}); tokenise with the model's tokenizer (or raise "
                "vocab_size for the toy model)")
        arr.setflags(write=False)
        tokens.append(arr)

    ids, members = rollouts.rollout_order()
    pos = np.empty(n, dtype=np.int64)  # sample -> its rollout's position
    for k, m in enumerate(members):
        pos[m] = k

    # prompt groups of rollouts
    if _present(rollouts, "group_index"):
        labels = _column(rollouts, "group_index")
        group = np.empty(ids.size, dtype=object)
        for k, m in enumerate(members):
            mine = {labels[int(i)] for i in m}
            if len(mine) > 1:
                raise ValueError(
                    f"rollout {int(ids[k])}: its samples {m.tolist()} have different "
                    f"group_index values {sorted(mine, key=str)}; a rollout belongs to one "
                    "prompt group")
            group[k] = labels[int(m[0])]
        group = np.asarray([str(g) for g in group])
    else:
        size = int(n_samples_per_prompt)
        if size < 1:
            raise ValueError(f"n_samples_per_prompt must be >= 1, got {n_samples_per_prompt!r}")
        group = np.arange(ids.size) // size

    has_reward = _present(rollouts, "reward")
    given_adv = _present(rollouts, "advantage")
    if has_reward:  # only reported when the advantages are given: missing rewards are NaN then
        sample_reward = _scalars(rollouts, "reward", allow_missing=given_adv)
        rollout_reward = np.array([sample_reward[m].mean() for m in members])
    else:
        sample_reward = np.full(n, np.nan)
        rollout_reward = np.full(ids.size, np.nan)

    if given_adv:
        sample_adv = _scalars(rollouts, "advantage")
        source = "advantage"
    elif has_reward:
        sample_adv = group_advantages(rollout_reward, group)[pos]
        source = "grpo"
    else:
        raise ValueError(
            "the rollouts carry tokens but neither an 'advantage' column nor a 'reward' "
            "column in Rollouts.extra: give per-sample advantages, or rewards (normalised "
            "GRPO-style per prompt group: 'group_index', else groups of "
            f"n_samples_per_prompt={n_samples_per_prompt} rollouts)")
    rollout_adv = np.array([sample_adv[m].mean() for m in members])

    old = None
    for column in OLD_LOGPROB_COLUMNS:
        if _present(rollouts, column):
            old = []
            for i, v in enumerate(_column(rollouts, column)):
                arr = _float_array(v, f"Rollouts.extra[{column!r}][{i}]")
                if arr.size != int(rollouts.response_len[i]):
                    raise ValueError(
                        f"Rollouts.extra[{column!r}][{i}] has {arr.size} log-probs but "
                        f"response_len[{i}] = {int(rollouts.response_len[i])}: give one per "
                        "response token")
                arr.setflags(write=False)
                old.append(arr)
            break
    return RolloutData(
        tokens=tokens,
        rollout_ids=ids,
        rollout_reward=rollout_reward,
        rollout_advantage=rollout_adv,
        sample_reward=sample_reward,
        sample_advantage=sample_adv,
        old_logprobs=old,
        advantage_source=source,
        group_of_rollout=group,
    )


def validate_rollout_data(rollouts: Rollouts, *, vocab_size: int,
                          data=None, loss=None) -> None:
    n_samples_per_prompt = data.n_samples_per_prompt
    """Check the real training data of ``rollouts`` (no-op without tokens); ValueError if bad.

    The check the launcher runs before starting workers
    (:func:`rollout_training_data` without keeping the result).
    """
    if has_tokens(rollouts):
        rollout_training_data(rollouts, vocab_size=vocab_size,
                              n_samples_per_prompt=n_samples_per_prompt)


def make_training_data(
    rollouts: Rollouts, *, vocab_size: int, seed: int, data=None, loss=None
) -> RolloutData | ToyData:
    n_samples_per_prompt = data.n_samples_per_prompt
    """The data the engine trains on: the rollouts' own tokens, else the toy task."""
    if has_tokens(rollouts):
        return rollout_training_data(rollouts, vocab_size=vocab_size,
                                     n_samples_per_prompt=n_samples_per_prompt)
    return make_toy_data(rollouts, vocab_size=vocab_size, seed=seed,
                         n_samples_per_prompt=n_samples_per_prompt)
