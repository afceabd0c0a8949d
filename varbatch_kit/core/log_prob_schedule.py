"""`build_log_prob_schedule`: the micro-batches of the forward-only log-prob pass.

slime's ``--log-probs-max-tokens-per-gpu`` (its issue #1964): the pass that
recomputes log-probs before training packs each DP rank's samples again under
its own, larger token cap.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from varbatch_kit.core.build import build_schedule, order_rank_bins
from varbatch_kit.core.config import ScheduleConfig
from varbatch_kit.core.flops import ModelShape
from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.core.schedule import Schedule
from varbatch_kit.core.step import Step
from varbatch_kit.core.workload import balancing_weights
from varbatch_kit.policies.packers import PackInput, aligned_count, split_to_target
from varbatch_kit.policies.registry import get_packer

__all__ = ["build_log_prob_schedule"]


def build_log_prob_schedule(
    rollouts: Rollouts,
    config: ScheduleConfig,
    model: ModelShape | None = None,
    *,
    schedule: Schedule | None = None,
) -> Schedule:
    """The micro-batches of the forward-only log-prob pass, under its own token cap.

    slime's ``--log-probs-max-tokens-per-gpu`` (its issue #1964): the pass
    that recomputes log-probs before training keeps no activations for a
    backward, so it can pack more tokens per micro-batch than training.

    Every sample's log-prob is computed on the DP rank that trains it (the
    rank holds the data; nothing moves between ranks): per step and rank,
    the rank's samples of the training schedule are packed again with the
    configured packer under ``log_probs_max_tokens_per_gpu * cp`` tokens,
    and every rank gets the same number of micro-batches (the largest
    count, rounded up to ``mb_group`` under virtual pipelining; the others
    split their largest micro-batches, as the training path does), then
    put in ``microbatch_order``. The steps (and any rollouts dropped or
    deferred) are the training schedule's.

    With ``log_probs_max_tokens_per_gpu`` unset or equal to the training
    cap this returns the training schedule itself (slime reuses the
    training micro-batches). Otherwise the result is a :class:`Schedule`
    whose ``config`` has ``max_tokens_per_gpu`` = the log-prob cap, so
    ``check()`` verifies that cap.

    Parameters
    ----------
    rollouts, config, model:
        As for :func:`build_schedule`.
    schedule:
        The training schedule, if already built from the same arguments.

    Raises
    ------
    ValueError
        For a step with no DP ranks (a dynamic-CP plan: its placements are
        not the fixed shape), when a rank holds fewer samples than the micro-batch count another
        rank needs under the log-prob cap (raise the cap), and as
        :func:`build_schedule`.
    """
    if schedule is None:
        schedule = build_schedule(rollouts, config, model)
    elif not isinstance(schedule, Schedule) or schedule.config != config or (
            schedule.rollouts is not rollouts):
        raise ValueError("schedule must be the training schedule of these rollouts and config "
                         "(build_schedule(rollouts, config, model))")
    if not config.dynamic or config.log_probs_cap == config.cap:
        return schedule
    lp_config = replace(config, max_tokens_per_gpu=config.log_probs_max_tokens_per_gpu,
                        log_probs_max_tokens_per_gpu=None)
    packer = get_packer(config.packing)
    cap = lp_config.cap
    lengths = rollouts.total_len
    flops = schedule.sample_flops
    weights = balancing_weights(config.workload, lengths, flops)  # what the policies balance
    per_rank_align = config.mb_group if config.vpp > 1 else 1
    steps: list[Step] = []
    for step in schedule.steps:
        rank_samples = [np.concatenate(mbs) for mbs in step.dp_ranks]
        packed = []
        for samples in rank_samples:
            inp = PackInput(lengths=lengths[samples],
                            flops=None if weights is None else weights[samples],
                            cap=cap, align=per_rank_align)
            packed.append(packer.fn(inp))
        target = aligned_count(max(len(b) for b in packed), per_rank_align)
        micro_batches: list[np.ndarray] = []
        rank_bins: list[list[int]] = []
        for r, (samples, bins) in enumerate(zip(rank_samples, packed)):
            if samples.size < target:
                raise ValueError(
                    f"log-prob pass: step {step.index}: rank {r} holds {samples.size} samples "
                    f"but every rank needs {target} micro-batches (the most any rank packs under "
                    f"log_probs_max_tokens_per_gpu={config.log_probs_max_tokens_per_gpu}); use "
                    f"a larger log_probs_max_tokens_per_gpu (e.g. >= max_tokens_per_gpu="
                    f"{config.max_tokens_per_gpu})")
            bins = split_to_target(bins, lengths[samples], target, step=step.index)
            rank_bins.append(list(range(len(micro_batches), len(micro_batches) + target)))
            micro_batches += [samples[np.asarray(b, dtype=np.int64)] for b in bins]
        rank_bins = order_rank_bins(lp_config, rank_bins, micro_batches, lengths, weights)
        steps.append(Step.from_dp_ranks(step.index, step.rollout_ids, step.sample_indices,
                                        micro_batches, rank_bins, cp=config.cp))
    return Schedule(lp_config, rollouts, steps, schedule.dropped_rollout_ids,
                    schedule.dropped_samples, schedule.model, flops,
                    deferred_rollouts=schedule.deferred_rollouts)
