"""verl 0.9.1's scheduler: parity with the released package and hand-made cases."""

from __future__ import annotations

import pytest
from _peer_golden import golden

from varbatch_kit.policies.peers.base import PeerRefusal
from varbatch_kit.policies.peers.verl_peer import verl, verl_rank_micro_batches, verl_workload


def test_verl_rearrange_micro_batches_matches_the_package():
    cases = golden("verl")["functions"]["rearrange_micro_batches"]
    raised = 0
    for c in cases:
        mbs, r = verl_rank_micro_batches([c["lengths"]], c["cap"])
        raised += r
        assert mbs[0] == c["micro_batches"], c
    assert raised > 0  # the cap-raising loop (verl #7553) was exercised


def test_verl_workload_formula():
    assert verl_workload([1, 100]).tolist() == [24577, 24576 * 100 + 10000]


def test_verl_raises_the_count_until_the_cap_holds():
    # lengths 6,5,4,3 (cap 9): ceil(18/9)=2 bins; KK on workloads gives {6,3},{5,4} -> fits
    plan = verl([6, 5, 4, 3], dp=1, cap=9)
    assert sorted(sorted(m.tolist()) for m in plan.micro_batches) == [[0, 3], [1, 2]]
    # 7,7,4 cap 9: k=2 gives {7,4} = 11 > 9, so k=3
    plan = verl([7, 7, 4], dp=1, cap=9)
    assert len(plan.micro_batches) == 3 and plan.notes


def test_verl_refuses_an_oversize_sample():
    with pytest.raises(PeerRefusal, match="cap"):
        verl([10, 3], dp=1, cap=8)
