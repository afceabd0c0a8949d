"""The report of a batch under a given DP x micro-batch x CP layout, in one process.

Used by the tests and benchmarks to show that sound modes do not move with the
layout and naive ones do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from varbatch_kit.report.cp import slice_response_for_cp
from varbatch_kit.report.modes import ReportMode, StepNormalizers, resolve_mode
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


def _check_step(values, total_lengths, response_lengths, loss_masks):
    """The samples' (total, response) lengths, checked, and ``values`` checked against them."""
    totals, responses = check_samples(total_lengths, response_lengths, loss_masks)
    if values.dim() != 1 or values.shape[0] != sum(responses):
        raise ValueError(
            f"values has shape {tuple(values.shape)} but sum(response_lengths) = "
            f"{sum(responses)}; pass the samples' full response values concatenated"
        )
    return totals, responses


@dataclass(frozen=True)
class _StepValues:
    """One step's checked samples: what every micro-batch's value vector is computed from."""

    mode: ReportMode
    norm: StepNormalizers
    values: torch.Tensor
    per_sample: list[torch.Tensor]
    totals: list[int]
    responses: list[int]
    loss_masks: Sequence[torch.Tensor]

    def contribution(self, idx: list[int], cp_rank: int, cp_size: int, *,
                     per_degree: bool = False) -> torch.Tensor:
        """CP rank ``cp_rank`` of ``cp_size``'s value vector ``[count, loss sum]`` for the
        micro-batch of samples ``idx``, as a training loop computes it on its zigzag pieces.

        ``per_degree``: the micro-batch has its own degree (a dynamic-CP plan), so
        slot 0 counts its tokens against the step's reference degree.
        """
        masks = [self.loss_masks[i] for i in idx]
        local = [slice_response_for_cp(self.per_sample[i], self.totals[i], cp_rank=cp_rank,
                                       cp_size=cp_size) for i in idx]
        loss = self.mode.microbatch_loss_sum(
            torch.cat(local) if local else self.values[:0],
            total_lengths=[self.totals[i] for i in idx],
            response_lengths=[self.responses[i] for i in idx],
            loss_masks=masks,
            sample_denominators=self.norm.denominators_for(idx),
            cp_rank=cp_rank,
            cp_size=cp_size,
        )
        count = (self.mode.count_slot(masks, cp_size=cp_size, reference_cp=self.norm.reference_cp)
                 if per_degree else self.mode.count_slot(masks))
        return torch.stack([loss.new_tensor(float(count)), loss.detach()])


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
    totals, responses = _check_step(values, total_lengths, response_lengths, loss_masks)
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
    step = _StepValues(mode, norm, values, list(values.split(responses)), totals, responses,
                       loss_masks)
    contributions = [step.contribution([int(i) for i in mb], cp_rank, cp_size)
                     for rank in layout for mb in rank for cp_rank in range(cp_size)]
    return reduce_train_step_metrics(
        contributions, keys=["value"], divisor=norm.report_divisor, cp_size=cp_size
    )["value"]


# ---------------------------------------------------------------------------
# One-process emulation of a dynamic-CP plan (a CP degree per micro-batch)
# ---------------------------------------------------------------------------

Program = Sequence[Sequence[object]]
"""``programs[world_rank][round]``: ``(samples, cp_size, cp_rank)`` or an object with those
attributes (:class:`varbatch_kit.core.placement.RankWork`); samples step-local, an empty
``samples`` is an idle round."""


def _work(entry: object, where: str) -> tuple[list[int], int, int]:
    if all(hasattr(entry, a) for a in ("samples", "cp_size", "cp_rank")):
        samples, c, r = entry.samples, entry.cp_size, entry.cp_rank  # type: ignore[attr-defined]
    else:
        try:
            samples, c, r = entry  # type: ignore[misc]
        except (TypeError, ValueError):
            raise ValueError(
                f"{where} is {entry!r}; pass (samples, cp_size, cp_rank) or a RankWork"
            ) from None
    return [int(i) for i in samples], int(c), int(r)


