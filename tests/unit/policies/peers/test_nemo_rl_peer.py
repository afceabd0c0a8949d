"""NeMo-RL's scheduler (a transcription): modified first-fit decreasing, bins dealt round-robin."""

from __future__ import annotations

import numpy as np

from varbatch_kit.policies.peers.nemo_rl_peer import mffd, nemo_rl


def test_nemo_rl_mffd_and_round_robin():
    # cap 12: large 10, 7; medium 5 (12/3 < 5 <= 6); small 3 (2 < 3 <= 4); tiny 2, 1
    # step 1: [10],[7]; step 2: medium 5 fits only [7] (room 5); step 3: none without medium
    # with two small; step 4: [10] takes 2 (largest fitting <= 2); [7,5] full; rest FFD: [3,1]
    lens = [10, 7, 5, 3, 2, 1]
    bins = mffd(np.asarray(lens), 12)
    assert sorted(sorted(lens[i] for i in b) for b in bins) == [[1, 3], [2, 10], [5, 7]]
    plan = nemo_rl(lens, dp=3, cap=12)
    assert [len(r) for r in plan.rank_micro_batches] == [1, 1, 1]
