"""prime-rl's scheduler (a transcription): split to a multiple of dp, KK, pairwise swaps."""

from __future__ import annotations

import numpy as np

from varbatch_kit.policies.peers.prime_rl_peer import prime_rl


def test_prime_rl_splits_to_a_dp_multiple_and_balances():
    # FFD cap 10: [8,2] x 3 (10 each); dp 2 -> split the first: [8],[2],[8,2],[8,2];
    # equal-size KK on 2,8,10,10: {8,10}=18, {2,10}=12; no swap narrows it (8-2 = gap 6)
    lens = [8, 8, 8, 2, 2, 2]
    plan = prime_rl(lens, dp=2, cap=10)
    assert [len(r) for r in plan.rank_micro_batches] == [2, 2]
    loads = sorted(sum(int(np.sum(np.asarray(lens)[m])) for m in r)
                   for r in plan.rank_micro_batches)
    assert loads == [12, 18]
    # a swap that helps: bins 9,1,5,5 (dp 2): KK {9,1}/{5,5} is already 10/10
    plan = prime_rl([9, 1, 5, 5], dp=2, cap=9)
    assert sorted(sum(int(np.asarray([9, 1, 5, 5])[m].sum()) for m in r)
                  for r in plan.rank_micro_batches) == [10, 10]
