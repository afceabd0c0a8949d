"""ScheduleConfig(workload=...): the policies balance a measured micro-batch cost instead of FLOPs.

A workload proportional to the model's FLOPs (``c1, c2`` the FLOPs coefficients times a power
of two, so every sum and comparison scales exactly) gives today's FLOPs schedule bit for bit;
a workload that weighs ``L^2`` more moves micro-batches to other ranks (a hand-derived case);
wrong values are ``ValueError`` naming the parameter.
"""

import math
import warnings

import numpy as np
import pytest
from _factories import TINY, rollouts
from hypothesis import given, settings
from hypothesis import strategies as st

from varbatch_kit import ModelShape, ScheduleConfig, build_schedule
from varbatch_kit.analysis.cost_model import MicroBatchCostModel
from varbatch_kit.core.log_prob_schedule import build_log_prob_schedule
from varbatch_kit.core.workload import Workload, as_workload

CPU = MicroBatchCostModel(0.0, 4.904293306089394e-05, 3.0492147025180916e-08, r2=0.998,
                          device="cpu", source="calibrate")


def _plan(schedule):
    return [(st.dp_rank_bins, [mb.tolist() for mb in st.micro_batches]) for st in schedule.steps]


# ------------------------------------------------------------------ the value object
def test_costs_per_sample_and_per_micro_batch():
    w = Workload(c0=0.5, c1=2.0, c2=0.25)
    assert w.sample_costs([2, 4]).tolist() == [2 * 2 + 0.25 * 4, 2 * 4 + 0.25 * 16]  # 5, 12
    assert w.bin_costs(w.sample_costs([2, 4, 4]), [[0, 1], [2]]).tolist() == [17.5, 12.5]
    assert w.microbatch_cost([2, 4]) == 17.5
    # the cost model's own prediction of a micro-batch is the workload's cost of it
    assert CPU.workload().microbatch_cost([512, 3000]) == pytest.approx(
        CPU.microbatch_seconds([512, 3000]), rel=1e-15)


def test_a_cost_model_is_stored_as_its_coefficients_and_is_the_configs_identity():
    base = ScheduleConfig(dp=2, global_batch_size=4, max_tokens_per_gpu=100, packing="balanced")
    cal = base.with_(workload=CPU)
    assert cal.workload == Workload(CPU.c0, CPU.c1, CPU.c2) == CPU.workload()
    same = base.with_(workload=Workload(CPU.c0, CPU.c1, CPU.c2))
    assert cal == same and hash(cal) == hash(same)
    assert cal != base and base.workload is None
    assert cal != base.with_(workload=Workload(CPU.c0, CPU.c1, 2 * CPU.c2))
    # a model with NaN fit figures (never equal to itself) still gives equal configs
    nan_model = MicroBatchCostModel(CPU.c0, CPU.c1, CPU.c2)
    assert math.isnan(nan_model.r2) and base.with_(workload=nan_model) == cal
    # repr (what the training checkpoint's fingerprint reads) holds the full-precision values
    assert "workload=Workload(c0=0.0, c1=4.904293306089394e-05, c2=3.0492147025180916e-08)" \
        in repr(cal)
    # with_ keeps the workload through a path change
    assert cal.with_(max_tokens_per_gpu=200, packing="first_fit").workload == cal.workload


