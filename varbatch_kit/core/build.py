"""`build_schedule`: rollouts → steps → micro-batches → placements on the rank pool.

"Pack first, distribute second" (docs/reference_semantics.md §2): each step holds
exactly ``global_batch_size`` rollouts (so a variable number of samples); the
step's samples are packed into micro-batches by the configured packer, the
bin count is aligned to a multiple of ``dp`` (times ``mb_group`` under
virtual pipelining), and the micro-batches are distributed over DP ranks,
each rank's in the configured ``microbatch_order``. The step's *planner*
turns that into placements (:class:`~varbatch_kit.core.step.Step`): under
fixed CP DP rank ``d``'s micro-batches run round after round on its CP
replica; under dynamic CP :func:`~varbatch_kit.policies.dynamic_cp.plan_dynamic_cp`
gives each micro-batch its own degree and group. With
``alignment_fallback="drop_rollouts"`` a step that cannot be aligned trains
fewer rollouts and moves its trailing ones to the next step (the same
per-step builder, :func:`_build_step`, tries the shorter prefixes).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from varbatch_kit.core.config import ScheduleConfig
from varbatch_kit.core.flops import ModelShape
from varbatch_kit.core.hardware import cp_cost_model
from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.core.schedule import Schedule, step_rollout_groups
from varbatch_kit.core.step import Step
from varbatch_kit.core.workload import balancing_weights
from varbatch_kit.policies.distributions import BinWeights
from varbatch_kit.policies.dynamic_cp import CPCostModel, plan_dynamic_cp
from varbatch_kit.policies.order import apply_order
from varbatch_kit.policies.packers import AlignmentError, PackInput, split_to_target
from varbatch_kit.policies.registry import get_distribution, get_packer

__all__ = ["DROPPED_ROLLOUTS_MESSAGE", "OversizeSampleWarning", "build_schedule",
           "order_rank_bins", "oversize_samples"]

log = logging.getLogger("varbatch_kit")

class OversizeSampleWarning(UserWarning):
    """Samples of the schedule are longer than the token cap (each trains alone, over it)."""


#: ``planner(index, rollout_ids, samples, step_lengths, bins, dp_rank_bins) -> Step``:
#: the placements of one step's micro-batches (``bins``: step-local positions)
Planner = Callable[[int, np.ndarray, np.ndarray, np.ndarray, list, list], Step]


def _planner(config: ScheduleConfig, model: ModelShape | None,
             cp_cost: CPCostModel | None) -> Planner:
    """The step planner of ``config.cp_mode`` (the one place the builder tells the modes apart)."""
    if config.cp_mode == "dynamic":
        if model is None:
            raise ValueError(
                "cp_mode='dynamic' plans CP degrees with a cost model of the model's linear and "
                "attention FLOPs and needs a model shape: pass model=ModelShape.preset('qwen3-8b')"
                " (or another preset / from_hf_config)")
        if cp_cost is None:
            cp_cost = cp_cost_model(model)
        elif not isinstance(cp_cost, CPCostModel):
            raise ValueError(f"cp_cost must be a CPCostModel or None, got {type(cp_cost).__name__}")

        def dynamic(s, ids, samples, step_len, bins, dp_rank_bins):
            plan = plan_dynamic_cp(step_len, dp=config.dp, cp=config.cp,
                                   cap=config.max_tokens_per_gpu, degrees=config.cp_degrees,
                                   cost=cp_cost, fixed=([list(b) for b in bins], dp_rank_bins))
            mbs = [samples[np.asarray(b, dtype=np.int64)] for b in plan.bins]
            return Step.from_placements(s, ids, samples, mbs, list(zip(plan.rounds, plan.groups)),
                                        dp=config.dp, cp=config.cp)
        return dynamic

    def fixed(s, ids, samples, step_len, bins, dp_rank_bins):
        mbs = [samples[np.asarray(b, dtype=np.int64)] for b in bins]
        return Step.from_dp_ranks(s, ids, samples, mbs, dp_rank_bins, cp=config.cp)
    return fixed


@dataclass(frozen=True)
class _StepBuilder:
    """Everything :func:`_build_step` needs besides the step's own rollouts."""

    config: ScheduleConfig
    lengths: np.ndarray
    flops: np.ndarray | None
    planner: Planner
    #: per-sample weights the policies balance: ``flops``, or ``config.workload``'s costs
    weights: np.ndarray | None = None

    def __call__(self, s: int, ids: np.ndarray, samples: np.ndarray) -> Step:
        return _build_step(self, s, ids, samples)


