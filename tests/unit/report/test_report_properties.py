"""Property tests: every non-naive mode reports the unsplit value under any layout.

Random steps (1-4 rollouts of 1-5 samples, uneven lengths, random masks
including fully masked samples and rollouts), random splits into micro-batches
and DP ranks, random cp in 1..4. Float64; the tolerance is 1e-12 relative to the
same report computed on |x| (a scale that cancellation cannot shrink).
"""

import torch
from _report_cases import Case, emulated_gradient, relative_difference
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

from varbatch_kit.report import (
    LAYOUT_INVARIANT_MODES,
    NAIVE_MODES,
    get_report_mode,
    reduce_log_dicts,
    report_under_layout,
    rollout_log_metric_contribution,
)

PROPERTY_SETTINGS = settings(
    max_examples=60,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)


@st.composite
def steps(draw):
    """A step plus a layout: (case, layout, cp_size)."""
    sizes = draw(st.lists(st.integers(1, 5), min_size=1, max_size=4))
    totals, responses, masks, rollout_ids = [], [], [], []
    for rollout, size in enumerate(sizes):
        all_masked = draw(st.integers(0, 4)) == 0  # about one rollout in five
        for _ in range(size):
            r = draw(st.integers(0, 9))
            p = draw(st.integers(1, 6))
            bits = draw(st.lists(st.booleans(), min_size=r, max_size=r))
            mask = torch.tensor(bits, dtype=torch.float64) * (0.0 if all_masked else 1.0)
            totals.append(p + r)
            responses.append(r)
            masks.append(mask.reshape(r))
            rollout_ids.append(rollout)
    order = draw(st.permutations(range(len(totals))))  # rollouts' samples need not be adjacent
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    case = Case(
        total_lengths=[totals[i] for i in order],
        response_lengths=[responses[i] for i in order],
        loss_masks=[masks[i] for i in order],
        rollout_ids=[rollout_ids[i] for i in order],
        values=torch.randn(sum(responses), generator=gen, dtype=torch.float64) * 10 + 1,
    )
    dp = draw(st.integers(1, 4))
    mbs = draw(st.integers(1, 3))
    slots = draw(st.lists(st.integers(0, dp * mbs - 1), min_size=case.n, max_size=case.n))
    layout = [
        [[i for i in range(case.n) if slots[i] == r * mbs + m] for m in range(mbs)]
        for r in range(dp)
    ]
    cp = draw(st.integers(1, 4))
    return case, layout, cp


def report(mode, case, layout=None, cp_size=1, values=None):
    return report_under_layout(
        mode,
        case.values if values is None else values,
        case.total_lengths,
        case.response_lengths,
        case.loss_masks,
        case.rollout_ids,
        layout=layout,
        cp_size=cp_size,
    )


def relative_drift(mode, case, layout, cp):
    base = report(mode, case)
    diff = abs(report(mode, case, layout, cp) - base)
    if diff == 0.0 or diff <= 1e-13 * abs(base):  # already tiny relative to the value itself
        return diff / max(abs(base), 1e-300)
    scale = max(abs(base), report(mode, case, values=case.values.abs()), 1e-300)
    return diff / scale


@PROPERTY_SETTINGS
@given(steps())
def test_every_invariant_mode_reports_the_unsplit_value(step):
    case, layout, cp = step
    for name in LAYOUT_INVARIANT_MODES:
        assert relative_drift(name, case, layout, cp) <= 1e-12, name


@PROPERTY_SETTINGS
@given(steps())
def test_rollout_side_log_equals_train_step_report(step):
    """Per-rank (cp * reducer_sum, G / dp) entries, gathered, give the per-rollout-mean report."""
    case, layout, cp = step
    mode = get_report_mode("per_rollout_mean")
    dp, g = len(layout), len(set(case.rollout_ids))
    norm = mode.step_normalizers(case.rollout_ids, case.loss_masks)
    per_sample = case.values.split(case.response_lengths)
    from varbatch_kit.report.cp import slice_response_for_cp

    logs = []
    for rank in layout:
        idx = [i for mb in rank for i in mb]
        for cp_rank in range(cp):
            local = [
                slice_response_for_cp(
                    per_sample[i], case.total_lengths[i], cp_rank=cp_rank, cp_size=cp
                )
                for i in idx
            ]
            reducer_sum = mode.microbatch_loss_sum(
                torch.cat(local) if local else case.values[:0],
                total_lengths=[case.total_lengths[i] for i in idx],
                response_lengths=[case.response_lengths[i] for i in idx],
                loss_masks=[case.loss_masks[i] for i in idx],
                sample_denominators=norm.denominators_for(idx),
                cp_rank=cp_rank,
                cp_size=cp,
            )
            entry = rollout_log_metric_contribution(
                reducer_sum, cp_size=cp, num_rollouts=g, dp_size=dp
            )
            logs.append({"x": entry})
    logged = reduce_log_dicts(logs)["x"]
    expected = report(mode, case)
    scale = max(abs(expected), report(mode, case, values=case.values.abs()), 1e-300)
    assert abs(logged - expected) <= 1e-12 * scale


@settings(max_examples=12, deadline=None, database=None, derandomize=True)
@given(steps())
def test_gradient_matches_the_unsplit_gradient(step):
    case, layout, cp = step
    for name in ("per_rollout_mean", "per_token"):
        mode = get_report_mode(name)
        reference = emulated_gradient(mode, case, [[list(range(case.n))]], 1)
        grad = emulated_gradient(mode, case, layout, cp)
        if float(reference.norm()) == 0.0:  # every token masked: nothing to compare
            assert float(grad.norm()) == 0.0
        else:
            assert relative_difference(grad, reference) <= 1e-6, name


def test_naive_modes_drift_on_some_generated_step():
    """The property above would catch them: hypothesis finds a step where each one drifts."""
    search = settings(  # generate only: the first drifting step will do, no shrinking
        max_examples=300, database=None, derandomize=True, deadline=None, phases=[Phase.generate]
    )
    for name in NAIVE_MODES:
        case, layout, cp = find(
            steps(), lambda s, name=name: relative_drift(name, *s) > 1e-3, settings=search
        )
        assert relative_drift(name, case, layout, cp) > 1e-3
