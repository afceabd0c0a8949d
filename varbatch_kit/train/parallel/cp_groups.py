"""The context-parallel process groups of a run, created once, on every rank in one order.

All-gather CP (:mod:`~varbatch_kit.train.parallel.cp_attention`) runs each micro-batch of degree
``c > 1``
on its own group of ``c`` ranks of the dp * cp pool. ``torch.distributed.new_group``
is collective over the whole world (every rank calls it, in the same order,
also for the groups it is not part of), so the groups are made before the first
step, from what every rank knows alike:

- fixed CP: the ``dp`` groups of ``cp`` consecutive pool ranks;
- dynamic CP: every group any step of the run places a micro-batch on (the
  steps are in the job, built by the launcher; megatron-core's
  ``create_hybrid_dp_cp_groups`` makes all aligned groups of each size
  instead: here only those the planner used are made, no fewer).

:func:`cp_groups_for_run` makes them (sorted by size, then ranks: one order on
every rank) and caches them per world, so the runs of one launch share them.
:func:`rank_rounds` gives a pool rank's non-idle rounds with the world ranks of
each micro-batch's group, in round order (the order the group's collectives
run in on every member).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["CPRound", "cp_group", "cp_group_members", "cp_groups_for_run", "rank_rounds",
           "share_for"]


@dataclass(frozen=True, eq=False)
class CPRound:
    """One micro-batch a pool rank trains: its samples, degree, the rank's CP rank in it and
    the pool ranks of its group in CP-rank order (``(pool_rank,)`` alone for degree 1)."""

    samples: np.ndarray
    cp_size: int
    cp_rank: int
    members: tuple[int, ...]


def rank_rounds(step, pool_rank: int) -> list[CPRound]:
    """``pool_rank``'s non-idle rounds of ``step`` in round order (as ``step.rank_program``)."""
    out = []
    for b in step.rank_bins[pool_rank]:
        p = step.placements[b]
        members = tuple(int(r) for r in p.ranks) if p.ranks else (int(pool_rank),)
        out.append((p.round, CPRound(step.micro_batches[b], int(p.degree),
                                     members.index(int(pool_rank)) if p.ranks else 0, members)))
    return [r for _, r in sorted(out, key=lambda x: x[0])]


def idle_round(step, pool_rank: int, total_len: np.ndarray) -> CPRound:
    """The zero-weight round a pool rank with no round in ``step`` runs alone (degree 1) so
    that it joins the step's gradient sync: the step's shortest sample (``total_len``: every
    sample's length), never a whole micro-batch, so the idle rank holds the fewest tokens of
    any rank (the memory guard and the step time see what it runs)."""
    samples = step.sample_indices
    shortest = samples[int(np.argmin(total_len[samples]))]
    return CPRound(np.array([shortest]), 1, 0, (int(pool_rank),))


def cp_group_members(layout, steps) -> list[tuple[int, ...]]:
    """The pool-rank sets of every CP group of degree > 1 the run uses, in creation order."""
    groups: set[tuple[int, ...]] = set()
    if layout.cp > 1 and layout.cp_mode != "dynamic":
        groups.update(tuple(range(d * layout.cp, (d + 1) * layout.cp)) for d in range(layout.dp))
    for step in steps:
        for p in step.placements:
            if p.degree > 1:
                groups.add(tuple(sorted(int(r) for r in p.ranks)))
    return sorted(groups, key=lambda g: (len(g), g))


_cache: dict = {"world": None, "groups": {}, "layout": None}


def _world_ranks(layout, members, tp_rank: int, pp_rank: int) -> tuple[int, ...]:
    return tuple(layout.world_rank(r, tp_rank, pp_rank) for r in members)


def cp_groups_for_run(layout, steps) -> dict[tuple[int, ...], object]:
    """Create (collectively, on every rank) the run's CP groups not made yet; return this
    rank's.

    Keys: the sorted pool ranks of a group; values: the ``ProcessGroup`` over the world
    ranks of those pool ranks at this rank's ``(tp, pp)`` coordinate. Tensor and pipeline
    parallelism replicate the pool, so each group exists once per coordinate (``tp * pp``
    process groups, all created on every rank, in one order: pool ranks, then stage, then
    TP rank). Groups are kept by their world ranks, so the runs of one launch share those
    that coincide and a run of another layout (another ``tp``, ``pp`` or pool) makes its own;
    the run's layout becomes the one :func:`cp_group` maps pool ranks with. Every rank must
    call this with the same ``layout`` and ``steps``.
    """
    import torch.distributed as dist

    world = dist.group.WORLD
    if _cache["world"] is not world:  # a new world (single_process tears the old one down)
        _cache["world"], _cache["groups"] = world, {}
    made = _cache["groups"]
    here = layout.coords(dist.get_rank())
    mine = {}
    for members in cp_group_members(layout, steps):
        for pp_rank in range(layout.pp):
            for tp_rank in range(layout.tp):
                ranks = _world_ranks(layout, members, tp_rank, pp_rank)
                if ranks not in made:
                    made[ranks] = dist.new_group(list(ranks))
        mine[members] = made[_world_ranks(layout, members, here.tp_rank, here.pp_rank)]
    _cache["layout"] = layout
    return mine


def cp_group(members) -> object:
    """The process group of these pool ranks at this rank's ``(tp, pp)`` coordinate, made by
    :func:`cp_groups_for_run` for the run in progress."""
    import torch.distributed as dist

    layout = _cache["layout"]
    key = tuple(sorted(int(r) for r in members))
    group = None
    if layout is not None:
        here = layout.coords(dist.get_rank())
        group = _cache["groups"].get(_world_ranks(layout, key, here.tp_rank, here.pp_rank))
    if group is None:
        raise RuntimeError(f"no CP process group for pool ranks {key}: cp_groups_for_run "
                           "makes a run's groups before its first step")
    return group


def share_for(rnd: CPRound, batch, *, swap_chunks_of: int | None = None):
    """The :class:`~varbatch_kit.train.parallel.cp_attention.CPShare` of ``batch`` this rank runs in
    round ``rnd`` (None for degree 1: the whole row, no exchange); ``swap_chunks_of``:
    ``FaultConfig.cp_swap_chunks_rank``, a fault injected for tests."""
    from varbatch_kit.train.parallel.cp_attention import CPShare

    if rnd.cp_size == 1:
        return None
    # a group's ranks in torch's order, by world rank: at one (tp, pp) coordinate the world
    # rank grows with the pool rank (train/config/parallel_layout.py)
    order = sorted(rnd.members)
    return CPShare(group=cp_group(rnd.members), rank=rnd.cp_rank, size=rnd.cp_size,
                   lengths=tuple(batch.lengths), prompt_lens=tuple(batch.prompt_lens),
                   slot_ranks=tuple(rnd.members.index(r) for r in order),
                   swap_chunks_of=swap_chunks_of)
