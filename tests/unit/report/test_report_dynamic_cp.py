"""Reports and gradients under dynamic CP: a CP degree per micro-batch (issue 14, item 2).

Under dynamic CP the ``dp x cp`` ranks of a step form one pool; each
micro-batch runs on its own group of ``c`` ranks and its samples are cut by the
zigzag rule of degree ``c``. The properties: the sound modes (per_rollout_mean,
per_token and verl's) report the same value, and Megatron's schedule + DDP give
the same gradient, for no CP, fixed CP and any dynamic plan of the same batch
(fp64, 1e-12 relative to the report on |x|).

Plans here are random (random degrees, random groups of any ranks, idle
rounds, ranks running different numbers of micro-batches): more general than
any planner's. All ranks run in this process, each computing its micro-batch
value vectors exactly as the training engine does.
"""

import math

import numpy as np
import pytest
import torch
from _report_cases import (
    Case,
    flat_grad,
    make_mlp,
    mixed_case,
    relative_difference,
    report_gradient,
    token_features,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from varbatch_kit import ModelShape, Rollouts, ScheduleConfig
from varbatch_kit.analysis.cp_reports import cp_report_check
from varbatch_kit.report import (
    LAYOUT_INVARIANT_MODES,
    get_report_mode,
    reduce_log_dicts,
    reduce_train_step_metrics,
    report_under_layout,
    report_under_plan,
    rollout_log_metric_contribution,
)
from varbatch_kit.report.cp import (
    per_sample_cp,
    reference_cp_size,
    slice_flat_responses_for_cp,
    slice_response_for_cp,
)
from varbatch_kit.report.layouts import plan_sample_cp

SETTINGS = settings(
    max_examples=40,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
# the verl modes, per_rollout_mean and per_token (every sound mode)
MODES = LAYOUT_INVARIANT_MODES
DEGREES = {1: [1], 2: [1, 2], 3: [1, 3], 4: [1, 2, 4], 6: [1, 2, 3, 6]}


# ---------------------------------------------------------------------------
# Random steps and random dynamic plans
# ---------------------------------------------------------------------------


@st.composite
def cases(draw) -> Case:
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    totals, responses, masks, rollout_ids = [], [], [], []
    for rollout, size in enumerate(sizes):
        all_masked = draw(st.integers(0, 5)) == 0
        for _ in range(size):
            r = draw(st.integers(0, 13))
            p = draw(st.integers(1, 6))
            bits = draw(st.lists(st.booleans(), min_size=r, max_size=r))
            masks.append(torch.tensor(bits, dtype=torch.float64).reshape(r)
                         * (0.0 if all_masked else 1.0))
            totals.append(p + r)
            responses.append(r)
            rollout_ids.append(rollout)
    order = draw(st.permutations(range(len(totals))))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    return Case(
        total_lengths=[totals[i] for i in order],
        response_lengths=[responses[i] for i in order],
        loss_masks=[masks[i] for i in order],
        rollout_ids=[rollout_ids[i] for i in order],
        values=torch.randn(sum(responses), generator=gen, dtype=torch.float64) * 10 + 1,
    )


@st.composite
def dynamic_plans(draw, n: int, cp: int, dp: int):
    """programs[w][round] = (samples, c, cp_rank): micro-batches of one degree on any c ranks."""
    world = dp * cp
    degree = [draw(st.sampled_from(DEGREES[cp])) for _ in range(n)]
    slot = [draw(st.integers(0, max(n - 1, 0))) for _ in range(n)]
    groups: dict[tuple[int, int], list[int]] = {}
    for i in range(n):
        groups.setdefault((degree[i], slot[i]), []).append(i)
    mbs = [(c, samples) for (c, _), samples in groups.items()]
    mbs = [mbs[k] for k in draw(st.permutations(range(len(mbs))))]
    rounds: list[list[tuple[list[int], int, int] | None]] = []
    for c, samples in mbs:
        for row in rounds:  # first round with c free ranks
            if sum(e is None for e in row) >= c:
                break
        else:
            row = [None] * world
            rounds.append(row)
        free = [w for w in range(world) if row[w] is None]
        picked = draw(st.permutations(free))[:c]  # any c ranks; CP rank = position
        for cp_rank, w in enumerate(picked):
            row[w] = (samples, c, cp_rank)
    extra_idle = draw(st.integers(0, 1))  # sometimes a fully idle round at the end
    rounds += [[None] * world for _ in range(extra_idle)]
    return [[e if e is not None else ([], 1, 0) for e in (row[w] for row in rounds)]
            for w in range(world)]


@st.composite
def fixed_layouts(draw, n: int, dp: int):
    mbs = draw(st.integers(1, 3))
    slots = draw(st.lists(st.integers(0, dp * mbs - 1), min_size=n, max_size=n))
    return [[[i for i in range(n) if slots[i] == r * mbs + m] for m in range(mbs)]
            for r in range(dp)]


@st.composite
def batches(draw):
    case = draw(cases())
    cp = draw(st.sampled_from(sorted(DEGREES)))
    dp = draw(st.integers(1, 3))
    return case, cp, dp, draw(dynamic_plans(case.n, cp, dp)), draw(fixed_layouts(case.n, dp))


def as_plan(layout, cp):
    """A fixed layout written as a plan: world rank d*cp + r runs DP rank d's micro-batches."""
    return [[(mb, cp, r) for mb in layout[d]] for d in range(len(layout)) for r in range(cp)]


def report(mode, case, *, layout=None, cp=1, plan=None, values=None):
    args = (mode, case.values if values is None else values, case.total_lengths,
            case.response_lengths, case.loss_masks, case.rollout_ids)
    if plan is not None:
        return report_under_plan(*args, programs=plan, cp_size=cp)
    return report_under_layout(*args, layout=layout, cp_size=cp)


def scale_of(mode, case):
    """A scale cancellation cannot shrink: the report on |x| (and the report itself)."""
    return max(abs(report(mode, case)), report(mode, case, values=case.values.abs()), 1e-300)


# ---------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------


@SETTINGS
@given(batches())
def test_no_cp_fixed_cp_and_dynamic_plans_report_the_same(batch):
    case, cp, dp, plan, layout = batch
    assert plan_sample_cp(plan, case.n, cp)[0] is not None  # the generator makes valid plans
    for name in MODES:
        unsplit = report(name, case)
        fixed = report(name, case, layout=layout, cp=cp)
        dynamic = report(name, case, plan=plan, cp=cp)
        scale = scale_of(name, case)
        assert abs(fixed - unsplit) <= 1e-12 * scale, name
        assert abs(dynamic - unsplit) <= 1e-12 * scale, name
        assert abs(dynamic - fixed) <= 1e-12 * scale, name


@settings(max_examples=15, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_a_fixed_layout_as_a_plan_reports_the_same(batch):
    """Bit for bit without CP; with CP the plan sums rank by rank (a different fp order)."""
    case, cp, _, _, layout = batch
    for name in MODES:
        as_a_plan = report(name, case, plan=as_plan(layout, cp), cp=cp)
        fixed = report(name, case, layout=layout, cp=cp)
        if cp == 1:
            assert as_a_plan == fixed, name
        else:
            assert abs(as_a_plan - fixed) <= 1e-14 * scale_of(name, case), name


@settings(max_examples=20, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_rollout_side_log_under_a_dynamic_plan(batch):
    """(pool cp * reducer sum, G / dp) per rank still gives the per-rollout-mean report."""
    case, cp, dp, plan, _ = batch
    mode = get_report_mode("per_rollout_mean")
    norm = mode.step_normalizers(case.rollout_ids, case.loss_masks,
                                 cp_size=plan_sample_cp(plan, case.n, cp)[0])
    pieces = case.values.split(case.response_lengths)
    logs = []
    for program in plan:
        total = 0.0
        for samples, c, r in program:
            if samples:
                x = torch.cat([slice_response_for_cp(pieces[i], case.total_lengths[i],
                                                     cp_rank=r, cp_size=c) for i in samples])
                total += float(mode.microbatch_loss_sum(
                    x, total_lengths=[case.total_lengths[i] for i in samples],
                    response_lengths=[case.response_lengths[i] for i in samples],
                    loss_masks=[case.loss_masks[i] for i in samples],
                    sample_denominators=norm.denominators_for(samples), cp_rank=r, cp_size=c))
        logs.append({"x": rollout_log_metric_contribution(
            total, cp_size=cp, num_rollouts=len(set(case.rollout_ids)), dp_size=dp)})
    got = reduce_log_dicts(logs)["x"]
    assert abs(got - report(mode, case)) <= 1e-12 * scale_of(mode, case)


def plan_gradient(mode, case, plan, cp):
    """Megatron's no-pipelining schedule + DDP over a dynamic plan, all ranks in-process.

    Rank w runs its M_w non-idle rounds (Megatron divides by its own M_w on the
    default path); the prescale uses M_w and the pool's dp * cp; DDP averages over
    the pool (default path) or divides by the all-reduced token count (per_token).
    """
    model, features = make_mlp(), token_features(case)
    degrees, rank_of = plan_sample_cp(plan, case.n, cp)
    dp = len(plan) // cp
    norm = mode.step_normalizers(case.rollout_ids, case.loss_masks, dp_size=dp,
                                 cp_size=degrees, dp_rank_of_sample=rank_of)
    grad_sum, token_sum = None, 0
    for program in plan:
        work = [(s, c, r) for s, c, r in program if s]
        m = max(len(work), 1)
        prescale = mode.loss_prescale(norm, num_microbatches=m, dp_size=dp, cp_size=cp)
        model.zero_grad(set_to_none=False)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        for samples, c, r in work:
            x = model(torch.cat([slice_response_for_cp(features[i], case.total_lengths[i],
                                                       cp_rank=r, cp_size=c)
                                 for i in samples])).reshape(-1)
            masks = [case.loss_masks[i] for i in samples]
            loss = prescale * mode.microbatch_loss_sum(
                x, total_lengths=[case.total_lengths[i] for i in samples],
                response_lengths=[case.response_lengths[i] for i in samples],
                loss_masks=masks, sample_denominators=norm.denominators_for(samples),
                cp_rank=r, cp_size=c)
            count = mode.megatron_num_tokens(masks, cp_size=c, reference_cp=norm.reference_cp)
            token_sum += count
            if not mode.megatron_per_token_loss:
                loss = loss / max(count, 1) / m
            loss.backward()
        g = flat_grad(model)
        grad_sum = g if grad_sum is None else grad_sum + g
    if mode.megatron_per_token_loss:
        return grad_sum / token_sum if token_sum > 0 else grad_sum
    return grad_sum / len(plan)


@settings(max_examples=15, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_gradient_under_a_dynamic_plan_is_the_unsplit_gradient(batch):
    case, cp, _, plan, _ = batch
    for name in ("per_rollout_mean", "per_token", "token-mean", "seq-mean-token-mean"):
        mode = get_report_mode(name)
        reference = report_gradient(mode, case)
        grad = plan_gradient(mode, case, plan, cp)
        if float(reference.norm()) == 0.0:
            assert float(grad.norm()) == 0.0, name
        else:
            assert relative_difference(grad, reference) <= 1e-10, name


# ---------------------------------------------------------------------------
# Hand-derived numbers and the int path
# ---------------------------------------------------------------------------


def test_reference_degree_is_the_lcm():
    assert reference_cp_size(4) == 4
    assert reference_cp_size([1, 2, 4, 1]) == 4
    assert reference_cp_size([2, 3]) == 6
    with pytest.raises(ValueError, match="empty"):
        reference_cp_size([])
    with pytest.raises(ValueError, match="cp_size"):
        reference_cp_size([2, 0])


def test_per_token_count_weights_each_sample_by_k_over_c():
    """Masks of 3 and 5 tokens on degrees 1 and 4, K = 4: 3*4 + 5*1 = 17 per rank."""
    mode = get_report_mode("per_token")
    masks = [torch.ones(3), torch.ones(5)]
    assert mode.count_slot(masks) == 8  # the fixed rule: every rank counts in full
    assert mode.count_slot(masks, cp_size=[1, 4], reference_cp=4) == 17
    assert mode.count_slot(masks, cp_size=2, reference_cp=4) == 16
    assert mode.count_slot(masks, cp_size=4, reference_cp=4) == 8
    assert mode.megatron_num_tokens(masks, cp_size=[1, 4]) == 17  # K defaults to the lcm
    with pytest.raises(ValueError, match="not a multiple"):
        mode.count_slot(masks, cp_size=[3, 4], reference_cp=4)
    assert get_report_mode("per_rollout_mean").count_slot(masks, cp_size=[1, 4]) == 0


def test_the_all_reduced_count_is_k_times_n():
    """A sample of 6 tokens on degree 2 (two ranks) and one of 4 tokens on degree 1, K = 2."""
    mode = get_report_mode("per_token")
    a, b = torch.ones(6), torch.ones(4)
    slot0 = 2 * mode.count_slot([a], cp_size=2, reference_cp=2) + mode.count_slot(
        [b], cp_size=1, reference_cp=2)
    assert slot0 == 2 * (6 + 4)
    got = reduce_train_step_metrics([torch.tensor([float(slot0), 30.0])], keys=["v"],
                                    divisor=None, cp_size=2)
    assert got["v"] == 30.0 / 10
    # the per-sample degrees themselves give the same reference
    assert reduce_train_step_metrics([torch.tensor([float(slot0), 30.0])], keys=["v"],
                                     divisor=None, cp_size=[2, 1])["v"] == 3.0


def test_step_normalizers_keep_the_per_sample_degrees():
    mode = get_report_mode("per_token")
    masks = [torch.ones(3), torch.ones(2), torch.ones(4)]
    norm = mode.step_normalizers([0, 0, 1], masks, cp_size=[1, 2, 4], dp_size=2)
    assert norm.sample_cp_sizes == (1, 2, 4) and norm.reference_cp == 4
    assert norm.cp_sizes_for([2, 0]) == [4, 1]
    assert mode.loss_prescale(norm, num_microbatches=3, dp_size=2, cp_size=4) == 4.0
    fixed = mode.step_normalizers([0, 0, 1], masks, cp_size=4, dp_size=2)
    assert fixed.sample_cp_sizes is None and fixed.reference_cp == 4
    assert fixed.cp_sizes_for([0]) is None
    # the sound modes' denominators and divisors do not depend on the degrees
    for name in MODES:
        m = get_report_mode(name)
        d = m.step_normalizers([0, 0, 1], masks, cp_size=[1, 2, 4])
        f = m.step_normalizers([0, 0, 1], masks, cp_size=2)
        assert torch.equal(d.sample_denominators, f.sample_denominators), name
        assert d.report_divisor == f.report_divisor, name
    rollout = get_report_mode("per_rollout_mean")
    norm = rollout.step_normalizers([0, 0, 1], masks, cp_size=[1, 2, 4], dp_size=2)
    assert rollout.loss_prescale(norm, num_microbatches=3, dp_size=2, cp_size=4) == 3 * 8 / 2
    with pytest.raises(ValueError, match="rank pool"):
        rollout.loss_prescale(norm, num_microbatches=3, dp_size=2, cp_size=[1, 2, 4])
    with pytest.raises(ValueError, match="3 samples"):
        rollout.step_normalizers([0, 0, 1], masks, cp_size=[1, 2])


def test_per_sample_slicing_cuts_each_sample_by_its_own_degree():
    """Sample 0 (P=1, R=7, T=8) on degree 2 rank 1; sample 1 (P=1, R=3) on degree 1."""
    flat = torch.arange(10, dtype=torch.float64)
    got = slice_flat_responses_for_cp(flat, [8, 4], [7, 3], cp_rank=[1, 0], cp_size=[2, 1])
    # T=8, cp=2: chunks of 2; rank 1 owns [2,4) and [4,6): logits [2,6) -> responses [2, 6)
    assert got.tolist() == [2.0, 3.0, 4.0, 5.0, 7.0, 8.0, 9.0]
    same = slice_flat_responses_for_cp(flat, [8, 4], [7, 3], cp_rank=1, cp_size=2)
    assert same.tolist() == slice_flat_responses_for_cp(
        flat, [8, 4], [7, 3], cp_rank=[1, 1], cp_size=[2, 2]).tolist()
    with pytest.raises(ValueError, match="sample 1: cp_rank=2"):
        per_sample_cp([0, 2], [2, 2], 2)
    with pytest.raises(ValueError, match="3 entries but there are 2 samples"):
        per_sample_cp(0, [1, 2, 4], 2)
    assert per_sample_cp(0, 2, 2) is None


def test_bad_plans_are_refused():
    case = mixed_case()
    n = case.n
    good = as_plan([[list(range(n))]], 2)
    assert plan_sample_cp(good, n, 2) == ([2] * n, [0] * n)
    with pytest.raises(ValueError, match="multiple of 2"):
        plan_sample_cp(good[:1], n, 2)
    twice = [[(list(range(n)), 1, 0)], [(list(range(n)), 1, 0)]]
    with pytest.raises(ValueError, match="CP ranks 0..0 once each"):
        plan_sample_cp(twice, n, 2)
    two_rounds = [[(list(range(n)), 2, 0), (list(range(n)), 2, 1)], [([], 1, 0), ([], 1, 0)]]
    with pytest.raises(ValueError, match="must run once, in one round"):
        plan_sample_cp(two_rounds, n, 2)
    half = [[(list(range(n)), 2, 0)], [([], 1, 0)]]
    with pytest.raises(ValueError, match="CP ranks 0..1 once each"):
        plan_sample_cp(half, n, 2)
    with pytest.raises(ValueError, match="samples 0..7"):
        plan_sample_cp([[([99], 1, 0)], [([], 1, 0)]], n, 2)


def test_a_hand_made_plan_on_the_mixed_case():
    """dp=1, cp=4: sample 5 (11 tokens) on degree 4, the rest on single ranks, idle slots."""
    case = mixed_case()
    plan = [
        [([5], 4, 0), ([0, 1], 1, 0)],
        [([5], 4, 1), ([2, 3], 1, 0)],
        [([5], 4, 2), ([4], 1, 0)],
        [([5], 4, 3), ([], 1, 0)],
    ]
    plan[3][1] = ([6, 7], 1, 0)
    for name in MODES:
        got = report(name, case, plan=plan, cp=4)
        want = report(name, case)
        assert math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-12 * scale_of(name, case))
    assert plan_sample_cp(plan, case.n, 4)[0] == [1, 1, 1, 1, 1, 4, 1, 1]


# ---------------------------------------------------------------------------
# The planner's own plans (core.build_schedule with cp_mode="dynamic")
# ---------------------------------------------------------------------------

PLANNER_MODEL = ModelShape(num_layers=2, hidden_size=16, num_attention_heads=2,
                           num_query_groups=2, vocab_size=32, ffn_hidden_size=64, kv_channels=8)


@st.composite
def planner_batches(draw):
    n_roll = draw(st.integers(2, 8))
    counts = draw(st.lists(st.integers(1, 3), min_size=n_roll, max_size=n_roll))
    n = sum(counts)
    long_ = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    resp = [draw(st.integers(1500, 4000)) if b else draw(st.integers(5, 300)) for b in long_]
    prompt = draw(st.lists(st.integers(1, 40), min_size=n, max_size=n))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    masks = [(rng.random(r) < 0.8).astype(int) for r in resp]
    rollouts = Rollouts(np.asarray(prompt), np.asarray(resp),
                        np.repeat(np.arange(n_roll), counts), masks)
    cfg = ScheduleConfig(dp=draw(st.sampled_from([1, 2])), cp=draw(st.sampled_from([2, 4])),
                         global_batch_size=n_roll, max_tokens_per_gpu=draw(
                             st.sampled_from([1024, 2048])),
                         cp_sizes=draw(st.sampled_from(["pow2", "divisors"])))
    return rollouts, cfg, seed


@settings(max_examples=15, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(planner_batches())
def test_the_planners_dynamic_plans_report_like_no_cp(batch):
    rollouts, cfg, seed = batch
    try:
        table = cp_report_check(rollouts, cfg, PLANNER_MODEL, seed=seed)
    except ValueError as err:  # a layout the scheduler refuses (e.g. fewer samples than dp)
        assert "dp" in str(err) or "samples" in str(err), err
        return
    assert table["equal"].all(), table
