"""Bad input raises ValueError naming the parameter, the value and what would work."""

from dataclasses import replace

import numpy as np
import pytest

from varbatch_kit import ModelShape, Rollouts, ScheduleConfig, build_schedule
from varbatch_kit.core.placement import Placement
from varbatch_kit.core.schedule import ScheduleInvariantError


def r(lengths, rid=None):
    return Rollouts(prompt_len=[0] * len(lengths), response_len=lengths, rollout_id=rid)


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompt_len=[], response_len=[]), "empty"),
    (dict(prompt_len=[1, 2], response_len=[3]), "prompt_len has 2 entries but response_len has 1"),
    (dict(prompt_len=[1], response_len=[0]), r"response_len\[0\] = 0 is not positive"),
    (dict(prompt_len=[-1], response_len=[3]), r"prompt_len\[0\] = -1 is negative"),
    (dict(prompt_len=[1], response_len=[2.5]), r"response_len\[0\] = 2.5 is not an integer"),
    (dict(prompt_len=[1], response_len=["a"]), r"response_len\[0\] = 'a' is a str.*integers"),
    (dict(prompt_len=[1, 1], response_len=[3, "12"]), r"response_len\[1\] = '12' is a str"),
    (dict(prompt_len=[1, 1], response_len=[3, 3], rollout_id=[0]), "rollout_id has 1 entries"),
    (dict(prompt_len=[1], response_len=[3], loss_masks=[[1, 1]]), r"loss_masks\[0\] has length 2"),
])
def test_rollouts_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Rollouts(**kwargs)


def test_float_lengths_that_are_integers_are_accepted():
    assert Rollouts(prompt_len=[1.0], response_len=[3.0]).total_len.tolist() == [4]


