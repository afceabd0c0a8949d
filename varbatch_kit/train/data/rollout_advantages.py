"""slime's advantages for the engine's training data: per-sample rewards to per-token advantages.

What slime 624b824 does, in three stages, each computed here with the pure
functions of :mod:`varbatch_kit.report.objective` (checked against vectors
recorded from slime, ``tests/golden/objective/``):

1. **Reward post-processing** (slime's ``RolloutManager._post_process_rewards``),
   :func:`post_processed_rewards`: on the per-*sample* rewards (a multi-turn
   rollout's samples each keep their own), for the estimators of
   :data:`~varbatch_kit.report.objective.GROUP_NORMALIZED_ESTIMATORS` with
   ``loss.rewards_normalization``: subtract the group mean, and for grpo / gspo / cispo with
   ``loss.grpo_std_normalization`` divide by the group's unbiased std + 1e-6
   (float32). The groups (:func:`reward_groups`):

   - ``loss.advantage_grouping="slime"`` (the default, slime's rule):
     consecutive groups of ``data.n_samples_per_prompt`` samples *only when*
     the batch holds exactly ``rollout_batch_size * n_samples_per_prompt``
     samples, else the whole batch is one group (whenever a rollout emits
     several samples, or prompt groups differ in size). ``data.rollout_batch_size``
     None means :func:`default_rollout_batch_size`: the number of distinct
     ``group_index`` values when the rollouts carry that column, else the
     number of rollouts // ``n_samples_per_prompt``;
   - ``"prompt"``: the samples of one ``group_index`` value form a group,
     wherever they sit in the batch (GRPO's intended prompt group).

   A group of one sample has no std: where slime would give NaN advantages,
   :func:`check_reward_groups` raises a ValueError instead.

2. **Advantages and returns** (slime's ``compute_advantages_and_returns``),
   :func:`token_advantages`: per ``loss.advantage_estimator``, grpo / gspo /
   cispo put the sample's scalar on every response token; reinforce_plus_plus
   puts ``-kl_coef * kl`` on every loss token, adds the scalar at the last
   loss token and takes ``gamma``-discounted returns; reinforce_plus_plus_baseline
   gives ``scalar - kl_coef * kl``. The KL is slime's: ``approx_kl`` of
   ``kl_loss_type`` between the old log-probs (the log-prob pass's, or the
   rollout log-probs with ``use_rollout_logprobs``) and the reference log-probs,
   *without* the importance ratio; zeros when ``kl_coef == 0``.

3. **Whitening** (``--normalize-advantages``): the masked mean and unbiased
   variance over every loss token of the whole rollout batch (slime reduces
   them over its DP x CP group, which holds the whole batch).

A given ``advantage`` column (:attr:`RolloutData.given_advantages
<varbatch_kit.train.data.rollout_data.RolloutData>`) replaces stages 1-2: its value on
every response token of the sample; stage 3 still applies.

Two differences from slime, both where slime would fail: the NaN of a
one-sample group (a ValueError here), and reinforce_plus_plus on a fully
masked sample (slime asserts; here the sample's returns are 0: it has no loss
token, so its advantages never reach the loss, and the other samples' returns
are slime's).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.report import objective as obj
from varbatch_kit.report.objective import GROUP_NORMALIZED_ESTIMATORS, STD_NORMALIZED_ESTIMATORS

__all__ = [
    "check_reward_groups",
    "is_missing",
    "default_rollout_batch_size",
    "post_processed_rewards",
    "reward_groups",
    "token_advantages",
]

#: estimators whose advantages use the KL to the reference (``kl_coef``)
KL_SHAPED_ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")


def is_missing(v: Any) -> bool:
    """A cell of ``Rollouts.extra`` that holds no value: None, NaN, ``pd.NA`` or ``pd.NaT``
    (a list of tokens is a value)."""
    if v is None:
        return True
    if isinstance(v, float) and v != v:
        return True
    import pandas as pd

    return v is pd.NA or v is pd.NaT


def _group_index(rollouts: Rollouts) -> list | None:
    """The ``group_index`` column of ``Rollouts.extra``, or None when absent or all missing."""
    extra = getattr(rollouts, "extra", None)
    if extra is None or "group_index" not in extra.columns:
        return None
    values = extra["group_index"].tolist()
    if all(is_missing(v) for v in values):
        return None
    return values


def default_rollout_batch_size(rollouts: Rollouts, n_samples_per_prompt: int) -> int:
    """slime's ``rollout_batch_size`` (prompts per rollout batch) when not given.

    The number of distinct ``group_index`` values when ``Rollouts.extra`` has
    that column, else ``num_rollouts // n_samples_per_prompt``.
    """
    labels = _group_index(rollouts)
    if labels is not None:
        return len({str(v) for v in labels if not is_missing(v)})
    return rollouts.num_rollouts // int(n_samples_per_prompt)


def _cfg(data, loss):
    if data is None or loss is None:
        raise ValueError("pass the DataConfig (data_cfg / data=) and the LossConfig (loss=): the "
                         "reward groups depend on n_samples_per_prompt, rollout_batch_size and "
                         "advantage_grouping")
    return data, loss


def reward_groups(rollouts: Rollouts, *, data, loss) -> tuple[np.ndarray, int | None]:
    """The reward-normalisation group of every sample: ``(group_of_sample, slime_group_size)``.

    ``group_of_sample`` is int64, groups numbered 0, 1, ... in order of first
    appearance. ``slime_group_size`` is ``n_samples_per_prompt`` when slime's
    rule splits the batch into consecutive groups, else None (one group, or
    prompt grouping). See the module docstring; ``"prompt"`` grouping without a
    ``group_index`` column (or with a sample missing it) is a ValueError.
    """
    data, loss = _cfg(data, loss)
    n = len(rollouts)
    if loss.advantage_grouping == "prompt":
        labels = _group_index(rollouts)
        if labels is None:
            raise ValueError(
                "loss.advantage_grouping='prompt' groups the samples by the 'group_index' "
                "column of Rollouts.extra, but the rollouts have none; give each sample its "
                "prompt's group_index, or use advantage_grouping='slime'")
        number: dict[str, int] = {}
        out = np.empty(n, dtype=np.int64)
        for i, v in enumerate(labels):
            if is_missing(v):
                raise ValueError(
                    f"Rollouts.extra['group_index'] is missing for sample {i} (of {n}); "
                    "loss.advantage_grouping='prompt' needs every sample's prompt group")
            out[i] = number.setdefault(str(v), len(number))
        return out, None
    size = int(data.n_samples_per_prompt)
    rbs = data.rollout_batch_size
    if rbs is None:
        rbs = default_rollout_batch_size(rollouts, size)
    if n == size * int(rbs):
        return np.arange(n, dtype=np.int64) // size, size
    return np.zeros(n, dtype=np.int64), None


def _divides_by_std(loss) -> bool:
    return (loss.rewards_normalization and loss.advantage_estimator in STD_NORMALIZED_ESTIMATORS
            and loss.grpo_std_normalization)


def check_reward_groups(groups: np.ndarray, *, data, loss) -> None:
    """ValueError when a one-sample group would be divided by its (undefined) std.

    slime's advantages are NaN there; only grpo / gspo / cispo with both
    ``rewards_normalization`` and ``grpo_std_normalization`` divide by the std.
    """
    data, loss = _cfg(data, loss)
    if not _divides_by_std(loss) or groups.size == 0:
        return
    counts = np.bincount(groups)
    if (counts == 1).any():
        g = int(np.flatnonzero(counts == 1)[0])
        i = int(np.flatnonzero(groups == g)[0])
        rule = ("group_index groups (loss.advantage_grouping='prompt')"
                if loss.advantage_grouping == "prompt" else
                f"slime's rule with data.n_samples_per_prompt={data.n_samples_per_prompt} and "
                f"rollout_batch_size={data.rollout_batch_size} on {groups.size} samples")
        raise ValueError(
            f"sample {i} is alone in its reward group ({rule}): the std of one reward is "
            f"undefined (slime's advantages would be NaN with advantage_estimator="
            f"{loss.advantage_estimator!r}); set data.n_samples_per_prompt to the group size "
            "(>= 2), or loss.grpo_std_normalization=False, or group by prompt")


def post_processed_rewards(sample_reward: Sequence[float], rollouts: Rollouts, *, loss,
                           data_cfg) -> np.ndarray:
    """slime's ``_post_process_rewards`` on per-sample rewards: float64 of the float32 values.

    Raw rewards (as float32) for estimators slime does not normalise or with
    ``rewards_normalization`` off; else group-normalised over
    :func:`reward_groups`.
    """
    rewards = np.asarray(sample_reward, dtype=np.float64)
    if rewards.shape != (len(rollouts),):
        raise ValueError(f"{rewards.size} rewards for {len(rollouts)} samples; give one per "
                         "sample")
    if loss.advantage_estimator not in GROUP_NORMALIZED_ESTIMATORS or \
            not loss.rewards_normalization:
        return torch.tensor(rewards.tolist(), dtype=torch.float32).double().numpy()
    groups, size = reward_groups(rollouts, data=data_cfg, loss=loss)
    check_reward_groups(groups, data=data_cfg, loss=loss)
    std = _divides_by_std(loss)
    if loss.advantage_grouping == "slime":
        return np.asarray(obj.normalize_group_rewards(rewards.tolist(), size, divide_by_std=std))
    out = np.empty(rewards.size)
    order = np.argsort(groups, kind="stable")  # each group's samples in batch order
    bounds = np.cumsum(np.bincount(groups))[:-1]
    for members in np.split(order, bounds):
        out[members] = obj.normalize_group_rewards(rewards[members].tolist(), None,
                                                   divide_by_std=std)
    return out


def _as_tensors(values, what: str, lengths: np.ndarray) -> list[torch.Tensor]:
    if len(values) != lengths.size:
        raise ValueError(f"{what} has {len(values)} entries for {lengths.size} samples; give "
                         "one per sample")
    out = []
    for i, (v, n) in enumerate(zip(values, lengths, strict=True)):
        t = v if torch.is_tensor(v) else torch.tensor(np.asarray(v, dtype=np.float64))
        if t.ndim != 1 or t.numel() != int(n):
            raise ValueError(f"{what}[{i}] has shape {tuple(t.shape)} but response_len[{i}] = "
                             f"{int(n)}: give one value per response token")
        out.append(t)
    return out


def _kl(data, rollouts: Rollouts, loss, log_probs, ref_log_probs) -> list[torch.Tensor]:
    """slime's per-token KL for the advantages (float32), zeros without ``kl_coef``."""
    lengths = rollouts.response_len
    zeros = [torch.zeros(int(n), dtype=torch.float32) for n in lengths]
    if loss.kl_coef == 0 or loss.advantage_estimator not in KL_SHAPED_ESTIMATORS:
        return zeros
    if loss.use_rollout_logprobs:
        log_probs, which = data.rollout_log_probs, "the rollout log-probs (use_rollout_logprobs)"
    else:
        which = "log_probs (the old log-probs of the log-prob pass)"
    if log_probs is None or ref_log_probs is None:
        missing = which if log_probs is None else "ref_log_probs (the reference model's)"
        raise ValueError(
            f"loss.kl_coef={loss.kl_coef} shapes the {loss.advantage_estimator} advantages "
            f"with the KL to the reference model, but {missing} are not given; pass them, or "
            "set kl_coef=0")
    lp = _as_tensors(log_probs, "log_probs", lengths)
    ref = _as_tensors(ref_log_probs, "ref_log_probs", lengths)
    return [obj.approx_kl(a, b, loss.kl_loss_type) for a, b in zip(lp, ref, strict=True)]


