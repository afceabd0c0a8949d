"""Reporting math: hand-derived values, layout invariance, gradients, logging, bad input."""

import itertools
import math

import pytest
import torch
from _report_cases import (
    emulated_gradient,
    four_rollouts_cp,
    four_samples_two_rollouts,
    mixed_case,
    relative_difference,
    report_gradient,
    round_robin_layout,
    uneven_case,
    unit_weight_backward,
)

from varbatch_kit.report import (
    LAYOUT_INVARIANT_MODES,
    NAIVE_MODES,
    REPORT_MODES,
    gather_and_reduce_log_dict,
    get_report_mode,
    make_reducer,
    masked_sums,
    reduce_log_dicts,
    reduce_train_step_metrics,
    report_under_layout,
    rollout_denominators,
    rollout_log_metric_contribution,
    sum_of_sample_means,
)

LAYOUTS_DP_CP = [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4), (4, 1), (2, 4), (4, 2), (4, 4)]


def report(mode, case, layout=None, cp_size=1, **kw):
    return report_under_layout(
        mode,
        case.values,
        case.total_lengths,
        case.response_lengths,
        case.loss_masks,
        case.rollout_ids,
        layout=layout,
        cp_size=cp_size,
        **kw,
    )


def all_splits(n, dp, mbs):
    """Every split of n samples into micro-batches on dp ranks (mbs slots per rank).

    Layouts that differ only in the order of micro-batches or ranks (or where
    empty micro-batches sit) are the same split and are yielded once.
    """
    seen = set()
    for slots in itertools.product(range(dp * mbs), repeat=n):
        layout = [
            [[i for i in range(n) if slots[i] == r * mbs + m] for m in range(mbs)]
            for r in range(dp)
        ]
        key = tuple(sorted(tuple(sorted(tuple(mb) for mb in rank if mb)) for rank in layout))
        if key not in seen:
            seen.add(key)
            yield layout


# ---------------------------------------------------------------------------
# Denominators and reducers
# ---------------------------------------------------------------------------


def test_rollout_denominators_sum_masks_over_each_rollout():
    masks = [torch.ones(3)] * 4
    assert rollout_denominators([0, 0, 0, 1], masks).tolist() == [9.0, 9.0, 9.0, 3.0]
    partial = [torch.tensor([1, 0, 1]), torch.tensor([0, 0]), torch.tensor([1])]
    assert rollout_denominators([5, 2, 5], partial).tolist() == [3.0, 0.0, 3.0]


def test_sum_of_sample_means_hand_values():
    case = four_samples_two_rollouts()
    args = (case.values, case.total_lengths, case.response_lengths, case.loss_masks)
    # own denominators: 6/3 + 15/3 + 24/3 + 33/3 = 26
    assert sum_of_sample_means(*args).item() == pytest.approx(26.0, rel=1e-15)
    # per-rollout denominators: 45/9 + 33/3 = 16
    denoms = rollout_denominators(case.rollout_ids, case.loss_masks)
    assert sum_of_sample_means(*args, denoms).item() == pytest.approx(16.0, rel=1e-15)
    reducer = make_reducer(
        case.total_lengths, case.response_lengths, case.loss_masks, per_token=True
    )
    assert reducer(case.values).item() == 78.0
    assert masked_sums(*args).tolist() == [6.0, 15.0, 24.0, 33.0]


def test_cp_pieces_of_the_reducer_add_up_to_the_full_value():
    case = four_rollouts_cp()
    denoms = rollout_denominators(case.rollout_ids, case.loss_masks)
    full = sum_of_sample_means(
        case.values, case.total_lengths, case.response_lengths, case.loss_masks, denoms
    ).item()
    assert full == pytest.approx(4999.5)
    pieces = []
    per_sample = case.values.split(case.response_lengths)
    for r in range(4):
        from varbatch_kit.report.cp import slice_response_for_cp

        x = torch.cat([slice_response_for_cp(p, 12, cp_rank=r, cp_size=4) for p in per_sample])
        reducer = make_reducer(
            case.total_lengths, case.response_lengths, case.loss_masks, denoms, cp_rank=r, cp_size=4
        )
        pieces.append(reducer(x).item())
    assert sum(pieces) == pytest.approx(4999.5, rel=1e-14)
    assert pieces[0] == 0.0  # rank 0 sees no response token of a 4+8 sample under cp=4


