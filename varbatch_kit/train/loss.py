"""The policy-gradient loss: on-policy GRPO / REINFORCE, PPO ratio clipping with old log-probs.

Per response token ``t`` of sample ``i`` (advantage ``A_i``, shared by the
sample's tokens; ``log p_t`` the log-probability of the token under the
model being trained):

- on-policy (no old log-probs), the REINFORCE / GRPO surrogate::

      l_t = -A_i * log p_t

- with old log-probs ``log q_t`` (the policy that generated the token, from
  an ``old_logprobs`` or ``rollout_log_probs`` column), PPO's clipped
  surrogate with ratio ``r_t = exp(log p_t - log q_t)`` and ``eps =
  clip_eps`` (default 0.2)::

      l_t = max(-A_i * r_t, -A_i * clip(r_t, 1 - eps, 1 + eps))

  At ``r_t = 1`` (old = current policy) both have the same gradient,
  ``-A_i * grad log p_t``; the values differ (``-A_i`` vs ``-A_i log p_t``).
  Outside the clip range the clipped branch wins when it is the larger loss
  and its gradient is 0 (the token no longer pushes the policy further).

The step loss is the report mode's reduction of ``l_t`` under the loss mask
``m_t`` (see :mod:`varbatch_kit.report.reducers`)::

    loss = (1 / Z) * sum_i (sum_t m_t * l_t) / max(d_i, 1)

e.g. ``per_rollout_mean``: ``d_i`` = the mask total of sample ``i``'s
rollout, ``Z`` = the step's rollout count (each rollout's token mean,
averaged over rollouts); ``per_token``: ``d_i = 1``, ``Z`` = the step's
unmasked token count. The training loop feeds these per-token values
through the same per-micro-batch loss sums and prescale as every metric
(:func:`varbatch_kit.train.step.train_step`), so the loss and its gradient
do not move with dp, cp or packing.

:func:`step_loss` computes the reduced loss in one process from per-sample
log-probs: the reference the tests derive by hand.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from varbatch_kit.checks import number_in

__all__ = ["DEFAULT_CLIP_EPS", "check_clip_eps", "policy_gradient_loss", "step_loss"]

DEFAULT_CLIP_EPS = 0.2


def check_clip_eps(clip_eps) -> float:
    """``clip_eps`` as a float in (0, 1); a ValueError naming it otherwise."""
    return number_in("clip_eps", clip_eps, 0, 1, lo_open=True, hi_open=True, note=", e.g. 0.2")


def policy_gradient_loss(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    old_logprobs: torch.Tensor | None = None,
    *,
    clip_eps: float = DEFAULT_CLIP_EPS,
) -> torch.Tensor:
    """Per-token policy-gradient loss ``l_t`` (see the module docstring), differentiable.

    ``logprobs``, ``advantages`` and ``old_logprobs`` (optional) are flat
    tensors of the same shape, one entry per response token; the result has
    that shape and the dtype of ``logprobs``. Without ``old_logprobs`` it is
    ``-advantages * logprobs``; with them, PPO's clipped surrogate.
    """
    if advantages.shape != logprobs.shape:
        raise ValueError(
            f"advantages has shape {tuple(advantages.shape)} but logprobs "
            f"{tuple(logprobs.shape)}: pass one advantage per response token")
    adv = advantages.to(device=logprobs.device, dtype=logprobs.dtype)
    if old_logprobs is None:
        return -adv * logprobs
    if old_logprobs.shape != logprobs.shape:
        raise ValueError(
            f"old_logprobs has shape {tuple(old_logprobs.shape)} but logprobs "
            f"{tuple(logprobs.shape)}: pass one old log-prob per response token")
    eps = check_clip_eps(clip_eps)
    old = old_logprobs.to(device=logprobs.device, dtype=logprobs.dtype)
    ratio = torch.exp(logprobs - old)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - eps, 1.0 + eps)
    return torch.maximum(unclipped, clipped)


def _float64(values) -> torch.Tensor:
    return torch.from_numpy(np.array(values, dtype=np.float64).reshape(-1))  # a fresh copy


def step_loss(
    logprobs: Sequence[Sequence[float]],
    advantages: Sequence[float],
    rollout_ids: Sequence[int],
    *,
    loss_masks: Sequence[Sequence[int]] | None = None,
    mode: str = "per_rollout_mean",
    old_logprobs: Sequence[Sequence[float]] | None = None,
    clip_eps: float = DEFAULT_CLIP_EPS,
) -> float:
    """The step loss of one step's samples in one process, as the training loop reports it.

    ``logprobs[i]``: the response tokens' log-probs of sample ``i``;
    ``advantages[i]``: its advantage; ``rollout_ids[i]``: its rollout;
    ``loss_masks[i]`` (default all ones); ``old_logprobs[i]`` (optional) turn
    on PPO clipping. One micro-batch, dp = cp = 1 (the layout does not change
    the value for the layout-invariant modes).
    """
    from varbatch_kit.report import get_report_mode

    n = len(logprobs)
    if not (len(advantages) == len(rollout_ids) == n):
        raise ValueError(
            f"{n} samples of logprobs but {len(advantages)} advantages and "
            f"{len(rollout_ids)} rollout ids: pass one of each per sample")
    lp = [_float64(x) for x in logprobs]
    masks = [torch.ones(t.numel(), dtype=torch.float64) if loss_masks is None
             else torch.as_tensor(loss_masks[i], dtype=torch.float64) for i, t in enumerate(lp)]
    adv = torch.cat([torch.full((t.numel(),), float(a), dtype=torch.float64)
                     for t, a in zip(lp, advantages)])
    old = None if old_logprobs is None else torch.cat([_float64(x) for x in old_logprobs])
    per_token = policy_gradient_loss(torch.cat(lp), adv, old, clip_eps=clip_eps)
    m = get_report_mode(mode)
    norm = m.step_normalizers(list(rollout_ids), masks, dp_size=1, cp_size=1,
                              num_microbatches=1, dp_rank_of_sample=[0] * n)
    lengths = [t.numel() for t in lp]
    total = m.microbatch_loss_sum(
        per_token, total_lengths=[n_ + 1 for n_ in lengths], response_lengths=lengths,
        loss_masks=masks, sample_denominators=norm.denominators_for(range(n)))
    divisor = max(norm.num_tokens, 1) if m.megatron_per_token_loss else norm.report_divisor
    return float(total) / float(divisor)
