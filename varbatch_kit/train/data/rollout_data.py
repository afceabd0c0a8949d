"""Training data for a :class:`~varbatch_kit.Rollouts` batch: real token sequences, or a toy task.

This module reads and checks what the engine trains on; the advantages are
computed from it by :func:`varbatch_kit.train.data.rollout_advantages.token_advantages`
(slime's reward post-processing, estimator and whitening).

Real data (:func:`rollout_training_data`)
----------------------------------------
When the rollouts carry per-sample ``tokens`` (a column of
``Rollouts.extra``: a JSONL / Parquet column of that name, or a slime dump's
``tokens``), the engine trains on them: ``tokens[i]`` holds the prompt and
the response token ids, ``prompt_len[i] + response_len[i]`` of them, each in
``[0, vocab_size)`` (``data.token_id_map="modulo"`` maps larger ids into
it, ``id % vocab_size``: real dumps on a toy model; off by default). Per
sample, from ``Rollouts.extra``:

- ``reward``: a number, or a dict of numbers (``{"acc": 1.0, "fmt": 0.5}``,
  as slime dumps and JSONL traces give them), of which ``loss.reward_key``
  picks one (slime's ``--reward-key``). Dict rewards without ``reward_key``,
  or a ``reward_key`` a sample lacks, are ValueErrors listing the keys;
- ``advantage`` (optional): given advantages, used as they are (every
  response token of the sample gets the value; the rewards are then only
  reported, and may be missing);
- ``rollout_log_probs`` (or the legacy ``old_logprobs``; the first present
  wins): the rollout engine's log-prob of every response token, for TIS,
  ``use_rollout_logprobs`` and ``train_rollout_logprob_abs_diff``. A loss that
  needs them (``loss.use_tis`` or ``loss.use_rollout_logprobs``) without
  them is a ValueError before any worker starts;
- ``group_index`` (optional): the prompt group of the sample, for
  ``loss.advantage_grouping="prompt"`` and the default ``rollout_batch_size``
  (:mod:`varbatch_kit.train.data.rollout_advantages`). All samples of a rollout must
  share one.

Neither ``advantage`` nor ``reward``: a ValueError. Everything is checked at
the boundary by :func:`validate_rollout_data` with ValueErrors naming the
sample and column.

The toy task (:func:`make_toy_data`, the fallback without ``tokens``)
----------------------------------------------------------------------
The rule to learn: **the next token is the previous token plus one** (modulo
the vocabulary). Every rollout has a hidden quality ``q``, 0.9 or 0.1 with
equal odds (a good or a sloppy rollout); each of its response tokens follows
the rule with probability ``q`` and is a uniformly random token otherwise
(prompts are random tokens).
The reward of a rollout is the fraction of its loss-bearing response tokens,
over all of its samples, that follow the rule; each sample's reward is its
rollout's. The advantages then take the same path as real rewards (slime's
group normalisation over samples, the estimator, optional whitening), so
good rollouts get positive advantages and sloppy ones negative: a
policy-gradient step pushes the model towards the rule, and the negative
log-likelihood of rule-following tokens falls as it learns.

Everything is seeded per rollout from ``(seed, rollout_id)``: a rollout's
tokens do not depend on which other rollouts are in the batch, nor on the
parallel layout.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from varbatch_kit.checks import positive_int
from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.train.data.rollout_advantages import (
    check_reward_groups,
    is_missing,
    reward_groups,
)

__all__ = [
    "ROLLOUT_LOGPROB_COLUMNS",
    "RolloutData",
    "ToyData",
    "has_tokens",
    "make_toy_data",
    "make_training_data",
    "rollout_training_data",
    "sample_rewards",
    "validate_rollout_data",
]

#: columns of ``Rollouts.extra`` read as the rollout engine's log-probs, first one present wins
#: (``old_logprobs`` is the name older traces use)
ROLLOUT_LOGPROB_COLUMNS = ("rollout_log_probs", "old_logprobs")


def _configs(data, loss):
    from varbatch_kit.train.config.sub_configs import DataConfig, LossConfig

    if not isinstance(data, DataConfig):
        raise ValueError(f"data={data!r}: give a DataConfig (n_samples_per_prompt, "  # noqa: TRY004
                         "rollout_batch_size)")
    if not isinstance(loss, LossConfig):
        raise ValueError(f"loss={loss!r}: give a LossConfig (advantage_estimator, "  # noqa: TRY004
                         "reward_key, ...)")
    return data, loss


@dataclass(frozen=True, eq=False)
class ToyData:
    """Token sequences and rewards of the toy task for every sample of a batch.

    Attributes
    ----------
    tokens:
        ``tokens[i]``: int64 array of ``prompt_len[i] + response_len[i]`` tokens.
    follows_rule:
        ``follows_rule[i]``: bool per response token of sample i.
    rollout_ids, rollout_reward:
        Per rollout, in order of first appearance.
    sample_reward:
        Per sample: its rollout's reward.
    group_of_sample:
        The reward-normalisation group of every sample
        (:func:`varbatch_kit.train.data.rollout_advantages.reward_groups`).
    rollout_log_probs, given_advantages:
        None: the toy task has no behaviour policy and no given advantages.
    """

    tokens: list[np.ndarray]
    follows_rule: list[np.ndarray]
    rollout_ids: np.ndarray
    rollout_reward: np.ndarray
    sample_reward: np.ndarray
    group_of_sample: np.ndarray
    rollout_log_probs: list[np.ndarray] | None = None
    given_advantages: np.ndarray | None = None
    source: str = "toy"


def _rollout_rng(seed: int, rollout_id: int) -> np.random.Generator:
    # SeedSequence needs non-negative entropy; map any int64 id onto uint64 bijectively
    return np.random.default_rng(np.random.SeedSequence([int(seed), int(rollout_id) % 2**64]))


def make_toy_data(rollouts: Rollouts, *, vocab_size: int, seed: int, data, loss) -> ToyData:
    """Generate the toy task's tokens and rewards for ``rollouts`` (``data``: a DataConfig,
    ``loss``: a LossConfig, for the reward groups)."""
    data, loss = _configs(data, loss)
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    n = len(rollouts)
    tokens: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * n
    follows: list[np.ndarray] = [np.empty(0, dtype=bool)] * n
    masks = rollouts.masks()
    ids, members_of = rollouts.rollout_order()
    reward = np.zeros(ids.size)
    for k, (rid, members) in enumerate(zip(ids, members_of)):
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
    groups, _ = reward_groups(rollouts, data=data, loss=loss)
    check_reward_groups(groups, data=data, loss=loss)
    return ToyData(
        tokens=tokens,
        follows_rule=follows,
        rollout_ids=ids,
        rollout_reward=reward,
        sample_reward=reward[_rollout_position(rollouts, members_of)],
        group_of_sample=groups,
    )


def _rollout_position(rollouts: Rollouts, members_of: list[np.ndarray]) -> np.ndarray:
    """Sample -> the position of its rollout in first-appearance order."""
    pos = np.empty(len(rollouts), dtype=np.int64)
    for k, m in enumerate(members_of):
        pos[m] = k
    return pos


# --------------------------------------------------------------------------- real token data
@dataclass(frozen=True, eq=False)
class RolloutData:
    """Token sequences, rewards, given advantages and rollout log-probs from ``Rollouts.extra``.

    Same attributes as :class:`ToyData` where they overlap (the engine reads
    ``tokens``, ``sample_reward``, ``given_advantages``, ``rollout_log_probs``,
    ``rollout_ids`` and ``rollout_reward``).

    Attributes
    ----------
    tokens:
        ``tokens[i]``: int64 array, prompt + response token ids of sample i.
    rollout_ids, rollout_reward:
        Per rollout in order of first appearance. ``rollout_reward`` is the
        mean of its samples' rewards (NaN where a reward is missing, only
        allowed with given advantages): the reported ``reward``.
    sample_reward:
        Per sample, float64, after ``reward_key``.
    rollout_log_probs:
        ``rollout_log_probs[i]``: float64 per response token, or None.
    given_advantages:
        Per sample, float64, from the ``advantage`` column; or None (the
        advantages come from the rewards).
    group_of_sample:
        The reward-normalisation group of every sample
        (:func:`varbatch_kit.train.data.rollout_advantages.reward_groups`).
    """

    tokens: list[np.ndarray]
    rollout_ids: np.ndarray
    rollout_reward: np.ndarray
    sample_reward: np.ndarray
    rollout_log_probs: list[np.ndarray] | None
    given_advantages: np.ndarray | None
    group_of_sample: np.ndarray
    source: str = "rollouts"


def _extra(rollouts: Rollouts):
    return getattr(rollouts, "extra", None)


def _present(rollouts: Rollouts, column: str) -> bool:
    """``column`` is in ``Rollouts.extra`` with at least one non-missing value."""
    extra = _extra(rollouts)
    return (extra is not None and column in extra.columns
            and not all(is_missing(v) for v in extra[column].tolist()))


def has_tokens(rollouts: Rollouts) -> bool:
    """Whether the rollouts carry token sequences (a ``tokens`` column in ``Rollouts.extra``)."""
    return _present(rollouts, "tokens")


def _column(rollouts: Rollouts, column: str) -> list:
    """Every sample's value of ``column``; a ValueError naming the first missing one."""
    values = _extra(rollouts)[column].tolist()
    for i, v in enumerate(values):
        if is_missing(v):
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


