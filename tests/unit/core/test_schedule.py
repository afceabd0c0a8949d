"""build_schedule on hand-derived cases (docs/reference_semantics.md §2)."""

import logging

import pytest
from _factories import TINY, rollouts

from varbatch_kit import Rollouts, ScheduleConfig, build_schedule


def slime(r, **cfg):
    model = cfg.pop("model", None)
    return build_schedule(r, ScheduleConfig(**cfg), model).check().rank_layout()


def test_static_strided_single_step():
    parts, mbi, nmb, gbs = slime(rollouts([5, 3, 8, 2, 7, 1, 4, 6]), dp=2, global_batch_size=8,
                                 micro_batch_size=2)
    # bins [0,1] [2,3] [4,5] [6,7]; rank r gets bins r, r+2
    assert parts == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert mbi == [[[0, 1], [2, 3]], [[0, 1], [2, 3]]]
    assert nmb == [2]
    assert gbs == [8]


def test_static_flops_balance_pinned_case():
    # the case slime's own tests pin
    parts, mbi, nmb, gbs = slime(rollouts([1, 2, 3, 4, 5, 7, 9, 10]), dp=2, global_batch_size=8,
                                 micro_batch_size=1, distribution="flops_kk", model=TINY)
    assert parts == [[1, 2, 5, 6], [0, 3, 4, 7]]
    assert nmb == [4]
    assert mbi == [[[0], [1], [2], [3]]] * 2


def test_static_flops_balance_two_steps():
    lengths = [1, 2, 3, 4, 5, 7, 9, 10] * 2
    parts, mbi, nmb, gbs = slime(rollouts(lengths), dp=2, global_batch_size=8,
                                 micro_batch_size=1, distribution="flops_kk", model=TINY)
    assert parts == [[1, 2, 5, 6, 9, 10, 13, 14], [0, 3, 4, 7, 8, 11, 12, 15]]
    assert nmb == [4, 4]
    assert gbs == [8, 8]
    assert mbi[0] == [[i] for i in range(8)]


def test_dynamic_uniform():
    parts, mbi, nmb, _ = slime(rollouts([100] * 8), dp=2, global_batch_size=8,
                               max_tokens_per_gpu=250)
    assert parts == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert mbi == [[[0, 1], [2, 3]]] * 2
    assert nmb == [2]


def test_dynamic_cap_is_max_tokens_times_cp():
    # cap = 125 * 2 = 250: same bins as the cp=1, cap 250 case
    sched = build_schedule(rollouts([100] * 8), ScheduleConfig(
        dp=2, cp=2, global_batch_size=8, max_tokens_per_gpu=125)).check()
    assert sched.rank_layout()[0] == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_oversize_sample_alone_and_split():
    # first-fit: [[0,2],[1],[3]]; dp=2 needs 4 bins: [0,2] splits into [0] and [2]
    r = rollouts([100, 500, 100, 100])
    sched = build_schedule(r, ScheduleConfig(dp=2, global_batch_size=4,
                                             max_tokens_per_gpu=250)).check()
    assert [mb.tolist() for mb in sched.steps[0].micro_batches] == [[0], [1], [3], [2]]
    assert sched.rank_layout()[0] == [[0, 3], [1, 2]]
    stats = sched.stats()
    assert stats["oversize_alone"].tolist() == [0, 1]  # the 500-token sample, alone on rank 1
    assert stats["cap_violations"].tolist() == [0, 0]  # no bin of 2+ samples exceeds the cap
    assert stats["max_mb_tokens"].tolist() == [100, 500]


def test_cap_violations_count_multi_sample_bins_over_the_cap():
    # flops_kk packing ignores the cap: k = ceil(100/50) = 2 bins for three 30s and a 10, so
    # one bin holds two 30s (60 > 50): one violation of 2+ samples, no oversize sample
    sched = build_schedule(rollouts([30, 30, 30, 10]), ScheduleConfig(
        dp=1, global_batch_size=4, max_tokens_per_gpu=50, packing="flops_kk",
        distribution="flops_kk"), TINY).check()
    st = sched.stats()
    assert st["micro_batches"].tolist() == [2]
    assert st["cap_violations"].tolist() == [1]
    assert st["oversize_alone"].tolist() == [0]


def test_oversize_dp1_keeps_first_fit_bins():
    sched = build_schedule(rollouts([100, 500, 100, 100]), ScheduleConfig(
        dp=1, global_batch_size=4, max_tokens_per_gpu=250)).check()
    assert [mb.tolist() for mb in sched.steps[0].micro_batches] == [[0, 2], [1], [3]]


