"""alignment_fallback="drop_rollouts": steps that cannot be aligned move trailing rollouts on."""

import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from varbatch_kit import ModelShape, Rollouts, ScheduleConfig, build_schedule
from varbatch_kit.core.schedule import Schedule, ScheduleInvariantError
from varbatch_kit.core.traces import bundled_traces, read_trace
from varbatch_kit.policies.packers import AlignmentError


def one_sample_rollouts(lengths):
    n = len(lengths)
    return Rollouts(np.zeros(n, dtype=np.int64), np.asarray(lengths), np.arange(n))


def test_static_step_of_five_samples_defers_its_last_rollout(caplog):
    # dp=2, micro_batch_size=2: a step of 5 one-sample rollouts gives 3 micro-batches (not even)
    roll = one_sample_rollouts([10] * 10)
    cfg = ScheduleConfig(dp=2, global_batch_size=5, micro_batch_size=2)
    with pytest.raises(AlignmentError, match="not a multiple of dp_size"):
        build_schedule(roll, cfg)
    with caplog.at_level(logging.WARNING, logger="varbatch_kit"):
        s = build_schedule(roll, cfg.with_(alignment_fallback="drop_rollouts")).check()
    # step 0: rollouts 0-3 (2 micro-batches), 4 moves on; step 1: rollouts 4-7, 8 moves on;
    # rollouts 8, 9 are fewer than 5: dropped
    assert [st.rollout_ids.tolist() for st in s.steps] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert {k: v.tolist() for k, v in s.deferred_rollouts.items()} == {0: [4], 1: [8]}
    assert s.dropped_rollout_ids.tolist() == [8, 9]
    assert s.dropped_samples.tolist() == [8, 9]
    assert s.rank_layout().global_batch_sizes == [4, 4]
    assert s.num_microbatches == [1, 1]
    assert "step 0 trains 4 of 5 rollouts; rollouts [4] move to the next step" in caplog.text


def test_dynamic_step_defers_the_fewest_rollouts_that_make_it_aligned():
    # dp=4, cap 100, every sample fills a micro-batch: 6 samples -> 6 bins, target 8 > 6
    roll = one_sample_rollouts([100] * 12)
    cfg = ScheduleConfig(dp=4, global_batch_size=6, max_tokens_per_gpu=100)
    with pytest.raises(AlignmentError, match="could only produce 6 mbs"):
        build_schedule(roll, cfg)
    s = build_schedule(roll, cfg.with_(alignment_fallback="drop_rollouts")).check()
    # 5 rollouts would still need 8 micro-batches; 4 give exactly 4
    assert [st.num_rollouts for st in s.steps] == [4, 4]
    assert {k: v.tolist() for k, v in s.deferred_rollouts.items()} == {0: [4, 5], 1: [8, 9]}
    assert s.dropped_rollout_ids.tolist() == [8, 9, 10, 11]
    assert s.steps[1].sample_indices.tolist() == [4, 5, 6, 7]


def test_multi_sample_rollouts_move_whole_and_nothing_is_lost():
    # rollouts 0..6 of 3, 1, 2, 2, 1, 2, 1 samples; dp=2, micro_batch_size=1 (even counts align)
    rid = np.array([0, 0, 0, 1, 2, 2, 3, 3, 4, 5, 5, 6])
    roll = Rollouts(np.zeros(12, dtype=np.int64), np.full(12, 7), rid)
    cfg = ScheduleConfig(dp=2, global_batch_size=3, micro_batch_size=1,
                         alignment_fallback="drop_rollouts")
    s = build_schedule(roll, cfg).check()
    # step 0: 6 samples; step 1: rollouts 3, 4, 5 = 5 samples, 3 + 4 = 3, rollout 3 alone = 2;
    # step 2: rollouts 4, 5, 6 = 4 samples. Every rollout trains.
    assert [st.rollout_ids.tolist() for st in s.steps] == [[0, 1, 2], [3], [4, 5, 6]]
    assert {k: v.tolist() for k, v in s.deferred_rollouts.items()} == {1: [4, 5]}
    assert s.dropped_rollout_ids.size == 0
    assert s.num_microbatches == [3, 1, 2]
    assert s.rank_layout().global_batch_sizes == [3, 1, 3]


def test_no_prefix_aligns_raises_saying_so():
    roll = one_sample_rollouts([10] * 4)
    cfg = ScheduleConfig(dp=4, global_batch_size=2, micro_batch_size=1,
                         alignment_fallback="drop_rollouts")
    with pytest.raises(AlignmentError, match="samples < dp_size 4.*cannot help"):
        build_schedule(roll, cfg)


