"""The forward-only log-prob pass: its own token cap, the same ranks, the same steps."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from varbatch_kit import ModelShape, Rollouts, ScheduleConfig, build_schedule
from varbatch_kit.compat.slime.flags import schedule_config_from_slime_args
from varbatch_kit.core.log_prob_schedule import build_log_prob_schedule
from varbatch_kit.core.traces import bundled_traces, read_trace


def one_sample_rollouts(lengths):
    n = len(lengths)
    return Rollouts(np.zeros(n, dtype=np.int64), np.asarray(lengths), np.arange(n))


def test_unset_or_equal_cap_reuses_the_training_micro_batches():
    roll = one_sample_rollouts([100] * 8)
    cfg = ScheduleConfig(dp=2, global_batch_size=8, max_tokens_per_gpu=100)
    train = build_schedule(roll, cfg)
    assert build_log_prob_schedule(roll, cfg, schedule=train) is train
    same = cfg.with_(log_probs_max_tokens_per_gpu=100)
    train2 = build_schedule(roll, same)
    assert build_log_prob_schedule(roll, same, schedule=train2) is train2
    assert cfg.log_probs_cap == 100


def test_larger_cap_packs_each_ranks_samples_again_by_hand():
    # training: cap 100, eight 100-token samples -> 8 micro-batches, strided over dp=2:
    # rank 0 trains samples 0, 2, 4, 6 and rank 1 samples 1, 3, 5, 7. Log-prob cap 300:
    # first-fit of each rank's samples -> [0, 2, 4], [6] and [1, 3, 5], [7].
    roll = one_sample_rollouts([100] * 8)
    cfg = ScheduleConfig(dp=2, global_batch_size=8, max_tokens_per_gpu=100,
                         log_probs_max_tokens_per_gpu=300)
    lp = build_log_prob_schedule(roll, cfg).check()
    assert [[mb.tolist() for mb in r] for r in lp.steps[0].ranks] == [[[0, 2, 4], [6]],
                                                                      [[1, 3, 5], [7]]]
    assert lp.config.cap == 300 and lp.config.log_probs_max_tokens_per_gpu is None
    assert build_schedule(roll, cfg).num_microbatches == [4]
    assert lp.num_microbatches == [2]


@pytest.mark.parametrize("kw", [
    dict(dp=4, cp=1, packing="first_fit"),
    dict(dp=4, cp=2, packing="flops_kk", distribution="flops_kk"),
    dict(dp=2, cp=1, packing="balanced"),
    dict(dp=2, cp=1, vpp=2, mb_group=2, packing="ffd", microbatch_order="min_bubble", pp=2),
])
def test_every_sample_stays_on_its_training_rank_under_its_cap(kw):
    roll = read_trace(bundled_traces()["long_context"])
    roll = roll.subset(np.flatnonzero(roll.rollout_id < 96))
    model = ModelShape.preset("qwen3-8b")
    cfg = ScheduleConfig(global_batch_size=32, max_tokens_per_gpu=16384,
                         log_probs_max_tokens_per_gpu=65536, **kw)
    train = build_schedule(roll, cfg, model)
    lp = build_log_prob_schedule(roll, cfg, model, schedule=train).check()
    assert lp.config.cap == 65536 * cfg.cp
    assert lp.num_steps == train.num_steps
    for a, b in zip(train.steps, lp.steps, strict=True):
        for ra, rb in zip(a.ranks, b.ranks, strict=True):
            assert sorted(np.concatenate(ra).tolist()) == sorted(np.concatenate(rb).tolist())
        assert len(b.rank_bins[0]) % (cfg.mb_group if cfg.vpp > 1 else 1) == 0
    assert sum(lp.num_microbatches) < sum(train.num_microbatches)


def test_a_rank_with_too_few_samples_for_the_common_count_is_an_error():
    # training cap 200: bins [0, 1] (100 + 100) and [2] (200); rank 0 holds samples 0, 1,
    # rank 1 sample 2. Log-prob cap 50: rank 0 needs 2 micro-batches, rank 1 has one sample.
    roll = one_sample_rollouts([100, 100, 200])
    cfg = ScheduleConfig(dp=2, global_batch_size=3, max_tokens_per_gpu=200,
                         log_probs_max_tokens_per_gpu=50)
    with pytest.raises(ValueError, match="rank 1 holds 1 samples but every rank needs 2"):
        build_log_prob_schedule(roll, cfg)


def test_static_path_has_no_log_prob_cap():
    with pytest.raises(ValueError, match="log_probs_max_tokens_per_gpu=4096 is a token cap of "
                                         "dynamic batching"):
        ScheduleConfig(global_batch_size=4, micro_batch_size=2, log_probs_max_tokens_per_gpu=4096)
    with pytest.raises(ValueError, match="log_probs_max_tokens_per_gpu must be a positive"):
        ScheduleConfig(global_batch_size=4, max_tokens_per_gpu=8, log_probs_max_tokens_per_gpu=0)


def test_a_foreign_schedule_is_refused():
    roll = one_sample_rollouts([100] * 8)
    cfg = ScheduleConfig(dp=2, global_batch_size=8, max_tokens_per_gpu=100,
                         log_probs_max_tokens_per_gpu=300)
    other = build_schedule(roll, cfg.with_(dp=4))
    with pytest.raises(ValueError, match="must be the training schedule"):
        build_log_prob_schedule(roll, cfg, schedule=other)


def test_slime_flag_maps_on_the_dynamic_path_only():
    c = schedule_config_from_slime_args(
        "--global-batch-size 8 --use-dynamic-batch-size --max-tokens-per-gpu 8192 "
        "--log-probs-max-tokens-per-gpu 32768 --pipeline-model-parallel-size 4 --dp-size 2")
    assert (c.log_probs_max_tokens_per_gpu, c.log_probs_cap, c.pp) == (32768, 32768, 4)
    s = schedule_config_from_slime_args(
        "--global-batch-size 8 --micro-batch-size 1 --log-probs-max-tokens-per-gpu 32768")
    assert s.log_probs_max_tokens_per_gpu is None


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=4, max_size=40), dp=st.integers(1, 4),
       cap=st.integers(100, 300), lp_cap=st.integers(50, 1200),
       packing=st.sampled_from(["first_fit", "ffd", "bfd"]), vpp=st.sampled_from([1, 2]))
def test_log_prob_schedule_invariants(lengths, dp, cap, lp_cap, packing, vpp):
    roll = one_sample_rollouts(lengths)
    cfg = ScheduleConfig(dp=dp, global_batch_size=max(1, len(lengths) // 2),
                         max_tokens_per_gpu=cap, log_probs_max_tokens_per_gpu=lp_cap,
                         packing=packing, vpp=vpp, mb_group=2)
    try:
        train = build_schedule(roll, cfg)
    except ValueError:
        return  # the training layout itself does not align
    try:
        lp = build_log_prob_schedule(roll, cfg, schedule=train).check()
    except ValueError as err:
        assert "every rank needs" in str(err) or "cannot split" in str(err)
        return
    for a, b in zip(train.steps, lp.steps, strict=True):
        for ra, rb in zip(a.ranks, b.ranks, strict=True):
            assert sorted(np.concatenate(ra).tolist()) == sorted(np.concatenate(rb).tolist())
            # under the log-prob cap: a micro-batch over it holds one sample
            assert all(mb.size == 1 or roll.total_len[mb].sum() <= lp_cap for mb in rb)
