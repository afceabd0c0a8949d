"""slime-signature scheduling helpers agree with hand-derived values and the core."""

from types import SimpleNamespace

import pytest
from _factories import SLIME_MODEL_ARGS as MODEL_ARGS

from varbatch_kit import ModelShape
from varbatch_kit.compat.slime import (
    SlimeCompatError,
    build_dp_schedule,
    calculate_fwd_flops,
    expand_bins_by_splitting,
    first_fit_pack,
    get_seqlen_balanced_partitions,
    karmarkar_karp,
)


def test_first_fit_pack_arrival_order():
    # cap 130: 60 -> b0; 50 -> b0 (110); 30 -> b1 (b0 would be 140); 40 -> b1 (70);
    # 20 -> b0 (exactly 130: the cap is inclusive)
    assert first_fit_pack([60, 50, 30, 40, 20], 130) == [[0, 1, 4], [2, 3]]
    # an over-cap sample ends up alone
    assert first_fit_pack([10, 400, 10], 100) == [[0, 2], [1]]


def test_expand_bins_by_splitting_in_place():
    # largest bin [0,1,2] (60): by length 30(2), 20(1), 10(0): 30->h0, 20->h1, 10->h1
    bins = [[0, 1, 2], [3]]
    assert expand_bins_by_splitting(bins, 3, [10, 20, 30, 5]) is None
    assert bins == [[2], [3], [1, 0]]
    # only singletons left: stops early without an error (slime's caller checks the count)
    bins = [[0, 1], [2]]
    expand_bins_by_splitting(bins, 8, [5, 5, 5])
    assert bins == [[0], [2], [1]]


def test_balanced_partitions_matches_pinned():
    assert get_seqlen_balanced_partitions([1, 2, 3, 4], 2, True) == [[0, 3], [1, 2]]


def test_calculate_fwd_flops_from_args():
    args = SimpleNamespace(num_layers=2, hidden_size=16, num_attention_heads=2,
                           num_query_groups=2, kv_channels=8, ffn_hidden_size=64, vocab_size=32)
    assert calculate_fwd_flops([10], args) == 180480.0
    shape = ModelShape.from_args(args)
    assert calculate_fwd_flops([7, 900], args) == sum(shape.forward_flops([7, 900]).tolist())


def test_raw_karmarkar_karp_fewer_items_than_parts():
    # slime's raw function (no balanced-partition check) leaves the surplus parts empty;
    # the singletons come first, largest value first (values recorded from slime)
    assert karmarkar_karp([3, 1, 2], 5, False) == [[0], [2], [1], [], []]
    assert karmarkar_karp([0, 2], 3, False) == [[1], [0], []]
    with pytest.raises(SlimeCompatError, match=r"3 % 5 != 0"):
        karmarkar_karp([3, 1, 2], 5, True)
    with pytest.raises(SlimeCompatError, match=r"number of items:\[3\] < k_partitions:\[5\]"):
        get_seqlen_balanced_partitions([3, 1, 2], 5, False)


def test_first_failing_step_decides_the_error():
    # step 0 (3 samples, micro-batches of 1) cannot be aligned to dp=2; step 1 has a single
    # sample, fewer than dp. slime checks step by step, so step 0's error is raised.
    args = SimpleNamespace(**MODEL_ARGS, micro_batch_size=1, use_dynamic_batch_size=False,
                           max_tokens_per_gpu=None, balance_data=False, balance_by_flops=False)
    tpc = dict(dp_size=2, cp_size=1, vpp_size=1, microbatch_group_size_per_vp_stage=1)
    with pytest.raises(SlimeCompatError,
                       match=r"static path: num_mbs \(3\) is not a multiple of dp_size"):
        build_dp_schedule(args, tpc, [5, 5, 5, 5], global_batch_size=1,
                          rollout_indices=[0, 0, 0, 1])
    with pytest.raises(SlimeCompatError, match=r"step 1: 1 samples < dp_size 2"):
        build_dp_schedule(args, tpc, [5, 5, 5], global_batch_size=1, rollout_indices=[0, 0, 1])


def test_to_slime_is_the_rank_layout_as_slime_returns_it():
    from varbatch_kit import Rollouts, ScheduleConfig, build_schedule
    from varbatch_kit.compat.slime import build_dp_schedule, to_slime

    r = Rollouts(prompt_len=[0] * 8, response_len=[5, 9, 3, 7, 2, 8, 4, 6])
    sched = build_schedule(r, ScheduleConfig(dp=2, global_batch_size=4, max_tokens_per_gpu=12))
    got = to_slime(sched)
    assert type(got) is tuple and len(got) == 4
    assert got == tuple(sched.rank_layout())
    args = SimpleNamespace(use_dynamic_batch_size=True, max_tokens_per_gpu=12, balance_data=False,
                           balance_by_flops=False, micro_batch_size=None)
    tpc = {"dp_size": 2, "cp_size": 1, "vpp_size": 1, "microbatch_group_size_per_vp_stage": 1}
    assert got == build_dp_schedule(args, tpc, [5, 9, 3, 7, 2, 8, 4, 6], global_batch_size=4,
                                    rollout_indices=list(range(8)))
