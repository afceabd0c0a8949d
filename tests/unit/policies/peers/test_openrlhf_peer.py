"""OpenRLHF 0.11.2's scheduler: parity with the released package and hand-made cases."""

from __future__ import annotations

import numpy as np
from _peer_golden import golden

from varbatch_kit.policies.packers import PackInput, first_fit
from varbatch_kit.policies.peers.openrlhf_peer import openrlhf, openrlhf_interleave


def test_openrlhf_first_fit_count_matches_the_package():
    for c in golden("openrlhf")["functions"]["get_minimum_num_micro_batch_size"]:
        lens = np.asarray(c["values"])
        assert len(first_fit(PackInput(lengths=lens, cap=c["cap"]))) == c["count"], c


def test_openrlhf_rank_interleave_matches_balance_experiences():
    cases = golden("openrlhf")["functions"]["balance_experiences"]
    assert any(len(set(c["lengths"])) < len(c["lengths"]) for c in cases)  # ties exercised
    for c in cases:
        assert openrlhf_interleave(c["lengths"], c["dp"]) == c["ranks"], c


def test_openrlhf_interleave_matches_its_docstring_example():
    # sorted lengths 8..1, 2 ranks: [[8,1,6,3],[7,2,5,4]] (as lengths)
    lens = [1, 2, 3, 4, 5, 6, 7, 8]
    ranks = openrlhf_interleave(lens, 2)
    assert [[lens[i] for i in r] for r in ranks] == [[8, 1, 6, 3], [7, 2, 5, 4]]


def test_openrlhf_may_break_the_cap():
    # lengths 2,3,2,3,4,6 (cap 10), one rank: interleaved order 6,2,4,2,3,3 (samples
    # 5,2,4,0,1,3); first-fit in that order: [6,2,2],[4,3,3] -> 2 micro-batches;
    # Karmarkar-Karp on tokens into 2 parts: {6,2,3} = 11 and {4,2,3} = 9 (not 10/10)
    lens = [2, 3, 2, 3, 4, 6]
    plan = openrlhf(lens, dp=1, cap=10)
    assert sorted(sorted(m.tolist()) for m in plan.micro_batches) == [[0, 3, 4], [1, 2, 5]]
    assert sorted(int(np.sum(np.asarray(lens)[m])) for m in plan.micro_batches) == [9, 11]
