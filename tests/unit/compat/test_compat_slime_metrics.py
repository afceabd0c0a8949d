"""slime-signature metric functions: same results as the core on the same inputs."""

import inspect

import pytest
import torch
from _report_cases import four_rollouts_cp, four_samples_two_rollouts, mixed_case

from varbatch_kit.compat import slime
from varbatch_kit.compat.slime import metrics as slime_metrics
from varbatch_kit.report import (
    make_reducer,
    reduce_log_dicts,
    reduce_train_step_metrics,
    rollout_denominators,
    rollout_log_metric_contribution,
)
from varbatch_kit.report.cp import slice_flat_responses_for_cp, zigzag_slice


def test_exports_and_signatures():
    assert sorted(slime_metrics.__all__) == [
        "gather_and_reduce_log_dict",
        "get_logits_and_tokens_offset_with_cp",
        "get_sum_of_sample_mean",
        "reduce_train_step_metrics",
        "rollout_log_metric_contribution",
    ]
    for name in slime_metrics.__all__:
        assert getattr(slime, name) is getattr(slime_metrics, name)
    params = inspect.signature(slime_metrics.get_sum_of_sample_mean).parameters
    assert list(params) == [
        "total_lengths",
        "response_lengths",
        "loss_masks",
        "sample_denoms",
        "calculate_per_token_loss",
        "cp_rank",
        "cp_size",
    ]
    assert params["cp_rank"].kind is inspect.Parameter.KEYWORD_ONLY
    params = inspect.signature(slime_metrics.reduce_train_step_metrics).parameters
    assert list(params) == [
        "losses_reduced",
        "calculate_per_token_loss",
        "step_global_batch_size",
        "cp_size",
        "dp_with_cp_group",
    ]


def test_offsets_hand_values_and_agreement_with_core():
    assert slime_metrics.get_logits_and_tokens_offset_with_cp(12, 8, cp_rank=0, cp_size=2) == (
        3,
        ((0, 3), (9, 12)),
        ((0, 0), (9, 11)),
        ((0, 0), (10, 12)),
    )
    for total, response, cp in [(12, 8, 4), (7, 3, 3), (40, 39, 2), (9, 0, 2)]:
        for r in range(cp):
            s = zigzag_slice(total, response, cp_rank=r, cp_size=cp)
            got = slime_metrics.get_logits_and_tokens_offset_with_cp(
                total, response, cp_rank=r, cp_size=cp
            )
            assert got == (s.chunk_size, s.chunks, s.logits_ranges, s.token_ranges)


@pytest.mark.parametrize("cp", [1, 2, 3])
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("rollout_denoms", [False, True])
def test_reducer_agrees_with_core(cp, per_token, rollout_denoms):
    case = mixed_case()
    denoms = rollout_denominators(case.rollout_ids, case.loss_masks) if rollout_denoms else None
    total = 0.0
    for r in range(cp):
        x = slice_flat_responses_for_cp(
            case.values, case.total_lengths, case.response_lengths, cp_rank=r, cp_size=cp
        )
        compat = slime_metrics.get_sum_of_sample_mean(
            case.total_lengths, case.response_lengths, case.loss_masks, denoms, per_token,
            cp_rank=r, cp_size=cp,
        )(x)  # fmt: skip
        core = make_reducer(
            case.total_lengths, case.response_lengths, case.loss_masks, denoms,
            per_token=per_token, cp_rank=r, cp_size=cp,
        )(x)  # fmt: skip
        assert compat.item() == core.item()
        total += compat.item()
    full = make_reducer(
        case.total_lengths, case.response_lengths, case.loss_masks, denoms, per_token=per_token
    )(case.values)
    assert total == pytest.approx(full.item(), rel=1e-12, abs=1e-12)


def test_reducer_worked_values():
    case = four_samples_two_rollouts()
    args = (case.total_lengths, case.response_lengths, case.loss_masks)
    denoms = rollout_denominators(case.rollout_ids, case.loss_masks)
    assert slime_metrics.get_sum_of_sample_mean(*args)(case.values).item() == pytest.approx(26.0)
    assert slime_metrics.get_sum_of_sample_mean(*args, denoms)(case.values).item() == (
        pytest.approx(16.0)
    )
    assert slime_metrics.get_sum_of_sample_mean(*args, None, True)(case.values).item() == 78.0