@pytest.mark.parametrize("kwargs, match", [
    ({"c0": -1.0, "c1": 1.0}, r"workload.c0 must be a finite number in \[0, inf\)"),
    ({"c1": -1e-6, "c2": 1.0}, r"workload.c1 must be a finite number in \[0, inf\)"),
    ({"c1": 1.0, "c2": math.nan}, r"workload.c2 must be a finite number"),
    ({"c1": 1.0, "c2": True}, r"workload.c2 must be a finite number"),
    ({"c0": 1.0}, r"workload.c1 and workload.c2 are both 0 \(c0=1.0\)"),
])
def test_bad_coefficients(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Workload(**kwargs)


@pytest.mark.parametrize("value", ["cost_model.json", (0.0, 1.0, 1e-3), 1.0,
                                   MicroBatchCostModel])
def test_a_wrong_type_names_the_parameter_and_what_works(value):
    with pytest.raises(ValueError, match=r"workload must be None \(balance FLOPs\), a "
                                         r"varbatch_kit.core.workload.Workload\(c0, c1, c2\) or a "
                                         r"calibrated .*MicroBatchCostModel.*, got "):
        ScheduleConfig(dp=2, max_tokens_per_gpu=100, workload=value)
    assert as_workload(None) is None


def test_a_negatively_fitted_cost_model_is_refused():
    bad = MicroBatchCostModel(0.01, -1e-6, 3e-8)
    with pytest.raises(ValueError, match=r"workload.c1 must be a finite number in \[0, inf\)"):
        ScheduleConfig(dp=2, max_tokens_per_gpu=100, workload=bad)


def test_balancing_needs_a_model_shape_or_a_workload():
    r = rollouts([30, 20, 10, 40])
    cfg = ScheduleConfig(dp=2, global_batch_size=4, max_tokens_per_gpu=60, packing="balanced")
    with pytest.raises(ValueError, match=r"'balanced' balances FLOPs and needs a model shape.*"
                                         r"ScheduleConfig\(workload="):
        build_schedule(r, cfg)
    sched = build_schedule(r, cfg.with_(workload=CPU)).check()  # no model shape needed
    assert sched.model is None and sched.sample_flops is None


# ------------------------------------------------------------------ FLOPs-proportional = FLOPs
POLICIES = [("balanced", "balanced"), ("flops_kk", "flops_kk"), ("first_fit", "flops_kk"),
            ("ffd", "balanced"), ("first_fit", "strided")]


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=4, max_size=40),
       dp=st.integers(1, 4), cap=st.integers(100, 600), policy=st.sampled_from(POLICIES),
       order=st.sampled_from(["arrival", "small_ends"]), scale=st.integers(-60, 20))
