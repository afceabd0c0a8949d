"""slime's RL-objective functions, with slime's signatures and return values.

Thin adapters over :mod:`varbatch_kit.report.objective` (pure torch math);
checked against vectors recorded from slime's own ``utils/ppo_utils.py``,
``backends/megatron_utils/loss.py`` and ``RolloutManager._post_process_rewards``
(``tests/golden/objective/``, written by ``scripts/record_slime_objective.py``).

Where slime asks ``megatron.core.mpu`` for the context-parallel size, these
functions take the non-CP path: the per-sample tensors are full responses.
Bad inputs raise :class:`SlimeCompatError` (a ``ValueError`` and an
``AssertionError``, as slime's asserts are).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from varbatch_kit.compat.slime.errors import SlimeCompatError, raises_slime_errors
from varbatch_kit.report import objective as obj
from varbatch_kit.report.objective import GROUP_NORMALIZED_ESTIMATORS, STD_NORMALIZED_ESTIMATORS

__all__ = [
    "chunked_discounted_returns",
    "compute_advantages_and_returns",
    "compute_approx_kl",
    "compute_cispo_loss",
    "compute_gspo_kl",
    "compute_opsm_mask",
    "compute_policy_loss",
    "distributed_masked_whiten",
    "get_advantages_and_returns_batch",
    "get_grpo_returns",
    "get_reinforce_plus_plus_baseline_advantages",
    "get_reinforce_plus_plus_returns",
    "icepop_function",
    "post_process_rewards",
    "vanilla_tis_function",
]



@raises_slime_errors
def compute_approx_kl(log_probs: torch.Tensor, log_probs_base: torch.Tensor, kl_loss_type: str,
                      importance_ratio: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token KL estimate (``k1``, ``k2``, ``k3``, ``low_var_kl``), float32."""
    return obj.approx_kl(log_probs, log_probs_base, kl_loss_type, weight=importance_ratio)


