"""Metric and loss reporting whose numbers do not move when the parallel layout does.

A training step holds a fixed set of samples (``global_batch_size`` rollouts, one
or more samples each). The scheduler packs them into micro-batches, spreads the
micro-batches over data-parallel (DP) ranks, and context parallelism (CP) cuts
every sequence into zigzag pieces (:mod:`varbatch_kit.report.cp`). A reported metric or
a loss is *layout-invariant* when its value, and the gradient of the loss, is the
same for every such layout. This module holds that math, pure: tensors and ints
in, tensors and floats out; no globals, no ``megatron.core.mpu``. The only
communication is the optional ``group`` argument of the step-reduction and
logging functions (``group=None``: single process, no communication).

How every mode works
--------------------
For sample ``i`` with response values ``x_i``, loss mask ``m_i`` (0/1 per response
token) let ``s_i = sum(x_i * m_i)`` and ``n_i = sum(m_i)``. Every mode is

    report = (1 / Z) * sum_i s_i / max(d_i, 1)

with per-sample denominators ``d_i`` and a step divisor ``Z``, both computed once
over the **whole step** (before packing), so no micro-batch, DP rank or CP rank
ever normalises by something only it can see. A rank's micro-batch contributes
the *loss sum* ``sum_{i in mb} s_i^local / max(d_i, 1)`` over its CP-local
pieces; the CP pieces of a sample tile its response exactly once and the DP ranks
hold disjoint samples, so the contributions of all (rank, micro-batch) pairs add
up to the unsplit numerator, whatever the layout.

=========================  ===========================  =================================
mode                       d_i (per sample)             Z (step-global divisor)
=========================  ===========================  =================================
per_rollout_mean           mask total of i's rollout    global_batch_size (rollouts)
per_sample_mean            n_i                          number of samples in the step
per_token                  1                            unmasked tokens of the step (*)
token-mean (verl)          1                            unmasked tokens of the step
seq-mean-token-mean        n_i                          number of samples in the step
seq-mean-token-sum         1                            number of samples in the step
seq-mean-token-sum-norm    1                            samples in the step * C
naive_microbatch_mean      (micro-batch token mean)     micro-batches * dp * cp  [naive]
naive_rank_mean            n_i * samples on i's rank    dp                       [naive]
=========================  ===========================  =================================

(*) ``per_token`` is slime's per-token path: Megatron runs with
``calculate_per_token_loss=True`` and the divisor is the all-reduced token count
(slot 0 of the reported values, counted in full by every CP rank, so divided by
``cp``). ``token-mean`` has the same value but precomputes the global token count
and runs Megatron's default path. ``C`` is a constant (verl's
``loss_scale_factor``; default: the step's longest response, i.e. the padded
response horizon). Token-count divisors are clamped to >= 1, so a step whose
every mask entry is 0 reports 0, never NaN; likewise a rollout whose masks are
all 0 contributes 0 (its ``d_i`` is clamped to 1 and ``s_i`` is 0).

The two naive modes reproduce normalisations real systems shipped; they are
**for comparison only** (``mode.naive is True``): the mean of per-micro-batch
token means (the 2024 gradient-accumulation bug of Hugging Face transformers,
issue 34191) and the per-rank mean of sample means averaged over DP ranks (slime
before PR #1930). Both move with micro-batch packing and DP; the first also with
CP.

API for a training loop (the training engine, :mod:`varbatch_kit.train`, uses it)
------------------------------------------------
::

    mode = get_report_mode("per_rollout_mean")          # or any name in REPORT_MODES
    # once per step, on every rank, over ALL samples of the step (step-local order):
    norm = mode.step_normalizers(rollout_ids, loss_masks,
                                 global_batch_size=G, dp_size=dp, cp_size=cp,
                                 num_microbatches=M,          # per rank (naive_microbatch_mean)
                                 dp_rank_of_sample=ranks)     # only naive_rank_mean needs it
    prescale = mode.loss_prescale(norm, num_microbatches=M, dp_size=dp, cp_size=cp)
    # Megatron config: calculate_per_token_loss = mode.megatron_per_token_loss
    # per micro-batch on DP rank r / CP rank c, samples idx (step-local indices):
    loss_sum = mode.microbatch_loss_sum(
        x_local,                       # flat per-token values, CP-local pieces concatenated
        total_lengths=[...], response_lengths=[...], loss_masks=[full masks of idx],
        sample_denominators=norm.denominators_for(idx), cp_rank=c, cp_size=cp)
    loss_func returns (prescale * loss_sum,
                       torch.tensor(mode.megatron_num_tokens(masks)),
                       {"keys": keys, "values": torch.stack([count_slot, loss_sum.detach(), ...])})
    # with count_slot = mode.count_slot(masks); other metrics use the same loss-sum function.
    # after the step (per-micro-batch value vectors, all-reduced over the DP x CP group):
    report = reduce_train_step_metrics(values_per_microbatch, keys=keys,
                                       divisor=norm.report_divisor, group=dp_cp_group)

``divisor=None`` in :func:`reduce_train_step_metrics` selects slime's per-token
path (divide by slot 0 / cp). :func:`report_under_layout` runs this whole recipe
in one process for any layout (used by tests, benchmarks and notebooks).

Loss prescaling: why the gradient does not depend on dp, cp or packing
---------------------------------------------------------------------
Let ``R = dp * cp`` ranks each run ``M`` micro-batches, ``L_{r,m}`` the loss sum
of micro-batch ``m`` on rank ``r`` and ``S = sum_{r,m} L_{r,m} = sum_i s_i /
max(d_i, 1)`` (layout-free, see above). Megatron-core's schedule takes the
loss-function output ``(p * L_{r,m}, c_{r,m}, ...)`` and

* default path (``calculate_per_token_loss=False``): divides by
  ``max(c_{r,m}, 1)`` and by ``M``; DDP then averages gradients over the
  ``R`` DP x CP ranks. Our modes return ``c = 1``, so the net gradient is
  ``(1/R) * sum_{r,m} p * grad(L_{r,m}) / M = p / (R * M) * grad(S)``. With
  ``p = M * R / Z`` (:meth:`ReportMode.loss_prescale`) this is
  ``grad(S / Z) = grad(report)``: the gradient of the layout-free report.
  For per_rollout_mean, ``Z = G`` gives slime's factor ``M / G * dp * cp``.
* per-token path (``calculate_per_token_loss=True``, mode ``per_token``): no
  division in the schedule; DDP sums gradients; ``finalize_model_grads`` divides
  by the all-reduced ``sum c_{r,m}``. Each micro-batch returns the *full*
  unmasked token count of its samples, which all ``cp`` ranks of a sample
  report, so ``sum c = cp * N``. With ``p = cp`` the gradient is
  ``cp * grad(S) / (cp * N) = grad(S / N)``.

In both cases only step-global quantities (``Z``, ``N``, ``d_i``) and the
layout-free sum ``S`` remain, so the gradient is the same for every dp, cp and
packing. The naive modes use the same recipe; their ``S`` or ``Z`` depend on the
layout, which is exactly their bug.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from varbatch_kit.report.cp import _as_int, slice_response_for_cp, validate_cp

__all__ = [
    "LAYOUT_INVARIANT_MODES",
    "NAIVE_MODES",
    "REPORT_MODES",
    "ReportMode",
    "StepNormalizers",
    "gather_and_reduce_log_dict",
    "get_report_mode",
    "make_reducer",
    "masked_sums",
    "reduce_log_dicts",
    "reduce_train_step_metrics",
    "report_under_layout",
    "rollout_denominators",
    "rollout_log_metric_contribution",
    "sample_mask_sums",
    "sum_of_sample_means",
]

Layout = Sequence[Sequence[Sequence[int]]]  # layout[dp_rank][micro_batch] -> sample indices


# ---------------------------------------------------------------------------
# Validation at the boundary
# ---------------------------------------------------------------------------


def _int_list(name: str, values: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    return [_as_int(f"{name}[{i}]", v) for i, v in enumerate(values)]


def _check_samples(
    total_lengths: Sequence[int] | torch.Tensor,
    response_lengths: Sequence[int] | torch.Tensor,
    loss_masks: Sequence[torch.Tensor],
) -> tuple[list[int], list[int]]:
    """Validate per-sample lengths and masks; return the lengths as int lists."""
    totals = _int_list("total_lengths", total_lengths)
    responses = _int_list("response_lengths", response_lengths)
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


def _positive(name: str, value: float) -> float:
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
    ids = _int_list("rollout_ids", rollout_ids)
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
class _LocalPieces:
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
        cp_rank: int,
        cp_size: int,
    ) -> _LocalPieces:
        cp_rank, cp_size = validate_cp(cp_rank, cp_size)
        totals, _ = _check_samples(total_lengths, response_lengths, loss_masks)
        local = [
            slice_response_for_cp(m.detach(), t, cp_rank=cp_rank, cp_size=cp_size)
            for t, m in zip(totals, loss_masks)
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


def _denominator_tensor(
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
    cp_rank: int = 0,
    cp_size: int = 1,
) -> torch.Tensor:
    """Per-sample ``s_i = sum(x_i * m_i)`` over what CP rank ``cp_rank`` sees.

    ``values`` is flat: the samples' CP-local response values concatenated (the
    full responses when ``cp_size == 1``); ``loss_masks`` are the full masks.
    """
    return _LocalPieces.build(total_lengths, response_lengths, loss_masks, cp_rank, cp_size).sums(
        values
    )


def make_reducer(
    total_lengths: Sequence[int] | torch.Tensor,
    response_lengths: Sequence[int] | torch.Tensor,
    loss_masks: Sequence[torch.Tensor],
    sample_denominators: Sequence[float] | torch.Tensor | None = None,
    *,
    per_token: bool = False,
    cp_rank: int = 0,
    cp_size: int = 1,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function of a flat per-token tensor: ``sum_i s_i / max(d_i, 1)`` (or ``sum_i s_i``).

    The masks are sliced to CP rank ``cp_rank`` once, here; the denominators
    stay the full-sample (or full-rollout) ones, so the results of all CP ranks
    add up to the ``cp_size == 1`` value. ``sample_denominators=None`` uses each
    sample's own mask sum (per-sample mean); ``per_token=True`` ignores the
    denominators (plain masked token sum). The returned function is
    differentiable in its argument and checks its length.
    """
    pieces = _LocalPieces.build(total_lengths, response_lengths, loss_masks, cp_rank, cp_size)
    denoms = None if per_token else _denominator_tensor(sample_denominators, loss_masks)

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
    cp_rank: int = 0,
    cp_size: int = 1,
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


