"""Report modes: how a step's sums are normalised (slime's, verl's, and two naive ones).

:data:`REPORT_MODES` is the registry; :func:`get_report_mode` looks a mode up.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from varbatch_kit.report.cp import per_sample_cp, reference_cp_size, validate_cp
from varbatch_kit.report.reducers import (
    LocalPieces,
    denominator_tensor,
    rollout_denominators,
    sample_mask_sums,
)
from varbatch_kit.report.validation import int_list, positive

# ---------------------------------------------------------------------------
# Modes
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StepNormalizers:
    """Everything a mode divides by, computed once over the whole step.

    ``sample_denominators[i]`` is ``d_i`` of step-local sample ``i`` (float64,
    not yet clamped); ``report_divisor`` is ``Z`` (clamped to > 0).
    ``sample_cp_sizes`` is each sample's CP degree when the step was given one
    per sample (dynamic CP; None when one ``cp_size`` applies to the step) and
    ``reference_cp`` the step's reference degree ``K`` (the lcm of the degrees;
    ``cp_size`` itself for one degree): slot 0 of the per-token path counts
    every token ``K`` times over the group (:meth:`ReportMode.count_slot`).
    """

    mode: str
    sample_denominators: torch.Tensor
    report_divisor: float
    num_rollouts: int
    num_samples: int
    num_tokens: int
    sample_cp_sizes: tuple[int, ...] | None = None
    reference_cp: int = 1

    def cp_sizes_for(self, sample_indices: Sequence[int] | torch.Tensor) -> list[int] | None:
        """The CP degrees of the given step-local samples (None: one degree for the step)."""
        if self.sample_cp_sizes is None:
            return None
        return [self.sample_cp_sizes[i] for i in int_list("sample_indices", sample_indices)]

    def denominators_for(self, sample_indices: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """The denominators of the given step-local samples, in that order."""
        idx = torch.as_tensor(int_list("sample_indices", sample_indices), dtype=torch.long)
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
        empty_counts_one: the token count counts a fully masked sample as one
            token (slime's ``clamp_min(loss_mask.sum(), 1)`` in ``loss_function``;
            ``per_token``).
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
    empty_counts_one: bool = False
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
        cp_size: int | Sequence[int] = 1,
        num_microbatches: int = 1,
        dp_rank_of_sample: Sequence[int] | torch.Tensor | None = None,
    ) -> StepNormalizers:
        """Per-sample denominators and the report divisor of one step.

        Pass every sample of the step (step-local order). ``global_batch_size``
        is the step's rollout count (default: the number of distinct rollout
        ids). ``num_microbatches`` is per DP rank (used by
        ``naive_microbatch_mean``); ``dp_rank_of_sample`` (used by
        ``naive_rank_mean`` only) is each sample's DP rank. ``cp_size`` is one
        degree for the whole step, or (dynamic CP) each sample's own degree;
        the sound modes' denominators and divisors do not depend on it, only
        the reference degree of the per-token count does
        (:attr:`StepNormalizers.reference_cp`).
        """
        ids = int_list("rollout_ids", rollout_ids)
        if len(ids) != len(loss_masks):
            raise ValueError(
                f"len(rollout_ids)={len(ids)} != len(loss_masks)={len(loss_masks)}; "
                f"pass one rollout id per sample"
            )
        if not ids:
            raise ValueError("the step has 0 samples; a step needs at least one sample")
        dp_size = int(positive("dp_size", dp_size))
        sample_cp_sizes = None
        if isinstance(cp_size, (int, float, np.integer)) or (
            isinstance(cp_size, torch.Tensor) and cp_size.dim() == 0
        ):
            cp_size = int(positive("cp_size", cp_size))
            reference_cp = cp_size
        else:
            per_sample = per_sample_cp(0, cp_size, len(ids))
            assert per_sample is not None
            sample_cp_sizes = tuple(per_sample[1])
            reference_cp = reference_cp_size(sample_cp_sizes)
            cp_size = reference_cp  # the naive micro-batch divisor counts K ranks per sample
        num_microbatches = int(positive("num_microbatches", num_microbatches))
        num_rollouts = len(set(ids))
        if global_batch_size is None:
            global_batch_size = num_rollouts
        gbs = positive("global_batch_size", global_batch_size)
        own = sample_mask_sums(loss_masks)
        num_tokens = int((own.clamp_min(1.0) if self.empty_counts_one else own).sum().item())
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
            ranks = int_list("dp_rank_of_sample", dp_rank_of_sample)
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
            divisor = float(num_samples) * positive("norm_constant", max(c, 1))
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
            sample_cp_sizes=sample_cp_sizes,
            reference_cp=reference_cp,
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
        cp_rank: int | Sequence[int] = 0,
        cp_size: int | Sequence[int] = 1,
    ) -> torch.Tensor:
        """The micro-batch's contribution to the step numerator (differentiable).

        ``values``: flat per-token values of the micro-batch's samples, each
        sample's CP-local pieces concatenated; ``loss_masks``: their full masks;
        ``sample_denominators``: ``StepNormalizers.denominators_for(samples)``;
        ``cp_rank`` / ``cp_size``: one int, or one entry per sample (dynamic CP).
        For ``naive_microbatch_mean`` this is the micro-batch's own token mean
        over what the rank sees (denominators ignored).
        """
        pieces = LocalPieces.build(total_lengths, response_lengths, loss_masks, cp_rank, cp_size)
        sums = pieces.sums(values)
        if self.microbatch_mean:
            return sums.sum() / max(float(pieces.counts().sum().item()), 1.0)
        if sample_denominators is None:
            raise ValueError(
                f"mode {self.name!r} needs sample_denominators; pass "
                f"StepNormalizers.denominators_for(sample_indices)"
            )
        denoms = denominator_tensor(sample_denominators, loss_masks)
        return (sums / denoms.to(device=sums.device, dtype=sums.dtype)).sum()

    def megatron_num_tokens(
        self,
        loss_masks: Sequence[torch.Tensor],
        *,
        cp_size: int | Sequence[int] | None = None,
        reference_cp: int | None = None,
    ) -> int:
        """The token count the loss function returns to Megatron for a micro-batch.

        ``per_token``: the micro-batch samples' full unmasked token count (every
        CP rank reports it in full); every other mode: 1.

        Dynamic CP: pass the samples' degree(s) ``cp_size`` and the step's
        ``reference_cp`` ``K`` (:attr:`StepNormalizers.reference_cp`); each CP
        rank then counts a sample of degree ``c`` with ``n_i * K / c`` tokens,
        so its ``c`` ranks count it ``K`` times in all: the fixed-CP sum
        ``cp * N`` with ``cp = K``, whatever the degrees. With one degree equal
        to ``K`` (or neither given) this is the count above, unchanged.
        """
        if not self.megatron_per_token_loss:
            return 1
        return _weighted_token_count(loss_masks, cp_size, reference_cp,
                                     empty_counts_one=self.empty_counts_one)

    def count_slot(
        self,
        loss_masks: Sequence[torch.Tensor],
        *,
        cp_size: int | Sequence[int] | None = None,
        reference_cp: int | None = None,
    ) -> int:
        """Slot 0 of the reported value vector: the token count for per_token, else 0.

        The count is :meth:`megatron_num_tokens`' (the same ``cp_size`` /
        ``reference_cp`` rule), so the all-reduced slot 0 is ``K * N`` and
        :func:`~varbatch_kit.report.reduce_train_step_metrics` with
        ``cp_size=K`` divides by ``N``.
        """
        if not self.megatron_per_token_loss:
            return 0
        return self.megatron_num_tokens(loss_masks, cp_size=cp_size, reference_cp=reference_cp)

    def loss_prescale(
        self, normalizers: StepNormalizers, *, num_microbatches: int, dp_size: int, cp_size: int
    ) -> float:
        """Factor the micro-batch loss sum gets before Megatron's schedule.

        ``cp`` for ``per_token`` (Megatron's per-token path), else
        ``num_microbatches * dp * cp / Z``. See the module docstring for why
        the resulting gradient is ``grad(report)`` for any dp, cp and packing.

        Dynamic CP: ``dp * cp`` is the rank pool whose gradients DDP averages
        (``cp`` the pool's CP size, an int, not a sample's degree) and
        ``num_microbatches`` the micro-batches *this* rank runs (ranks may run
        different counts; Megatron divides by each rank's own). ``per_token``
        returns the step's reference degree ``K`` when the normalisers were
        built with per-sample degrees (the token count is ``K * N`` then).
        """
        m = positive("num_microbatches", num_microbatches)
        dp = positive("dp_size", dp_size)
        if not isinstance(cp_size, (int, float, np.integer, torch.Tensor)):
            raise ValueError(
                f"cp_size={cp_size!r}: loss_prescale needs the CP size of the rank pool (an int; "
                f"dp_size * cp_size ranks average the gradients), not per-sample degrees; those "
                f"go to step_normalizers"
            )
        cp = positive("cp_size", cp_size)
        if self.megatron_per_token_loss:
            if normalizers.sample_cp_sizes is not None:
                return float(normalizers.reference_cp)
            return cp
        return m * dp * cp / positive("report_divisor", normalizers.report_divisor)

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
            positive("norm_constant", c)
        return ReportMode(**{**self.__dict__, "norm_constant": c})


def _weighted_token_count(
    loss_masks: Sequence[torch.Tensor],
    cp_size: int | Sequence[int] | None,
    reference_cp: int | None,
    *,
    empty_counts_one: bool = False,
) -> int:
    """``sum_i n_i * K / c_i`` (``n_i`` a sample's unmasked tokens, at least 1 with
    ``empty_counts_one``; ``c_i`` its degree)."""
    sums = sample_mask_sums(loss_masks)
    if empty_counts_one:
        sums = sums.clamp_min(1.0)
    if cp_size is None and reference_cp is None:
        return int(sums.sum().item())
    per_sample = per_sample_cp(0, 1 if cp_size is None else cp_size, len(loss_masks))
    if per_sample is None:
        sizes = [validate_cp(0, 1 if cp_size is None else cp_size)[1]] * len(loss_masks)
    else:
        sizes = per_sample[1]
    k = reference_cp_size(sizes) if reference_cp is None else validate_cp(0, reference_cp)[1]
    if all(c == k for c in sizes):
        return int(sums.sum().item())  # every rank counts in full: the fixed-CP count
    bad = sorted({c for c in sizes if k % c})
    if bad:
        raise ValueError(
            f"reference_cp={k} is not a multiple of the CP degree(s) {bad}; pass the step's "
            f"reference degree (StepNormalizers.reference_cp, the lcm of its degrees)"
        )
    weights = torch.tensor([k // c for c in sizes], dtype=torch.float64)
    return int((sums * weights).sum().item())


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
            "the global count of unmasked tokens of the step, a fully masked sample counting "
            "one (all-reduced slot 0 / cp)",
            megatron_per_token_loss=True,
            empty_counts_one=True,
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


def resolve_mode(mode: str | ReportMode) -> ReportMode:
    return mode if isinstance(mode, ReportMode) else get_report_mode(mode)
