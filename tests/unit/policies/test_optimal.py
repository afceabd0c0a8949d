"""CP-SAT exact reference: hand-derived optima, constraints, and the heuristics' gap."""

import numpy as np
import pytest

pytest.importorskip("ortools")

from varbatch_kit import ModelShape
from varbatch_kit.analysis.optimum_gap import gap_to_optimal, random_small_steps
from varbatch_kit.policies.optimal import MAX_SAMPLES, solve_min_max_rank_flops


def loads(res, flops):
    return sorted(sum(flops[i] for b in rb for i in res.bins[b]) for rb in res.rank_bins)


def test_pairs_hand_derived():
    # 2 ranks x 1 micro-batch: {3, 2} | {3, 2} is the only way to reach 5
    flops = [3.0, 3.0, 2.0, 2.0]
    res = solve_min_max_rank_flops([1, 1, 1, 1], flops, 10, 2, 1, relative_gap=0)
    assert res.proven_optimal and res.max_rank_flops == 5.0
    assert loads(res, flops) == [5.0, 5.0]


def test_cap_forces_imbalance():
    # FLOPs 10, 9, 4, 1 with tokens 6, 1, 1, 6, one micro-batch per rank, cap 7: the two
    # 6-token samples cannot share and three samples never fit (8 tokens), so each rank takes
    # one of them plus one short sample: {10, 4} | {1, 9} -> 14. Without the cap {10, 1} | {9, 4}
    # would give 13.
    flops = [10.0, 9.0, 4.0, 1.0]
    res = solve_min_max_rank_flops([6, 1, 1, 6], flops, 7, 2, 1, relative_gap=0)
    assert res.proven_optimal and res.max_rank_flops == 14.0
    assert sorted(map(sorted, res.bins)) == [[0, 2], [1, 3]]
    free = solve_min_max_rank_flops([6, 1, 1, 6], flops, 12, 2, 1, relative_gap=0)
    assert free.max_rank_flops == 13.0


def test_over_cap_sample_sits_alone():
    # the 20-token sample exceeds the cap: it cannot share, so its rank's other micro-batch
    # takes the rest it can; 3 micro-batches on 1 rank hold {20}, and two non-empty others
    res = solve_min_max_rank_flops([20, 2, 2, 2], [8.0, 1.0, 1.0, 1.0], 5, 1, 3, relative_gap=0)
    assert [len(b) for b in res.bins if 0 in b] == [1]
    assert res.max_rank_flops == 11.0


@pytest.mark.parametrize("args,match", [
    (([1] * 41, [1.0] * 41, 5, 2, 1), f"MAX_SAMPLES={MAX_SAMPLES}"),
    (([1, 1, 1], [1.0, 1.0, 1.0], 5, 2, 2), "at least as many samples"),
    (([1, 1], [1.0], 5, 1, 1), "match lengths"),
    (([1, 0], [1.0, 1.0], 5, 1, 1), "positive integers"),
    (([1, 1], [1.0, 1.0], 0, 1, 1), "cap must be a positive integer"),
])
def test_errors(args, match):
    with pytest.raises(ValueError, match=match):
        solve_min_max_rank_flops(*args)


def test_balanced_is_near_optimal_on_small_random_steps():
    """Smaller version of the benchmark's 200-instance study (benchmarks/run.py)."""
    model = ModelShape.preset("qwen3-8b")
    rows = []
    for step in random_small_steps(12, seed=7, min_samples=6, max_samples=14):
        rows += gap_to_optimal(step, model, [("balanced", "balanced"), ("first_fit", "flops_kk")],
                               time_limit_s=5.0)
    bal = [r for r in rows if r["policy"] == "balanced+balanced"]
    assert all(r["proven"] for r in bal)
    assert all(r["optimum"] <= r["heuristic"] * (1 + 1e-9) for r in rows)
    assert np.median([r["gap_high"] for r in bal]) <= 0.02
    ff = [r for r in rows if r["policy"] == "first_fit+flops_kk"]
    assert np.mean([r["gap_low"] for r in bal]) <= np.mean([r["gap_low"] for r in ff])
