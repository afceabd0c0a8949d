"""The report of a batch under a given DP x micro-batch x CP layout, in one process.

Used by the tests and benchmarks to show that sound modes do not move with the
layout and naive ones do.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from varbatch_kit.report.cp import slice_response_for_cp
from varbatch_kit.report.modes import ReportMode, resolve_mode
from varbatch_kit.report.steps import reduce_train_step_metrics
from varbatch_kit.report.validation import check_samples

Layout = Sequence[Sequence[Sequence[int]]]  # layout[dp_rank][micro_batch] -> sample indices


# ---------------------------------------------------------------------------
# One-process emulation of a layout
# ---------------------------------------------------------------------------


def _check_layout(layout: Layout, num_samples: int) -> tuple[int, int]:
    if len(layout) == 0:
        raise ValueError("layout has 0 DP ranks; pass layout[dp_rank][micro_batch] = samples")
    counts = {len(rank) for rank in layout}
    if len(counts) != 1 or 0 in counts:
        raise ValueError(
            f"layout ranks have {[len(r) for r in layout]} micro-batches; every DP rank must "
            f"run the same number (>= 1) of micro-batches"
        )
    seen = sorted(int(i) for rank in layout for mb in rank for i in mb)
    if seen != list(range(num_samples)):
        raise ValueError(
            f"layout covers samples {seen} but the step has samples 0..{num_samples - 1}; "
            f"every sample must appear exactly once"
        )
    return len(layout), counts.pop()


def report_under_layout(
    mode: str | ReportMode,
    values: torch.Tensor,
    total_lengths: Sequence[int] | torch.Tensor,
    response_lengths: Sequence[int] | torch.Tensor,
    loss_masks: Sequence[torch.Tensor],
    rollout_ids: Sequence[int] | torch.Tensor,
    *,
    layout: Layout | None = None,
    cp_size: int = 1,
    global_batch_size: int | None = None,
) -> float:
    """The step report of ``mode`` when the step runs with the given layout (one process).

    ``values`` holds the samples' full response values, concatenated in sample
    order. ``layout[r][m]`` lists the step-local samples of micro-batch ``m`` on
    DP rank ``r`` (default: one rank, one micro-batch); every CP rank of every
    DP rank computes its micro-batch loss sums on its zigzag pieces exactly as a
    training loop would, and :func:`reduce_train_step_metrics` reduces them.
    """
    mode = resolve_mode(mode)
    totals, responses = check_samples(total_lengths, response_lengths, loss_masks)
    if values.dim() != 1 or values.shape[0] != sum(responses):
        raise ValueError(
            f"values has shape {tuple(values.shape)} but sum(response_lengths) = "
            f"{sum(responses)}; pass the samples' full response values concatenated"
        )
    n = len(totals)
    layout = [[list(range(n))]] if layout is None else layout
    dp_size, num_mb = _check_layout(layout, n)
    rank_of = [0] * n
    for r, rank in enumerate(layout):
        for mb in rank:
            for i in mb:
                rank_of[int(i)] = r
    norm = mode.step_normalizers(
        rollout_ids,
        loss_masks,
        global_batch_size=global_batch_size,
        dp_size=dp_size,
        cp_size=cp_size,
        num_microbatches=num_mb,
        dp_rank_of_sample=rank_of,
    )
    per_sample = list(values.split(responses))
    contributions = []
    for rank in layout:
        for mb in rank:
            idx = [int(i) for i in mb]
            masks = [loss_masks[i] for i in idx]
            for cp_rank in range(cp_size):
                local = [
                    slice_response_for_cp(
                        per_sample[i], totals[i], cp_rank=cp_rank, cp_size=cp_size
                    )
                    for i in idx
                ]
                x = torch.cat(local) if local else values[:0]
                loss = mode.microbatch_loss_sum(
                    x,
                    total_lengths=[totals[i] for i in idx],
                    response_lengths=[responses[i] for i in idx],
                    loss_masks=masks,
                    sample_denominators=norm.denominators_for(idx),
                    cp_rank=cp_rank,
                    cp_size=cp_size,
                )
                count = float(mode.count_slot(masks))
                contributions.append(torch.stack([loss.new_tensor(count), loss.detach()]))
    return reduce_train_step_metrics(
        contributions, keys=["value"], divisor=norm.report_divisor, cp_size=cp_size
    )["value"]