def _losses_reduced(case, dp, cp, per_token):
    """slime's per-micro-batch dicts for one micro-batch per (dp, cp) rank, round robin."""
    denoms = rollout_denominators(case.rollout_ids, case.loss_masks)
    out = []
    for d in range(dp):
        idx = [i for i in range(case.n) if i % dp == d]
        pieces = case.values.split(case.response_lengths)
        for r in range(cp):
            x = slice_flat_responses_for_cp(
                torch.cat([pieces[i] for i in idx]),
                [case.total_lengths[i] for i in idx],
                [case.response_lengths[i] for i in idx],
                cp_rank=r,
                cp_size=cp,
            )
            masks = [case.loss_masks[i] for i in idx]
            value = slime_metrics.get_sum_of_sample_mean(
                [case.total_lengths[i] for i in idx],
                [case.response_lengths[i] for i in idx],
                masks,
                denoms[idx],
                per_token,
                cp_rank=r,
                cp_size=cp,
            )(x)
            slot0 = float(sum(m.sum() for m in masks)) if per_token else 0.0
            out.append(
                {"keys": ["pg_loss"], "values": torch.stack([value.new_tensor(slot0), value])}
            )
    return out


@pytest.mark.parametrize(("dp", "cp"), [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4), (4, 1)])
def test_train_step_report_worked_numbers_and_core_agreement(dp, cp):
    case = four_rollouts_cp()
    for per_token in (False, True):
        entries = _losses_reduced(case, dp, cp, per_token)
        compat = slime_metrics.reduce_train_step_metrics(
            entries, calculate_per_token_loss=per_token, step_global_batch_size=4, cp_size=cp
        )
        assert compat == {"pg_loss": pytest.approx(1249.875, rel=1e-14)}
        core = reduce_train_step_metrics(
            [e["values"] for e in entries],
            keys=["pg_loss"],
            divisor=None if per_token else 4,
            cp_size=cp,
        )
        assert core == compat
    small = four_samples_two_rollouts()
    for per_token, expected in ((False, 8.0), (True, 6.5)):
        entries = _losses_reduced(small, dp, 1, per_token)
        got = slime_metrics.reduce_train_step_metrics(
            entries, calculate_per_token_loss=per_token, step_global_batch_size=2, cp_size=1
        )
        assert got["pg_loss"] == pytest.approx(expected, rel=1e-14)


def test_rollout_contribution_and_single_process_gather():
    assert slime_metrics.rollout_log_metric_contribution(
        torch.tensor(3.0), cp_size=2, num_rollouts_in_rollout=8, dp_size=4
    ) == (6.0, 2.0)
    assert slime_metrics.rollout_log_metric_contribution(
        3.0, cp_size=2, num_rollouts_in_rollout=8, dp_size=4
    ) == rollout_log_metric_contribution(3.0, cp_size=2, num_rollouts=8, dp_size=4)
    reduced = slime_metrics.gather_and_reduce_log_dict(
        {"log_probs": (6.0, 2.0), "lr": 1e-6}, dp_size=1, dp_src_rank=0, dp_group=None
    )
    assert reduced == {"log_probs": 3.0, "lr": 1e-6}


def test_bad_input_is_a_value_error():
    entries = _losses_reduced(four_rollouts_cp(), 1, 1, False)
    for bad in (0, -2):
        with pytest.raises(ValueError, match=r"step_global_batch_size=-?\d.*positive"):
            slime_metrics.reduce_train_step_metrics(
                entries, calculate_per_token_loss=False, step_global_batch_size=bad, cp_size=1
            )
    with pytest.raises(ValueError, match=r"losses_reduced\[0\] is list"):
        slime_metrics.reduce_train_step_metrics(
            [[1.0, 2.0]], calculate_per_token_loss=False, step_global_batch_size=1, cp_size=1
        )
    with pytest.raises(ValueError, match=r"losses_reduced is empty"):
        slime_metrics.reduce_train_step_metrics(
            [], calculate_per_token_loss=False, step_global_batch_size=1, cp_size=1
        )
    with pytest.raises(ValueError, match=r"cp_rank=2 is outside"):
        slime_metrics.get_logits_and_tokens_offset_with_cp(12, 8, cp_rank=2, cp_size=2)
    with pytest.raises(ValueError, match=r"response_length=13 > total_length=12"):
        slime_metrics.get_logits_and_tokens_offset_with_cp(12, 13, cp_rank=0, cp_size=2)
    with pytest.raises(ValueError, match=r"loss_masks\[0\] has shape \(2,\)"):
        slime_metrics.get_sum_of_sample_mean([5], [3], [torch.ones(2)])
    reducer = slime_metrics.get_sum_of_sample_mean([12], [8], [torch.ones(8)], cp_rank=1, cp_size=2)
    with pytest.raises(ValueError, match=r"values has shape \(8,\).*sum to 6"):
        reducer(torch.ones(8))
    with pytest.raises(ValueError, match=r"dp_group=None means a single process"):
        slime_metrics.gather_and_reduce_log_dict(
            {"a": 1.0}, dp_size=2, dp_src_rank=0, dp_group=None
        )
    with pytest.raises(ValueError, match=r"'a' is a \(sum, count\) pair on ranks \[0\]"):
        reduce_log_dicts([{"a": (1.0, 1)}, {"a": 1.0}])