class _SampleView:
    """The per-sample fields :func:`token_advantages` reads, for a subset of the samples."""

    def __init__(self, data, idx: np.ndarray):
        def pick(values):
            return None if values is None else [values[int(i)] for i in idx]

        self.sample_reward = np.asarray(data.sample_reward)[idx]
        given = getattr(data, "given_advantages", None)
        self.given_advantages = None if given is None else np.asarray(given)[idx]
        self.rollout_log_probs = pick(getattr(data, "rollout_log_probs", None))


def token_advantages(data, rollouts: Rollouts, *, loss, data_cfg, samples=None, log_probs=None,
                     ref_log_probs=None) -> list[np.ndarray]:
    """slime's per-token advantages of every sample: one float64 per response token.

    ``samples`` (optional): the indices of one rollout batch's samples; the
    advantages are then computed over those samples alone (their reward groups,
    their whitening), returned in that order, and ``log_probs`` /
    ``ref_log_probs`` are given in that order too.

    ``data`` is the :func:`~varbatch_kit.train.data.rollout_data.make_training_data` result
    (``sample_reward``, ``given_advantages``, ``rollout_log_probs``);
    ``loss`` a :class:`~varbatch_kit.train.config.sub_configs.LossConfig`, ``data_cfg`` a
    :class:`~varbatch_kit.train.config.sub_configs.DataConfig`; ``log_probs`` /
    ``ref_log_probs`` the old and reference log-probs per sample (one per
    response token), needed only for the KL of ``kl_coef > 0`` with the
    reinforce_plus_plus estimators. Loss masks are ``rollouts.masks()``. See
    the module docstring for the stages.
    """
    if samples is not None:
        idx = np.asarray(samples, dtype=np.int64)
        rollouts, data = rollouts.subset(idx), _SampleView(data, idx)
    masks = [torch.as_tensor(m, dtype=torch.float32) for m in rollouts.masks()]
    given = getattr(data, "given_advantages", None)
    if given is not None:
        adv = [torch.full((int(n),), float(a), dtype=torch.float64)
               for a, n in zip(given, rollouts.response_len, strict=True)]
    else:
        scalars = post_processed_rewards(data.sample_reward, rollouts, loss=loss,
                                         data_cfg=data_cfg)
        kl = _kl(data, rollouts, loss, log_probs, ref_log_probs)
        if loss.advantage_estimator == "reinforce_plus_plus":
            live = [i for i, m in enumerate(masks) if bool(m.any())]
            adv = [torch.zeros_like(k) for k in kl]
            returns = obj.reinforce_pp_returns(scalars[live].tolist(), [kl[i] for i in live],
                                               [masks[i] for i in live], loss.kl_coef,
                                               loss.gamma)
            for i, r in zip(live, returns, strict=True):
                adv[i] = r
        else:
            adv, _ = obj.estimate_advantages(loss.advantage_estimator, scalars.tolist(), kl,
                                             masks, kl_coef=loss.kl_coef, gamma=loss.gamma)
    if loss.normalize_advantages:
        flat = obj.masked_whiten(torch.cat(adv), torch.cat(masks), all_reduce=False)
        adv = list(torch.split(flat, [a.numel() for a in adv]))
    out = []
    for a in adv:
        arr = a.detach().double().numpy().copy()
        arr.setflags(write=False)
        out.append(arr)
    return out
