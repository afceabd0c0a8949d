"""Per-rollout denominators and the reducer: masked sums of a flat per-token tensor.

CP-local slicing by the zigzag rule of :mod:`varbatch_kit.report.cp`; the
denominators are always the full sample's (see :mod:`varbatch_kit.report`).
Every ``cp_rank`` / ``cp_size`` here is one int for all samples or one entry
per sample (dynamic CP: each sample cut by its own degree).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from varbatch_kit.report.cp import per_sample_cp, slice_response_for_cp, validate_cp
from varbatch_kit.report.validation import check_samples, int_list

# ---------------------------------------------------------------------------
# Per-sample denominators
# ---------------------------------------------------------------------------


def sample_mask_sums(loss_masks: Sequence[torch.Tensor]) -> torch.Tensor:
    """``n_i = sum(loss_masks[i])`` for each sample, as a float64 CPU tensor."""
    return torch.tensor(
        [float(m.detach().sum().item()) for m in loss_masks], dtype=torch.float64
    ).reshape(len(loss_masks))


def rollout_denominators(
    rollout_ids: Sequence[int] | torch.Tensor, loss_masks: Sequence[torch.Tensor]
) -> torch.Tensor:
    """Per-rollout denominators: for each sample, the total mask sum of its rollout.

    ``rollout_ids[i]`` is the rollout of sample ``i``; compute this over the whole
    step (every sample of every rollout in it), before any packing. Returns a
    float64 tensor; a rollout whose masks are all 0 gets 0 (reducers clamp to 1).

    >>> ones = [torch.ones(3)] * 4
    >>> rollout_denominators([7, 7, 7, 9], ones).tolist()
    [9.0, 9.0, 9.0, 3.0]
    """
    ids = int_list("rollout_ids", rollout_ids)
    if len(ids) != len(loss_masks):
        raise ValueError(
            f"len(rollout_ids)={len(ids)} != len(loss_masks)={len(loss_masks)}; "
            f"pass one rollout id per sample"
        )
    sums = sample_mask_sums(loss_masks)
    if not ids:
        return sums
    _, inverse = torch.unique(torch.tensor(ids, dtype=torch.long), return_inverse=True)
    per_rollout = torch.zeros(int(inverse.max()) + 1, dtype=torch.float64)
    per_rollout.index_add_(0, inverse, sums)
    return per_rollout[inverse]


# ---------------------------------------------------------------------------
# The reducer: masked sums over CP-local pieces
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalPieces:
    """CP-local loss masks of a set of samples, flattened, with a segment id per token."""

    local_lengths: tuple[int, ...]
    flat_mask: torch.Tensor  # float64, CP-local mask entries, samples concatenated
    segment_ids: torch.Tensor  # long, sample position of each entry
    num_samples: int

    @classmethod
    def build(
        cls,
        total_lengths: Sequence[int] | torch.Tensor,
        response_lengths: Sequence[int] | torch.Tensor,
        loss_masks: Sequence[torch.Tensor],
        cp_rank: int | Sequence[int],
        cp_size: int | Sequence[int],
    ) -> LocalPieces:
        """``cp_rank`` / ``cp_size``: one int for all samples, or one entry per sample."""
        per_sample = per_sample_cp(cp_rank, cp_size, len(loss_masks))
        if per_sample is None:
            cp_rank, cp_size = validate_cp(cp_rank, cp_size)
            ranks, sizes = [cp_rank] * len(loss_masks), [cp_size] * len(loss_masks)
        else:
            ranks, sizes = per_sample
        totals, _ = check_samples(total_lengths, response_lengths, loss_masks)
        local = [
            slice_response_for_cp(m.detach(), t, cp_rank=r, cp_size=c)
            for t, m, r, c in zip(totals, loss_masks, ranks, sizes)
        ]
        device = loss_masks[0].device if loss_masks else torch.device("cpu")
        lengths = tuple(int(m.shape[0]) for m in local)
        flat = (
            torch.cat([m.to(torch.float64) for m in local])
            if local
            else torch.zeros(0, dtype=torch.float64, device=device)
        )
        # segment id of every CP-local entry, built on the host (torch's CPU
        # repeat_interleave costs ~1 ms a call when its thread pool is contended)
        segments = torch.from_numpy(
            np.repeat(np.arange(len(lengths), dtype=np.int64), np.asarray(lengths, dtype=np.int64))
        ).to(device)
        return cls(lengths, flat, segments, len(lengths))

    def sums(self, values: torch.Tensor) -> torch.Tensor:
        """Per-sample ``sum(x * mask)`` over the CP-local pieces (differentiable in ``values``)."""
        expected = sum(self.local_lengths)
        if values.dim() != 1 or values.shape[0] != expected:
            raise ValueError(
                f"values has shape {tuple(values.shape)} but the samples' CP-local response "
                f"lengths sum to {expected} (lengths {list(self.local_lengths)}); pass a 1-D "
                f"tensor of the samples' (CP-sliced) response values, concatenated"
            )
        mask = self.flat_mask.to(device=values.device, dtype=values.dtype)
        out = torch.zeros(self.num_samples, dtype=values.dtype, device=values.device)
        return out.index_add(0, self.segment_ids.to(values.device), values * mask)

    def counts(self) -> torch.Tensor:
        """Per-sample CP-local unmasked token counts (float64)."""
        out = torch.zeros(self.num_samples, dtype=torch.float64, device=self.flat_mask.device)
        return out.index_add(0, self.segment_ids, self.flat_mask)


def denominator_tensor(
    sample_denominators: Sequence[float] | torch.Tensor | None,
    loss_masks: Sequence[torch.Tensor],
) -> torch.Tensor:
    """``max(d_i, 1)`` as float64; ``None`` means each sample's own mask sum."""
    if sample_denominators is None:
        denoms = sample_mask_sums(loss_masks)
    else:
        denoms = torch.as_tensor(sample_denominators, dtype=torch.float64).detach().reshape(-1)
        if denoms.shape[0] != len(loss_masks):
            raise ValueError(
                f"sample_denominators has {denoms.shape[0]} entries but there are "
                f"{len(loss_masks)} samples; pass one denominator per sample"
            )
        if bool((denoms < 0).any()) or not bool(torch.isfinite(denoms).all()):
            raise ValueError(
                f"sample_denominators={denoms.tolist()} has a negative or non-finite entry; "
                f"denominators are token counts (>= 0)"
            )
    return denoms.cpu().clamp_min(1.0)