# ---------------------------------------------------------------------------
# Worked numbers of docs/reference_semantics.md §5
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(("dp", "mbs"), [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (4, 1)])
def test_worked_8_and_6_5_over_every_split(dp, mbs):
    case = four_samples_two_rollouts()
    for layout in all_splits(4, dp, mbs):
        for cp in (1, 2):
            assert report("per_rollout_mean", case, layout, cp) == pytest.approx(8.0, rel=1e-14)
            assert report("per_token", case, layout, cp) == pytest.approx(6.5, rel=1e-14)


@pytest.mark.parametrize(("dp", "cp"), LAYOUTS_DP_CP)
def test_worked_1249_875_for_every_dp_cp(dp, cp):
    case = four_rollouts_cp()
    for mbs in (1, 4 // dp):
        layout = round_robin_layout(4, dp, mbs)
        assert report("per_rollout_mean", case, layout, cp) == pytest.approx(1249.875, rel=1e-14)
        # all samples have 8 unmasked tokens, so the per-token mean is the same number
        assert report("per_token", case, layout, cp) == pytest.approx(1249.875, rel=1e-14)


@pytest.mark.parametrize(("dp", "cp"), LAYOUTS_DP_CP)
def test_worked_1249_875_is_the_gradient_of_a_unit_weight(dp, cp):
    """d(loss)/dw for x * w, w = 1, through prescale + Megatron + DDP averaging."""
    case = four_rollouts_cp()
    for name in ("per_rollout_mean", "per_token"):
        mode = get_report_mode(name)
        layout = round_robin_layout(4, dp, 1)
        norm = mode.step_normalizers(case.rollout_ids, case.loss_masks, dp_size=dp, cp_size=cp)
        grads, tokens = [], 0
        for rank in layout:
            for cp_rank in range(cp):
                grad, count = unit_weight_backward(mode, case, norm, rank[0], cp_rank=cp_rank,
                                                   dp=dp, cp=cp)
                grads.append(grad)
                tokens += count
        net = sum(grads) / (tokens if mode.megatron_per_token_loss else dp * cp)
        assert net == pytest.approx(1249.875, rel=1e-14), name


def test_hand_derived_values_of_every_mode():
    case = four_samples_two_rollouts()
    # token sums 6, 15, 24, 33; token means 2, 5, 8, 11; 12 tokens; 4 samples; 2 rollouts
    expected = {
        "per_rollout_mean": 8.0,
        "per_sample_mean": 26 / 4,
        "per_token": 78 / 12,
        "token-mean": 78 / 12,
        "seq-mean-token-mean": 26 / 4,
        "seq-mean-token-sum": 78 / 4,
        "seq-mean-token-sum-norm": 78 / (4 * 3),  # C = longest response = 3
        "naive_microbatch_mean": 78 / 12,  # one micro-batch: the true token mean
        "naive_rank_mean": 26 / 4,  # one rank: the true sample mean
    }
    assert set(expected) == set(REPORT_MODES)
    for name, value in expected.items():
        assert report(name, case) == pytest.approx(value, rel=1e-14), name
    norm_c = get_report_mode("seq-mean-token-sum-norm", norm_constant=6)
    assert report(norm_c, case) == pytest.approx(78 / 24)


def test_naive_modes_move_with_the_layout_by_hand():
    case = four_samples_two_rollouts()
    # micro-batches {0,1,2} and {3}: token means 5 and 11 -> 8.0 instead of 6.5
    assert report("naive_microbatch_mean", case, [[[0, 1, 2], [3]]]) == pytest.approx(8.0)
    # cp=2 (T=5, R=3): rank 0 sees token 0 of each sample (mean 5.5), rank 1 tokens 1-2 (mean 7)
    assert report("naive_microbatch_mean", case, None, 2) == pytest.approx(6.25)
    # ranks {0,1,2} and {3}: sample-mean means 5 and 11 -> 8.0 instead of 6.5
    assert report("naive_rank_mean", case, [[[0, 1, 2]], [[3]]]) == pytest.approx(8.0)
    # the invariant modes do not move on the same layouts
    for name in LAYOUT_INVARIANT_MODES:
        base = report(name, case)
        assert report(name, case, [[[0, 1, 2], [3]]]) == pytest.approx(base, rel=1e-14)
        assert report(name, case, [[[0, 1, 2]], [[3]]], 2) == pytest.approx(base, rel=1e-14)


def test_norm_constant_defaults_to_the_longest_response_not_the_shortest():
    # seq-mean-token-sum-norm: token sums 4 and 8 over 2 samples x C, C the step's longest
    # response (its length, 4, not its 3 unmasked tokens): 12 / 8; the shortest (1) gives 6
    case = uneven_case()
    assert report("seq-mean-token-sum-norm", case) == pytest.approx(12 / 8, rel=1e-14)
    assert report("seq-mean-token-sum-norm", case, [[[1]], [[0]]]) == \
        pytest.approx(12 / 8, rel=1e-14)


def test_naive_microbatch_mean_divides_by_the_micro_batches_of_every_rank():
    # four_samples_two_rollouts on 2 ranks, one micro-batch each: {0} (token mean 2) and
    # {1, 2, 3} (8): the mean of the 2 = num_microbatches x dp micro-batch means is 5
    case = four_samples_two_rollouts()
    assert report("naive_microbatch_mean", case, [[[0]], [[1, 2, 3]]]) == pytest.approx(5.0)
    # 2 ranks x 2 micro-batches: {0}, {1} | {2}, {3}: means 2, 5, 8, 11 -> 6.5
    assert report("naive_microbatch_mean", case, [[[0], [1]], [[2], [3]]]) == pytest.approx(6.5)


def test_naive_rank_mean_of_a_one_token_sample():
    # uneven_case: sample means 4 (one token) and 8 / 3; one rank: (4 + 8/3) / 2; a rank each:
    # the same two means averaged over dp = 2 ranks
    case = uneven_case()
    assert report("naive_rank_mean", case) == pytest.approx((4 + 8 / 3) / 2, rel=1e-14)
    assert report("naive_rank_mean", case, [[[0]], [[1]]]) == \
        pytest.approx((4 + 8 / 3) / 2, rel=1e-14)


def test_every_invariant_mode_on_a_mixed_step_for_many_layouts():
    case = mixed_case()
    for name in LAYOUT_INVARIANT_MODES:
        base = report(name, case)
        assert math.isfinite(base)
        for dp, cp, mbs in [(2, 1, 2), (1, 2, 1), (2, 2, 2), (1, 4, 3), (4, 1, 1), (4, 4, 2)]:
            got = report(name, case, round_robin_layout(case.n, dp, mbs), cp)
            assert got == pytest.approx(base, rel=1e-12, abs=1e-14), (name, dp, cp, mbs)


# ---------------------------------------------------------------------------
# Gradients through prescale + Megatron emulation (in-process ranks)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["per_rollout_mean", "per_token", "token-mean", "seq-mean-token-mean"]
)
def test_gradient_is_independent_of_dp_cp_and_packing(name):
    mode = get_report_mode(name)
    case = mixed_case()
    reference = emulated_gradient(mode, case, [[list(range(case.n))]], 1)
    assert relative_difference(reference, report_gradient(mode, case)) < 1e-12
    assert float(reference.norm()) > 0.1  # the check is not vacuous
    for dp, cp in [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4), (4, 1), (4, 4)]:
        for mbs in (1, 2):
            grad = emulated_gradient(mode, case, round_robin_layout(case.n, dp, mbs), cp)
            assert relative_difference(grad, reference) < 1e-6, (dp, cp, mbs)


