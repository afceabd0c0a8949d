"""Checks at the boundary of the report functions: per-sample lists, positive numbers."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch

from varbatch_kit.report.cp import _as_int

# ---------------------------------------------------------------------------
# Validation at the boundary
# ---------------------------------------------------------------------------


def int_list(name: str, values: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    return [_as_int(f"{name}[{i}]", v) for i, v in enumerate(values)]


def check_samples(
    total_lengths: Sequence[int] | torch.Tensor,
    response_lengths: Sequence[int] | torch.Tensor,
    loss_masks: Sequence[torch.Tensor],
) -> tuple[list[int], list[int]]:
    """Validate per-sample lengths and masks; return the lengths as int lists."""
    totals = int_list("total_lengths", total_lengths)
    responses = int_list("response_lengths", response_lengths)
    if not len(totals) == len(responses) == len(loss_masks):
        raise ValueError(
            f"len(total_lengths)={len(totals)}, len(response_lengths)={len(responses)} and "
            f"len(loss_masks)={len(loss_masks)} differ; pass one entry per sample in each"
        )
    for i, (t, r, m) in enumerate(zip(totals, responses, loss_masks)):
        if r < 0:
            raise ValueError(f"response_lengths[{i}]={r} is negative; lengths must be >= 0")
        if r > t:
            raise ValueError(
                f"response_lengths[{i}]={r} > total_lengths[{i}]={t}; the response is part of "
                f"the sequence, so it must be <= total length"
            )
        if m.dim() != 1 or m.shape[0] != r:
            raise ValueError(
                f"loss_masks[{i}] has shape {tuple(m.shape)} but response_lengths[{i}]={r}; "
                f"each loss mask must be 1-D with one entry per response token"
            )
    return totals, responses


def positive(name: str, value: float) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ValueError(
            f"{name}={value!r} is invalid; it must be a positive number (a step needs at "
            f"least one rollout / sample / token to divide by)"
        )
    if not math.isfinite(value):
        raise ValueError(f"{name}={value!r} is not finite; pass a positive finite number")
    return float(value)