def masked_sums(
    values: torch.Tensor,
    total_lengths: Sequence[int] | torch.Tensor,
    response_lengths: Sequence[int] | torch.Tensor,
    loss_masks: Sequence[torch.Tensor],
    *,
    cp_rank: int | Sequence[int] = 0,
    cp_size: int | Sequence[int] = 1,
) -> torch.Tensor:
    """Per-sample ``s_i = sum(x_i * m_i)`` over what CP rank ``cp_rank`` sees.

    ``values`` is flat: the samples' CP-local response values concatenated (the
    full responses when ``cp_size == 1``); ``loss_masks`` are the full masks.
    """
    return LocalPieces.build(total_lengths, response_lengths, loss_masks, cp_rank, cp_size).sums(
        values
    )


def make_reducer(
    total_lengths: Sequence[int] | torch.Tensor,
    response_lengths: Sequence[int] | torch.Tensor,
    loss_masks: Sequence[torch.Tensor],
    sample_denominators: Sequence[float] | torch.Tensor | None = None,
    *,
    per_token: bool = False,
    cp_rank: int | Sequence[int] = 0,
    cp_size: int | Sequence[int] = 1,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function of a flat per-token tensor: ``sum_i s_i / max(d_i, 1)`` (or ``sum_i s_i``).

    The masks are sliced to CP rank ``cp_rank`` once, here; the denominators
    stay the full-sample (or full-rollout) ones, so the results of all CP ranks
    add up to the ``cp_size == 1`` value. ``sample_denominators=None`` uses each
    sample's own mask sum (per-sample mean); ``per_token=True`` ignores the
    denominators (plain masked token sum). The returned function is
    differentiable in its argument and checks its length.
    """
    pieces = LocalPieces.build(total_lengths, response_lengths, loss_masks, cp_rank, cp_size)
    denoms = None if per_token else denominator_tensor(sample_denominators, loss_masks)

    def reduce(values: torch.Tensor) -> torch.Tensor:
        sums = pieces.sums(values)
        if denoms is None:
            return sums.sum()
        return (sums / denoms.to(device=sums.device, dtype=sums.dtype)).sum()

    return reduce


def sum_of_sample_means(
    values: torch.Tensor,
    total_lengths: Sequence[int] | torch.Tensor,
    response_lengths: Sequence[int] | torch.Tensor,
    loss_masks: Sequence[torch.Tensor],
    sample_denominators: Sequence[float] | torch.Tensor | None = None,
    *,
    cp_rank: int | Sequence[int] = 0,
    cp_size: int | Sequence[int] = 1,
) -> torch.Tensor:
    """``sum_i s_i / max(d_i, 1)`` in one call (see :func:`make_reducer`)."""
    return make_reducer(
        total_lengths,
        response_lengths,
        loss_masks,
        sample_denominators,
        cp_rank=cp_rank,
        cp_size=cp_size,
    )(values)