def test_naive_microbatch_gradient_moves_with_packing():
    mode = get_report_mode("naive_microbatch_mean")
    case = mixed_case()
    reference = emulated_gradient(mode, case, [[list(range(case.n))]], 1)
    moved = emulated_gradient(mode, case, round_robin_layout(case.n, 2, 2), 1)
    assert relative_difference(moved, reference) > 1e-3


def test_prescale_factors():
    case = four_rollouts_cp()
    rollout = get_report_mode("per_rollout_mean")
    norm = rollout.step_normalizers(case.rollout_ids, case.loss_masks, global_batch_size=4)
    # slime: num_microbatches / step_global_batch_size * dp * cp
    assert rollout.loss_prescale(norm, num_microbatches=2, dp_size=2, cp_size=2) == 2 / 4 * 4
    token = get_report_mode("per_token")
    norm = token.step_normalizers(case.rollout_ids, case.loss_masks)
    assert token.loss_prescale(norm, num_microbatches=2, dp_size=2, cp_size=4) == 4
    assert token.megatron_num_tokens(case.loss_masks[:2]) == 16
    assert token.count_slot(case.loss_masks[:2]) == 16
    assert rollout.megatron_num_tokens(case.loss_masks[:2]) == 1
    assert rollout.count_slot(case.loss_masks[:2]) == 0
    verl = get_report_mode("token-mean")
    norm = verl.step_normalizers(case.rollout_ids, case.loss_masks)
    assert norm.report_divisor == 32
    assert verl.loss_prescale(norm, num_microbatches=2, dp_size=2, cp_size=2) == 8 / 32


