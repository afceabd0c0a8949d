"""Dynamic-CP interface: ScheduleConfig(cp_mode=...), Placement/RankWork, Step.rank_program,
Step.sample_cp_sizes and Schedule.check() on hand-made plans."""

import numpy as np
import pytest
from _factories import TINY, rollouts

from varbatch_kit import ScheduleConfig, build_schedule
from varbatch_kit.core.placement import Placement
from varbatch_kit.core.schedule import Schedule, ScheduleInvariantError
from varbatch_kit.core.step import Step


# ------------------------------------------------------------------ config
def test_config_defaults_and_degrees():
    c = ScheduleConfig(dp=2, cp=4, max_tokens_per_gpu=100, global_batch_size=4)
    assert c.cp_mode == "fixed" and c.cp_sizes == "pow2" and c.cp_degrees == (4,)
    d = c.with_(cp_mode="dynamic")
    assert d.cp_degrees == (1, 2, 4)
    assert c.with_(cp=6, cp_mode="dynamic").cp_degrees == (1, 2, 4, 6)
    assert c.with_(cp=6, cp_mode="dynamic", cp_sizes="divisors").cp_degrees == (1, 2, 3, 6)
    assert c.with_(cp=8, cp_mode="dynamic", cp_sizes="divisors").cp_degrees == (1, 2, 4, 8)


@pytest.mark.parametrize("kw, match", [
    (dict(cp_mode="ring"), "cp_mode must be one of"),
    (dict(cp_sizes="odd"), "cp_sizes must be one of"),
    (dict(cp_mode="dynamic", cp=1), "cp >= 2"),
    (dict(cp_mode="dynamic", vpp=2, mb_group=2), "virtual pipelining"),
    (dict(cp_mode="dynamic", micro_batch_size=2, max_tokens_per_gpu=None), "max_tokens_per_gpu"),
])
def test_config_errors(kw, match):
    base = dict(dp=2, cp=4, max_tokens_per_gpu=100, global_batch_size=4)
    base.update(kw)
    with pytest.raises(ValueError, match=match):
        ScheduleConfig(**base)


def test_dynamic_needs_a_model():
    cfg = ScheduleConfig(dp=2, cp=2, max_tokens_per_gpu=100, global_batch_size=4,
                         cp_mode="dynamic")
    with pytest.raises(ValueError, match="model shape"):
        build_schedule(rollouts([5, 6, 7, 8]), cfg)


# ------------------------------------------------------------- fixed mode
def test_fixed_rank_program_and_cp_sizes():
    r = rollouts([50, 30, 80, 20, 70, 10, 40, 60])
    cfg = ScheduleConfig(dp=2, cp=2, global_batch_size=8, micro_batch_size=2)
    sched = build_schedule(r, cfg).check()
    st = sched.steps[0]
    assert st.is_fixed_shape and (st.dp, st.cp, st.world_size) == (2, 2, 4)
    assert st.num_rounds == st.num_microbatches == 2
    # DP rank 0 -> bins 0, 2; DP rank 1 -> bins 1, 3 (strided); each on its CP replica
    assert st.dp_rank_bins == [[0, 2], [1, 3]]
    assert [(p.bin, p.round, p.ranks) for p in st.placements] == [
        (0, 0, (0, 1)), (1, 0, (2, 3)), (2, 1, (0, 1)), (3, 1, (2, 3))]
    # rank_bins: per world rank, the micro-batches it takes part in
    assert st.rank_bins == [[0, 2], [0, 2], [1, 3], [1, 3]]
    for w in range(4):
        prog = st.rank_program(w)
        assert len(prog) == 2
        d = w // 2
        for j, work in enumerate(prog):
            assert np.array_equal(work.samples, st.micro_batches[st.dp_rank_bins[d][j]])
            assert (work.cp_size, work.cp_rank) == (2, w % 2)
            assert not work.idle
    assert np.array_equal(st.sample_cp_sizes(), np.full(8, 2))
    with pytest.raises(ValueError, match="world_rank"):
        st.rank_program(4)


def test_from_dp_ranks_places_each_dp_rank_on_its_replica():
    mbs = [np.array([i]) for i in range(4)]
    st = Step.from_dp_ranks(0, np.arange(4), np.arange(4), mbs, [[0, 2], [1, 3]], cp=2)
    assert [(p.round, p.ranks) for p in st.placements] == [(0, (0, 1)), (0, (2, 3)),
                                                           (1, (0, 1)), (1, (2, 3))]
    assert st.dp_rank_bins == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match="used once"):
        Step.from_dp_ranks(0, np.arange(4), np.arange(4), mbs, [[0, 2], [0, 3]], cp=2)
    with pytest.raises(ValueError, match="cp must be a positive integer"):
        Step.from_dp_ranks(0, np.arange(4), np.arange(4), mbs, [[0, 2], [1, 3]], cp=0)
    with pytest.raises(ValueError, match="one per micro-batch"):
        Step.from_placements(0, np.arange(4), np.arange(4), mbs, [(0, (0,))], dp=1, cp=1)


