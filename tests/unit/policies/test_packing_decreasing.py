"""First-fit decreasing and best-fit decreasing packers: hand-derived cases and properties."""

import math

import numpy as np
import pytest
from _factories import TINY
from hypothesis import given
from hypothesis import strategies as st

from varbatch_kit import Rollouts, ScheduleConfig, build_schedule
from varbatch_kit.policies.packers import (
    PackInput,
    aligned_count,
    best_fit_decreasing,
    first_fit,
    first_fit_decreasing,
)
from varbatch_kit.policies.registry import PACKERS, get_packer


def test_ffd_and_bfd_hand_derived():
    # visiting order 8, 6, 3, 1 (cap 10): rooms after 8 and 6 are 2 and 4.
    # FFD: 3 -> first bin with room (the 6's, room 1 left); 1 -> the 8's bin.
    # BFD: 3 -> fullest bin it fits (the 6's); 1 -> fullest that fits: the 6's (room 1).
    inp = PackInput(np.array([6, 3, 1, 8]), cap=10)
    assert first_fit_decreasing(inp) == [[2, 3], [0, 1]]
    assert best_fit_decreasing(inp) == [[3], [0, 1, 2]]
    assert first_fit(inp) == [[0, 1, 2], [3]]


def test_ties_break_by_arrival_and_lowest_bin():
    inp = PackInput(np.array([4, 4, 4, 4]), cap=8)
    assert first_fit_decreasing(inp) == [[0, 1], [2, 3]]
    assert best_fit_decreasing(inp) == [[0, 1], [2, 3]]


def test_over_cap_sample_alone():
    inp = PackInput(np.array([3, 25, 4, 12]), cap=10)
    for fn in (first_fit_decreasing, best_fit_decreasing):
        bins = fn(inp)
        assert [1] in bins and [3] in bins and sorted(map(sorted, bins)) == [[0, 2], [1], [3]]


def test_registry_entries():
    for name in ("ffd", "bfd"):
        spec = get_packer(name)
        assert spec.dynamic and spec.respects_cap and not spec.needs_flops
        assert spec.requires_distribution is None and spec.refine is None
    assert {"static", "first_fit", "flops_kk", "ffd", "bfd", "balanced"} <= set(PACKERS)


def test_aligned_count():
    assert [aligned_count(k, 4) for k in (1, 4, 5, 8, 9)] == [4, 4, 8, 8, 12]


@given(st.lists(st.integers(1, 200), min_size=1, max_size=120), st.integers(20, 250))
def test_packings_are_valid_and_near_the_bound(lengths, cap):
    arr = np.array(lengths)
    over = arr > cap
    lower = int(over.sum()) + math.ceil(int(arr[~over].sum()) / cap)
    for fn in (first_fit_decreasing, best_fit_decreasing):
        bins = fn(PackInput(arr, cap=cap))
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        assert all(b == sorted(b) and b for b in bins)
        for b in bins:
            assert len(b) == 1 or arr[b].sum() <= cap
        # any-fit decreasing: every bin but one is more than half full (items <= cap)
        assert lower <= len(bins) <= 2 * lower + 1


@pytest.mark.parametrize("packing", ["ffd", "bfd"])
def test_schedules_pass_check_with_any_distribution(packing):
    r = Rollouts.synthetic(64, samples_per_rollout=(1, 3), seed=5)
    for dist in ("strided", "flops_kk", "balanced"):
        cfg = ScheduleConfig(dp=4, global_batch_size=16, max_tokens_per_gpu=6000,
                             packing=packing, distribution=dist)
        s = build_schedule(r, cfg, TINY).check()
        for step in s.steps:
            k = len(PACKERS[packing].fn(PackInput(r.total_len[step.sample_indices], cap=6000)))
            assert len(step.micro_batches) == aligned_count(k, 4)