def _number(v: Any, what: str) -> float:
    if isinstance(v, bool):
        v = float(v)
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"{what} = {v!r:.80} is not a number") from None
    if not math.isfinite(x):
        raise ValueError(f"{what} = {v!r} is not finite")
    return x


def _scalars(rollouts: Rollouts, column: str, *, allow_missing: bool = False) -> np.ndarray:
    """Every sample's number in ``column`` (missing -> NaN when ``allow_missing``)."""
    values = _extra(rollouts)[column].tolist() if allow_missing else _column(rollouts, column)
    out = np.empty(len(values))
    for i, v in enumerate(values):
        out[i] = np.nan if allow_missing and is_missing(v) else _number(
            v, f"Rollouts.extra[{column!r}][{i}]")
    return out


def _keys(values: list) -> list[str]:
    keys: dict[str, None] = {}
    for v in values:
        if isinstance(v, Mapping):
            keys.update(dict.fromkeys(map(str, v)))
    return list(keys)


def sample_rewards(rollouts: Rollouts, *, reward_key: str | None,
                   allow_missing: bool = False) -> np.ndarray:
    """Every sample's reward (float64) from the ``reward`` column, after ``reward_key``.

    A missing reward is NaN with ``allow_missing``, else a ValueError; dict
    rewards need ``reward_key`` (the key of the number to train on).
    """
    values = _extra(rollouts)["reward"].tolist()
    out = np.empty(len(values))
    for i, v in enumerate(values):
        if is_missing(v):
            if allow_missing:
                out[i] = np.nan
                continue
            raise ValueError(
                f"Rollouts.extra['reward'] is missing for sample {i} (of {len(values)}); "
                "give every sample a 'reward' value, or drop the column")
        if reward_key is None:
            if isinstance(v, Mapping):
                raise ValueError(
                    f"Rollouts.extra['reward'][{i}] is a dict reward with keys {_keys(values)}; "
                    "set loss.reward_key to the key to train on (slime's --reward-key)")
            out[i] = _number(v, f"Rollouts.extra['reward'][{i}]")
            continue
        if not isinstance(v, Mapping):
            raise ValueError(
                f"loss.reward_key={reward_key!r} picks a key of dict rewards, but "
                f"Rollouts.extra['reward'][{i}] = {v!r:.80} is not a dict; set "
                "loss.reward_key=None for plain rewards")
        if reward_key not in v:
            raise ValueError(
                f"loss.reward_key={reward_key!r} is not a key of the reward of sample {i}; its "
                f"keys are {sorted(map(str, v))}")
        out[i] = _number(v[reward_key], f"Rollouts.extra['reward'][{i}][{reward_key!r}]")
    return out


