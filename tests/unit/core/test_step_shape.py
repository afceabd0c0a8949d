"""One step shape (properties): every step carries placements; fixed CP is the fixed shape.

Fixed CP: every micro-batch has degree ``cp`` and the CP replica ``d*cp .. d*cp+cp-1``
of its DP rank ``d``, in round = its position in ``d``'s training order, and every
world rank's program is its DP rank's slime layout (the per-DP-rank program).
``Schedule.check()`` verifies the placements the same way for both CP modes.
"""

from dataclasses import replace

import numpy as np
import pytest
from _factories import TINY, rollouts
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from varbatch_kit import ScheduleConfig, build_schedule
from varbatch_kit.core.placement import Placement
from varbatch_kit.core.schedule import ScheduleInvariantError
from varbatch_kit.policies.packers import AlignmentError

SETTINGS = settings(max_examples=40, deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def fixed_cases(draw):
    dp = draw(st.sampled_from([1, 2, 3]))
    cp = draw(st.sampled_from([1, 2, 4]))
    n = draw(st.integers(dp * 2, 40))
    lengths = draw(st.lists(st.integers(1, 600), min_size=n, max_size=n))
    capped = draw(st.booleans())
    gbs = draw(st.integers(dp, n))
    if capped:
        packing = draw(st.sampled_from(["first_fit", "flops_kk", "balanced"]))
        dist = {"first_fit": "strided", "flops_kk": "flops_kk", "balanced": "balanced"}[packing]
        kw = dict(max_tokens_per_gpu=draw(st.integers(50, 400)), packing=packing,
                  distribution=dist)
    else:
        kw = dict(micro_batch_size=1)
    order = draw(st.sampled_from(["arrival", "small_ends"]))
    cfg = ScheduleConfig(dp=dp, cp=cp, global_batch_size=gbs, microbatch_order=order, **kw)
    return rollouts(lengths), cfg


@SETTINGS
@given(fixed_cases())
def test_fixed_cp_placements_are_the_fixed_shape_and_programs_the_dp_layout(case):
    r, cfg = case
    try:
        sched = build_schedule(r, cfg, TINY).check()
    except AlignmentError:  # a layout that cannot be aligned: nothing to check
        assume(False)
    dp, cp = cfg.dp, cfg.cp
    parts, mbi, nmb, _ = sched.rank_layout()
    offset = [0] * dp  # position in each DP rank's partition
    mb_seen = [0] * dp
    for step in sched.steps:
        assert step.is_fixed_shape and (step.dp, step.cp) == (dp, cp)
        dp_bins = step.dp_rank_bins
        assert sorted(b for bins in dp_bins for b in bins) == list(range(len(step.micro_batches)))
        assert {len(bins) for bins in dp_bins} == {step.num_rounds}
        for d, bins in enumerate(dp_bins):
            for j, b in enumerate(bins):
                p = step.placements[b]
                assert p == Placement(b, j, tuple(range(d * cp, d * cp + cp)))
        assert np.array_equal(step.sample_cp_sizes(), np.full(step.num_samples, cp))
        for w in range(dp * cp):
            d = w // cp
            prog = step.rank_program(w)
            assert step.rank_bins[w] == dp_bins[d]
            assert len(prog) == step.num_rounds == nmb[step.index]
            for j, work in enumerate(prog):
                assert (work.cp_size, work.cp_rank) == (cp, w % cp) and not work.idle
                # the per-DP-rank program: slime's layout of DP rank d, micro-batch by micro-batch
                pos = mbi[d][mb_seen[d] + j]
                want = [parts[d][i] for i in pos]
                assert work.samples.tolist() == want
        for d in range(dp):
            n_samples = sum(step.micro_batches[b].size for b in dp_bins[d])
            offset[d] += n_samples
            mb_seen[d] += len(dp_bins[d])
    assert offset == [len(p) for p in parts]
    # stats: one row per step and world rank, every micro-batch counted on its cp ranks
    stats = sched.stats()
    assert len(stats) == sched.num_steps * dp * cp
    assert int(stats["micro_batches"].sum()) == cp * sum(len(s.micro_batches) for s in sched.steps)


def _dynamic(seed):
    rng = np.random.default_rng(seed)
    L = np.concatenate([rng.integers(10, 300, 30), [1500, 900]])
    cfg = ScheduleConfig(dp=2, cp=4, global_batch_size=len(L), max_tokens_per_gpu=256,
                         cp_mode="dynamic")
    return build_schedule(rollouts(L), cfg, TINY)


def _corruptions(step, cfg):
    """Ways to break a valid step's placements, each with the message check() must give."""
    pl = list(step.placements)
    world, rounds = cfg.world_size, step.num_rounds
    out = []
    p0 = pl[0]
    # another micro-batch joins p0's group in its round
    other = next(b for b in range(len(pl)) if b != p0.bin)
    q = list(pl)
    q[other] = Placement(other, p0.round, p0.ranks)
    out.append((q, "disjoint"))
    # a degree the config does not allow (cp + 1 ranks; the pool has room since dp >= 2)
    q = list(pl)
    q[0] = Placement(0, rounds, tuple(range(cfg.cp + 1)))
    out.append((q, "CP degree"))
    # a round gap: p0 moved two rounds past the last
    q = list(pl)
    q[0] = Placement(0, rounds + 1, p0.ranks)
    out.append((q, "without gaps" if len(pl) > 1 else "rounds"))
    # a rank twice in one group
    q = list(pl)
    q[0] = Placement(0, p0.round, (p0.ranks[0],) * max(2, p0.degree))
    out.append((q, "distinct"))
    # a rank outside the pool
    q = list(pl)
    q[0] = Placement(0, p0.round, (world,) + p0.ranks[1:])
    out.append((q, "distinct ranks of the pool"))
    # placements that name the wrong bin
    q = list(pl)
    q[0] = Placement(1, p0.round, p0.ranks)
    out.append((q, "not a Placement of bin 0"))
    # one placement missing
    out.append((pl[:-1], "placements for"))
    return out


@settings(max_examples=15, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**6), st.sampled_from(["fixed", "dynamic"]), st.data())
def test_check_verifies_placements_in_both_modes(seed, mode, data):
    base = _dynamic(seed)
    sched = build_schedule(base.rollouts, base.config.with_(cp_mode=mode), TINY).check()
    s = data.draw(st.integers(0, sched.num_steps - 1))
    step = sched.steps[s]
    for placements, match in _corruptions(step, sched.config):
        broken = replace(sched, steps=list(sched.steps))
        broken.steps[s] = replace(step, placements=tuple(placements))
        with pytest.raises(ScheduleInvariantError, match=match):
            broken.check()
    sched.check()  # the original is untouched


def test_check_rejects_dynamic_groups_under_fixed_cp():
    """A valid dynamic plan is not a valid fixed-CP plan: check() names the fixed shape."""
    checked = 0
    for seed in range(4):
        dyn = _dynamic(seed).check()
        if all(s.is_fixed_shape for s in dyn.steps):
            continue  # the planner kept the fixed plan
        fixed = build_schedule(dyn.rollouts, dyn.config.with_(cp_mode="fixed"), TINY)
        mixed = replace(fixed, steps=list(dyn.steps))
        with pytest.raises(ScheduleInvariantError, match="CP degree|fixed-CP shape"):
            mixed.check()
        checked += 1
    assert checked >= 2


def test_schedule_step_range_check():
    sched = build_schedule(rollouts([5, 6, 7, 8]), ScheduleConfig(global_batch_size=2,
                                                                  micro_batch_size=1))
    assert sched.step(1) is sched.steps[1]
    assert sched.step(np.int64(0)) is sched.steps[0]
    for bad in (2, -1, 1.0, True, "0"):
        with pytest.raises(ValueError, match=r"step=.* is out of range: the schedule has "
                                             r"steps 0\.\.1"):
            sched.step(bad)
