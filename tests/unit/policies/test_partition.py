"""Karmarkar-Karp: hand-derived cases and properties."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from varbatch_kit.policies.partition import karmarkar_karp


def test_equal_size_hand_derived():
    # states {2},{1} and {4},{3} (sorted by (value, index)); tie on spread 1 -> the state with
    # the larger top set pops first; merge pairs {4}+{1} and {3}+{2}: both sum 5; the set
    # holding (3, 4) first compares larger.
    assert karmarkar_karp([1, 2, 3, 4], 2, equal_size=True) == [[0, 3], [1, 2]]


def test_free_size_hand_derived():
    # the textbook case where largest differencing is not optimal (16/14, optimum 15/15):
    # pop 8,7 -> {8}|{7}; pop 6,5 -> {6}|{5}; pop {4} (spread 4) and {8}|{7} (ties on spread 1
    # with {6}|{5}, larger top set first) -> {4,7}|{8}; then {4,7}+{5} | {8}+{6}
    assert karmarkar_karp([8, 7, 6, 5, 4], 2, equal_size=False) == [[1, 3, 4], [0, 2]]


def test_single_partition_and_singletons():
    assert karmarkar_karp([3, 1, 2], 1, equal_size=False) == [[0, 1, 2]]
    parts = karmarkar_karp([3, 1, 2], 3, equal_size=True)
    assert sorted(parts) == [[0], [1], [2]]


@pytest.mark.parametrize("values,k,eq,match", [
    ([1, 2], 3, False, "cannot split 2 items into k=3"),
    ([1, 2, 3], 2, True, "divisible by k: n=3, k=2"),
    ([1, 2], 0, False, "positive integer"),
])
def test_errors(values, k, eq, match):
    with pytest.raises(ValueError, match=match):
        karmarkar_karp(values, k, eq)


@given(st.lists(st.integers(1, 10_000), min_size=1, max_size=60), st.integers(1, 8),
       st.booleans())
def test_is_a_partition_with_nonempty_parts(values, k, equal_size):
    n = len(values)
    if n < k or (equal_size and n % k):
        with pytest.raises(ValueError):
            karmarkar_karp(values, k, equal_size)
        return
    parts = karmarkar_karp(values, k, equal_size)
    assert len(parts) == k
    assert sorted(itertools.chain(*parts)) == list(range(n))
    assert all(p == sorted(p) and p for p in parts)
    if equal_size:
        assert {len(p) for p in parts} == {n // k}
    # largest differencing is never worse than putting everything on one part
    if k > 1:
        assert max(sum(values[i] for i in p) for p in parts) < sum(values) or n == 1