@pytest.mark.parametrize("vpp,expected_parts,expected_nmb", [
    (1, [[0, 1, 4, 5, 8], [2, 3, 6, 7, 9]], [3]),
    # align = dp * mb_group = 4 -> 8 bins: split the highest of the equal bins each time
    (2, [[0, 1, 4, 8, 7], [2, 3, 6, 9, 5]], [4]),
])
def test_vpp_rounds_to_mb_group(vpp, expected_parts, expected_nmb):
    parts, _, nmb, _ = slime(rollouts([100] * 10), dp=2, vpp=vpp, mb_group=2,
                             global_batch_size=10, max_tokens_per_gpu=250)
    assert parts == expected_parts
    assert nmb == expected_nmb


def test_multi_sample_rollouts_stay_in_one_step():
    r = rollouts([10] * 8, rollout_id=[0, 0, 1, 2, 2, 2, 3, 3])
    sched = build_schedule(r, ScheduleConfig(dp=1, global_batch_size=2,
                                             max_tokens_per_gpu=1000)).check()
    assert [s.sample_indices.tolist() for s in sched.steps] == [[0, 1, 2], [3, 4, 5, 6, 7]]
    assert [s.num_rollouts for s in sched.steps] == [2, 2]
    assert sched.rank_layout()[3] == [2, 2]  # rollouts per step, not samples


def test_rollouts_ordered_by_first_appearance():
    r = rollouts([10] * 6, rollout_id=[5, 3, 5, 3, 9, 9])
    sched = build_schedule(r, ScheduleConfig(dp=1, global_batch_size=1,
                                             micro_batch_size=1)).check()
    assert [s.rollout_ids.tolist() for s in sched.steps] == [[5], [3], [9]]
    assert [s.sample_indices.tolist() for s in sched.steps] == [[0, 2], [1, 3], [4, 5]]


def test_trailing_rollouts_trimmed_and_logged(caplog):
    r = rollouts([10] * 6, rollout_id=[0, 1, 1, 2, 3, 4])
    with caplog.at_level(logging.WARNING, logger="varbatch_kit"):
        sched = build_schedule(r, ScheduleConfig(dp=1, global_batch_size=2,
                                                 micro_batch_size=1)).check()
    assert sched.num_steps == 2
    assert sched.dropped_rollout_ids.tolist() == [4]
    assert sched.dropped_samples.tolist() == [5]
    assert "dropping 1 trailing rollouts (1 samples)" in caplog.text


def test_too_few_rollouts_is_an_error():
    with pytest.raises(ValueError, match=r"global_batch_size=5.*only 3 rollouts.*<= 3"):
        build_schedule(rollouts([1, 2, 3]), ScheduleConfig(global_batch_size=5,
                                                           micro_batch_size=1))


def test_flops_kk_packing_bins_and_no_cap():
    # 4 samples, tokens 10 total 100 -> k = ceil(100/50) = 2 KK bins on FLOPs
    lengths = [40, 30, 20, 10]
    sched = build_schedule(rollouts(lengths), ScheduleConfig(
        dp=2, global_batch_size=4, max_tokens_per_gpu=50, packing="flops_kk",
        distribution="flops_kk"), TINY).check()
    bins = sorted(sorted(mb.tolist()) for mb in sched.steps[0].micro_batches)
    assert bins == [[0, 3], [1, 2]]  # 40+10 vs 30+20 in FLOPs too


def test_flops_kk_packing_k_at_least_n_gives_singletons():
    sched = build_schedule(rollouts([60, 70, 80, 90]), ScheduleConfig(
        dp=2, global_batch_size=4, max_tokens_per_gpu=50, packing="flops_kk",
        distribution="flops_kk"), TINY).check()
    assert [mb.tolist() for mb in sched.steps[0].micro_batches] == [[0], [1], [2], [3]]


def test_stats_table_per_step_and_rank():
    sched = build_schedule(rollouts([100, 500, 100, 100]), ScheduleConfig(
        dp=2, global_batch_size=4, max_tokens_per_gpu=250), TINY)
    st = sched.stats()
    assert list(st.columns) == ["step", "rank", "samples", "tokens", "flops", "micro_batches",
                                "max_mb_tokens", "cap_violations", "oversize_alone"]
    assert st["tokens"].tolist() == [200, 600]
    assert st["samples"].tolist() == [2, 2]
    assert st["micro_batches"].tolist() == [2, 2]
    expected = TINY.forward_flops([100, 100]).sum()
    assert st["flops"].iloc[0] == pytest.approx(expected)


def test_deterministic():
    r = Rollouts.synthetic(300, samples_per_rollout=(1, 4), seed=7)
    cfg = ScheduleConfig(dp=4, global_batch_size=64, max_tokens_per_gpu=8192,
                         distribution="flops_kk")
    a = build_schedule(r, cfg, TINY).rank_layout()
    b = build_schedule(r, cfg, TINY).rank_layout()
    assert a == b
