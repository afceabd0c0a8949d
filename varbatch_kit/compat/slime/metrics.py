"""slime's metric-reporting functions, with slime's signatures plus explicit CP arguments.

Thin adapters over :mod:`varbatch_kit.report.cp` and :mod:`varbatch_kit.report`; see
``docs/reference_semantics.md`` section 5. Where slime asks ``megatron.core.mpu`` for
the CP rank and size or the process groups, these functions take them as
arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from varbatch_kit import report
from varbatch_kit.report.cp import validate_cp, zigzag_slice
from varbatch_kit.report.validation import positive

__all__ = [
    "gather_and_reduce_log_dict",
    "get_logits_and_tokens_offset_with_cp",
    "get_sum_of_sample_mean",
    "reduce_train_step_metrics",
    "rollout_log_metric_contribution",
]

Range = tuple[int, int]


def get_logits_and_tokens_offset_with_cp(
    total_length: int, response_length: int, *, cp_rank: int, cp_size: int
) -> tuple[int, tuple[Range, Range], tuple[Range, Range], tuple[Range, Range]]:
    """``(chunk_size, (chunk_0, chunk_1), (logits_0, logits_1), (tokens_0, tokens_1))``.

    All offsets count from the beginning of the prompt; an empty logits/tokens
    range is ``(0, 0)``. The sample needs a prompt of at least one token.
    """
    s = zigzag_slice(total_length, response_length, cp_rank=cp_rank, cp_size=cp_size)
    return s.chunk_size, s.chunks, s.logits_ranges, s.token_ranges


def get_sum_of_sample_mean(
    total_lengths: Sequence[int],
    response_lengths: Sequence[int],
    loss_masks: Sequence[torch.Tensor],
    sample_denoms: Sequence[float] | torch.Tensor | None = None,
    calculate_per_token_loss: bool = False,
    *,
    cp_rank: int = 0,
    cp_size: int = 1,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The reducer: ``x -> sum_i (x_i * mask_i).sum() / max(denom_i, 1)`` (or the token sum).

    ``denom_i = sample_denoms[i]`` (e.g. per-rollout mask totals) or, when
    None, ``mask_i.sum()``; with ``calculate_per_token_loss`` the plain masked
    token sum. ``x`` is flat: the samples' CP-local response values
    concatenated; masks are sliced to CP rank ``cp_rank``, denominators stay
    full-sample.
    """
    return report.make_reducer(
        total_lengths,
        response_lengths,
        loss_masks,
        sample_denoms,
        per_token=calculate_per_token_loss,
        cp_rank=cp_rank,
        cp_size=cp_size,
    )


def _as_value_vectors(losses_reduced: Sequence[Any]) -> tuple[list[str], list[torch.Tensor]]:
    """Split slime's per-micro-batch ``{"keys": [...], "values": tensor}`` dicts."""
    keys: list[str] | None = None
    vectors = []
    for j, item in enumerate(losses_reduced):
        if not isinstance(item, Mapping) or "keys" not in item or "values" not in item:
            raise ValueError(
                f"losses_reduced[{j}] is {type(item).__name__}; each micro-batch entry must be "
                f"a dict {{'keys': [metric names], 'values': tensor([slot0, sums...])}}"
            )
        if keys is None:
            keys = list(item["keys"])
        elif list(item["keys"]) != keys:
            raise ValueError(
                f"losses_reduced[{j}]['keys']={list(item['keys'])} differs from "
                f"losses_reduced[0]['keys']={keys}; every micro-batch must report the same keys"
            )
        vectors.append(torch.as_tensor(item["values"]))
    if keys is None:
        raise ValueError("losses_reduced is empty; pass one entry per micro-batch of this rank")
    return keys, vectors


def reduce_train_step_metrics(
    losses_reduced: Sequence[Mapping[str, Any]],
    *,
    calculate_per_token_loss: bool,
    step_global_batch_size: int,
    cp_size: int,
    dp_with_cp_group: Any = None,
) -> dict[str, float]:
    """slime's train-step report from its per-micro-batch loss-function outputs.

    Each entry of ``losses_reduced`` is ``{"keys": [names], "values":
    tensor([slot0, sum_1, ...])}``. The vectors are summed over micro-batches
    and all-reduced over ``dp_with_cp_group`` (None: single process); per-token
    mode divides by ``slot0 / cp_size``, per-rollout-mean mode by
    ``step_global_batch_size`` (rollouts), with no CP factor.
    """
    validate_cp(0, cp_size)
    positive("step_global_batch_size", step_global_batch_size)
    keys, vectors = _as_value_vectors(losses_reduced)
    return report.reduce_train_step_metrics(
        vectors,
        keys=keys,
        divisor=None if calculate_per_token_loss else step_global_batch_size,
        cp_size=cp_size,
        group=dp_with_cp_group,
    )


def rollout_log_metric_contribution(
    per_rank_reducer_sum: float | torch.Tensor,
    *,
    cp_size: int,
    num_rollouts_in_rollout: int,
    dp_size: int,
) -> tuple[float, float]:
    """A rank's ``(cp * reducer_sum, num_rollouts / dp)`` rollout-log entry."""
    return report.rollout_log_metric_contribution(
        per_rank_reducer_sum,
        cp_size=cp_size,
        num_rollouts=num_rollouts_in_rollout,
        dp_size=dp_size,
    )


def gather_and_reduce_log_dict(
    log_dict: Mapping[str, Any], *, dp_size: int, dp_src_rank: int, dp_group: Any
) -> dict[str, float] | None:
    """Gather log dicts over the DP x CP group; the source rank gets the reduced dict.

    ``(sum, count)`` entries report ``sum(sums) / sum(counts)``, scalars their
    mean over ranks. ``dp_size`` is the group's size and ``dp_src_rank`` the
    global rank that reports; every other rank gets None (as in slime). With
    ``dp_group=None`` (single process) ``dp_size`` must be 1. Inconsistent
    entries raise ``ValueError`` on every rank.
    """
    if dp_group is None:
        if dp_size != 1:
            raise ValueError(
                f"dp_group=None means a single process, but dp_size={dp_size}; pass the DP x CP "
                f"process group or dp_size=1"
            )
        return report.gather_and_reduce_log_dict(log_dict, group=None)
    group_size = dist.get_world_size(dp_group)
    if dp_size != group_size:
        raise ValueError(
            f"dp_size={dp_size} but dp_group has {group_size} ranks; pass the group's size"
        )
    reduced = report.gather_and_reduce_log_dict(log_dict, group=dp_group)
    return reduced if dist.get_rank() == dp_src_rank else None