# ---------------------------------------------------------------------------
# Step reduction and logging
# ---------------------------------------------------------------------------


def test_reduce_train_step_metrics_divisor_and_per_token_paths():
    values = [torch.tensor([3.0, 6.0, 1.0]), torch.tensor([5.0, 10.0, 3.0])]
    by_gbs = reduce_train_step_metrics(values, keys=["loss", "kl"], divisor=4)
    assert by_gbs == {"loss": 4.0, "kl": 1.0}
    # per-token: slot 0 = 8 = 2 tokens counted in full by each of 4 CP ranks -> 8 / cp = 2
    assert reduce_train_step_metrics(values, keys=["loss", "kl"], divisor=None, cp_size=4) == {
        "loss": 8.0,
        "kl": 2.0,
    }
    assert reduce_train_step_metrics([], keys=["loss"], divisor=2) == {"loss": 0.0}
    zero_tokens = [torch.tensor([0.0, 0.0])]
    assert reduce_train_step_metrics(zero_tokens, keys=["loss"], divisor=None) == {"loss": 0.0}


def test_rollout_contribution_equals_train_step_report_for_one_step():
    case = four_samples_two_rollouts()
    from varbatch_kit.report.cp import slice_response_for_cp

    denoms = rollout_denominators(case.rollout_ids, case.loss_masks)
    per_sample = case.values.split(case.response_lengths)
    for dp, cp in [(1, 1), (2, 1), (2, 2), (1, 2)]:
        layout = round_robin_layout(4, dp, 1)
        logs = []
        for rank in layout:
            mb = rank[0]
            for cp_rank in range(cp):
                x = torch.cat(
                    [
                        slice_response_for_cp(per_sample[i], 5, cp_rank=cp_rank, cp_size=cp)
                        for i in mb
                    ]
                )
                reducer = make_reducer(
                    [5] * len(mb), [3] * len(mb), [case.loss_masks[i] for i in mb], denoms[mb],
                    cp_rank=cp_rank, cp_size=cp,
                )  # fmt: skip
                entry = rollout_log_metric_contribution(
                    reducer(x), cp_size=cp, num_rollouts=2, dp_size=dp
                )
                logs.append({"log_probs": entry, "lr": 0.5})
        assert reduce_log_dicts(logs) == {"log_probs": pytest.approx(8.0), "lr": 0.5}


def test_reduce_log_dicts_pairs_and_scalars():
    logs = [{"a": (3.0, 1.0), "b": 1.0}, {"a": (5.0, 3.0), "b": 3}]
    assert reduce_log_dicts(logs) == {"a": 2.0, "b": 2.0}
    assert reduce_log_dicts([{"a": (0.0, 0)}, {"a": (0.0, 0)}]) == {"a": 0.0}
    assert gather_and_reduce_log_dict({"a": (torch.tensor(6.0), 4), "b": 2.0}) == {
        "a": 1.5,
        "b": 2.0,
    }


# ---------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------


def test_registry_names_and_flags():
    assert set(NAIVE_MODES) == {"naive_microbatch_mean", "naive_rank_mean"}
    assert set(LAYOUT_INVARIANT_MODES) == {
        "per_rollout_mean",
        "per_sample_mean",
        "per_token",
        "token-mean",
        "seq-mean-token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
    }
    assert [n for n, m in REPORT_MODES.items() if m.megatron_per_token_loss] == ["per_token"]
    for mode in REPORT_MODES.values():
        assert mode.divides_by and mode.description
        if mode.naive:
            assert "COMPARISON ONLY" in mode.description
    with pytest.raises(ValueError, match=r"unknown report mode 'mean'; choose one of"):
        get_report_mode("mean")
    with pytest.raises(ValueError, match=r"norm_constant applies to 'seq-mean-token-sum-norm'"):
        get_report_mode("per_token", norm_constant=3)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['scale'\]"):
        get_report_mode("per_token", scale=3)


