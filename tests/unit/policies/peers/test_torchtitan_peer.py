"""torchtitan's scheduler (a transcription): next-fit on contiguous shards."""

from __future__ import annotations

from _peer_golden import as_lists

from varbatch_kit.policies.peers.torchtitan_peer import torchtitan


def test_torchtitan_next_fit_on_contiguous_shards():
    plan = torchtitan([4, 4, 4, 1, 9, 2], dp=2, cap=8)
    assert as_lists(plan) == [[[0, 1], [2]], [[3], [4], [5]]]
