"""megatron-core's own dynamic CP planner (``BalancedCPScheduler``) in the project's step shape.

megatron-core 0.16.1 ships a dynamic ("hybrid") context parallelism:
``megatron.core.pipeline_parallel.hybrid_cp_schedule.BalancedCPScheduler``
plans a global batch of sub-samples over the whole DP x CP pool of ranks, and
``hybrid_context_parallel_forward_backward`` runs the plan. Its output
(``get_groups_and_subsamples``) is a list of *megatron groups*; in each, one
list of sample ids per pool rank, in the order that rank runs them. A sample
listed on ``c`` ranks is cut over those ``c`` ranks (its ``local_cp_size``,
counted the same way by megatron's forward-backward); each sample is its own
forward/backward (megatron does not pack sub-samples into one micro-batch).
Within a group a rank belongs to one CP group, which runs its samples one
after the other; at the end of every megatron group all ranks of the pool
meet in a barrier.

This module runs that scheduler from the installed package, on the samples of
one step, and turns its plan into a :class:`varbatch_kit.core.step.Step`
(:func:`plan_to_placements`, :func:`megatron_step`) so the project's simulator
times it with the same cost model as the project's plans; and times it with
megatron's barriers (:func:`barrier_step_time`), which the project's group
timeline does not have.

Stand-in: ``BalancedCPScheduler(max_seq_len_per_rank, dp_cp_group)`` reads only
``dp_cp_group.size()`` (the number of DP x CP ranks); :class:`PoolGroupStandIn`
is an object with that one method (no process group is created, nothing runs
distributed). ``get_groups_and_subsamples(sample_id_seqlens, config)`` does not
read ``config``; ``None`` is passed.

Limitations of megatron's scheduler and hybrid CP, as read in 0.16.1
(:data:`LIMITATIONS`): CP sizes are powers of two (``gpus_needed`` rounds
``L / max_seq_len_per_rank`` up to one), or the whole pool when
``fill_empty_gpus`` widens a group to ``min(2 * size, pool)``; process groups
exist only for aligned blocks of a power-of-two size and for the whole pool
(``parallel_state.create_hybrid_dp_cp_groups``), which needs an even pool; a
sample longer than ``pool * max_seq_len_per_rank`` cannot be placed (the
scheduler fails an assertion: :func:`megatron_groups` refuses it first);
hybrid CP runs only in ``forward_backward_no_pipelining`` (pp = 1); multi-latent
attention (DeepSeek-V3's) refuses it, and megatron's local attention has no
CP (TransformerEngine's is needed).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from varbatch_kit.core.schedule import Schedule
from varbatch_kit.core.step import Step
from varbatch_kit.policies.dynamic_cp import CPCostModel

__all__ = ["LIMITATIONS", "MegatronPlan", "PoolGroupStandIn", "barrier_step_time",
           "megatron_groups", "megatron_schedule", "megatron_step", "plan_to_placements",
           "tokens_per_rank", "unaligned_groups"]

#: what megatron-core 0.16.1's hybrid CP cannot do (printed by the benchmark)
LIMITATIONS = (
    "CP sizes are powers of two (or the whole DPxCP pool when a group is widened to fill idle "
    "ranks); process groups exist only for aligned power-of-two blocks and the whole pool "
    "(create_hybrid_dp_cp_groups, even pool size); its groups span the whole DPxCP pool (CP "
    "sizes up to dp*cp, not cp); one forward/backward per sample (no packing); a barrier over "
    "the pool after each of its groups; a sample longer than pool*max_seqlen_per_dp_cp_rank "
    "cannot be placed; pp=1 only (forward_backward_no_pipelining); not with MLA (DeepSeek-V3) "
    "and only with TransformerEngine attention.")


class PoolGroupStandIn:
    """Stand-in for the DP x CP process group ``BalancedCPScheduler`` is given.

    The scheduler reads only ``dp_cp_group.size()``: this object answers the
    pool size and nothing else (no process group, no communication).
    """

    def __init__(self, size: int) -> None:
        self._size = int(size)

    def size(self) -> int:
        return self._size


def megatron_groups(lengths, pool: int, cap: int) -> list[list[list[int]]]:
    """Run the installed megatron-core ``BalancedCPScheduler`` on one step's samples.

    ``lengths[i]``: tokens of step-local sample ``i``; ``pool``: DP x CP ranks;
    ``cap``: ``max_seq_len_per_rank`` (the project's ``max_tokens_per_gpu``).
    Returns its ``sample_id_groups``: per megatron group, per pool rank, the
    step-local sample ids that rank runs, in order.
    """
    lengths = [int(x) for x in np.asarray(lengths, dtype=np.int64)]
    if pool < 2 or pool % 2:
        raise ValueError(f"pool must be an even number of DPxCP ranks >= 2 for megatron's hybrid "
                         f"CP (create_hybrid_dp_cp_groups), got {pool}")
    if cap < 1:
        raise ValueError(f"cap must be a positive number of tokens per rank, got {cap}")
    if lengths and max(lengths) > pool * cap:
        raise ValueError(f"lengths: a sample of {max(lengths)} tokens is longer than pool * cap = "
                         f"{pool} * {cap}: megatron's BalancedCPScheduler cannot place it "
                         "(raise cap or the pool)")
    if any(x <= 0 for x in lengths):
        raise ValueError("lengths must be positive token counts (megatron drops empty samples)")
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    scheduler = BalancedCPScheduler(max_seq_len_per_rank=cap, dp_cp_group=PoolGroupStandIn(pool))
    _, sample_id_groups = scheduler.get_groups_and_subsamples(list(enumerate(lengths)), None)
    return [[[int(i) for i in ids] for ids in group] for group in sample_id_groups]


@dataclass(frozen=True)
class MegatronPlan:
    """A megatron plan of one step in the project's terms (one micro-batch per sample).

    ``bins[b]``: step-local sample positions of micro-batch ``b`` (one sample);
    ``rounds[b]``, ``groups[b]``: its round and ranks (ascending, as megatron
    orders its CP ranks); ``megatron_group[b]``: the megatron group it ran in;
    ``group_rounds[g]``: the rounds of megatron group ``g``
    (``range(first, first + count)``).
    """

    bins: list[list[int]]
    rounds: list[int]
    groups: list[tuple[int, ...]]
    megatron_group: list[int]
    group_rounds: list[range]

    @property
    def degrees(self) -> list[int]:
        return [len(g) for g in self.groups]


def plan_to_placements(sample_id_groups, pool: int, num_samples: int) -> MegatronPlan:
    """Convert megatron's ``sample_id_groups`` into micro-batches with (round, ranks) placements.

    A sample's CP group is the ranks that list it in its megatron group (its
    degree is their count, as megatron's ``local_cp_size``); its round is
    its position in their lists plus the rounds of the earlier megatron
    groups (each takes as many rounds as its longest rank list). Raises
    ``ValueError`` when the plan does not hold every sample ``0 ..
    num_samples-1`` in exactly one megatron group, names a rank outside the
    pool, or lists a sample at different positions on its ranks.
    """
    bins: list[list[int]] = []
    rounds: list[int] = []
    groups: list[tuple[int, ...]] = []
    mg: list[int] = []
    group_rounds: list[range] = []
    home: dict[int, int] = {}
    base = 0
    for g, per_rank in enumerate(sample_id_groups):
        if len(per_rank) > pool:
            raise ValueError(f"sample_id_groups[{g}] lists {len(per_rank)} ranks, pool={pool}")
        where: dict[int, list[tuple[int, int]]] = {}
        for r, ids in enumerate(per_rank):
            for pos, i in enumerate(ids):
                where.setdefault(int(i), []).append((r, pos))
        for i in sorted(where, key=lambda i: (where[i][0][1], where[i][0][0])):
            if not 0 <= i < num_samples:
                raise ValueError(f"sample_id_groups[{g}]: sample {i} is outside "
                                 f"0..{num_samples - 1}")
            if i in home:
                raise ValueError(f"sample {i} is in megatron groups {home[i]} and {g}: "
                                 "each sample must be in exactly one")
            home[i] = g
            ranks = tuple(r for r, _ in where[i])
            positions = {pos for _, pos in where[i]}
            if len(positions) != 1 or len(set(ranks)) != len(ranks):
                raise ValueError(f"sample_id_groups[{g}]: sample {i} is at positions "
                                 f"{[p for _, p in where[i]]} on ranks {list(ranks)}: a CP group "
                                 "runs its samples once each, in one order")
            bins.append([i])
            rounds.append(base + positions.pop())
            groups.append(ranks)
            mg.append(g)
        count = max((len(ids) for ids in per_rank), default=0)
        group_rounds.append(range(base, base + count))
        base += count
    missing = sorted(set(range(num_samples)) - set(home))
    if missing:
        raise ValueError(f"sample_id_groups leaves out samples {missing[:10]}: megatron's plan "
                         "must hold every sample of the step")
    return MegatronPlan(bins, rounds, groups, mg, group_rounds)


def megatron_step(index: int, rollout_ids: np.ndarray, samples: np.ndarray, lengths,
                  pool: int, cap: int, planner=None) -> tuple[Step, MegatronPlan]:
    """megatron's plan of one step as a :class:`Step` on a pool of ``pool`` ranks.

    ``samples``: the step's global sample indices (step-local order),
    ``lengths``: their tokens. The step's pool is ``dp=1, cp=pool``: megatron's
    CP groups span the whole DP x CP pool (degrees up to ``pool``), which the
    project's fixed ``dp x cp`` split does not allow; the simulator times a
    dynamic plan on the pool whatever the split. ``planner(lengths, pool, cap)`` gives
    megatron's ``sample_id_groups`` (default :func:`megatron_groups`).
    """
    planner = megatron_groups if planner is None else planner
    plan = plan_to_placements(planner(lengths, pool, cap), pool, len(samples))
    samples = np.asarray(samples, dtype=np.int64)
    mbs = [samples[np.asarray(b, dtype=np.int64)] for b in plan.bins]
    step = Step.from_placements(index, rollout_ids, samples, mbs,
                                list(zip(plan.rounds, plan.groups)), dp=1, cp=pool)
    return step, plan


def megatron_schedule(schedule: Schedule, planner=None) -> tuple[Schedule, list[MegatronPlan]]:
    """megatron's plans of the steps of ``schedule`` (same samples per step), checked.

    The pool is ``schedule.config.world_size`` ranks and the cap its
    ``max_tokens_per_gpu``; the result's config is ``dp=1, cp=pool,
    cp_mode="dynamic"`` (see :func:`megatron_step`), and
    :meth:`Schedule.check` has verified it: every sample of every step exactly
    once, the groups of a round disjoint. Its micro-batches are single samples,
    which ``check`` exempts from the cap: :func:`tokens_per_rank` measures it.
    """
    cfg = schedule.config
    if cfg.max_tokens_per_gpu is None:
        raise ValueError("schedule: megatron's planner needs the token cap "
                         "(ScheduleConfig.max_tokens_per_gpu), got None")
    pool, cap = cfg.world_size, cfg.max_tokens_per_gpu
    lengths = schedule.rollouts.total_len
    steps, plans = [], []
    for st in schedule.steps:
        step, plan = megatron_step(st.index, st.rollout_ids, st.sample_indices,
                                   lengths[st.sample_indices], pool, cap, planner)
        steps.append(step)
        plans.append(plan)
    mcfg = cfg.with_(dp=1, cp=pool, cp_mode="dynamic")
    out = replace(schedule, config=mcfg, steps=steps)
    return out.check(), plans


def tokens_per_rank(lengths, bins, degrees) -> np.ndarray:
    """Tokens each rank of a micro-batch's group holds: ``sum(L) / c`` per micro-batch."""
    lengths = np.asarray(lengths, dtype=np.int64)
    tok = np.array([float(lengths[np.asarray(b, dtype=np.int64)].sum()) for b in bins])
    return tok / np.asarray(degrees, dtype=np.float64)


def unaligned_groups(plan: MegatronPlan, pool: int) -> int:
    """Micro-batches whose ranks are neither an aligned block ``k*c .. k*c+c-1`` of a
    power-of-two size ``c`` nor the whole pool: megatron has no process group for them
    (``create_hybrid_dp_cp_groups``), so its forward-backward could not run them."""
    bad = 0
    for ranks in plan.groups:
        c = len(ranks)
        block = ranks == tuple(range(ranks[0], ranks[0] + c))
        bad += not (c == 1 or c == pool or (c & (c - 1) == 0 and ranks[0] % c == 0 and block))
    return bad


def barrier_step_time(plan: MegatronPlan, lengths, cost: CPCostModel, pool: int) -> float:
    """Seconds of one step as megatron runs it: every sample keeps its ``c`` ranks busy for
    ``cost.time(L, L**2, c)``; a rank runs its samples of a megatron group one after the
    other; all ranks wait for the slowest at the end of each megatron group (barrier)."""
    lengths = np.asarray(lengths, dtype=np.float64)
    tok = np.array([lengths[b].sum() for b in plan.bins])
    sq = np.array([(lengths[b] ** 2).sum() for b in plan.bins])
    dur = cost.time(tok, sq, np.array(plan.degrees, dtype=np.float64))
    busy = np.zeros((len(plan.group_rounds), pool))
    for b, g in enumerate(plan.megatron_group):
        busy[g, list(plan.groups[b])] += dur[b]
    return float(busy.max(axis=1).sum()) if busy.size else 0.0
