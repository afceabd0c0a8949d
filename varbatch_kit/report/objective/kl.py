"""KL estimators between two policies, per token and per sequence.

With ``r = log p_new - log p_ref`` per token (Schulman's notation):

- ``k1``: ``r`` (unbiased, may be negative);
- ``k2``: ``r**2 / 2``;
- ``k3`` / ``low_var_kl``: ``exp(-r) - 1 + r`` (non-negative, unbiased for
  KL(new || ref) when sampled from new); ``low_var_kl`` is the same estimate
  clamped to ``[-10, 10]`` *after* the optional importance weight.

The log-probs are cast to float32 first (as slime does: the estimate is
float32 whatever the input dtype; a float64 ``weight`` promotes the product).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["KL_TYPES", "approx_kl", "sequence_kl"]

#: the estimator names :func:`approx_kl` knows
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")


def approx_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str, *,
              weight: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token KL estimate of ``kind`` (:data:`KL_TYPES`), times ``weight`` when given.

    ``weight`` is the importance ratio ``pi_new / pi_old`` of the unbiased
    (DeepSeek-V3.2) estimate.
    """
    if kind not in KL_TYPES:
        raise ValueError(f"Unknown kl_loss_type: {kind}; kind={kind!r}, use one of {KL_TYPES}")
    r = log_probs.float() - ref_log_probs.float()
    if kind == "k1":
        kl = r
    elif kind == "k2":
        kl = r**2 / 2.0
    else:
        neg = -r
        kl = neg.exp() - 1 - neg
    if weight is not None:
        kl = weight * kl
    if kind == "low_var_kl":
        kl = kl.clamp(min=-10, max=10)
    return kl


def sequence_kl(log_probs: Sequence[torch.Tensor], old_log_probs: Sequence[torch.Tensor],
                loss_masks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per sample: the masked mean of ``old - new`` (a 0-dim tensor).

    A fully masked sample has mean 0 (its token count is clamped to 1).
    """
    if not len(log_probs) == len(old_log_probs) == len(loss_masks):
        raise ValueError(f"log_probs, old_log_probs and loss_masks differ in length: "
                         f"{len(log_probs)}, {len(old_log_probs)}, {len(loss_masks)}; "
                         "pass one entry per sample to each")
    return [((old - new) * m).sum() / m.sum().clamp_min(1)
            for new, old, m in zip(log_probs, old_log_probs, loss_masks, strict=True)]