# ---------------------------------------------------------------------------
# Modes
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StepNormalizers:
    """Everything a mode divides by, computed once over the whole step.

    ``sample_denominators[i]`` is ``d_i`` of step-local sample ``i`` (float64,
    not yet clamped); ``report_divisor`` is ``Z`` (clamped to > 0).
    """

    mode: str
    sample_denominators: torch.Tensor
    report_divisor: float
    num_rollouts: int
    num_samples: int
    num_tokens: int

    def denominators_for(self, sample_indices: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """The denominators of the given step-local samples, in that order."""
        idx = torch.as_tensor(_int_list("sample_indices", sample_indices), dtype=torch.long)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.num_samples):
            raise ValueError(
                f"sample_indices={idx.tolist()} has an index outside [0, {self.num_samples}); "
                f"pass step-local sample indices"
            )
        return self.sample_denominators[idx]


_DENOMINATOR_KINDS = ("rollout", "own", "one", "rank")
_DIVISOR_KINDS = ("rollouts", "samples", "tokens", "samples_times_c", "microbatches", "dp")


@dataclass(frozen=True)
class ReportMode:
    """A loss / metric normalisation: per-sample denominators, a step divisor, a recipe.

    Attributes:
        name: registry name.
        denominators: ``"rollout"`` (rollout mask total), ``"own"`` (own mask
            sum), ``"one"`` or ``"rank"`` (own mask sum times the number of
            samples on the sample's DP rank; naive).
        divisor: which step-global quantity ``Z`` is (see the module table).
        megatron_per_token_loss: run Megatron with ``calculate_per_token_loss``.
        naive: for comparison only; the value depends on the layout.
        microbatch_mean: the loss sum is the micro-batch's own token mean (naive).
        norm_constant: ``C`` of ``seq-mean-token-sum-norm`` (None: the step's
            longest response).
        divides_by: the divisor in words (for docs, tables and notebooks).
    """

    name: str
    denominators: str
    divisor: str
    divides_by: str
    megatron_per_token_loss: bool = False
    naive: bool = False
    microbatch_mean: bool = False
    norm_constant: float | None = None
    description: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        assert self.denominators in _DENOMINATOR_KINDS, self.denominators
        assert self.divisor in _DIVISOR_KINDS, self.divisor

    # -- step-wide quantities ------------------------------------------------

    def step_normalizers(
        self,
        rollout_ids: Sequence[int] | torch.Tensor,
        loss_masks: Sequence[torch.Tensor],
        *,
        global_batch_size: int | None = None,
        dp_size: int = 1,
        cp_size: int = 1,
        num_microbatches: int = 1,
        dp_rank_of_sample: Sequence[int] | torch.Tensor | None = None,
    ) -> StepNormalizers:
        """Per-sample denominators and the report divisor of one step.

        Pass every sample of the step (step-local order). ``global_batch_size``
        is the step's rollout count (default: the number of distinct rollout
        ids). ``num_microbatches`` is per DP rank (used by
        ``naive_microbatch_mean``); ``dp_rank_of_sample`` (used by
        ``naive_rank_mean`` only) is each sample's DP rank.
        """
        ids = _int_list("rollout_ids", rollout_ids)
        if len(ids) != len(loss_masks):
            raise ValueError(
                f"len(rollout_ids)={len(ids)} != len(loss_masks)={len(loss_masks)}; "
                f"pass one rollout id per sample"
            )
        if not ids:
            raise ValueError("the step has 0 samples; a step needs at least one sample")
        dp_size = int(_positive("dp_size", dp_size))
        cp_size = int(_positive("cp_size", cp_size))
        num_microbatches = int(_positive("num_microbatches", num_microbatches))
        num_rollouts = len(set(ids))
        if global_batch_size is None:
            global_batch_size = num_rollouts
        gbs = _positive("global_batch_size", global_batch_size)
        own = sample_mask_sums(loss_masks)
        num_tokens = int(own.sum().item())
        num_samples = len(ids)

        if self.denominators == "rollout":
            denoms = rollout_denominators(ids, loss_masks)
        elif self.denominators == "own":
            denoms = own
        elif self.denominators == "one":
            denoms = torch.ones(num_samples, dtype=torch.float64)
        else:  # "rank": naive per-rank mean of sample means
            if dp_rank_of_sample is None:
                raise ValueError(
                    f"mode {self.name!r} needs dp_rank_of_sample (each sample's DP rank); "
                    f"pass a sequence of {num_samples} ints in [0, {dp_size})"
                )
            ranks = _int_list("dp_rank_of_sample", dp_rank_of_sample)
            if len(ranks) != num_samples or any(not 0 <= r < dp_size for r in ranks):
                raise ValueError(
                    f"dp_rank_of_sample={ranks} must have {num_samples} entries in "
                    f"[0, dp_size={dp_size})"
                )
            per_rank = torch.bincount(torch.tensor(ranks), minlength=dp_size).to(torch.float64)
            denoms = own.clamp_min(1.0) * per_rank[torch.tensor(ranks)]

        if self.divisor == "rollouts":
            divisor = gbs
        elif self.divisor == "samples":
            divisor = float(num_samples)
        elif self.divisor == "tokens":
            divisor = float(max(num_tokens, 1))
        elif self.divisor == "samples_times_c":
            c = self.norm_constant
            if c is None:
                c = max(int(m.shape[0]) for m in loss_masks)
            divisor = float(num_samples) * _positive("norm_constant", max(c, 1))
        elif self.divisor == "microbatches":
            divisor = float(num_microbatches * dp_size * cp_size)
        else:  # "dp"
            divisor = float(dp_size)
        return StepNormalizers(
            mode=self.name,
            sample_denominators=denoms,
            report_divisor=divisor,
            num_rollouts=num_rollouts,
            num_samples=num_samples,
            num_tokens=num_tokens,
        )

    # -- per micro-batch -----------------------------------------------------

    def microbatch_loss_sum(
        self,
        values: torch.Tensor,
        *,
        total_lengths: Sequence[int] | torch.Tensor,
        response_lengths: Sequence[int] | torch.Tensor,
        loss_masks: Sequence[torch.Tensor],
        sample_denominators: Sequence[float] | torch.Tensor | None,
        cp_rank: int = 0,
        cp_size: int = 1,
    ) -> torch.Tensor:
        """The micro-batch's contribution to the step numerator (differentiable).

        ``values``: flat per-token values of the micro-batch's samples, each
        sample's CP-local pieces concatenated; ``loss_masks``: their full masks;
        ``sample_denominators``: ``StepNormalizers.denominators_for(samples)``.
        For ``naive_microbatch_mean`` this is the micro-batch's own token mean
        over what the rank sees (denominators ignored).
        """
        pieces = _LocalPieces.build(total_lengths, response_lengths, loss_masks, cp_rank, cp_size)
        sums = pieces.sums(values)
        if self.microbatch_mean:
            return sums.sum() / max(float(pieces.counts().sum().item()), 1.0)
        if sample_denominators is None:
            raise ValueError(
                f"mode {self.name!r} needs sample_denominators; pass "
                f"StepNormalizers.denominators_for(sample_indices)"
            )
        denoms = _denominator_tensor(sample_denominators, loss_masks)
        return (sums / denoms.to(device=sums.device, dtype=sums.dtype)).sum()

    def megatron_num_tokens(self, loss_masks: Sequence[torch.Tensor]) -> int:
        """The token count the loss function returns to Megatron for a micro-batch.

        ``per_token``: the micro-batch samples' full unmasked token count (every
        CP rank reports it in full); every other mode: 1.
        """
        if self.megatron_per_token_loss:
            return int(sample_mask_sums(loss_masks).sum().item())
        return 1

    def count_slot(self, loss_masks: Sequence[torch.Tensor]) -> int:
        """Slot 0 of the reported value vector: the full token count for per_token, else 0."""
        return self.megatron_num_tokens(loss_masks) if self.megatron_per_token_loss else 0

    def loss_prescale(
        self, normalizers: StepNormalizers, *, num_microbatches: int, dp_size: int, cp_size: int
    ) -> float:
        """Factor the micro-batch loss sum gets before Megatron's schedule.

        ``cp`` for ``per_token`` (Megatron's per-token path), else
        ``num_microbatches * dp * cp / Z``. See the module docstring for why
        the resulting gradient is ``grad(report)`` for any dp, cp and packing.
        """
        m = _positive("num_microbatches", num_microbatches)
        dp = _positive("dp_size", dp_size)
        cp = _positive("cp_size", cp_size)
        if self.megatron_per_token_loss:
            return cp
        return m * dp * cp / _positive("report_divisor", normalizers.report_divisor)

    def with_options(self, **options: Any) -> ReportMode:
        """A copy with ``norm_constant`` (the only option) set."""
        unknown = set(options) - {"norm_constant"}
        if unknown:
            raise ValueError(
                f"unknown option(s) {sorted(unknown)} for mode {self.name!r}; "
                f"the only option is norm_constant"
            )
        c = options.get("norm_constant")
        if c is not None:
            if self.divisor != "samples_times_c":
                raise ValueError(
                    f"norm_constant applies to 'seq-mean-token-sum-norm' only, not {self.name!r}"
                )
            _positive("norm_constant", c)
        return ReportMode(**{**self.__dict__, "norm_constant": c})