def test_a_workload_proportional_to_flops_gives_the_flops_schedule(lengths, dp, cap, policy,
                                                                    order, scale):
    n = len(lengths)
    if n < 2 * dp:
        dp = 1
    r = rollouts(lengths)
    packing, distribution = policy
    cfg = ScheduleConfig(dp=dp, global_batch_size=max(1, n // 2), max_tokens_per_gpu=cap,
                         packing=packing, distribution=distribution, microbatch_order=order,
                         alignment_fallback="drop_rollouts")
    c1, c2 = TINY.flops_coefficients()
    s = 2.0 ** scale  # a power of two: every sum, difference and comparison scales exactly
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flops = build_schedule(r, cfg, TINY)
        work = build_schedule(r, cfg.with_(workload=Workload(0.0, s * c1, s * c2)))
    assert _plan(work) == _plan(flops)


def test_the_log_prob_pass_packs_by_the_workload_too():
    r = rollouts([300, 20, 250, 40, 120, 90, 60, 200, 10, 180, 70, 30])
    cfg = ScheduleConfig(dp=2, global_batch_size=12, max_tokens_per_gpu=300, packing="balanced",
                         log_probs_max_tokens_per_gpu=600, microbatch_order="small_ends")
    c1, c2 = TINY.flops_coefficients()
    flops = build_log_prob_schedule(r, cfg, TINY)
    work = build_log_prob_schedule(r, cfg.with_(workload=Workload(0.0, c1 / 8, c2 / 8)))
    assert _plan(work) == _plan(flops)


# ------------------------------------------------------------------ a workload that moves work
def test_a_quadratic_workload_pairs_the_micro_batches_by_hand():
    # first-fit under cap 12 in arrival order: A=[10], B=[4,4,4], C=[8], D=[5,5]
    # (tokens 10, 12, 8, 10; sum L^2 100, 48, 64, 50). Equal-count Karmarkar-Karp over dp=2:
    # - FLOPs (Qwen3-8B, linear term ~5e4 x the quadratic one at these lengths) weigh tokens:
    #   A+D = 20 = B+C tokens, where A+B / C+D would be 22 / 18 -> ranks {A, D}, {B, C};
    # - the workload c2 * sum L^2 (c2 = 1): sorted 100 (A), 64 (C), 50 (D), 48 (B): pairs
    #   (A, C) differ by 36, (D, B) by 2; the larger difference is set apart and the pair
    #   with the smaller joins reversed: {A, B} = 148, {C, D} = 114 (the optimum: {A, D} = 150,
    #   {A, C} = 164) -> ranks {A, B}, {C, D}; c0 (per micro-batch) shifts both ranks alike.
    r = rollouts([10, 4, 4, 4, 8, 5, 5])
    cfg = ScheduleConfig(dp=2, global_batch_size=7, max_tokens_per_gpu=12, packing="first_fit",
                         distribution="flops_kk")
    by_flops = build_schedule(r, cfg, ModelShape.preset("qwen3-8b")).steps[0]
    assert [[mb.tolist() for mb in rank] for rank in by_flops.dp_ranks] == [
        [[0], [5, 6]], [[1, 2, 3], [4]]]
    for c0 in (0.0, 3.0):
        by_cost = build_schedule(r, cfg.with_(workload=Workload(c0, 0.0, 1.0))).steps[0]
        assert [[mb.tolist() for mb in rank] for rank in by_cost.dp_ranks] == [
            [[0], [1, 2, 3]], [[4], [5, 6]]]


def test_balanced_by_the_calibrated_cost_evens_that_cost():
    # long-tailed lengths up to 8k: the CPU's measured cost weighs L^2 from ~1.6k tokens on,
    # Qwen3-8B's FLOPs only from ~51k, so the FLOPs-balanced plan leaves the rank holding the
    # long samples busiest under the measured cost; balancing the cost itself reaches its bound
    rng = np.random.default_rng(5)
    lengths = np.clip(rng.lognormal(np.log(900), 1.0, 96), 16, 8000).astype(np.int64)
    r = rollouts(lengths)
    cfg = ScheduleConfig(dp=4, global_batch_size=96, max_tokens_per_gpu=16384,
                         packing="balanced")
    w = CPU.workload()
    costs = w.sample_costs(lengths)

    def busiest(sched):
        st = sched.steps[0]
        return max(sum(w.microbatch_cost(lengths[mb]) for mb in rank) for rank in st.dp_ranks)

    m = build_schedule(r, cfg, ModelShape.preset("qwen3-8b")).steps[0].num_microbatches
    bound = max(costs.sum() / 4, costs.max()) + w.c0 * m / 4
    by_flops = busiest(build_schedule(r, cfg, ModelShape.preset("qwen3-8b")))
    by_cost = busiest(build_schedule(r, cfg.with_(workload=CPU)))
    assert by_cost <= bound * 1.001
    assert by_flops > by_cost * 1.01


def test_a_resumed_run_must_keep_the_workload():
    # the checkpoint's fingerprint holds the schedule's fields by repr: a resume under another
    # workload is refused, naming it; TrainConfig.with_ routes the field to the schedule
    pytest.importorskip("megatron.core")
    from varbatch_kit.train import TrainConfig
    from varbatch_kit.train.runs.checkpoint import _config_fields, check_resumable

    base = TrainConfig()
    cal = base.with_(workload=CPU)
    assert cal.schedule.workload == CPU.workload()
    saved = {"config": _config_fields(cal), "rollouts": "r", "steps": "s"}
    now = {"config": _config_fields(base), "rollouts": "r", "steps": "s"}
    assert saved["config"]["schedule.workload"] == repr(CPU.workload())
    check_resumable(saved, {**saved}, "ckpt")
    with pytest.raises(ValueError, match=r"schedule.workload: checkpoint Workload\(c0=0.0, "
                                         r"c1=4.904293306089394e-05.*now None"):
        check_resumable(saved, now, "ckpt")