def _build_step(b: _StepBuilder, s: int, ids: np.ndarray, samples: np.ndarray) -> Step:
    """Step ``s`` of rollouts ``ids`` (global ``samples``): pack, align, distribute, order, plan.

    Raises :class:`~varbatch_kit.policies.packers.AlignmentError` naming step ``s``.
    """
    config, lengths, flops = b.config, b.lengths, b.weights
    packer = get_packer(config.packing)
    distribution = get_distribution(config.distribution)
    dp, align = config.dp, config.align
    n = samples.size
    if n < dp:
        raise AlignmentError(
            f"step {s}: {n} samples < dp_size {dp}; step {s} holds {n} samples but dp={dp}: "
            f"every rank needs at least one sample. Use dp <= {n} or a larger "
            "global_batch_size"
        )
    step_len = lengths[samples]
    inp = PackInput(
        lengths=step_len,
        flops=None if flops is None else flops[samples],
        cap=config.cap,
        micro_batch_size=config.micro_batch_size,
        align=align,
    )
    bins = packer.fn(inp)
    k = len(bins)
    target = max(math.ceil(k / align) * align, align)
    if config.dynamic:
        if target > n:
            raise AlignmentError(
                f"dynamic path: could only produce {n} mbs after maximal splitting; need "
                f"{target}. step {s} holds {n} samples but the layout needs {target} "
                "micro-batches "
                f"(a multiple of dp*mb_group={align}, at least one sample each); slime stalls "
                "here (its issue #2065). Use a smaller dp or mb_group, or a larger "
                "global_batch_size"
            )
        bins = split_to_target(bins, step_len, target, step=s)
    elif k != target:
        raise _static_alignment_error(s, n, k, config)
    step_flops = None if flops is None else flops[samples].tolist()
    if config.workload is not None:  # c0 per micro-batch plus its samples' costs
        bin_flops = config.workload.bin_costs(flops[samples], bins)
    elif step_flops is not None:  # summed in bin order, as slime does, so ties break identically
        bin_flops = np.array([sum(step_flops[i] for i in x) for x in bins], dtype=np.float64)
    else:
        bin_flops = None
    weights = BinWeights(
        tokens=np.array([int(step_len[x].sum()) for x in bins], dtype=np.int64),
        flops=bin_flops,
    )
    rank_bins = distribution.fn(weights, dp)
    if packer.refine is not None:  # e.g. 'balanced': moves samples between ranks
        bins, rank_bins = packer.refine(inp, bins, [list(x) for x in rank_bins])
    micro_batches = [samples[np.asarray(x, dtype=np.int64)] for x in bins]
    rank_bins = order_rank_bins(config, rank_bins, micro_batches, lengths, flops)
    return b.planner(s, ids, samples, step_len, bins, [list(x) for x in rank_bins])


def _static_alignment_error(step: int, n: int, k: int, cfg: ScheduleConfig) -> AlignmentError:
    align, m = cfg.align, cfg.micro_batch_size
    good_m = [c for c in range(1, n + 1) if math.ceil(n / c) % align == 0]
    hint = (f"micro_batch_size in {good_m[:8]}" if good_m else
            f"a step with at least {align} samples")
    return AlignmentError(
        f"static path: num_mbs ({k}) is not a multiple of dp_size * mb_group ({align}); "
        f"step {step}: {n} samples in micro-batches of micro_batch_size={m} give {k} "
        f"micro-batches, not a multiple of dp*mb_group={align} (static batching cannot split "
        f"micro-batches). Use {hint} for this step, or a global_batch_size whose steps hold a "
        f"multiple of micro_batch_size*dp*mb_group={m * align} samples (for one-sample "
        f"rollouts: global_batch_size={m * align}, {2 * m * align}, ...)"
    )