def _modes() -> dict[str, ReportMode]:
    modes = [
        ReportMode(
            "per_rollout_mean",
            "rollout",
            "rollouts",
            "global_batch_size: the number of rollouts in the step",
            description="slime default: each rollout's masked token mean, averaged over rollouts",
        ),
        ReportMode(
            "per_sample_mean",
            "own",
            "samples",
            "the number of samples in the step",
            description="slime legacy: each sample's masked token mean, averaged over samples",
        ),
        ReportMode(
            "per_token",
            "one",
            "tokens",
            "the global count of unmasked tokens of the step (all-reduced slot 0 / cp)",
            megatron_per_token_loss=True,
            description="slime per-token: masked token sum over the step's token count",
        ),
        ReportMode(
            "token-mean",
            "one",
            "tokens",
            "the global count of unmasked tokens of the step (precomputed)",
            description="verl token-mean: one mean over every unmasked token of the step",
        ),
        ReportMode(
            "seq-mean-token-mean",
            "own",
            "samples",
            "the number of samples (sequences) in the step",
            description="verl seq-mean-token-mean: mean over sequences of token means",
        ),
        ReportMode(
            "seq-mean-token-sum",
            "one",
            "samples",
            "the number of samples (sequences) in the step",
            description="verl seq-mean-token-sum: mean over sequences of token sums",
        ),
        ReportMode(
            "seq-mean-token-sum-norm",
            "one",
            "samples_times_c",
            "the number of samples in the step times a constant C (verl loss_scale_factor; "
            "default: the step's longest response)",
            description="verl seq-mean-token-sum-norm (Dr. GRPO): token sums over a constant",
        ),
        ReportMode(
            "naive_microbatch_mean",
            "one",
            "microbatches",
            "num_microbatches * dp * cp: it averages per-micro-batch token means (NAIVE)",
            naive=True,
            microbatch_mean=True,
            description="FOR COMPARISON ONLY: mean of per-micro-batch token means "
            "(Hugging Face transformers gradient-accumulation bug, issue 34191)",
        ),
        ReportMode(
            "naive_rank_mean",
            "rank",
            "dp",
            "dp: it averages per-DP-rank means of sample means (NAIVE)",
            naive=True,
            description="FOR COMPARISON ONLY: per-rank mean of sample means, averaged over DP "
            "ranks (slime before PR #1930)",
        ),
    ]
    return {m.name: m for m in modes}