def _check_group_index(rollouts: Rollouts, ids: np.ndarray, members_of: list) -> None:
    """All samples of a rollout share one ``group_index`` (the prompt of the rollout)."""
    labels = _column(rollouts, "group_index")
    for k, m in enumerate(members_of):
        mine = {str(labels[int(i)]) for i in m}
        if len(mine) > 1:
            raise ValueError(
                f"rollout {int(ids[k])}: its samples {m.tolist()} have different "
                f"group_index values {sorted(mine)}; a rollout belongs to one prompt group")


def _rollout_log_probs(rollouts: Rollouts) -> list[np.ndarray] | None:
    for column in ROLLOUT_LOGPROB_COLUMNS:
        if _present(rollouts, column):
            out = []
            for i, v in enumerate(_column(rollouts, column)):
                arr = _float_array(v, f"Rollouts.extra[{column!r}][{i}]")
                if arr.size != int(rollouts.response_len[i]):
                    raise ValueError(
                        f"Rollouts.extra[{column!r}][{i}] has {arr.size} log-probs but "
                        f"response_len[{i}] = {int(rollouts.response_len[i])}: give one per "
                        "response token")
                arr.setflags(write=False)
                out.append(arr)
            return out
    return None


def _check_needs(rollouts: Rollouts, loss, rollout_log_probs) -> None:
    if loss.needs_rollout_logprobs and rollout_log_probs is None:
        flags = [f for f in ("use_tis", "use_rollout_logprobs") if getattr(loss, f)]
        raise ValueError(
            f"loss.{flags[0]}=True needs the rollout engine's log-probs, but the rollouts carry "
            f"no {' / '.join(repr(c) for c in ROLLOUT_LOGPROB_COLUMNS)} column in "
            "Rollouts.extra (one float per response token); give them, or turn "
            f"{' and '.join(flags)} off")


