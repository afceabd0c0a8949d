"""megatron's BalancedCPScheduler plans in the project's step shape (_megatron_hybrid_cp).

The hand case: five samples of 350, 180, 90, 60 and 50 tokens, a pool of 4
ranks, 100 tokens per rank. megatron's ``gpus_needed`` rounds ``L / 100`` up
to a power of two: 4, 2, 1, 1, 1. Its first group puts sample 0 on all four
ranks; no rank is left for sample 1 (no group of 2, no free rank), so the
group closes. The second group gives sample 1 ranks 0-1, sample 2 the free
rank 2, sample 3 the free rank 3 (load 0 beats rank 2's), and sample 4 the
least-loaded group of size 1 (rank 3). That is ``HAND_GROUPS`` (megatron's
``sample_id_groups``), checked against the installed scheduler once (the one test
that imports megatron-core: about 2.5 s in a process without it, nothing in a
test worker that already ran a megatron test).
"""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import _megatron_hybrid_cp as mh
from varbatch_kit import ModelShape, Rollouts, ScheduleConfig, build_schedule
from varbatch_kit.core.schedule import Schedule
from varbatch_kit.policies.dynamic_cp import CPCostModel, group_timeline

HAND_LENGTHS = [350, 180, 90, 60, 50]
HAND_GROUPS = [[[0], [0], [0], [0]], [[1], [1], [2], [3, 4]]]
POOL, CAP = 4, 100


def test_hand_plan_converts_to_rounds_and_groups():
    plan = mh.plan_to_placements(HAND_GROUPS, POOL, 5)
    got = {b[0]: (r, g) for b, r, g in zip(plan.bins, plan.rounds, plan.groups)}
    assert got == {0: (0, (0, 1, 2, 3)), 1: (1, (0, 1)), 2: (1, (2,)), 3: (1, (3,)),
                   4: (2, (3,))}
    assert sorted(i for b in plan.bins for i in b) == [0, 1, 2, 3, 4]  # every sample once
    assert all(len(b) == 1 for b in plan.bins)  # megatron: one forward/backward per sample
    assert dict(zip([b[0] for b in plan.bins], plan.degrees)) == {0: 4, 1: 2, 2: 1, 3: 1, 4: 1}
    assert plan.group_rounds == [range(0, 1), range(1, 3)]
    per_rank = mh.tokens_per_rank(HAND_LENGTHS, plan.bins, plan.degrees)
    assert per_rank.tolist() == [87.5, 90.0, 90.0, 60.0, 50.0]  # all within the cap of 100
    assert mh.unaligned_groups(plan, POOL) == 0


def _hand_schedule() -> Schedule:
    roll = Rollouts(prompt_len=np.zeros(5, dtype=np.int64),
                    response_len=np.array(HAND_LENGTHS, dtype=np.int64))
    cfg = ScheduleConfig(dp=1, cp=4, max_tokens_per_gpu=CAP, global_batch_size=5,
                         packing="balanced", cp_mode="dynamic")
    return build_schedule(roll, cfg, ModelShape.preset("qwen3-8b"))


def test_megatron_schedule_is_a_checked_dynamic_schedule_on_the_pool():
    sched, plans = mh.megatron_schedule(_hand_schedule(), planner=lambda L, pool, cap: HAND_GROUPS)
    assert (sched.config.dp, sched.config.cp, sched.config.cp_mode) == (1, POOL, "dynamic")
    (step,) = sched.steps
    assert step.sample_cp_sizes().tolist() == [4, 2, 1, 1, 1]
    assert step.num_rounds == 3
    assert [list(r) for r in plans[0].group_rounds] == [[0], [1, 2]]


def test_barrier_time_adds_megatrons_wait_at_each_group_end():
    cost = CPCostModel(linear_s=1.0, attention_s=0.0)  # a sample takes L / c seconds
    plan = mh.plan_to_placements(HAND_GROUPS, POOL, 5)
    # group 0: 350 / 4; group 1: rank 3 runs 60 + 50, the slowest
    assert mh.barrier_step_time(plan, HAND_LENGTHS, cost, POOL) == pytest.approx(87.5 + 110.0)
    # two ranks, two groups of one sample per rank: the barrier makes 10 + 10 of 11 + 11
    plan = mh.plan_to_placements([[[0], [1]], [[2], [3]]], 2, 4)
    lengths = np.array([10, 1, 1, 10])
    assert mh.barrier_step_time(plan, lengths, cost, 2) == pytest.approx(20.0)
    dur = [float(lengths[b].sum()) / len(g) for b, g in zip(plan.bins, plan.groups)]
    assert group_timeline(dur, plan.rounds, plan.groups, 2)[2].max() == pytest.approx(11.0)


@pytest.mark.parametrize(("groups", "match"), [
    ([[[0], [0]], [[1], [1]]], "leaves out samples \\[2\\]"),
    ([[[0], [1]], [[2], [1]]], "sample 1 is in megatron groups 0 and 1"),
    ([[[0, 1], [1, 2]]], "sample 1 is at positions \\[1, 0\\]"),
    ([[[0], [1], [2]]], "lists 3 ranks, pool=2"),
    ([[[0], [5]]], "sample 5 is outside 0..2"),
])
def test_a_malformed_plan_is_refused(groups, match):
    with pytest.raises(ValueError, match=match):
        mh.plan_to_placements(groups, 2, 3)


def test_unaligned_groups_have_no_megatron_process_group():
    plan = mh.plan_to_placements([[[0], [1], [1], [2]]], 4, 3)  # sample 1 on ranks 1-2
    assert mh.unaligned_groups(plan, 4) == 1


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"lengths": [10], "pool": 3, "cap": 10}, "pool must be an even number"),
    ({"lengths": [50], "pool": 4, "cap": 10}, "50 tokens is longer than pool \\* cap"),
    ({"lengths": [0, 5], "pool": 2, "cap": 10}, "positive token counts"),
])
def test_megatron_groups_refuses_what_the_scheduler_cannot_place(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mh.megatron_groups(**kwargs)


def test_the_installed_scheduler_gives_the_hand_plan():
    pytest.importorskip("megatron.core")
    assert mh.megatron_groups(HAND_LENGTHS, POOL, CAP) == HAND_GROUPS


def test_the_benchmark_gives_every_planner_a_row_on_a_small_batch():
    pytest.importorskip("megatron.core")
    from benchmarks.dynamic_cp import FIXED
    from benchmarks.dynamic_cp_megatron import PLANNERS, one_batch
    from varbatch_kit.core.hardware import HARDWARE

    rng = np.random.default_rng(0)
    lengths = np.concatenate([rng.integers(200, 6000, 30), [40000, 20000]])
    roll = Rollouts(prompt_len=np.zeros(lengths.size, dtype=np.int64), response_len=lengths)
    rows = one_batch(roll, 16, 2, 4, FIXED, HARDWARE["H100"])  # 2 steps of 16 samples
    assert [r["planner"] for r in rows] == PLANNERS
    by = {r["planner"]: r for r in rows}
    assert by["project dynamic"]["vs_dynamic"] == 1.0
    mg = by["megatron (barriers)"]
    assert mg["micro_batches"] == lengths.size  # one forward/backward per sample
    assert sum(mg["degrees"].values()) == lengths.size
    assert mg["over_cap"] == 0 and mg["max_tokens_per_rank"] <= 16384
    assert mg["step_s"] >= by["megatron (no barrier)"]["step_s"]