REPORT_MODES: Mapping[str, ReportMode] = MappingProxyType(_modes())
"""Registry: mode name -> :class:`ReportMode`."""

LAYOUT_INVARIANT_MODES: tuple[str, ...] = tuple(n for n, m in REPORT_MODES.items() if not m.naive)
NAIVE_MODES: tuple[str, ...] = tuple(n for n, m in REPORT_MODES.items() if m.naive)


def get_report_mode(name: str, **options: Any) -> ReportMode:
    """Look up a mode by name; ``norm_constant=C`` configures ``seq-mean-token-sum-norm``."""
    if name not in REPORT_MODES:
        raise ValueError(f"unknown report mode {name!r}; choose one of {list(REPORT_MODES)}")
    mode = REPORT_MODES[name]
    return mode.with_options(**options) if options else mode


def _resolve_mode(mode: str | ReportMode) -> ReportMode:
    return mode if isinstance(mode, ReportMode) else get_report_mode(mode)


# ---------------------------------------------------------------------------
# Step reduction and logging
# ---------------------------------------------------------------------------


def _collective_device(group: Any) -> torch.device:
    """The device a tensor collective on ``group`` needs: CUDA for NCCL, else CPU.

    A ``group`` that torch.distributed does not know (a stand-in object, as
    slime's single-process tests pass with a patched ``dist.all_reduce``) gets
    CPU: the collective itself then decides whether the group is usable.
    """
    try:
        backend = dist.get_backend(group)
    except (ValueError, RuntimeError, TypeError, AttributeError):
        return torch.device("cpu")
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_train_step_metrics(
    microbatch_values: Sequence[torch.Tensor],
    *,
    keys: Sequence[str],
    divisor: float | None,
    cp_size: int = 1,
    group: Any = None,
) -> dict[str, float]:
    """Sum per-micro-batch ``[slot0, sum_1, ..., sum_k]`` vectors, all-reduce, divide.

    The vectors of this rank's micro-batches are summed (float64), all-reduced
    (sum) over ``group`` (the DP x CP group; ``None``: single process, no
    communication), and each metric sum is divided by ``divisor`` (the step's
    report divisor, e.g. the rollout count) or, with ``divisor=None`` (slime's
    per-token path), by ``slot0 / cp_size``: every CP rank counted its samples'
    tokens in full (computed as ``sum * cp_size / slot0``, slime's operations, so
    the float is slime's to the last bit). A zero token count reports 0, never
    NaN. A rank with no micro-batches passes an empty sequence. The sums are
    float64 on the CPU and move, for the all-reduce only, to the device the
    group's backend needs (CUDA for NCCL).
    """
    keys = list(keys)
    _, cp_size = validate_cp(0, cp_size)
    if divisor is not None:
        divisor = _positive("divisor (step batch size)", divisor)
    width = len(keys) + 1
    total = torch.zeros(width, dtype=torch.float64)
    for j, v in enumerate(microbatch_values):
        v = torch.as_tensor(v).detach().to(device="cpu", dtype=torch.float64).reshape(-1)
        if v.numel() != width:
            raise ValueError(
                f"microbatch_values[{j}] has {v.numel()} entries but keys={keys} needs "
                f"{width} (slot 0 = token count or 0, then one sum per key)"
            )
        total += v
    if group is not None:
        device = _collective_device(group)
        reduced = total.to(device)
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM, group=group)
        total = reduced.cpu()
    sums = [float(total[i + 1].item()) for i in range(len(keys))]
    if divisor is None:
        count = float(total[0].item())
        if count >= cp_size:  # ``sum * cp / count``: slime's operations, so the same float
            return {k: v * cp_size / count for k, v in zip(keys, sums)}
        divisor = 1.0  # no token counted (slot0 < cp): clamp, report 0, never NaN
    return {k: v / divisor for k, v in zip(keys, sums)}