def build_schedule(
    rollouts: Rollouts,
    config: ScheduleConfig,
    model: ModelShape | None = None,
    *,
    progress: bool = False,
    cp_cost: CPCostModel | None = None,
) -> Schedule:
    """Turn a rollout batch into training steps → micro-batches → placements on the ranks.

    Parameters
    ----------
    rollouts:
        The batch (samples with their rollout ids).
    config:
        Layout and policy; see :class:`ScheduleConfig`.
    model:
        Model shape for FLOPs weights; required by FLOPs-based packings and
        distributions (unless ``config.workload`` gives the weights) and by
        ``cp_mode="dynamic"``, optional otherwise (then ``stats()`` has no
        FLOPs).
    progress:
        Show a tqdm progress bar over steps.
    cp_cost:
        ``cp_mode="dynamic"`` only: the cost model the plans minimise the
        step's makespan under; defaults to
        :func:`~varbatch_kit.core.hardware.cp_cost_model` of ``model`` (the
        simulator's default H100 figures). Pass
        ``cp_cost_model(model, hardware, efficiency, ...)`` to plan for other
        simulator settings.

    Raises
    ------
    ValueError
        For impossible layouts (too few rollouts, a step with fewer samples
        than dp, a bin count that cannot be aligned), naming the step and
        what would work. The alignment ones are
        :class:`~varbatch_kit.policies.packers.AlignmentError` (a
        ``ValueError``); ``config.alignment_fallback="drop_rollouts"`` turns
        them into deferred rollouts where a shorter step aligns.
    """
    if not isinstance(rollouts, Rollouts):
        raise ValueError(f"rollouts must be a varbatch_kit.Rollouts, got {type(rollouts).__name__}")
    if not isinstance(config, ScheduleConfig):
        raise ValueError(f"config must be a ScheduleConfig, got {type(config).__name__}")
    packer = get_packer(config.packing)
    distribution = get_distribution(config.distribution)
    if model is None and config.workload is None and (packer.needs_flops
                                                      or distribution.needs_flops):
        need = config.packing if packer.needs_flops else config.distribution
        raise ValueError(
            f"{need!r} balances FLOPs and needs a model shape: pass "
            "model=ModelShape.preset('qwen3-8b') (or another preset / from_hf_config), or "
            "balance a measured cost: ScheduleConfig(workload=MicroBatchCostModel.load(...))"
        )
    if model is not None and not isinstance(model, ModelShape):
        raise ValueError(f"model must be a ModelShape or None, got {type(model).__name__}")
    lengths = rollouts.total_len
    flops = model.forward_flops(lengths) if model is not None else None
    builder = _StepBuilder(config, lengths, flops, _planner(config, model, cp_cost),
                           balancing_weights(config.workload, lengths, flops))
    if config.alignment_fallback == "drop_rollouts":
        return _warn_oversize(_build_deferring(rollouts, builder, model, progress=progress))
    groups, dropped_ids, dropped = step_rollout_groups(rollouts, config.global_batch_size)
    _warn_dropped(dropped_ids, dropped, config.global_batch_size)
    iterator = groups
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(groups, desc="scheduling steps", unit="step")
    steps = [builder(s, ids, samples) for s, (ids, samples) in enumerate(iterator)]
    return _warn_oversize(Schedule(config, rollouts, steps, dropped_ids, dropped, model, flops))


def oversize_samples(schedule: Schedule) -> np.ndarray:
    """The scheduled samples longer than the largest cap a micro-batch can get, ascending.

    That cap is ``max_tokens_per_gpu * c`` for the largest CP degree ``c`` the
    config allows (``max_tokens_per_gpu * cp`` under fixed CP); such a sample
    trains alone in a micro-batch over it (``oversize_alone`` in
    :meth:`Schedule.stats` and :func:`varbatch_kit.analysis.quality.step_quality`),
    an out-of-memory risk no packing can avoid. Empty on the static path (no cap).
    """
    cfg = schedule.config
    if cfg.max_tokens_per_gpu is None or not schedule.steps:
        return np.zeros(0, dtype=np.int64)
    cap = cfg.max_tokens_per_gpu * max(cfg.cp_degrees)
    kept = np.sort(np.concatenate([st.sample_indices for st in schedule.steps]))
    return kept[schedule.rollouts.total_len[kept] > cap]


def _warn_oversize(schedule: Schedule) -> Schedule:
    """Warn (:class:`OversizeSampleWarning`) with the count and share of over-cap samples."""
    over = oversize_samples(schedule)
    if over.size:
        cfg = schedule.config
        cap = cfg.max_tokens_per_gpu * max(cfg.cp_degrees)
        n = sum(st.num_samples for st in schedule.steps)
        longest = int(schedule.rollouts.total_len[over].max())
        warnings.warn(
            f"{over.size} of {n} samples ({100 * over.size / n:.1f} %) are longer than the "
            f"token cap {cap} (max_tokens_per_gpu={cfg.max_tokens_per_gpu} x cp); each trains "
            f"alone in a micro-batch over the cap (oversize_alone), the longest {longest} "
            f"tokens: raise max_tokens_per_gpu to {math.ceil(longest / max(cfg.cp_degrees))} "
            "to fit them", OversizeSampleWarning, stacklevel=3)
    return schedule


