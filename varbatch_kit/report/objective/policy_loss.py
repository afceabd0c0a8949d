"""Per-token policy-gradient losses and off-policy corrections.

All functions are elementwise over a flat token tensor (samples concatenated)
unless they take per-sample lists. ``ppo_kl = old_log_prob - new_log_prob``
per token, so the importance ratio is ``exp(-ppo_kl)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from varbatch_kit.report.objective.kl import sequence_kl

__all__ = [
    "cispo_loss",
    "icepop_weights",
    "opsm_keep_mask",
    "ppo_clip_loss",
    "truncated_is_weights",
]


def ppo_clip_loss(ppo_kl: torch.Tensor, advantages: torch.Tensor, eps_clip: float,
                  eps_clip_high: float, eps_clip_c: float | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token, and the 0/1 flag of tokens where clipping won.

    ``loss = max(-A*ratio, -A*clip(ratio, 1-eps_clip, 1+eps_clip_high))``; with
    the dual clip ``eps_clip_c`` (> 1) the loss of a token with ``A < 0`` is
    further capped at ``-eps_clip_c*A``. The flag counts the first clip only.
    """
    if eps_clip_c is not None and not eps_clip_c > 1.0:
        raise ValueError(
            "The lower bound of the clip_ratio_c for dual-clip PPO should be greater than "
            f"1.0, but get the value: {eps_clip_c}. (eps_clip_c must be > 1, or None to "
            "disable the dual clip)")
    ratio = torch.exp(-ppo_kl)
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * advantages
    loss = torch.maximum(unclipped, clipped)
    clipfrac = (clipped > unclipped).float()
    if eps_clip_c is not None:
        capped = torch.minimum(-eps_clip_c * advantages, loss)
        loss = torch.where(advantages < 0, capped, loss)
    return loss, clipfrac


def cispo_loss(ppo_kl: torch.Tensor, log_probs: torch.Tensor, advantages: torch.Tensor,
               eps_clip: float, eps_clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1): ``-sg(clip(ratio)) * A * log_prob`` and the clipped-token flag.

    The ratio is clipped to ``[1-eps_clip, 1+eps_clip_high]`` under stop-gradient,
    so the gradient flows through ``log_probs`` on every token.
    """
    ratio = torch.exp(-ppo_kl)
    weight = ratio.clamp(min=1.0 - eps_clip, max=1.0 + eps_clip_high)
    loss = -weight.detach() * advantages * log_probs
    return loss, (weight != ratio).float()


def opsm_keep_mask(log_probs: Sequence[torch.Tensor], old_log_probs: Sequence[torch.Tensor],
                   advantages: Sequence[torch.Tensor], loss_masks: Sequence[torch.Tensor],
                   delta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Off-policy sequence masking: drop negative-advantage tokens of too-stale samples.

    A token is dropped (0) when its advantage is negative and its sample's
    masked-mean ``old - new`` exceeds ``delta``. Returns the concatenated keep
    mask and the summed share of dropped tokens per sample (each sample's
    dropped count over its unmasked token count, clamped to 1), accumulated in
    float32.
    """
    seq = sequence_kl(log_probs, old_log_probs, loss_masks)
    if len(advantages) != len(seq):
        raise ValueError(f"advantages has {len(advantages)} entries for {len(seq)} samples; "
                         "pass one per sample")
    dropped_share = torch.zeros((), dtype=torch.float32,
                                device=advantages[0].device if len(advantages) else None)
    keep = []
    for kl, adv, m in zip(seq, advantages, loss_masks, strict=True):
        drop = ((adv < 0) & (kl > delta)).float()
        dropped_share += drop.sum() / m.sum().clamp_min(1)
        keep.append(1 - drop)
    return torch.cat(keep), dropped_share


def truncated_is_weights(log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                         low: float, high: float) -> dict[str, torch.Tensor]:
    """Truncated importance sampling against the rollout engine's log-probs.

    ``ratio = exp(log_probs - rollout_log_probs)``; ``weight`` = the ratio
    clamped to ``[low, high]``; ``clipfrac`` flags tokens whose weight moved;
    ``abs`` = ``|ratio - 1|``.
    """
    ratio = torch.exp(log_probs - rollout_log_probs)
    weight = ratio.clamp(min=low, max=high)
    return {"ratio": ratio, "weight": weight, "clipfrac": (weight != ratio).float(),
            "abs": (ratio - 1).abs()}


def icepop_weights(log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                   low: float, high: float) -> dict[str, torch.Tensor]:
    """ICEPOP: keep the ratio where it lies in ``[low, high]``, else weight 0.

    Same keys as :func:`truncated_is_weights`.
    """
    ratio = torch.exp(log_probs - rollout_log_probs)
    inside = (ratio >= low) & (ratio <= high)
    weight = torch.where(inside, ratio, torch.zeros_like(ratio))
    return {"ratio": ratio, "weight": weight, "clipfrac": (weight != ratio).float(),
            "abs": (ratio - 1).abs()}
