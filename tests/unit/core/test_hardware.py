"""The hardware table and the one CP cost model builder: figures by hand, the planner's and
the simulator's default, bad input."""

import math

import numpy as np
import pytest
from _factories import TINY

from varbatch_kit import ModelShape, Rollouts, ScheduleConfig, build_schedule
from varbatch_kit.core.hardware import (
    DEFAULT_BACKWARD_FACTOR,
    DEFAULT_EFFICIENCY,
    DEFAULT_HARDWARE,
    DEFAULT_MICROBATCH_OVERHEAD_S,
    HARDWARE,
    HardwareProfile,
    cp_cost_model,
    hardware_profile,
    kv_bytes_per_token,
)


def test_profiles():
    assert HARDWARE["H100"].peak_flops == HARDWARE["H200"].peak_flops == 989e12
    assert HARDWARE["A100"].peak_flops == 312e12
    assert HARDWARE["H200"].memory_gib > HARDWARE["H100"].memory_gib
    assert HARDWARE["H100"].cp_bandwidth_Bps == 200e9 and HARDWARE["A100"].cp_bandwidth_Bps == 120e9
    assert all(h.cp_latency_s == 20e-6 and h.cp_overlap == 1.0 for h in HARDWARE.values())
    assert all(name == h.name for name, h in HARDWARE.items())
    assert DEFAULT_HARDWARE in HARDWARE
    assert (DEFAULT_EFFICIENCY, DEFAULT_MICROBATCH_OVERHEAD_S, DEFAULT_BACKWARD_FACTOR) == (
        0.45, 0.004, 2.0)


def test_hardware_profile_resolves_names_and_passes_profiles():
    assert hardware_profile("A100") is HARDWARE["A100"]
    mine = HardwareProfile("mine", peak_flops=1e15, memory_gib=192)
    assert hardware_profile(mine) is mine


def test_kv_bytes_per_token():
    # GQA: K and V of every group, bf16
    assert kv_bytes_per_token(TINY) == 2 * 2 * 8 * 2
    assert kv_bytes_per_token(TINY, dtype_bytes=4) == 2 * 2 * 8 * 4
    # MLA: the up-projected keys and values of every head
    ds = ModelShape.preset("deepseek-v3")
    assert kv_bytes_per_token(ds) == ds.num_attention_heads * (
        ds.qk_head_dim + ds.qk_pos_emb_head_dim + ds.v_head_dim) * 2


def test_cp_cost_model_by_hand():
    # 8 FLOP/s at efficiency 0.5 = 4 FLOP/s per GPU, tp 2, backward = forward (2 passes);
    # TINY: 2 layers, 64 KV bytes per token and layer
    hw = HardwareProfile("unit", peak_flops=8.0, memory_gib=1.0, cp_bandwidth_Bps=2.0,
                         cp_latency_s=0.1, cp_overlap=0.5)
    c1, c2 = TINY.flops_coefficients()
    m = cp_cost_model(TINY, hw, efficiency=0.5, microbatch_overhead_s=0.25, tp=2,
                      backward_factor=1.0)
    assert m.linear_s == pytest.approx(c1 * 2 / (2 * 4)) and m.attention_s == pytest.approx(
        c2 * 2 / (2 * 4))
    # the ring: 3 passes (K, V forward; and their gradients backward) x 2 layers x 64 bytes,
    # split over tp 2, at 2 B/s
    assert m.comm_s == pytest.approx(3 * 2 * 64 / (2 * 2))
    assert m.latency_s == pytest.approx(2 * 2 * 0.1)  # forward and backward, every layer
    assert m.microbatch_overhead_s == 0.25 and m.overlap == 0.5
    # a free ring
    free = HardwareProfile("free", peak_flops=8.0, memory_gib=1.0, cp_bandwidth_Bps=math.inf,
                           cp_latency_s=0.0)
    assert cp_cost_model(TINY, free).comm_s == 0 and cp_cost_model(TINY, free).latency_s == 0


def test_the_default_is_the_h100_at_the_simulators_settings():
    c1, c2 = TINY.flops_coefficients()
    m = cp_cost_model(TINY)
    assert m == cp_cost_model(TINY, "H100", 0.45, 0.004, tp=1, backward_factor=2.0)
    rate = 989e12 * 0.45
    assert m.linear_s == pytest.approx(3 * c1 / rate) and m.attention_s == pytest.approx(
        3 * c2 / rate)
    assert m.comm_s == pytest.approx(3 * 2 * 64 / 200e9)
    assert m.latency_s == pytest.approx(2 * 2 * 20e-6) and m.microbatch_overhead_s == 0.004
    assert cp_cost_model(TINY, "A100").comm_s == pytest.approx(3 * 2 * 64 / 120e9)


def test_the_planner_plans_under_the_default_cost_model():
    rng = np.random.default_rng(3)
    L = np.concatenate([rng.integers(10, 200, 60), [900, 700, 500]])
    r = Rollouts(prompt_len=np.zeros_like(L), response_len=L)
    cfg = ScheduleConfig(dp=2, cp=4, max_tokens_per_gpu=256, global_batch_size=len(L),
                         cp_mode="dynamic")
    model = ModelShape.preset("deepseek-v3")
    default = build_schedule(r, cfg, model).steps[0]
    explicit = build_schedule(r, cfg, model, cp_cost=cp_cost_model(model, "H100")).steps[0]
    slow_ring = build_schedule(
        r, cfg, model, cp_cost=cp_cost_model(model, HardwareProfile(
            "slow", 989e12, 80, cp_bandwidth_Bps=1e6)))
    assert default.placements == explicit.placements
    assert default.placements != slow_ring.steps[0].placements


@pytest.mark.parametrize("call, match", [
    (lambda: cp_cost_model(TINY, "B200"), r"unknown hardware 'B200'.*'A100', 'H100', 'H200'"),
    (lambda: cp_cost_model("qwen3-8b"), "model must be a ModelShape"),
    (lambda: cp_cost_model(TINY, efficiency=0.0), r"efficiency must be in \(0, 1\]"),
    (lambda: cp_cost_model(TINY, efficiency=1.5), r"efficiency must be in \(0, 1\]"),
    (lambda: cp_cost_model(TINY, microbatch_overhead_s=-1.0), "microbatch_overhead_s"),
    (lambda: cp_cost_model(TINY, tp=0), "tp must be a positive integer"),
    (lambda: cp_cost_model(TINY, backward_factor=-1.0), "backward_factor"),
    (lambda: hardware_profile(3), "unknown hardware 3"),
    (lambda: HardwareProfile("x", peak_flops=0.0, memory_gib=1), "peak_flops must be"),
    (lambda: HardwareProfile("x", peak_flops=1.0, memory_gib=-1), "memory_gib must be"),
    (lambda: HardwareProfile("x", 1.0, 1, cp_bandwidth_Bps=0.0), "cp_bandwidth_Bps must be > 0"),
    (lambda: HardwareProfile("x", 1.0, 1, cp_latency_s=-1.0), "cp_latency_s must be"),
    (lambda: HardwareProfile("x", 1.0, 1, cp_overlap=1.5), r"cp_overlap must be in \[0, 1\]"),
])
def test_bad_input_is_a_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()