# ----------------------------------------------------------- dynamic mode
def _hand_plan():
    """dp=1, cp=4 pool; samples 0 (400 tok), 1..4 (100 tok each); cap 100 per GPU.

    round 0: sample 0 over all 4 ranks; round 1: samples 1..4 alone on ranks 0..3.
    """
    r = rollouts([400, 100, 100, 100, 100])
    cfg = ScheduleConfig(dp=1, cp=4, global_batch_size=5, max_tokens_per_gpu=100,
                         cp_mode="dynamic")
    sched = build_schedule(r, cfg, TINY)
    st0 = sched.steps[0]
    mbs = [np.array([0]), np.array([1]), np.array([2]), np.array([3]), np.array([4])]
    st = Step.from_placements(
        0, st0.rollout_ids, st0.sample_indices, mbs,
        [(0, (0, 1, 2, 3)), (1, (0,)), (1, (1,)), (1, (2,)), (1, (3,))], dp=1, cp=4)
    return Schedule(cfg, r, [st], sched.dropped_rollout_ids, sched.dropped_samples, TINY,
                    sched.sample_flops)


def test_dynamic_hand_plan():
    sched = _hand_plan().check()
    st = sched.steps[0]
    assert not st.is_fixed_shape and st.num_rounds == 2 and st.num_microbatches == 2
    assert st.rank_bins == [[0, 1], [0, 2], [0, 3], [0, 4]]
    assert [p.degree for p in st.placements] == [4, 1, 1, 1, 1]
    prog = st.rank_program(2)
    assert [(w.samples.tolist(), w.cp_size, w.cp_rank) for w in prog] == [([0], 4, 2),
                                                                          ([3], 1, 0)]
    assert st.sample_cp_sizes().tolist() == [4, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="DP ranks"):
        sched.rank_layout()
    with pytest.raises(ValueError, match="has no DP ranks"):
        _ = st.dp_rank_bins


def test_dynamic_idle_round_entries():
    r = rollouts([100, 100, 300])
    cfg = ScheduleConfig(dp=1, cp=4, global_batch_size=3, max_tokens_per_gpu=100,
                         cp_mode="dynamic")
    base = build_schedule(r, cfg, TINY)
    st0 = base.steps[0]
    st = Step.from_placements(0, st0.rollout_ids, st0.sample_indices,
                              [np.array([0]), np.array([1]), np.array([2])],
                              [(0, (0,)), (0, (1,)), (1, (3, 2, 1, 0))], dp=1, cp=4)
    sched = Schedule(cfg, r, [st], base.dropped_rollout_ids, base.dropped_samples, TINY,
                     base.sample_flops).check()
    prog = sched.steps[0].rank_program(3)
    assert prog[0].idle and (prog[0].cp_size, prog[0].cp_rank) == (1, 0)
    assert (prog[1].cp_size, prog[1].cp_rank) == (4, 0)
    assert all(len(st.rank_program(w)) == 2 for w in range(4))


def _broken(placements, mbs=None, lengths=(400, 100, 100, 100, 100)):
    r = rollouts(list(lengths))
    cfg = ScheduleConfig(dp=1, cp=4, global_batch_size=len(lengths), max_tokens_per_gpu=100,
                         cp_mode="dynamic")
    base = build_schedule(r, cfg, TINY)
    st0 = base.steps[0]
    mbs = mbs or [np.array([i]) for i in range(len(lengths))]
    st = Step.from_placements(0, st0.rollout_ids, st0.sample_indices, mbs, placements, dp=1,
                              cp=4)
    return Schedule(cfg, r, [st], base.dropped_rollout_ids, base.dropped_samples, TINY,
                    base.sample_flops)


@pytest.mark.parametrize("placements, mbs, match", [
    # sample 0 (400 tokens) over 2 ranks and packed with another: 250/rank > 100
    ([(0, (0, 1)), (1, (0,)), (1, (1,)), (1, (2,))],
     [np.array([0, 4]), np.array([1]), np.array([2]), np.array([3])], "max_tokens_per_gpu"),
    # rank 0 in two groups of round 0
    ([(0, (0, 1, 2, 3)), (0, (0,)), (1, (1,)), (1, (2,)), (1, (3,))], None, "disjoint"),
    # degree 3 is not a power of two <= 4
    ([(0, (0, 1, 2, 3)), (1, (0, 1, 2)), (2, (1,)), (2, (2,)), (2, (3,))], None, "degree 3"),
    # round 1 missing (0, 2)
    ([(0, (0, 1, 2, 3)), (2, (0,)), (2, (1,)), (2, (2,)), (2, (3,))], None, "without gaps"),
])
def test_dynamic_check_catches(placements, mbs, match):
    sched = _broken(placements, mbs)
    with pytest.raises(ScheduleInvariantError, match=match):
        sched.check()


def test_dynamic_step_rank_outside_pool():
    with pytest.raises(ValueError, match="outside the pool"):
        _broken([(0, (0, 1, 2, 3)), (1, (4,)), (1, (1,)), (1, (2,)), (1, (3,))])


def test_dynamic_check_single_oversize_sample_allowed():
    # 500 tokens alone over all 4 ranks: 125/rank > 100, but nothing could do better
    sched = _broken([(0, (0, 1, 2, 3))], [np.array([0])], lengths=(500,))
    sched.check()


def test_placement_degree():
    assert Placement(0, 0, (3, 1)).degree == 2


def test_build_schedule_dynamic_passes_check():
    rng = np.random.default_rng(0)
    r = rollouts(rng.integers(10, 400, 40))
    cfg = ScheduleConfig(dp=2, cp=2, global_batch_size=20, max_tokens_per_gpu=300,
                         cp_mode="dynamic")
    sched = build_schedule(r, cfg, TINY).check()
    for st in sched.steps:
        sizes = st.sample_cp_sizes()
        assert sizes.shape == st.sample_indices.shape
        assert set(sizes.tolist()) <= {1, 2}
        assert len({len(st.rank_program(w)) for w in range(4)}) == 1