def rollout_training_data(rollouts: Rollouts, *, vocab_size: int, data, loss) -> RolloutData:
    """Read and check the token sequences, rewards, advantages and log-probs of ``rollouts``.

    ``data`` is a DataConfig, ``loss`` a LossConfig. See the module docstring
    for the columns. Raises ValueError naming the sample and column for:
    missing tokens, a token sequence whose length is not ``prompt_len +
    response_len``, token ids outside ``[0, vocab_size)``, non-finite rewards
    / advantages / log-probs, log-probs whose length is not ``response_len``,
    dict rewards without (or lacking) ``reward_key``, a rollout whose samples
    disagree on ``group_index``, neither ``advantage`` nor ``reward`` given,
    and rollout log-probs missing where the loss needs them.
    """
    data, loss = _configs(data, loss)
    vocab_size = positive_int("vocab_size", vocab_size, whole_floats=True)
    if not has_tokens(rollouts):
        raise ValueError(
            "the rollouts carry no token sequences: Rollouts.extra needs a 'tokens' column "
            "(prompt + response token ids per sample)")
    tokens: list[np.ndarray] = []
    for i, seq in enumerate(_column(rollouts, "tokens")):
        arr = _int_array(seq, f"tokens of sample {i}")
        want = int(rollouts.total_len[i])
        if arr.size != want:
            raise ValueError(
                f"tokens of sample {i} has {arr.size} ids but prompt_len + response_len = "
                f"{int(rollouts.prompt_len[i])} + {int(rollouts.response_len[i])} = {want}; "
                "the lengths and the token sequence must agree")
        if data.token_id_map == "modulo" and (arr >= 0).all():  # a negative id stays an error
            arr = arr % vocab_size
        bad = (arr < 0) | (arr >= vocab_size)
        if bad.any():
            j = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"tokens of sample {i}: id {int(arr[j])} at position {j} is outside the model's "
                f"vocabulary [0, {vocab_size}); tokenise with the model's tokenizer (or raise "
                "vocab_size for the toy model, or map the ids into it with "
                "DataConfig(token_id_map='modulo'))")
        arr.setflags(write=False)
        tokens.append(arr)

    ids, members_of = rollouts.rollout_order()
    if _present(rollouts, "group_index"):
        _check_group_index(rollouts, ids, members_of)
    has_reward = _present(rollouts, "reward")
    given = _scalars(rollouts, "advantage") if _present(rollouts, "advantage") else None
    if has_reward:  # only reported when the advantages are given: missing rewards are NaN then
        sample_reward = sample_rewards(rollouts, reward_key=loss.reward_key,
                                       allow_missing=given is not None)
    elif given is not None:
        sample_reward = np.full(len(rollouts), np.nan)
    else:
        raise ValueError(
            "the rollouts carry tokens but neither an 'advantage' column nor a 'reward' "
            "column in Rollouts.extra: give per-sample advantages, or rewards (normalised as "
            "slime does, see varbatch_kit.train.data.rollout_advantages)")
    groups, _ = reward_groups(rollouts, data=data, loss=loss)
    if given is None:
        check_reward_groups(groups, data=data, loss=loss)
    log_probs = _rollout_log_probs(rollouts)
    _check_needs(rollouts, loss, log_probs)
    for a in (sample_reward, groups) + (() if given is None else (given,)):
        a.setflags(write=False)
    return RolloutData(
        tokens=tokens,
        rollout_ids=ids,
        rollout_reward=np.array([sample_reward[m].mean() for m in members_of]),
        sample_reward=sample_reward,
        rollout_log_probs=log_probs,
        given_advantages=given,
        group_of_sample=groups,
    )


def validate_rollout_data(rollouts: Rollouts, *, vocab_size: int, data, loss) -> None:
    """Check the training data of ``rollouts`` for ``data`` / ``loss``; ValueError if bad.

    The check the launcher runs before starting workers: the real data
    (:func:`rollout_training_data` without keeping the result) or, for the toy
    task, its reward groups and that the loss does not need rollout log-probs.
    """
    data, loss = _configs(data, loss)
    if has_tokens(rollouts):
        rollout_training_data(rollouts, vocab_size=vocab_size, data=data, loss=loss)
        return
    _check_needs(rollouts, loss, None)
    groups, _ = reward_groups(rollouts, data=data, loss=loss)
    check_reward_groups(groups, data=data, loss=loss)


def make_training_data(rollouts: Rollouts, *, vocab_size: int, seed: int, data,
                       loss) -> RolloutData | ToyData:
    """The data the engine trains on: the rollouts' own tokens, else the toy task (seeded by
    ``seed``). ``data``: a DataConfig, ``loss``: a LossConfig."""
    if has_tokens(rollouts):
        return rollout_training_data(rollouts, vocab_size=vocab_size, data=data, loss=loss)
    data, loss = _configs(data, loss)
    _check_needs(rollouts, loss, None)
    return make_toy_data(rollouts, vocab_size=vocab_size, seed=seed, data=data, loss=loss)