def plan_sample_cp(
    programs: Program, num_samples: int, cp_size: int
) -> tuple[list[int], list[int]]:
    """Check a plan and return each sample's CP degree and DP rank.

    Every sample must run in exactly one micro-batch: on ``c`` (world rank,
    round) slots holding CP ranks ``0..c-1`` once each, all of the same degree
    ``c`` and the same round. Its *DP rank* is the lowest world rank of its
    CP group divided by ``cp_size`` (the pool's CP size): the DP replica that
    holds the group in the fixed layout, so fixed plans give the fixed DP rank.
    """
    if len(programs) == 0 or len(programs) % cp_size:
        raise ValueError(
            f"the plan has {len(programs)} ranks; a pool of dp x cp_size={cp_size} ranks needs a "
            f"positive multiple of {cp_size}"
        )
    seen: dict[int, list[tuple[int, int, int, int]]] = {}
    for w, program in enumerate(programs):
        for k, entry in enumerate(program):
            samples, c, r = _work(entry, f"programs[{w}][{k}]")
            for i in samples:
                if not 0 <= i < num_samples:
                    raise ValueError(
                        f"programs[{w}][{k}] holds sample {i}; the step has samples "
                        f"0..{num_samples - 1}"
                    )
                seen.setdefault(i, []).append((w, k, c, r))
    degrees, dp_rank = [0] * num_samples, [0] * num_samples
    for i in range(num_samples):
        slots = seen.get(i, [])
        cs = {c for _, _, c, _ in slots}
        rounds = {k for _, k, _, _ in slots}
        if not slots or len(cs) != 1 or len(rounds) != 1:
            raise ValueError(
                f"sample {i} runs on {[(w, k) for w, k, _, _ in slots]} (rank, round) with "
                f"degrees {sorted(cs)}; every sample must run once, in one round, on one CP group"
            )
        (c,) = cs
        if sorted(r for *_, r in slots) != list(range(c)):
            raise ValueError(
                f"sample {i} has degree {c} but CP ranks {sorted(r for *_, r in slots)}; its group "
                f"must hold CP ranks 0..{c - 1} once each"
            )
        degrees[i] = c
        dp_rank[i] = min(w for w, *_ in slots) // cp_size
    return degrees, dp_rank


def report_under_plan(
    mode: str | ReportMode,
    values: torch.Tensor,
    total_lengths: Sequence[int] | torch.Tensor,
    response_lengths: Sequence[int] | torch.Tensor,
    loss_masks: Sequence[torch.Tensor],
    rollout_ids: Sequence[int] | torch.Tensor,
    *,
    programs: Program,
    cp_size: int,
    global_batch_size: int | None = None,
) -> float:
    """The step report of ``mode`` under a dynamic-CP plan, all ranks in one process.

    ``programs[w]`` is world rank ``w``'s rounds (see :data:`Program`); the
    pool has ``len(programs) = dp * cp_size`` ranks. Each sample is cut by the
    zigzag rule of its own degree ``c`` and seen from its own CP rank; every
    rank computes its micro-batch value vectors as a training loop would (loss
    sum, and slot 0 counting ``n_i * K / c`` tokens, ``K`` the step's
    reference degree), and :func:`reduce_train_step_metrics` reduces them with
    ``cp_size=K``. A fixed layout written as a plan gives
    :func:`report_under_layout`'s value bit for bit.
    """
    mode = resolve_mode(mode)
    totals, responses = _check_step(values, total_lengths, response_lengths, loss_masks)
    n = len(totals)
    degrees, rank_of = plan_sample_cp(programs, n, cp_size)
    dp_size = len(programs) // cp_size
    uniform = len(set(degrees)) == 1 and degrees[0] == cp_size
    norm = mode.step_normalizers(
        rollout_ids,
        loss_masks,
        global_batch_size=global_batch_size,
        dp_size=dp_size,
        cp_size=cp_size if uniform else degrees,
        num_microbatches=max(len(p) for p in programs),
        dp_rank_of_sample=rank_of,
    )
    step = _StepValues(mode, norm, values, list(values.split(responses)), totals, responses,
                       loss_masks)
    contributions = []
    for w, program in enumerate(programs):
        for k, entry in enumerate(program):
            idx, c, r = _work(entry, f"programs[{w}][{k}]")
            if idx:  # else an idle round
                contributions.append(step.contribution(idx, r, c, per_degree=True))
    return reduce_train_step_metrics(
        contributions, keys=["value"], divisor=norm.report_divisor, cp_size=norm.reference_cp
    )["value"]