@raises_slime_errors
def compute_opsm_mask(args: Any, full_log_probs: list[torch.Tensor],
                      full_old_log_probs: list[torch.Tensor], advantages: list[torch.Tensor],
                      loss_masks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(opsm_mask, opsm_clipfrac)`` with the threshold ``args.opsm_delta``."""
    return obj.opsm_keep_mask(full_log_probs, full_old_log_probs, advantages, loss_masks,
                              args.opsm_delta)


@raises_slime_errors
def compute_gspo_kl(full_log_probs: list[torch.Tensor], full_old_log_probs: list[torch.Tensor],
                    local_log_probs: list[torch.Tensor],
                    loss_masks: list[torch.Tensor]) -> torch.Tensor:
    """Each sample's sequence KL repeated on its (local) tokens, concatenated."""
    seq = obj.sequence_kl(full_log_probs, full_old_log_probs, loss_masks)
    if len(local_log_probs) != len(seq):
        raise ValueError(f"local_log_probs has {len(local_log_probs)} entries for {len(seq)} "
                         "samples; pass one per sample")
    return torch.cat([kl.expand_as(x) for kl, x in zip(seq, local_log_probs, strict=True)])


@raises_slime_errors
def compute_policy_loss(ppo_kl: torch.Tensor, advantages: torch.Tensor, eps_clip: float,
                        eps_clip_high: float, eps_clip_c: float | None = None):
    """``(pg_losses, clipfrac)`` of PPO's clipped surrogate (dual clip with ``eps_clip_c``)."""
    return obj.ppo_clip_loss(ppo_kl, advantages, eps_clip, eps_clip_high, eps_clip_c)


@raises_slime_errors
def compute_cispo_loss(ppo_kl: torch.Tensor, log_probs: torch.Tensor, advantages: torch.Tensor,
                       eps_clip: float, eps_clip_high: float):
    """``(pg_losses, clipfrac)`` of CISPO."""
    return obj.cispo_loss(ppo_kl, log_probs, advantages, eps_clip, eps_clip_high)


@raises_slime_errors
def get_grpo_returns(rewards: torch.Tensor, kl: list[torch.Tensor]) -> list[torch.Tensor]:
    """Sample i's reward on every token of ``kl[i]``."""
    return obj.broadcast_advantages(rewards, kl)


@raises_slime_errors
def get_reinforce_plus_plus_returns(rewards: torch.Tensor, kl: list[torch.Tensor],
                                    loss_masks: list[torch.Tensor], response_lengths: list[int],
                                    total_lengths: list[int], kl_coef: float,
                                    gamma: float) -> list[torch.Tensor]:
    """REINFORCE++ discounted returns per sample (full responses; no CP gather).

    As slime, the returns are in the dtype of the first sample's KL.
    """
    if not len(rewards):
        return []
    dtype = kl[0].dtype if len(kl) else None
    return [x.to(dtype) for x in obj.reinforce_pp_returns(rewards, kl, loss_masks, kl_coef, gamma)]


@raises_slime_errors
def get_reinforce_plus_plus_baseline_advantages(rewards: torch.Tensor, kl: list[torch.Tensor],
                                                loss_masks: list[torch.Tensor],
                                                kl_coef: float) -> list[torch.Tensor]:
    """``reward - kl_coef * kl`` per token (``loss_masks`` is not read, as in slime)."""
    return obj.reinforce_pp_baseline_advantages(rewards, kl, kl_coef)


@raises_slime_errors
def get_advantages_and_returns_batch(total_lengths, response_lengths, values_list, rewards_list,
                                     gamma, lambd, chunked: bool = True):
    """``(advantages_list, returns_list)`` of GAE, each entry ``response_lengths[i]`` long.

    ``chunked`` picks slime's scan implementation; the values are the same.
    """
    n = len(response_lengths)
    if not (n == len(values_list) == len(rewards_list)):
        raise ValueError(f"response_lengths, values_list, rewards_list differ in length: "
                         f"{n}, {len(values_list)}, {len(rewards_list)}")
    dtype = values_list[0].dtype
    vals = [v[:L].to(dtype) for v, L in zip(values_list, response_lengths, strict=True)]
    rews = [r[:L].to(dtype) for r, L in zip(rewards_list, response_lengths, strict=True)]
    with torch.no_grad():
        return obj.gae(rews, vals, gamma, lambd)


def chunked_discounted_returns(rewards: torch.Tensor, discount: float,
                               chunk_size: int = 128) -> torch.Tensor:
    """Discounted returns of a ``[B, T]`` tensor along ``T`` (``chunk_size`` is slime's scan
    block; the values do not depend on it)."""
    if rewards.ndim != 2:
        raise SlimeCompatError(f"rewards must be [B, T], got shape {tuple(rewards.shape)}")
    return obj.discounted_returns(rewards, discount)


def _tis(weights, args, pg_loss, train_log_probs, rollout_log_probs, loss_masks):
    w = weights(torch.cat(train_log_probs, dim=0), torch.cat(rollout_log_probs, dim=0),
                args.tis_clip_low, args.tis_clip)
    metrics = {"tis": w["ratio"].detach().clone(), "tis_clipfrac": w["clipfrac"].detach().clone(),
               "tis_abs": w["abs"].detach().clone()}
    return pg_loss * w["weight"], loss_masks, metrics


@raises_slime_errors
def vanilla_tis_function(args, *, pg_loss: torch.Tensor, train_log_probs: list[torch.Tensor],
                         rollout_log_probs: list[torch.Tensor], loss_masks: list[torch.Tensor],
                         **kwargs: Any):
    """``(pg_loss * clamp(ratio, tis_clip_low, tis_clip), loss_masks, metrics)``."""
    return _tis(obj.truncated_is_weights, args, pg_loss, train_log_probs, rollout_log_probs,
                loss_masks)


@raises_slime_errors
def icepop_function(args, *, pg_loss: torch.Tensor, train_log_probs: list[torch.Tensor],
                    rollout_log_probs: list[torch.Tensor], loss_masks: list[torch.Tensor],
                    **kwargs: Any):
    """``(pg_loss * ratio-where-inside-bounds-else-0, loss_masks, metrics)``."""
    return _tis(obj.icepop_weights, args, pg_loss, train_log_probs, rollout_log_probs, loss_masks)


def _reward_value(sample: Mapping[str, Any], reward_key: str | None, i: int):
    reward = sample.get("reward")
    if not reward_key:
        return reward
    if not isinstance(reward, Mapping) or reward_key not in reward:
        raise SlimeCompatError(f"samples[{i}].reward has no key {reward_key!r} (reward_key); "
                               f"it is {reward!r}")
    return reward[reward_key]


def post_process_rewards(args: Any, samples: Sequence[Mapping[str, Any]]
                         ) -> tuple[list[Any], list[Any]]:
    """slime's ``RolloutManager._post_process_rewards``: ``(raw_rewards, rewards)``.

    ``samples`` are ``Sample.to_dict()`` dicts; ``args`` carries
    ``advantage_estimator``, ``rewards_normalization``, ``grpo_std_normalization``,
    ``n_samples_per_prompt``, ``rollout_batch_size`` and ``reward_key``. The
    estimators of
    :data:`~varbatch_kit.report.objective.GROUP_NORMALIZED_ESTIMATORS` (with normalisation on)
    subtract the group mean, groups of ``n_samples_per_prompt`` when the batch
    holds exactly ``n_samples_per_prompt * rollout_batch_size`` samples, else
    one group; grpo/gspo/cispo with ``grpo_std_normalization`` also divide by
    the group's std + 1e-6. Other estimators return the raw rewards twice.
    """
    key = getattr(args, "reward_key", None)
    raw = [_reward_value(s, key, i) for i, s in enumerate(samples)]
    if args.advantage_estimator not in GROUP_NORMALIZED_ESTIMATORS or \
            not args.rewards_normalization:
        return raw, raw
    full = args.n_samples_per_prompt * args.rollout_batch_size
    group = args.n_samples_per_prompt if len(raw) == full else None
    std = args.advantage_estimator in STD_NORMALIZED_ESTIMATORS and args.grpo_std_normalization
    try:
        return raw, obj.normalize_group_rewards(raw, group, divide_by_std=std)
    except ValueError as e:
        raise SlimeCompatError(str(e)) from e


@raises_slime_errors
def distributed_masked_whiten(values: torch.Tensor, mask: torch.Tensor, process_group=None,
                              shift_mean: bool = True, epsilon: float = 1e-8) -> torch.Tensor:
    """Whiten with statistics summed over ``process_group`` (when ``torch.distributed`` is
    initialised; a single process uses its own)."""
    reduce = torch.distributed.is_available() and torch.distributed.is_initialized()
    return obj.masked_whiten(values, mask, group=process_group, shift_mean=shift_mean,
                             eps=epsilon, all_reduce=reduce)


@raises_slime_errors
def compute_advantages_and_returns(args: Any, rollout_data: dict, *,
                                   process_group=None) -> None:
    """slime's train-side step: writes ``kl``, ``advantages`` and ``returns`` into
    ``rollout_data`` (lists of per-sample tensors), on the last pipeline stage without CP.

    ``args``: ``advantage_estimator``, ``kl_coef``, ``kl_loss_type``,
    ``use_rollout_logprobs``, ``normalize_advantages``, ``gamma``, ``lambd``
    (``custom_advantage_function_path`` and ``use_opd`` must be unset). The
    whitening statistics are summed over ``process_group`` (slime's DP x CP
    group) when ``torch.distributed`` is initialised.
    """
    for flag in ("custom_advantage_function_path", "use_opd"):
        if getattr(args, flag, None):
            raise ValueError(f"args.{flag}={getattr(args, flag)!r} is not supported here; "
                             "leave it unset")
    rollout_lp = rollout_data.get("rollout_log_probs")
    log_probs = rollout_lp if args.use_rollout_logprobs else rollout_data.get("log_probs")
    values = rollout_data.get("values")
    masks = rollout_data.get("loss_masks")
    if args.kl_coef == 0 or not log_probs:
        like = log_probs or rollout_lp or values
        kl = [torch.zeros_like(x, dtype=torch.float32) for x in like]
    else:
        ref = rollout_data.get("ref_log_probs")
        kl = [obj.approx_kl(lp, r, args.kl_loss_type) for lp, r in zip(log_probs, ref,
                                                                         strict=True)]
    rollout_data["kl"] = kl
    advantages, returns = obj.estimate_advantages(
        args.advantage_estimator, rollout_data.get("rewards"), kl, masks,
        kl_coef=args.kl_coef, gamma=getattr(args, "gamma", 1.0),
        lambd=getattr(args, "lambd", 1.0), values=values)
    if args.normalize_advantages:
        flat = distributed_masked_whiten(torch.cat(advantages), torch.cat(masks),
                                         process_group=process_group)
        advantages = list(torch.split(flat, [a.size(0) for a in advantages]))
    rollout_data["advantages"] = advantages
    rollout_data["returns"] = returns
