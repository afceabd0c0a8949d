"""torchtitan (a transcription of its documented greedy next-fit packing; no package checked)."""

from __future__ import annotations

from varbatch_kit.policies.peers.base import PeerPlan, make_plan, validate

__all__ = ["torchtitan"]


def torchtitan(lengths, *, dp: int, cap: int, workload=None) -> PeerPlan:
    """torchtitan (transcription of its documented greedy next-fit packing; no package checked).

    The dataset is sharded by rank (contiguous shards, as ``split_dataset_by_node``
    does for a map-style dataset); each rank packs its shard in arrival order
    by next-fit: a micro-batch is closed as soon as the next sample does not
    fit. Ranks may end with different micro-batch counts; an over-cap sample
    sits alone. Balances nothing.
    """
    lens, dp, cap, _ = validate(lengths, dp, cap, workload)
    n = lens.size
    bounds = [n * r // dp for r in range(dp + 1)]
    out = []
    for r in range(dp):
        mbs, cur, room = [], [], cap
        for i in range(bounds[r], bounds[r + 1]):
            if cur and lens[i] > room:
                mbs.append(cur)
                cur, room = [], cap
            cur.append(i)
            room -= int(lens[i])
        if cur:
            mbs.append(cur)
        out.append(mbs)
    return make_plan(out)


#: Every peer, by name: ``fn(lengths, *, dp, cap, workload=None) -> PeerPlan``.