def rollout_log_metric_contribution(
    per_rank_reducer_sum: float | torch.Tensor,
    *,
    cp_size: int,
    num_rollouts: int,
    dp_size: int,
) -> tuple[float, float]:
    """A rank's ``(sum, count)`` log entry for a rollout-side metric.

    ``per_rank_reducer_sum`` is the rank's reducer value over its CP-local
    pieces (the per-rollout-mean reducer of :func:`make_reducer`). Every rank of
    the DP x CP group emits ``(cp * reducer_sum, num_rollouts / dp)``; gathered
    over that group, ``sum(sums) / sum(counts) = cp * S / (cp * num_rollouts) =
    S / num_rollouts``, which for a one-step rollout is the train-step report.
    """
    _, cp_size = validate_cp(0, cp_size)
    dp = _positive("dp_size", dp_size)
    n = _positive("num_rollouts", num_rollouts)
    if isinstance(per_rank_reducer_sum, torch.Tensor):
        per_rank_reducer_sum = float(per_rank_reducer_sum.detach().item())
    return cp_size * float(per_rank_reducer_sum), n / dp


def _scalar(key: str, rank: int, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"log entry {key!r} on rank {rank} is a tensor of shape {tuple(value.shape)}; "
                f"pass a scalar or a (sum, count) pair"
            )
        return float(value.detach().item())
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    raise ValueError(
        f"log entry {key!r} on rank {rank} is {value!r}; pass a number or a (sum, count) pair"
    )