# ---------------------------------------------------------------------------
# Bad input and all-masked input
# ---------------------------------------------------------------------------


def test_value_length_not_matching_response_lengths():
    case = four_samples_two_rollouts()
    reducer = make_reducer(case.total_lengths, case.response_lengths, case.loss_masks)
    with pytest.raises(ValueError, match=r"values has shape \(11,\).*sum to 12"):
        reducer(case.values[:11])


def test_value_length_not_matching_cp_slice_lengths():
    case = four_rollouts_cp()
    reducer = make_reducer(
        case.total_lengths, case.response_lengths, case.loss_masks, cp_rank=2, cp_size=4
    )
    # rank 2 of 4 sees 3 of each sample's 8 response tokens: 12 in all
    with pytest.raises(
        ValueError, match=r"values has shape \(32,\).*sum to 12 \(lengths \[3, 3, 3, 3\]\)"
    ):
        reducer(case.values)
    assert reducer(torch.ones(12, dtype=torch.float64)).item() == pytest.approx(4 * 3 / 8)


def test_mask_length_not_matching_response_length():
    with pytest.raises(
        ValueError, match=r"loss_masks\[1\] has shape \(2,\) but response_lengths\[1\]=3"
    ):
        make_reducer([5, 5], [3, 3], [torch.ones(3), torch.ones(2)])


def test_response_longer_than_total():
    with pytest.raises(ValueError, match=r"response_lengths\[0\]=6 > total_lengths\[0\]=5"):
        make_reducer([5], [6], [torch.ones(6)])


@pytest.mark.parametrize("cp_rank", [-1, 2, 7])
def test_cp_rank_outside_range(cp_rank):
    with pytest.raises(ValueError, match=rf"cp_rank={cp_rank} is outside \[0, cp_size\)"):
        make_reducer([5], [3], [torch.ones(3)], cp_rank=cp_rank, cp_size=2)


@pytest.mark.parametrize("bad", [0, -4, 0.0])
def test_zero_or_negative_step_batch_size(bad):
    case = four_samples_two_rollouts()
    with pytest.raises(ValueError, match=r"divisor \(step batch size\)=.*positive"):
        reduce_train_step_metrics([torch.zeros(2)], keys=["loss"], divisor=bad)
    with pytest.raises(ValueError, match=r"global_batch_size=.*positive"):
        get_report_mode("per_rollout_mean").step_normalizers(
            case.rollout_ids, case.loss_masks, global_batch_size=bad
        )
    with pytest.raises(ValueError, match=r"num_rollouts=.*positive"):
        rollout_log_metric_contribution(1.0, cp_size=1, num_rollouts=bad, dp_size=1)


def test_pair_on_some_ranks_and_scalar_on_others():
    with pytest.raises(
        ValueError,
        match=r"'kl' is a \(sum, count\) pair on ranks \[0, 2\] but a scalar on ranks \[1\]",
    ):
        reduce_log_dicts([{"kl": (1.0, 2)}, {"kl": 0.5}, {"kl": (1.0, 2)}])
    with pytest.raises(ValueError, match=r"rank 1 logs keys"):
        reduce_log_dicts([{"kl": 1.0}, {"loss": 1.0}])


def test_wrong_value_vector_width():
    with pytest.raises(ValueError, match=r"microbatch_values\[0\] has 2 entries but keys"):
        reduce_train_step_metrics([torch.zeros(2)], keys=["a", "b"], divisor=1)