#: the ``varbatch_kit`` logger's warning about the rollouts that fill no step (its template:
#: :func:`varbatch_kit.analysis.warn_once.warn_once` can hold these records back by it)
DROPPED_ROLLOUTS_MESSAGE = ("dropping %d trailing rollouts (%d samples) that do not fill a step "
                            "of global_batch_size=%d")


def _warn_dropped(dropped_ids: np.ndarray, dropped: np.ndarray, gbs: int) -> None:
    if dropped.size:
        log.warning(DROPPED_ROLLOUTS_MESSAGE, dropped_ids.size, dropped.size, gbs)


# ------------------------------------------------------------------ micro-batch order
def order_rank_bins(config: ScheduleConfig, rank_bins, micro_batches, lengths, flops):
    """Each rank's bins in ``config.microbatch_order`` (bwd = 2 fwd).

    The cost of a micro-batch is the sum of ``flops`` (the per-sample balancing
    weights: FLOPs, or ``config.workload``'s costs, plus its ``c0``), else of
    its tokens.
    """
    if config.microbatch_order == "arrival":
        return rank_bins
    weights = lengths if flops is None else flops
    cost = np.array([float(weights[mb].sum()) for mb in micro_batches], dtype=np.float64)
    if config.workload is not None and flops is not None:
        cost += config.workload.c0
    out = []
    for bins in rank_bins:
        bins = list(bins)
        c = cost[bins]
        perm = apply_order(config.microbatch_order, c, 2.0 * c, config.pp)
        out.append([bins[i] for i in perm])
    return out


# ------------------------------------------------------------------ alignment fallback
def _build_deferring(rollouts: Rollouts, builder: _StepBuilder, model: ModelShape | None, *,
                     progress: bool = False) -> Schedule:
    """``alignment_fallback="drop_rollouts"``: steps that cannot be aligned move rollouts on.

    The rollouts (first-appearance order) are consumed as a stream: each
    step takes the next ``global_batch_size`` of them; when they cannot be
    split into a multiple of ``dp`` (times ``mb_group``) micro-batches, the
    step keeps the longest prefix that can (it drops the fewest trailing
    rollouts) and the dropped ones head the next step. When fewer than
    ``global_batch_size`` rollouts remain, they are dropped, as always. A
    step no prefix of which aligns raises the error of its full set.
    """
    config = builder.config
    ids, groups = rollouts.rollout_order()
    gbs = config.global_batch_size
    if ids.size < gbs:
        step_rollout_groups(rollouts, gbs)  # raises the usual message
    steps: list[Step] = []
    deferred: dict[int, np.ndarray] = {}
    p = 0
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(desc="scheduling steps", unit="step")
    while ids.size - p >= gbs:
        s = len(steps)
        first_error = None
        for size in range(gbs, 0, -1):
            samples = np.concatenate(groups[p:p + size]).astype(np.int64)
            try:
                step = builder(s, ids[p:p + size], samples)
            except AlignmentError as err:
                first_error = first_error or err
                continue
            steps.append(step)
            if size < gbs:
                deferred[s] = ids[p + size:p + gbs]
                log.warning(
                    "alignment_fallback='drop_rollouts': step %d trains %d of %d rollouts; "
                    "rollouts %s move to the next step (%s)", s, size, gbs,
                    ids[p + size:p + gbs].tolist(), str(first_error).split(";")[0])
            p += size
            break
        else:
            raise AlignmentError(
                f"{first_error} (alignment_fallback='drop_rollouts' cannot help: no prefix of "
                f"step {s}'s {gbs} rollouts can be aligned either)") from first_error
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    dropped_ids = ids[p:]
    dropped = (np.sort(np.concatenate(groups[p:])).astype(np.int64) if p < ids.size
               else np.zeros(0, dtype=np.int64))
    _warn_dropped(dropped_ids, dropped, gbs)
    return Schedule(config, rollouts, steps, dropped_ids, dropped, model, builder.flops,
                    deferred_rollouts=deferred)
