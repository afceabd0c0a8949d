"""The layout planner (compat.slime.planner): every candidate a real factorisation of the
GPUs, the fastest fitting one chosen, its pruning never changing the answer."""

from __future__ import annotations

import numpy as np
import pytest

from varbatch_kit import ModelShape, Rollouts
from varbatch_kit.compat.slime.planner import plan_layouts
from varbatch_kit.core.hardware import HardwareProfile, hardware_profile
from varbatch_kit.core.memory import MemoryLayout, static_memory

MODEL = ModelShape(num_layers=8, hidden_size=1024, num_attention_heads=16, num_query_groups=4,
                   ffn_hidden_size=4096, vocab_size=32000)


def _rollouts(n=96, seed=0):
    rng = np.random.default_rng(seed)
    return Rollouts(prompt_len=rng.integers(50, 400, n),
                    response_len=np.minimum(rng.pareto(1.1, n) * 800 + 100, 12000).astype(int),
                    rollout_id=np.arange(n) // 4)


def _device(gib: float) -> HardwareProfile:
    h100 = hardware_profile("H100")
    return HardwareProfile(name=f"{gib:g} GiB", peak_flops=h100.peak_flops, memory_gib=gib)


def test_candidates_factor_the_gpus_and_the_best_is_the_fastest_that_fits():
    plan = plan_layouts(_rollouts(), MODEL, 8, global_batch_size=8, caps=(4096, 8192))
    t = plan.table
    assert ((t.tp * t.pp * t.cp * t.dp) == 8).all()
    assert (MODEL.num_attention_heads % t.tp == 0).all() and (MODEL.num_layers % t.pp == 0).all()
    judged = t.dropna(subset=["peak_gib"])
    assert (judged["fits"] == (judged["peak_gib"] <= plan.memory_gib)).all()
    best = plan.best
    assert best["fits"] and best["time_s"] == t[t.fits].time_s.min()
    assert (plan.top(3).time_s.diff().dropna() >= 0).all()
    assert np.isclose(best["gpu_hours"], best["time_s"] * 8 / 3600)
    slime = t[t.fits & t.command.notna()].iloc[0]
    assert f"--tensor-model-parallel-size {slime.tp}" in slime.command
    assert f"--max-tokens-per-gpu {slime.max_tokens_per_gpu}" in slime.command
    assert plan.figure().data  # time against memory


def test_pruning_by_time_does_not_change_the_answer():
    ro = _rollouts()
    exact = plan_layouts(ro, MODEL, 8, global_batch_size=8, caps=(4096, 8192), top=10_000)
    fast = plan_layouts(ro, MODEL, 8, global_batch_size=8, caps=(4096, 8192), top=1)
    assert exact.pruned["time"] == 0 and fast.pruned["time"] > 0
    keys = ["tp", "pp", "cp", "max_tokens_per_gpu", "packing", "recompute"]
    assert {k: exact.best[k] for k in keys} == {k: fast.best[k] for k in keys}


def test_recomputation_only_where_memory_needs_it():
    ro = _rollouts()
    roomy = plan_layouts(ro, MODEL, 4, global_batch_size=4, caps=(8192,), hardware="H200")
    assert set(roomy.table[roomy.table.fits].recompute) == {"none"}
    # a device just above the static bytes of the leanest layout: activations must go
    lean = min(sum(static_memory(MODEL, MemoryLayout(dp=4 // (tp * pp), tp=tp, pp=pp,
                                                     precision="bf16",
                                                     distributed_optimizer=True), r).values())
                   for tp in (1, 2, 4) for pp in (1, 2, 4) if tp * pp <= 4 for r in range(pp))
    tight = plan_layouts(ro, MODEL, 4, global_batch_size=4, caps=(8192,),
                         hardware=_device(lean / 2**30 + 0.6))
    if tight.best is not None:
        assert tight.best["peak_gib"] <= tight.memory_gib
    assert (tight.table.recompute != "none").any()
    # a device smaller than any layout's static bytes: nothing is built
    none = plan_layouts(ro, MODEL, 4, global_batch_size=4, caps=(8192,),
                        hardware=_device(lean / 2**30 / 2))
    assert none.best is None and none.table.empty and none.pruned["static memory"] > 0


def test_bad_inputs_say_what_is_allowed():
    with pytest.raises(ValueError, match="packings must be among"):
        plan_layouts(_rollouts(), MODEL, 8, packings=("magic",))
    with pytest.raises(ValueError, match="max_pp"):
        plan_layouts(_rollouts(), MODEL, 8, max_pp=0)
    # a model tp cannot split: only tp 1 is tried
    odd = ModelShape(**{**MODEL.to_dict(), "num_attention_heads": 7, "num_query_groups": 7})
    assert set(plan_layouts(_rollouts(), odd, 4, global_batch_size=4, caps=(8192,),
                            packings=("slime",)).table.tp) == {1}
    with pytest.raises(ValueError, match="gpus"):
        plan_layouts(_rollouts(), MODEL, 0)