def test_all_masked_rollout_contributes_zero_not_nan():
    case = four_samples_two_rollouts()
    masks = [torch.ones(3)] * 3 + [torch.zeros(3)]  # rollout B fully masked
    layouts = [(None, 1), ([[[0, 3, 2]], [[1]]], 1), ([[[3], [0, 1]], [[2], []]], 2)]
    for name in REPORT_MODES:
        for layout, cp in layouts:
            value = report_under_layout(
                name, case.values, case.total_lengths, case.response_lengths, masks,
                case.rollout_ids, layout=layout, cp_size=cp,
            )  # fmt: skip
            assert math.isfinite(value), (name, layout, cp)
    # per_rollout_mean: rollout A's mean is 5, rollout B contributes 0; 2 rollouts
    for layout, cp in layouts:
        value = report_under_layout(
            "per_rollout_mean", case.values, case.total_lengths, case.response_lengths, masks,
            case.rollout_ids, layout=layout, cp_size=cp,
        )  # fmt: skip
        assert value == pytest.approx(2.5, rel=1e-14)


def test_step_whose_every_mask_is_zero_reports_zero():
    case = four_samples_two_rollouts()
    masks = [torch.zeros(3)] * 4
    for name in REPORT_MODES:
        value = report_under_layout(
            name, case.values, case.total_lengths, case.response_lengths, masks, case.rollout_ids,
            layout=[[[0, 1]], [[2, 3]]], cp_size=2,
        )  # fmt: skip
        assert value == 0.0, name


def test_layout_must_cover_every_sample_once():
    case = four_samples_two_rollouts()
    with pytest.raises(ValueError, match=r"every sample must appear exactly once"):
        report("per_token", case, [[[0, 1, 2, 2]]])
    with pytest.raises(ValueError, match=r"same number"):
        report("per_token", case, [[[0, 1]], [[2], [3]]])


@pytest.mark.parametrize("bad", [[4], [-1], [0, 4]])
def test_denominators_of_a_sample_outside_the_step_are_refused(bad):
    case = four_samples_two_rollouts()
    norm = get_report_mode("per_sample_mean").step_normalizers(case.rollout_ids, case.loss_masks)
    with pytest.raises(ValueError, match=r"has an index outside \[0, 4\)"):
        norm.denominators_for(bad)


@pytest.mark.parametrize("ranks", [[0, 0, 1], [0, 0, 1, 2], [0, -1, 1, 1]])
def test_naive_rank_mean_refuses_a_rank_per_sample_that_is_missing_or_outside_dp(ranks):
    case = four_samples_two_rollouts()
    with pytest.raises(ValueError, match=r"must have 4 entries in \[0, dp_size=2\)"):
        get_report_mode("naive_rank_mean").step_normalizers(
            case.rollout_ids, case.loss_masks, dp_size=2, dp_rank_of_sample=ranks)


def test_per_token_counts_a_fully_masked_sample_as_one_token_as_slime_does():
    """slime's loss_function: num_tokens = sum(clamp_min(loss_mask.sum(), 1)); verl's
    token-mean does not clamp. Hand-derived: masks with 3, 0 and 2 unmasked tokens."""
    import torch as _torch

    from varbatch_kit.report import get_report_mode

    masks = [_torch.tensor([1.0, 1, 1]), _torch.zeros(4), _torch.tensor([0.0, 1, 1])]
    per_token, verl = get_report_mode("per_token"), get_report_mode("token-mean")
    assert per_token.step_normalizers([0, 1, 2], masks).num_tokens == 6  # 3 + 1 + 2
    assert per_token.step_normalizers([0, 1, 2], masks).report_divisor == 6.0
    assert per_token.megatron_num_tokens(masks) == 6
    assert per_token.count_slot(masks) == 6
    assert verl.step_normalizers([0, 1, 2], masks).num_tokens == 5
    # every sample fully masked: slime still counts one token per sample
    empty = [_torch.zeros(2), _torch.zeros(3)]
    assert per_token.step_normalizers([0, 1], empty).report_divisor == 2.0
    assert verl.step_normalizers([0, 1], empty).report_divisor == 1.0  # max(0, 1)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_a_negative_or_non_finite_denominator_is_refused(bad):
    from varbatch_kit.report.reducers import denominator_tensor

    masks = [torch.ones(2, dtype=torch.float64), torch.ones(3, dtype=torch.float64)]
    assert denominator_tensor([0.0, 3.0], masks).tolist() == [1.0, 3.0]  # clamped to >= 1
    with pytest.raises(ValueError, match="negative or non-finite"):
        denominator_tensor([2.0, bad], masks)