def test_a_later_step_that_cannot_align_is_named_by_its_own_index():
    # step 0 holds 4 samples (fine for dp=4); step 1 holds 2 samples, and no prefix helps:
    # the error (built by the same per-step builder) names step 1, never "step 0"
    roll = one_sample_rollouts([10, 10, 10, 10, 10, 10, 10, 10])
    roll = Rollouts(prompt_len=roll.prompt_len, response_len=roll.response_len,
                    rollout_id=np.array([0, 0, 0, 0, 1, 2, 3, 3]))
    cfg = ScheduleConfig(dp=4, global_batch_size=2, micro_batch_size=1,
                         alignment_fallback="drop_rollouts")
    with pytest.raises(AlignmentError) as err:
        build_schedule(roll, cfg)
    msg = str(err.value)
    assert "step 1: 2 samples < dp_size 4" in msg and "step 1's 2 rollouts" in msg
    assert "step 0" not in msg


@pytest.mark.parametrize("trace,kw", [
    ("agentic", dict(max_tokens_per_gpu=8192, packing="flops_kk", distribution="flops_kk")),
    ("agentic", dict(max_tokens_per_gpu=16384, packing="balanced")),
    ("math", dict(micro_batch_size=2)),
])
def test_when_nothing_fails_the_schedule_is_the_strict_one(trace, kw):
    roll = read_trace(bundled_traces()[trace])
    roll = roll.subset(np.flatnonzero(np.isin(roll.rollout_id, roll.rollout_order()[0][:100])))
    model = ModelShape.preset("qwen3-8b")
    cfg = ScheduleConfig(dp=4, global_batch_size=24, microbatch_order="small_ends", **kw)
    strict = build_schedule(roll, cfg, model)
    lenient = build_schedule(roll, cfg.with_(alignment_fallback="drop_rollouts"), model).check()
    assert lenient.deferred_rollouts == {}
    assert np.array_equal(lenient.dropped_samples, strict.dropped_samples)
    for a, b in zip(strict.steps, lenient.steps, strict=True):
        assert a.rank_bins == b.rank_bins
        assert [m.tolist() for m in a.micro_batches] == [m.tolist() for m in b.micro_batches]
    np.testing.assert_array_equal(lenient.sample_flops, strict.sample_flops)


def test_check_catches_a_deferral_that_is_not_the_trailing_rollouts():
    roll = one_sample_rollouts([10] * 10)
    s = build_schedule(roll, ScheduleConfig(dp=2, global_batch_size=5, micro_batch_size=2,
                                            alignment_fallback="drop_rollouts"))
    bad = Schedule(s.config, s.rollouts, s.steps, s.dropped_rollout_ids, s.dropped_samples,
                   deferred_rollouts={0: np.array([3]), 1: np.array([8])})
    with pytest.raises(ScheduleInvariantError, match="step 0: deferred rollouts"):
        bad.check()


def test_bad_fallback_name():
    with pytest.raises(ValueError, match="alignment_fallback must be one of"):
        ScheduleConfig(global_batch_size=2, micro_batch_size=1, alignment_fallback="skip")


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_fallback_keeps_every_rollout_once_or_raises_saying_why(data):
    n_roll = data.draw(st.integers(2, 14))
    counts = data.draw(st.lists(st.integers(1, 3), min_size=n_roll, max_size=n_roll))
    lengths = data.draw(st.lists(st.integers(1, 120), min_size=sum(counts),
                                 max_size=sum(counts)))
    roll = Rollouts(np.zeros(len(lengths), dtype=np.int64), np.array(lengths),
                    np.repeat(np.arange(n_roll), counts))
    dp = data.draw(st.integers(1, 4))
    size = (dict(micro_batch_size=data.draw(st.integers(1, 3))) if data.draw(st.booleans())
            else dict(max_tokens_per_gpu=data.draw(st.integers(50, 200))))
    cfg = ScheduleConfig(dp=dp, global_batch_size=data.draw(st.integers(1, n_roll)),
                         alignment_fallback="drop_rollouts", **size)
    try:
        s = build_schedule(roll, cfg).check()
    except AlignmentError as err:
        assert "cannot help" in str(err)
        return
    kept = np.concatenate([st_.rollout_ids for st_ in s.steps])
    order = roll.rollout_order()[0]
    # the steps train a prefix of the rollouts, in order, each once; the rest is dropped
    assert kept.tolist() == order[:kept.size].tolist()
    assert s.dropped_rollout_ids.tolist() == order[kept.size:].tolist()
    assert all(st_.num_rollouts <= cfg.global_batch_size for st_ in s.steps)
    for k, moved in s.deferred_rollouts.items():
        assert s.steps[k].num_rollouts + moved.size == cfg.global_batch_size
    try:
        strict = build_schedule(roll, cfg.with_(alignment_fallback="error"))
    except AlignmentError:
        assert s.deferred_rollouts
    else:
        assert s.deferred_rollouts == {}
        assert [a.rank_bins for a in strict.steps] == [b.rank_bins for b in s.steps]
