"""Shared cases and a Megatron emulation for the report tests (not collected by pytest).

Kept free of pytest imports so spawned worker processes start fast.

Megatron emulation (megatron-core's schedule + DDP, as docs/reference_semantics.md §5 and
megatron-core describe them):

* ``calculate_per_token_loss=False``: each micro-batch's loss-function output
  ``p * loss_sum`` is divided by the returned token count (clamped to >= 1) and by
  ``num_microbatches`` before ``backward()``; DDP averages the gradients over the
  DP x CP ranks.
* ``calculate_per_token_loss=True``: no division in the schedule; DDP sums the
  gradients; they are then divided by the all-reduced sum of returned token counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from varbatch_kit.report import ReportMode, StepNormalizers
from varbatch_kit.report.cp import slice_response_for_cp

FEATURES = 3


@dataclass
class Case:
    """One step: per-sample lengths, full masks, rollout ids and full response values."""

    total_lengths: list[int]
    response_lengths: list[int]
    loss_masks: list[torch.Tensor]
    rollout_ids: list[int]
    values: torch.Tensor  # flat, full responses concatenated

    @property
    def n(self) -> int:
        return len(self.total_lengths)


def four_samples_two_rollouts() -> Case:
    """§5 worked case 1: 4 samples x 3 tokens, rollouts A={0,1,2} and B={3}, x = 1..12."""
    return Case(
        total_lengths=[5, 5, 5, 5],
        response_lengths=[3, 3, 3, 3],
        loss_masks=[torch.ones(3, dtype=torch.float64) for _ in range(4)],
        rollout_ids=[0, 0, 0, 1],
        values=torch.arange(1, 13, dtype=torch.float64),
    )


def four_rollouts_cp() -> Case:
    """§5 worked case 2: 4 one-sample rollouts, 4 prompt + 8 response tokens.

    x rows 1..8, 10..80, 100..800, 1000..8000; per-rollout mean report 1249.875.
    """
    rows = [torch.arange(1, 9, dtype=torch.float64) * 10**k for k in range(4)]
    return Case(
        total_lengths=[12] * 4,
        response_lengths=[8] * 4,
        loss_masks=[torch.ones(8, dtype=torch.float64) for _ in range(4)],
        rollout_ids=[0, 1, 2, 3],
        values=torch.cat(rows),
    )


def mixed_case() -> Case:
    """Uneven lengths, partial and all-zero masks, multi-sample rollouts (for gradients)."""
    gen = torch.Generator().manual_seed(1234)
    responses = [5, 9, 2, 7, 4, 11, 6, 3]
    prompts = [3, 1, 6, 2, 4, 2, 5, 1]
    masks = [(torch.rand(r, generator=gen) > 0.3).to(torch.float64) for r in responses]
    masks[2] = torch.zeros(2, dtype=torch.float64)  # a fully masked sample...
    masks[3] = torch.zeros(7, dtype=torch.float64)  # ...whose rollout (ids 1) is all masked
    return Case(
        total_lengths=[p + r for p, r in zip(prompts, responses)],
        response_lengths=responses,
        loss_masks=masks,
        rollout_ids=[0, 0, 1, 1, 2, 3, 3, 3],
        values=torch.randn(sum(responses), generator=gen, dtype=torch.float64),
    )


def uneven_case() -> Case:
    """Two one-sample rollouts of 1 and 4 response tokens: sample 0 holds x = 4 (its one token),
    sample 1 x = 1, 2, 3, 5 with its third token masked (token sum 8, 3 unmasked tokens)."""
    return Case(total_lengths=[3, 6], response_lengths=[1, 4],
                loss_masks=[torch.ones(1, dtype=torch.float64),
                            torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=torch.float64)],
                rollout_ids=[0, 1], values=torch.tensor([4.0, 1, 2, 3, 5], dtype=torch.float64))


def round_robin_layout(n: int, dp: int, mbs_per_rank: int) -> list[list[list[int]]]:
    """Sample i goes to rank i % dp, micro-batch (i // dp) % mbs_per_rank."""
    layout = [[[] for _ in range(mbs_per_rank)] for _ in range(dp)]
    for i in range(n):
        layout[i % dp][(i // dp) % mbs_per_rank].append(i)
    return layout


# ---------------------------------------------------------------------------
# A small model over per-token features, and the Megatron emulation
# ---------------------------------------------------------------------------


def token_features(case: Case) -> list[torch.Tensor]:
    """Deterministic per-response-token features [R_i, FEATURES] (float64)."""
    gen = torch.Generator().manual_seed(99)
    return [
        torch.randn(r, FEATURES, generator=gen, dtype=torch.float64) for r in case.response_lengths
    ]


def make_mlp() -> torch.nn.Module:
    """2-layer MLP: features -> tanh hidden -> one value per token (float64, fixed init)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1)
    ).to(torch.float64)


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1).clone() for p in model.parameters()])


def rank_backward(
    model: torch.nn.Module,
    mode: ReportMode,
    norm: StepNormalizers,
    case: Case,
    features: list[torch.Tensor],
    rank_microbatches: list[list[int]],
    *,
    cp_rank: int,
    cp_size: int,
    dp_size: int,
) -> tuple[torch.Tensor, int]:
    """One (DP, CP) rank's work: prescaled micro-batch losses through Megatron's schedule.

    Returns this rank's accumulated gradient (before DDP) and its summed token count.
    """
    model.zero_grad(set_to_none=False)
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    m = len(rank_microbatches)
    prescale = mode.loss_prescale(norm, num_microbatches=m, dp_size=dp_size, cp_size=cp_size)
    tokens = 0
    for mb in rank_microbatches:
        if not mb:
            continue
        local_feats = [
            slice_response_for_cp(
                features[i], case.total_lengths[i], cp_rank=cp_rank, cp_size=cp_size
            )
            for i in mb
        ]
        x = model(torch.cat(local_feats)).reshape(-1)
        masks = [case.loss_masks[i] for i in mb]
        loss_sum = mode.microbatch_loss_sum(
            x,
            total_lengths=[case.total_lengths[i] for i in mb],
            response_lengths=[case.response_lengths[i] for i in mb],
            loss_masks=masks,
            sample_denominators=norm.denominators_for(mb),
            cp_rank=cp_rank,
            cp_size=cp_size,
        )
        count = mode.megatron_num_tokens(masks)
        tokens += count
        loss = prescale * loss_sum
        if not mode.megatron_per_token_loss:
            loss = loss / max(count, 1) / m
        loss.backward()
    return flat_grad(model), tokens


def cp_local_values(case: Case, mb: list[int], cp_rank: int, cp: int) -> torch.Tensor:
    """The flat per-token values CP rank ``cp_rank`` sees for the samples ``mb``."""
    pieces = case.values.split(case.response_lengths)
    local = [
        slice_response_for_cp(pieces[i], case.total_lengths[i], cp_rank=cp_rank, cp_size=cp)
        for i in mb
    ]
    return torch.cat(local) if local else case.values[:0]


def unit_weight_backward(
    mode: ReportMode, case: Case, norm: StepNormalizers, mb: list[int], *,
    cp_rank: int, dp: int, cp: int,
) -> tuple[float, int]:
    """One rank's d loss / d w for ``x * w`` (w = 1), one micro-batch, Megatron-scaled.

    Returns the rank's gradient and the token count it reports to Megatron.
    """
    w = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
    prescale = mode.loss_prescale(norm, num_microbatches=1, dp_size=dp, cp_size=cp)
    masks = [case.loss_masks[i] for i in mb]
    loss = prescale * mode.microbatch_loss_sum(
        cp_local_values(case, mb, cp_rank, cp) * w,
        total_lengths=[case.total_lengths[i] for i in mb],
        response_lengths=[case.response_lengths[i] for i in mb],
        loss_masks=masks,
        sample_denominators=norm.denominators_for(mb),
        cp_rank=cp_rank,
        cp_size=cp,
    )
    count = mode.megatron_num_tokens(masks)
    if not mode.megatron_per_token_loss:
        loss = loss / max(count, 1) / 1  # / token count / num_microbatches
    loss.backward()
    return w.grad.item(), count


def ddp_finish(
    mode: ReportMode, grad_sum: torch.Tensor, token_sum: int, world: int
) -> torch.Tensor:
    """DDP + finalize_model_grads, given gradients and token counts summed over ranks."""
    if mode.megatron_per_token_loss:
        return grad_sum / token_sum if token_sum > 0 else grad_sum
    return grad_sum / world


def normalizers_for(mode: ReportMode, case: Case, layout, cp_size: int) -> StepNormalizers:
    rank_of = [0] * case.n
    for r, rank in enumerate(layout):
        for mb in rank:
            for i in mb:
                rank_of[i] = r
    return mode.step_normalizers(
        case.rollout_ids,
        case.loss_masks,
        dp_size=len(layout),
        cp_size=cp_size,
        num_microbatches=len(layout[0]),
        dp_rank_of_sample=rank_of,
    )


def emulated_gradient(mode: ReportMode, case: Case, layout, cp_size: int) -> torch.Tensor:
    """The net gradient of one step under ``layout`` x ``cp_size``, all ranks in-process."""
    model = make_mlp()
    features = token_features(case)
    norm = normalizers_for(mode, case, layout, cp_size)
    grad_sum, token_sum = None, 0
    for rank in layout:
        for cp_rank in range(cp_size):
            g, t = rank_backward(
                model, mode, norm, case, features, rank,
                cp_rank=cp_rank, cp_size=cp_size, dp_size=len(layout),
            )  # fmt: skip
            grad_sum = g if grad_sum is None else grad_sum + g
            token_sum += t
    return ddp_finish(mode, grad_sum, token_sum, len(layout) * cp_size)


def report_gradient(mode: ReportMode, case: Case) -> torch.Tensor:
    """Autograd of the unsplit report value ``sum_i s_i / max(d_i, 1) / Z``."""
    model = make_mlp()
    features = token_features(case)
    norm = normalizers_for(mode, case, [[list(range(case.n))]], 1)
    x = model(torch.cat(features)).reshape(-1)
    value = (
        mode.microbatch_loss_sum(
            x,
            total_lengths=case.total_lengths,
            response_lengths=case.response_lengths,
            loss_masks=case.loss_masks,
            sample_denominators=norm.sample_denominators,
        )
        / norm.report_divisor
    )
    value.backward()
    return flat_grad(model)


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / max(float(b.norm()), 1e-300))
