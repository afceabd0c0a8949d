"""Micro-batch orders on a 1F1B pipeline: hand-derived makespans, exact = brute force, promises."""

import itertools

import numpy as np
import pytest
from _pipeline_oracle import reference_1f1b
from hypothesis import given, settings
from hypothesis import strategies as st

from varbatch_kit.policies.order import (
    EXACT_MAX,
    ORDERS,
    apply_order,
    get_order,
    min_bubble,
    small_ends,
)
from varbatch_kit.policies.pipeline import pipeline_makespan


def span(costs, perm, pp, bwd_factor=2.0):
    c = np.asarray(costs, dtype=float)[np.asarray(perm)]
    return float(pipeline_makespan(c, bwd_factor * c, pp))


def test_two_stages_two_micro_batches_by_hand():
    # pp=2, costs 1 and 3, backward = 2 x forward. Small first:
    # s0 F0 [0,1] F1 [1,4]; s1 F0 [1,2] B0 [2,4]; s0 B0 [4,6]; s1 F1 [4,7] B1 [7,13];
    # s0 B1 [13,19] -> 19 (work per stage 12, bubble 7).
    assert span([1, 3], [0, 1], 2) == 19.0
    # big first: s0 F0 [0,3] F1 [3,4]; s1 F0 [3,6] B0 [6,12]; s0 B0 [12,18];
    # s1 F1 [12,13] B1 [13,15]; s0 B1 [18,20] -> 20 (bubble 8).
    assert span([1, 3], [1, 0], 2) == 20.0
    assert min_bubble(np.array([3.0, 1.0]), np.array([6.0, 2.0]), 2).tolist() == [1, 0]


@pytest.mark.parametrize("pp,m", [(1, 3), (2, 1), (2, 5), (3, 3), (4, 2), (4, 8), (8, 3)])
def test_equal_micro_batches_take_m_plus_pp_minus_one_slots(pp, m):
    # the textbook 1F1B result: (m + pp - 1) * (f + b)
    f = np.full(m, 1.0)
    assert pipeline_makespan(f, 2 * f, pp) == pytest.approx((m + pp - 1) * 3.0)


def test_evaluator_matches_the_independent_recurrence():
    rng = np.random.default_rng(0)
    for pp in (1, 2, 3, 5, 8):
        for m in (1, 2, 4, 7, 11):
            f = rng.random((6, m))
            b = 2 * f + 0.1 * rng.random((6, m))
            np.testing.assert_allclose(pipeline_makespan(f, b, pp),
                                       [reference_1f1b(f[r], b[r], pp)[2] for r in range(6)],
                                       rtol=1e-12)


def test_small_ends_by_hand():
    costs = np.array([5.0, 1.0, 4.0, 2.0, 3.0])
    perm = small_ends(costs, 2 * costs)
    assert costs[perm].tolist() == [1.0, 3.0, 5.0, 4.0, 2.0]
    costs = np.array([1.0, 2.0, 3.0, 4.0])  # ties would go to arrival order
    assert costs[small_ends(costs, costs)].tolist() == [1.0, 3.0, 4.0, 2.0]


@pytest.mark.parametrize("seed", range(6))
def test_exact_search_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    m = int(rng.integers(2, 7))
    pp = int(rng.choice([2, 3, 4, 8]))
    costs = rng.lognormal(0.0, 1.0, m)
    # the slow independent path: every permutation through the test's own recurrence
    best = min(reference_1f1b(costs[list(p)], 2 * costs[list(p)], pp)[2]
               for p in itertools.permutations(range(m)))
    assert span(costs, min_bubble(costs, 2 * costs, pp), pp) == pytest.approx(best, rel=1e-12)


def test_ties_keep_arrival_order_and_one_stage_needs_no_order():
    f = np.ones(6)
    assert min_bubble(f, 2 * f, 4).tolist() == list(range(6))
    costs = np.array([3.0, 1.0, 2.0])
    assert min_bubble(costs, 2 * costs, 1).tolist() == [0, 1, 2]


costs_st = st.lists(st.floats(0.0, 100.0, allow_nan=False), min_size=1, max_size=14)


@settings(max_examples=40, deadline=None)
@given(costs=costs_st, pp=st.integers(1, 6), name=st.sampled_from(sorted(ORDERS)))
def test_every_order_is_a_permutation(costs, pp, name):
    c = np.array(costs)
    perm = apply_order(name, c, 2 * c, pp)
    assert sorted(perm.tolist()) == list(range(c.size))


@settings(max_examples=30, deadline=None)
@given(costs=st.lists(st.floats(0.01, 100.0), min_size=2, max_size=13), pp=st.integers(2, 6),
       exact_max=st.sampled_from([0, EXACT_MAX]))
def test_min_bubble_is_never_worse_than_arrival_or_small_ends(costs, pp, exact_max):
    c = np.array(costs)
    best = span(c, min_bubble(c, 2 * c, pp, exact_max=exact_max), pp)
    assert best <= span(c, np.arange(c.size), pp) * (1 + 1e-12)
    assert best <= span(c, small_ends(c, 2 * c), pp) * (1 + 1e-12)


def test_small_ends_shortens_a_pipeline_of_one_long_micro_batch():
    costs = np.array([8.0, 1.0, 1.0, 1.0, 1.0, 1.0])  # the long one first: the worst warm-up
    assert span(costs, small_ends(costs, 2 * costs), 4) < span(costs, np.arange(6), 4)


@pytest.mark.parametrize("call,match", [
    (lambda: get_order("fastest"), "unknown microbatch_order 'fastest'"),
    (lambda: min_bubble(np.ones(3), np.ones(2), 2), "equal length"),
    (lambda: min_bubble(np.array([1.0, -1.0]), np.ones(2), 2), "finite and >= 0"),
    (lambda: small_ends(np.ones(2), np.ones(2), 0), "pp must be a positive integer"),
    (lambda: pipeline_makespan(np.ones(2), np.ones(3), 2), "same shape"),
])
def test_bad_input_is_a_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()