def reduce_log_dicts(log_dicts: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Combine the per-rank log dicts of a group (pure; one dict per rank).

    A ``(sum, count)`` entry reports ``sum(sums) / sum(counts)`` (0 when both
    are 0); a scalar entry reports its mean over ranks. Every rank must log the
    same keys, and a key must be a pair on every rank or a scalar on every rank.
    """
    if not log_dicts:
        raise ValueError("log_dicts is empty; pass one log dict per rank")
    keys = list(log_dicts[0])
    for r, d in enumerate(log_dicts):
        if set(d) != set(keys):
            raise ValueError(
                f"rank {r} logs keys {sorted(d)} but rank 0 logs {sorted(keys)}; every rank "
                f"of the group must log the same keys"
            )
    out: dict[str, float] = {}
    for key in keys:
        is_pair = [isinstance(d[key], (tuple, list)) for d in log_dicts]
        if any(is_pair) and not all(is_pair):
            pairs = [r for r, p in enumerate(is_pair) if p]
            scalars = [r for r, p in enumerate(is_pair) if not p]
            raise ValueError(
                f"log entry {key!r} is a (sum, count) pair on ranks {pairs} but a scalar on "
                f"ranks {scalars}; log it the same way on every rank"
            )
        if all(is_pair):
            sums, counts = 0.0, 0.0
            for r, d in enumerate(log_dicts):
                if len(d[key]) != 2:
                    raise ValueError(
                        f"log entry {key!r} on rank {r} is {d[key]!r}; a pair must be (sum, count)"
                    )
                sums += _scalar(key, r, d[key][0])
                counts += _scalar(key, r, d[key][1])
            if counts == 0:
                if sums != 0:
                    raise ValueError(
                        f"log entry {key!r} has total count 0 but total sum {sums}; a (sum, "
                        f"count) pair needs a positive count wherever its sum is non-zero"
                    )
                out[key] = 0.0
            else:
                out[key] = sums / counts
        else:
            out[key] = sum(_scalar(key, r, d[key]) for r, d in enumerate(log_dicts)) / len(
                log_dicts
            )
    return out


def gather_and_reduce_log_dict(
    log_dict: Mapping[str, Any], *, group: Any = None
) -> dict[str, float]:
    """Gather every rank's log dict over ``group`` and reduce (:func:`reduce_log_dicts`).

    Uses ``all_gather_object``, so every rank gets the reduced dict and every
    rank raises the same ``ValueError`` on inconsistent entries (no rank is
    left waiting in a later collective). ``group=None``: single process.
    """
    if group is None:
        return reduce_log_dicts([dict(log_dict)])
    world = dist.get_world_size(group)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, dict(log_dict), group=group)
    return reduce_log_dicts(gathered)


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
    mode = _resolve_mode(mode)
    totals, responses = _check_samples(total_lengths, response_lengths, loss_masks)
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
