"""Dynamic-CP planner: the cost model by hand, hand-made plans, and properties of
build_schedule(cp_mode="dynamic") (check() passes, never slower than fixed)."""

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
from _factories import TINY, rollouts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from varbatch_kit import ModelShape, Rollouts, ScheduleConfig, build_schedule
from varbatch_kit.analysis.simulate import compare_cp_modes, simulate, simulated_step_time_bound
from varbatch_kit.core.hardware import HARDWARE, HardwareProfile, cp_cost_model, kv_bytes_per_token
from varbatch_kit.policies.dynamic_cp import CPCostModel, group_timeline, plan_dynamic_cp

# a cost model where the ring is expensive: short samples should not be cut
RING = CPCostModel(linear_s=1.0, attention_s=0.01, comm_s=0.5, latency_s=1.0,
                   microbatch_overhead_s=0.0, overlap=1.0)


# ------------------------------------------------------------- cost model
def test_cost_model_by_hand():
    m = CPCostModel(linear_s=2.0, attention_s=0.1, comm_s=1.0, latency_s=0.5,
                    microbatch_overhead_s=3.0, overlap=1.0)
    # c = 1: overhead + linear + attention, no ring
    assert m.time(10, 100, 1) == pytest.approx(3 + 20 + 10)
    # c = 4, S = 40, Q = 400: att 10, ring 1*3*40/4 = 30 -> exposed 20; latency 1.5
    assert m.time(40, 400, 4) == pytest.approx(3 + 20 + 10 + 20 + 1.5)
    # attention hides the ring: Q = 4000 -> att 100 > ring 30
    assert m.time(40, 4000, 4) == pytest.approx(3 + 20 + 100 + 0 + 1.5)
    half = CPCostModel(2.0, 0.1, 1.0, 0.5, 3.0, overlap=0.5)
    assert half.time(40, 400, 4) == pytest.approx(3 + 20 + 10 + (30 - 5) + 1.5)
    assert m.time1(40, 400, 4) == pytest.approx(float(m.time(40, 400, 4)))
    assert m.exposed_comm(40, 400, 1) == 0


@pytest.mark.parametrize("kw, match", [
    (dict(linear_s=-1.0, attention_s=0.0), "linear_s"),
    (dict(linear_s=1.0, attention_s=0.0, overlap=2.0), "overlap"),
])
def test_cost_model_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        CPCostModel(**kw)


def test_group_timeline_waits_for_the_whole_group():
    # ranks 0, 1: round 0 rank 0 runs 5 s, rank 1 runs 1 s; round 1 both together 2 s
    start, end, finish, busy = group_timeline([5.0, 1.0, 2.0], [0, 0, 1],
                                              [(0,), (1,), (0, 1)], 2)
    assert start.tolist() == [0.0, 0.0, 5.0] and end.tolist() == [5.0, 1.0, 7.0]
    assert finish.tolist() == [7.0, 7.0] and busy.tolist() == [7.0, 3.0]


# ------------------------------------------------------------ hand plans
def test_plan_long_sample_spread_short_ones_alone():
    # pool of 4 ranks (dp=1, cp=4), 100 tokens per rank: the 400-token sample needs c=4,
    # the four 100-token samples fit one rank each
    plan = plan_dynamic_cp([400, 100, 100, 100, 100], dp=1, cp=4, cap=100,
                           degrees=(1, 2, 4), cost=RING)
    assert plan.source == "dynamic"
    by_sample = {tuple(b): (len(g), r) for b, g, r in zip(plan.bins, plan.groups, plan.rounds)}
    assert by_sample[(0,)] == (4, 0)
    assert sorted(by_sample[(i,)] for i in (1, 2, 3, 4)) == [(1, 1)] * 4
    # makespan: 400 tokens over 4: linear 100, att 0.01*160000/4 = 400 (hides the ring
    # 0.5*3*100 = 150), latency 3; then 100 + 100 for a 100-token sample alone
    assert plan.makespan_s == pytest.approx(100 + 400 + 3 + 100 + 100)


