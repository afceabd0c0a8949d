"""What the peers share: the plan, its completeness check, the input check, the bin split."""

from __future__ import annotations

import numpy as np
import pytest

from varbatch_kit.policies.peers.base import (
    PeerPlan,
    PeerRefusal,
    lpt_split,
    make_plan,
    refuse_oversize,
    validate,
)


def test_make_plan_maps_through_the_index_and_keeps_the_notes():
    plan = make_plan([[[0, 1], [2]], [[3]]], index=np.array([10, 11, 12, 13]), notes=["x"])
    assert [[m.tolist() for m in r] for r in plan.rank_micro_batches] == [[[10, 11], [12]], [[13]]]
    assert plan.notes == ("x",) and plan.dp == 2
    assert [m.tolist() for m in plan.micro_batches] == [[10, 11], [12], [13]]


def test_check_wants_every_sample_exactly_once():
    assert make_plan([[[0, 2]], [[1]]]).check(3).dp == 2
    with pytest.raises(AssertionError):
        make_plan([[[0, 0]], [[1]]]).check(3)
    with pytest.raises(AssertionError):
        make_plan([[[0]], [[1]]]).check(3)
    assert isinstance(make_plan([[]]), PeerPlan)


def test_validate_returns_int64_lengths_and_names_the_parameter():
    lens, dp, cap, w = validate([3.0, 4.0], 2, 8)
    assert lens.dtype == np.int64 and lens.tolist() == [3, 4] and (dp, cap, w) == (2, 8, None)
    assert validate([3, 4], 1, 8, workload=[1, 2])[3].tolist() == [1.0, 2.0]
    for args, word in ((([3.5], 1, 8), "whole token counts"), (([3], True, 8), "dp"),
                       (([3], 1, 2.5), "cap"), (([3], 1, 8, [-1.0]), "workload"),
                       (([[3]], 1, 8), "lengths")):
        with pytest.raises(ValueError, match=word):
            validate(*args)


def test_refuse_oversize_names_the_peer_and_the_cap():
    refuse_oversize("p", np.array([8]), 8)
    with pytest.raises(PeerRefusal, match="p refuses a sample of 9 tokens > cap 8"):
        refuse_oversize("p", np.array([9]), 8)


def test_lpt_split_heaviest_first_each_to_the_lighter_half():
    w = np.array([5.0, 4.0, 3.0, 3.0])
    # 5 -> a; 4 -> b; 3 (item 2) -> b (4 < 5); 3 (item 3) -> a (5 <= 7)
    assert lpt_split([0, 1, 2, 3], w) == ([0, 3], [1, 2])
