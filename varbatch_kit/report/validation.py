"""Checks at the boundary of the report functions: integers, per-sample lists, positive numbers.

:func:`as_int` is the one integer check of the report layer (also
:mod:`varbatch_kit.report.cp`'s): :mod:`varbatch_kit.checks`'s, which also
takes a one-element torch tensor here; each raises ``ValueError`` naming the
argument.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from varbatch_kit import checks

# ---------------------------------------------------------------------------
# Validation at the boundary
# ---------------------------------------------------------------------------


def as_int(name: str, value: object) -> int:
    """``value`` as a Python int, else ValueError.

    :func:`varbatch_kit.checks.as_int` (ints and numpy integers, no bool) after
    unwrapping a one-element integer torch tensor (not a bool one).
    """
    if (isinstance(value, torch.Tensor) and value.numel() == 1
            and not value.is_floating_point() and value.dtype != torch.bool):
        value = int(value.item())
    return checks.as_int(name, value)


def int_list(name: str, values: Sequence[int] | torch.Tensor) -> list[int]:
    """Every entry of ``values`` as a Python int (:func:`as_int`; ``name[i]`` in errors)."""
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    return [as_int(f"{name}[{i}]", v) for i, v in enumerate(values)]


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
    """``value`` as a positive finite float (a 1-element tensor accepted), else ValueError."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    try:
        return checks.number_in(name, value, 0, lo_open=True)
    except ValueError:
        if isinstance(value, numbers.Real) and not isinstance(value, bool) and value > 0:  # inf
            raise ValueError(f"{name}={value!r} is not finite; pass a positive finite "
                             f"number") from None
        raise ValueError(
            f"{name}={value!r} is invalid; it must be a positive number (a step needs at "
            f"least one rollout / sample / token to divide by)") from None