def test_plan_keeps_fixed_when_not_faster():
    # 4 equal samples that fit one rank each, no ring cost: fixed dp=1 cp=4 packs them
    # into one micro-batch at c=4 (one overhead), dynamic runs 4 micro-batches at c=1
    cost = CPCostModel(linear_s=1.0, attention_s=0.0, microbatch_overhead_s=10.0)
    fixed = ([[0, 1, 2, 3]], [[0]])
    plan = plan_dynamic_cp([100] * 4, dp=1, cp=4, cap=100, degrees=(1, 2, 4), cost=cost,
                           fixed=fixed)
    assert plan.source == "fixed" and plan.bins == [[0, 1, 2, 3]]
    assert plan.groups == [(0, 1, 2, 3)] and plan.rounds == [0]
    assert plan.makespan_s == pytest.approx(10 + 100) == plan.fixed_makespan_s


def test_plan_oversize_sample_goes_alone_at_cp():
    plan = plan_dynamic_cp([1000, 10], dp=1, cp=2, cap=100, degrees=(1, 2), cost=RING)
    assert {tuple(b): len(g) for b, g in zip(plan.bins, plan.groups)} == {(0,): 2, (1,): 1}


def test_plan_divisor_windows_stay_inside_a_replica():
    # a costly ring step: c=3 (100 + 300 + 2*100) beats c=6 (50 + 150 + 5*100)
    cost = CPCostModel(linear_s=1.0, attention_s=0.01, comm_s=0.5, latency_s=100.0)
    plan = plan_dynamic_cp([300, 300, 10, 10, 10], dp=2, cp=6, cap=100, degrees=(1, 2, 3, 6),
                           cost=cost)
    for g in plan.groups:
        assert len({r // 6 for r in g}) == 1 and list(g) == list(range(g[0], g[0] + len(g)))
    assert sorted(plan.degrees)[-2:] == [3, 3]


@pytest.mark.parametrize("kw, match", [
    (dict(degrees=(1, 2)), "include cp"),
    (dict(degrees=(1, 8)), "1..cp"),
    (dict(cap=0), "cap must be"),
    (dict(cost="fast"), "CPCostModel"),
])
def test_plan_errors(kw, match):
    args = dict(dp=1, cp=4, cap=100, degrees=(1, 2, 4), cost=RING)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        plan_dynamic_cp([10, 20], **args)


# ------------------------------------------------------------ properties
@st.composite
def cases(draw):
    n = draw(st.integers(3, 40))
    cap = draw(st.sampled_from([64, 128, 256]))
    lengths = draw(st.lists(st.integers(1, 6 * cap), min_size=n, max_size=n))
    dp = draw(st.integers(1, 3))
    cp = draw(st.sampled_from([2, 3, 4, 6]))
    sizes = draw(st.sampled_from(["pow2", "divisors"]))
    packing = draw(st.sampled_from(["first_fit", "ffd"]))
    gbs = draw(st.integers(max(dp, n // 3), n))
    return lengths, cap, dp, cp, sizes, packing, gbs


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_dynamic_plans_are_valid_and_never_slower(case):
    lengths, cap, dp, cp, sizes, packing, gbs = case
    r = rollouts(lengths)
    fixed_cfg = ScheduleConfig(dp=dp, cp=cp, max_tokens_per_gpu=cap, global_batch_size=gbs,
                               packing=packing)
    try:
        fixed = build_schedule(r, fixed_cfg, TINY)
    except ValueError:  # a step with fewer samples than dp micro-batches can be split into
        return
    dyn = build_schedule(r, fixed_cfg.with_(cp_mode="dynamic", cp_sizes=sizes), TINY).check()
    allowed = set(dyn.config.cp_degrees)
    L = r.total_len
    for s in dyn.steps:
        sizes_of = s.sample_cp_sizes()
        assert set(sizes_of.tolist()) <= allowed
        for i, c in zip(s.sample_indices.tolist(), sizes_of.tolist()):
            if L[i] > cap * cp:  # an oversize sample runs at the largest degree
                assert c == cp
        progs = [s.rank_program(w) for w in range(dp * cp)]
        assert {len(p) for p in progs} == {s.num_rounds}
        held = np.concatenate([w.samples for p in progs for w in p if w.cp_rank == 0])
        assert np.array_equal(np.sort(held), np.sort(s.sample_indices))
    t_fixed = simulate(fixed, timelines=False).step_times.time_s.to_numpy()
    t_dyn = simulate(dyn, timelines=False).step_times.time_s.to_numpy()
    assert (t_dyn <= t_fixed * (1 + 1e-9) + 1e-12).all()


def test_simulated_dynamic_time_is_the_planned_makespan():
    rng = np.random.default_rng(3)
    L = np.concatenate([rng.integers(10, 200, 60), [900, 700, 500]])
    r = rollouts(L)
    model = ModelShape.preset("deepseek-v3")
    cfg = ScheduleConfig(dp=2, cp=4, max_tokens_per_gpu=256, global_batch_size=len(L),
                         cp_mode="dynamic")
    sched = build_schedule(r, cfg, model).check()
    cost = cp_cost_model(model)
    st0 = sched.steps[0]
    pos = {g: i for i, g in enumerate(st0.sample_indices.tolist())}
    fixed = build_schedule(r, cfg.with_(cp_mode="fixed"), model).steps[0]
    fb = [[pos[g] for g in mb.tolist()] for mb in fixed.micro_batches]
    plan = plan_dynamic_cp(L[st0.sample_indices], dp=2, cp=4, cap=256, degrees=(1, 2, 4),
                           cost=cost, fixed=(fb, fixed.dp_rank_bins))
    sim = simulate(sched)
    assert sim.step_times.time_s.iloc[0] == pytest.approx(plan.makespan_s, rel=1e-12)
    assert plan.source == "dynamic" and plan.makespan_s < plan.fixed_makespan_s
    assert (sim.step_times.ratio >= 1 - 1e-12).all()
    assert simulated_step_time_bound(sched).tolist() == pytest.approx(
        sim.step_times.bound_s.tolist())
    tl = sim.timelines
    assert set(tl.cp_size) <= {1, 2, 4} and len(tl) == sum(len(b) for b in st0.rank_bins)
    with pytest.raises(ValueError, match="pp=1 only"):
        simulate(sched, pp=2)


def test_fixed_cp_simulation_pays_the_exposed_ring():
    # one micro-batch of two 40-token samples at cp=2 on a 1 FLOP/s GPU: the fixed
    # simulation adds the cost model's exposed ring seconds to the compute
    slow = HardwareProfile("slow", peak_flops=1e6, memory_gib=1, cp_bandwidth_Bps=1.0,
                           cp_latency_s=0.0, cp_overlap=0.0)
    r = rollouts([40, 40])
    s = build_schedule(r, ScheduleConfig(dp=1, cp=2, max_tokens_per_gpu=40,
                                         global_batch_size=2), TINY)
    base = simulate(s, hardware=slow, efficiency=1.0, microbatch_overhead_s=0.0)
    f = TINY.forward_flops(np.array([40, 40])).sum()
    compute = 3 * f / (2 * 1e6)
    ring = 3 * TINY.num_layers * kv_bytes_per_token(TINY) * 1 * 80 / 2  # (c-1) S / c per byte/s
    assert base.total_time_s == pytest.approx(compute + ring)
    assert not math.isnan(base.total_bound_s)


@st.composite
def plans(draw):
    cap = draw(st.sampled_from([50, 100]))
    lengths = draw(st.lists(st.integers(1, 5 * cap), min_size=1, max_size=30))
    dp = draw(st.integers(1, 3))
    cp = draw(st.sampled_from([2, 3, 4]))
    degrees = draw(st.sampled_from([tuple(c for c in range(1, cp + 1) if cp % c == 0),
                                    tuple(sorted({1, 2, cp} & set(range(1, cp + 1))))]))
    cost = CPCostModel(linear_s=draw(st.floats(0.0, 2.0)), attention_s=draw(st.floats(0, 0.05)),
                       comm_s=draw(st.floats(0.0, 3.0)), latency_s=draw(st.floats(0.0, 50.0)),
                       microbatch_overhead_s=draw(st.floats(0.0, 20.0)),
                       overlap=draw(st.floats(0.0, 1.0)))
    return np.array(lengths), cap, dp, cp, degrees, cost


@settings(max_examples=60, deadline=None)
@given(plans())
def test_planner_properties(case):
    lengths, cap, dp, cp, degrees, cost = case
    # a fixed plan: one sample per micro-batch, dealt round-robin over the dp replicas
    fixed_bins = [[i] for i in range(lengths.size)]
    fixed_ranks = [list(range(d, lengths.size, dp)) for d in range(dp)]
    plan = plan_dynamic_cp(lengths, dp=dp, cp=cp, cap=cap, degrees=degrees, cost=cost,
                           fixed=(fixed_bins, fixed_ranks))
    flat = sorted(i for b in plan.bins for i in b)
    assert flat == list(range(lengths.size))  # every sample exactly once
    seen = set()
    for b, g, r in zip(plan.bins, plan.groups, plan.rounds):
        c = len(g)
        assert b and c in degrees and len(set(g)) == c
        assert len({x // cp for x in g}) == 1  # a group lies inside one CP replica
        assert len(b) == 1 or lengths[b].sum() <= c * cap  # ranks hold <= cap tokens
        for x in g:
            assert (r, x) not in seen  # the groups of a round are disjoint
            seen.add((r, x))
    tok = [float(lengths[b].sum()) for b in plan.bins]
    sq = [float((lengths[b].astype(float) ** 2).sum()) for b in plan.bins]
    dur = cost.time(np.array(tok), np.array(sq), np.array(plan.degrees))
    finish = group_timeline(dur, plan.rounds, plan.groups, dp * cp)[2]
    assert finish.max() == pytest.approx(plan.makespan_s, rel=1e-9, abs=1e-9)
    assert plan.makespan_s <= plan.fixed_makespan_s * (1 + 1e-12) + 1e-12


def test_compare_cp_modes_table():
    rng = np.random.default_rng(5)
    r = rollouts(np.concatenate([rng.integers(10, 120, 40), [700, 500]]))
    cfg = ScheduleConfig(dp=2, cp=4, max_tokens_per_gpu=200, global_batch_size=21)
    t = compare_cp_modes(r, cfg, ModelShape.preset("deepseek-v3"))
    assert list(t.index) == ["fixed", "dynamic"]
    assert t.loc["fixed", "share_c1"] == 0 and t.loc["dynamic", "share_c1"] > 0.5
    assert t.loc["dynamic", "speedup"] >= 1 and t.loc["fixed", "speedup"] == 1
    assert (t["ratio"] >= 1 - 1e-12).all()


def test_fixed_cp_without_ring_cost_is_the_compute_only_model():
    # a free ring (infinite bandwidth, no latency) gives the simulator's compute-only times
    from dataclasses import replace

    r = Rollouts.synthetic(64, seed=2)
    cfg = ScheduleConfig(dp=2, cp=4, max_tokens_per_gpu=4096, global_batch_size=32)
    s = build_schedule(r, cfg, TINY)
    free = replace(HARDWARE["H100"], cp_bandwidth_Bps=math.inf, cp_latency_s=0.0)
    one = build_schedule(r, cfg.with_(cp=1, max_tokens_per_gpu=4 * 4096), TINY)
    # same micro-batches and ranks as cp=1 with the whole cap: times are a quarter of those
    t_cp = simulate(s, hardware=free, microbatch_overhead_s=0.0).step_times.time_s
    t_one = simulate(one, hardware=free, microbatch_overhead_s=0.0).step_times.time_s
    assert t_cp.tolist() == pytest.approx((t_one / 4).tolist(), rel=1e-12)
    assert (simulate(s).step_times.time_s >= t_cp - 1e-15).all()


# ------------------------------------------------------------ recorded plans
# simulated seconds of the dynamic plans of the planner at commit 75766c8 (before the
# planning speed-up): a faster planner must not give slower plans
RECORDED_75766C8 = [("qwen3-8b", 4, 4, 11.4604154418527),
                    ("deepseek-v3", 2, 8, 63.355235117091205)]


@pytest.mark.parametrize("model, dp, cp, recorded", RECORDED_75766C8)
def test_dynamic_plan_not_slower_than_recorded(model, dp, cp, recorded):
    from benchmarks._batches import tail_trace

    r = tail_trace(400, seed=1)  # two steps of 200 samples, 4% of them 16k-64k tokens
    cfg = ScheduleConfig(dp=dp, cp=cp, max_tokens_per_gpu=16384, global_batch_size=200,
                         packing="balanced", distribution="balanced")
    shape = ModelShape.preset(model)
    dyn = simulate(build_schedule(r, cfg.with_(cp_mode="dynamic"), shape).check(),
                   timelines=False)
    fixed = simulate(build_schedule(r, cfg, shape), timelines=False)
    assert dyn.total_time_s <= recorded * (1 + 1e-9)
    assert dyn.total_time_s == pytest.approx(recorded, rel=1e-3)  # the same kind of plan
    assert (dyn.step_times.time_s < fixed.step_times.time_s).all()  # dynamic wins each step


# ------------------------------------------------------------ fast planner, same plans
GOLDEN_PLANS = Path(__file__).parents[2] / "golden" / "dynamic_cp" / "plans.json"


def golden_case(seed: int):
    """A seeded planner input: short samples and 10% long ones, 1..8 replicas of cp 2/4/8,
    and a fixed plan of one sample per micro-batch (odd seeds) or one micro-batch per replica."""
    rng = np.random.default_rng(seed)
    cap = int(rng.choice([64, 128, 256]))
    n = int(rng.integers(20, 300))
    lengths = np.where(rng.random(n) < 0.1, rng.integers(cap, 5 * cap, n),
                       rng.integers(1, cap, n))
    dp, cp = int(rng.integers(1, 9)), int(rng.choice([2, 4, 8]))
    cost = CPCostModel(linear_s=float(rng.uniform(0.5, 2.0)),
                       attention_s=float(rng.uniform(0.0, 0.01)),
                       comm_s=float(rng.uniform(0.0, 1.0)), latency_s=float(rng.uniform(0, 5)),
                       microbatch_overhead_s=float(rng.choice([0.0, 1.0, 10.0, 100.0])),
                       overlap=float(rng.uniform(0.0, 1.0)))
    if seed % 2:  # one sample per micro-batch, dealt round-robin
        fixed = ([[i] for i in range(n)], [list(range(d, n, dp)) for d in range(dp)])
    else:  # one micro-batch per replica (few overheads: the fixed plan may be kept)
        fixed = ([p.tolist() for p in np.array_split(np.arange(n), dp)], [[d] for d in range(dp)])
    return lengths, dict(dp=dp, cp=cp, cap=cap, degrees=tuple(c for c in (1, 2, 4, 8) if c <= cp),
                         cost=cost, fixed=fixed)


def plan_digest(plan) -> str:
    """sha256 of a plan's micro-batches, rounds, groups, makespans (repr: every bit) and source."""
    text = json.dumps([plan.bins, plan.rounds, [list(g) for g in plan.groups],
                       repr(plan.makespan_s), repr(plan.fixed_makespan_s), plan.source])
    return hashlib.sha256(text.encode()).hexdigest()


def test_plans_are_those_of_the_plain_planner():
    # digests of the plans of the planner at commit 75766c8, before the speed-up (its
    # candidate skipping, heap deal and chunked local search must not change a bit)
    golden = json.loads(GOLDEN_PLANS.read_text())
    assert golden["commit"].startswith("75766c8") and len(golden["digests"]) == 40
    for seed, digest in enumerate(golden["digests"]):
        lengths, kw = golden_case(seed)
        plan = plan_dynamic_cp(lengths, **kw)
        assert plan_digest(plan) == digest, f"seed {seed}"
        assert plan_digest(plan_dynamic_cp(lengths, **kw)) == digest  # deterministic


@settings(max_examples=40, deadline=None)
@given(plans())
def test_short_phase_lower_bound_holds(case):
    # the bound that lets the planner skip a candidate never exceeds its makespan
    from varbatch_kit.policies.dynamic_cp import _long_bins, _place_groups, _short_lower_bound
    from varbatch_kit.policies.dynamic_cp_short import deal_short, refine_short

    lengths, cap, dp, cp, degrees, cost = case
    deg = np.full(lengths.size, cp, dtype=np.int64)
    for c in sorted(degrees, reverse=True):
        deg[lengths <= c * cap] = c
    bins, bdeg = _long_bins(lengths, deg, cap, cost, math.inf)
    _, _, free, _ = _place_groups(lengths, bins, bdeg, dp * cp, cp, cost)
    short = np.flatnonzero(deg == 1)
    L = lengths[short].astype(float)
    lb = _short_lower_bound(free, int(lengths[short].sum()), float(cost.compute(L, L * L, 1).sum()),
                            cap, cost)
    busy = sum(len(b) and float(cost.time(lengths[b].sum(), (lengths[b].astype(float) ** 2).sum(),
                                          c)) * c for b, c in zip(bins, bdeg))
    weak = _short_lower_bound(np.array([busy] + [0.0] * (dp * cp - 1)), int(lengths[short].sum()),
                              float(cost.compute(L, L * L, 1).sum()), cap, cost, spread=True)
    per_rank = deal_short(short, lengths, free, cap, cost)
    fin = refine_short(per_rank, lengths, free, cap, cost)
    assert weak <= fin.max() and lb <= fin.max()
    assert sorted(i for mbs in per_rank for mb in mbs for i in mb) == short.tolist()
    assert all(lengths[mb].sum() <= cap for mbs in per_rank for mb in mbs)


def test_deal_short_by_hand():
    from varbatch_kit.policies.dynamic_cp_short import deal_short

    # 1 s per token, 1 s per micro-batch, 10 tokens per rank: 6 -> rank 0 (key 1, ties to
    # the lower rank); 5 does not fit rank 0's 6 (key 8) -> rank 1 (key 1); 4 fits both
    # (keys 7, 6) -> rank 1; 3 fits rank 0 only (keys 7, 11) -> rank 0
    cost = CPCostModel(linear_s=1.0, attention_s=0.0, microbatch_overhead_s=1.0)
    per_rank = deal_short(np.arange(4), np.array([6, 5, 4, 3]), np.zeros(2), 10, cost)
    assert per_rank == [[[0, 3]], [[1, 2]]]


def test_refine_short_by_hand():
    from varbatch_kit.policies.dynamic_cp_short import refine_short

    # rank 0 runs two 10-token samples (20 s), rank 1 one of 4 (4 s): a 10 moves over
    # (10 s and 14 s); then no move or swap lowers the later finish
    cost = CPCostModel(linear_s=1.0, attention_s=0.0)
    per_rank = [[[0, 1]], [[2]]]
    fin = refine_short(per_rank, np.array([10, 10, 4]), np.zeros(2), 100, cost)
    assert fin.tolist() == [10.0, 14.0] and per_rank == [[[1]], [[0, 2]]]