@pytest.mark.parametrize("kwargs,match", [
    (dict(dp=0, micro_batch_size=1), "dp must be a positive integer, got 0"),
    (dict(cp=0, micro_batch_size=1), "cp must be a positive integer"),
    (dict(vpp=-1, micro_batch_size=1), "vpp must be a positive integer"),
    (dict(global_batch_size=0, micro_batch_size=1), "global_batch_size must be a positive"),
    (dict(), "set exactly one of micro_batch_size"),
    (dict(micro_batch_size=1, max_tokens_per_gpu=10), "set exactly one of micro_batch_size"),
    (dict(micro_batch_size=1, packing="nope"), "unknown packing 'nope'; choose one of"),
    (dict(micro_batch_size=1, distribution="x"), "unknown distribution 'x'; choose one of"),
    (dict(micro_batch_size=2, packing="flops_kk"), "packs under a token cap: set max_tokens"),
    (dict(micro_batch_size=2, packing="first_fit"), "packs under a token cap"),
    (dict(max_tokens_per_gpu=100, packing="static"), "needs micro_batch_size"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ScheduleConfig(**kwargs)


def test_gbs_larger_than_rollouts():
    with pytest.raises(ValueError, match="global_batch_size=4 .* only 2 rollouts"):
        build_schedule(r([5, 5, 5], [0, 0, 1]), ScheduleConfig(global_batch_size=4,
                                                               micro_batch_size=1))


def test_step_with_fewer_samples_than_dp():
    with pytest.raises(ValueError, match=r"^step 0: 2 samples < dp_size 4; "
                                         r"step 0 holds 2 samples but dp=4.*dp <= 2"):
        build_schedule(r([5, 5]), ScheduleConfig(dp=4, global_batch_size=2, micro_batch_size=1))


def test_static_not_divisible_names_what_works():
    with pytest.raises(ValueError) as e:
        build_schedule(r([5] * 6), ScheduleConfig(dp=4, global_batch_size=6, micro_batch_size=1))
    msg = str(e.value)
    assert "step 0: 6 samples" in msg and "6 micro-batches" in msg
    assert "not a multiple of dp*mb_group=4" in msg
    assert "global_batch_size=4" in msg
    # ceil(6/c) for c = 1..6 is 6, 3, 2, 2, 2, 1: no micro_batch_size works for dp=4
    assert "at least 4 samples" in msg


def test_static_hint_lists_working_micro_batch_sizes():
    with pytest.raises(ValueError, match=r"micro_batch_size in \[1, 3, 4, 5\]"):
        build_schedule(r([5] * 6), ScheduleConfig(dp=2, global_batch_size=6, micro_batch_size=2))


def test_dynamic_alignment_unreachable_names_step_and_counts():
    # dp=2, vpp=2, mb_group=2 -> 4 micro-batches needed; step 1 has only 3 samples
    roll = r([10] * 7, [0, 0, 0, 0, 1, 1, 1])
    cfg = ScheduleConfig(dp=2, vpp=2, mb_group=2, global_batch_size=1, max_tokens_per_gpu=100)
    with pytest.raises(ValueError, match=r"step 1 holds 3 samples but the layout needs 4 micro"):
        build_schedule(roll, cfg)


def test_flops_policy_without_model():
    with pytest.raises(ValueError, match="needs a model shape"):
        build_schedule(r([5, 5]), ScheduleConfig(global_batch_size=2, micro_batch_size=1,
                                                 distribution="flops_kk"))


def test_wrong_argument_types():
    with pytest.raises(ValueError, match="rollouts must be a varbatch_kit.Rollouts"):
        build_schedule([1, 2], ScheduleConfig(micro_batch_size=1))
    with pytest.raises(ValueError, match="config must be a ScheduleConfig"):
        build_schedule(r([1]), {"dp": 1})


def test_check_catches_a_broken_schedule():
    sched = build_schedule(r([10] * 4), ScheduleConfig(dp=2, global_batch_size=4,
                                                       micro_batch_size=1))
    st = sched.steps[0]
    pl = list(st.placements)
    pl[1] = Placement(1, pl[0].round, pl[0].ranks)  # bin 1 now on bin 0's ranks and round
    sched.steps[0] = replace(st, placements=tuple(pl))
    with pytest.raises(ScheduleInvariantError, match="disjoint"):
        sched.check()


def test_check_catches_rank_bins_out_of_step_with_placements():
    sched = build_schedule(r([10] * 4), ScheduleConfig(dp=2, global_batch_size=4,
                                                       micro_batch_size=1))
    sched.steps[0].rank_bins[1][0] = 0  # rank 1 now claims bin 0 (its placements disagree)
    with pytest.raises(ScheduleInvariantError, match="round order"):
        sched.check()


def test_check_catches_fixed_cp_plan_off_its_replicas():
    # cp=2, fixed: degree-2 groups that are valid dynamic groups but not the DP replicas
    sched = build_schedule(r([10] * 4), ScheduleConfig(dp=2, cp=2, global_batch_size=4,
                                                       micro_batch_size=1))
    st = sched.steps[0]
    assert st.is_fixed_shape
    pl = (Placement(0, 0, (0, 1)), Placement(1, 0, (2, 3)), Placement(2, 1, (1, 2)),
          Placement(3, 2, (0, 3)))
    sched.steps[0] = replace(st, placements=pl)
    assert not sched.steps[0].is_fixed_shape
    with pytest.raises(ScheduleInvariantError, match="not the fixed-CP shape"):
        sched.check()
    with pytest.raises(ValueError, match="has no DP ranks"):
        _ = sched.steps[0].dp_rank_bins
    with pytest.raises(ValueError, match="no DP ranks"):
        sched.rank_layout()


def test_check_catches_cap_violation_by_multi_sample_bin():
    sched = build_schedule(r([10] * 4), ScheduleConfig(dp=1, global_batch_size=4,
                                                       max_tokens_per_gpu=100))
    object.__setattr__(sched.config, "max_tokens_per_gpu", 15)
    with pytest.raises(ScheduleInvariantError, match="tokens > cap 15"):
        sched.check()


def test_model_shape_validation():
    with pytest.raises(ValueError, match="hidden_size must be a positive integer"):
        ModelShape(num_layers=1, hidden_size=0, num_attention_heads=1, ffn_hidden_size=1,
                   vocab_size=1)
    with pytest.raises(ValueError, match="unknown model preset 'gpt-9'; available: "):
        ModelShape.preset("gpt-9")
    with pytest.raises(ValueError, match="moe_layer_freq has 2 entries but num_layers = 3"):
        ModelShape(num_layers=3, hidden_size=8, num_attention_heads=2, ffn_hidden_size=8,
                   vocab_size=4, num_experts=4, moe_ffn_hidden_size=4, moe_layer_freq=[1, 0])
    assert np.isfinite(ModelShape.preset("qwen3-8b").forward_flops(10**6))
