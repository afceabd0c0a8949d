"""Per-sample reward scalars: group normalisation before the advantage estimator."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

__all__ = ["GROUP_NORMALIZED_ESTIMATORS", "STD_NORMALIZED_ESTIMATORS", "normalize_group_rewards"]

#: estimators whose rewards slime group-normalises (with ``rewards_normalization``)
GROUP_NORMALIZED_ESTIMATORS = ("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline")
#: estimators that also divide by the group's std (with ``grpo_std_normalization``)
STD_NORMALIZED_ESTIMATORS = ("grpo", "gspo", "cispo")


def normalize_group_rewards(rewards: Sequence[float], group_size: int | None, *,
                            divide_by_std: bool, eps: float = 1e-6) -> list[float]:
    """Subtract each group's mean (and divide by its unbiased std + ``eps``), in float32.

    Groups are consecutive runs of ``group_size`` samples; ``None`` makes the
    whole batch one group. A group of one sample has an undefined std (NaN),
    as torch's unbiased ``std`` gives.
    """
    x = torch.tensor(list(rewards), dtype=torch.float)
    n = x.shape[-1]
    if group_size is None:
        group_size = n
    if group_size <= 0 or n % group_size:
        raise ValueError(f"group_size={group_size} does not divide the {n} rewards; pass a "
                         "divisor of the count, or None for one group")
    x = x.reshape(-1, group_size) if n else x.reshape(1, 0)
    x = x - x.mean(dim=-1, keepdim=True)
    if divide_by_std:
        with warnings.catch_warnings():  # one-sample groups: NaN, as documented
            warnings.simplefilter("ignore", UserWarning)
            std = x.std(dim=-1, keepdim=True)
        x = x / (std + eps)
    return x.flatten().tolist()
