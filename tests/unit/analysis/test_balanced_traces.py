"""The balanced packing on the bundled traces (cap 16384, Qwen3-8B, 4 steps per trace).

``balanced`` has no cap violations and no more micro-batches than first-fit; its
per-step busiest-rank FLOPs over ``max(step FLOPs / dp, largest sample)`` averages
<= 1.005 on the math and agentic traces, and on every trace it is no worse than the
better of slime's two FLOPs-balancing options.
"""

import pytest

from varbatch_kit import ModelShape, ScheduleConfig, build_schedule
from varbatch_kit.analysis.quality import step_quality
from varbatch_kit.core.traces import bundled_traces, read_trace

MODEL = ModelShape.preset("qwen3-8b")
SLIME_OPTIONS = [("first_fit", "flops_kk"), ("flops_kk", "flops_kk")]


@pytest.fixture(scope="module")
def traces():
    return {name: read_trace(path) for name, path in bundled_traces().items()}


@pytest.mark.parametrize("dp", [16, 64])
@pytest.mark.parametrize("name", ["math", "agentic", "long_context"])
def test_balanced_on_bundled_traces(traces, name, dp):
    r = traces[name]
    cfg = ScheduleConfig(dp=dp, global_batch_size=r.num_rollouts // 4, max_tokens_per_gpu=16384,
                         packing="balanced")
    bal = build_schedule(r, cfg, MODEL).check()
    qb = step_quality(bal)
    assert len(qb) == 4
    assert qb["cap_violations"].sum() == 0
    ff = step_quality(build_schedule(r, cfg.with_(packing="first_fit", distribution="strided")))
    assert (qb["micro_batches"] <= ff["micro_batches"]).all()
    if name in ("math", "agentic"):
        assert qb["makespan_ratio"].mean() <= 1.005
    slime = min(step_quality(build_schedule(
        r, cfg.with_(packing=p, distribution=d), MODEL))["makespan_ratio"].mean()
        for p, d in SLIME_OPTIONS)
    assert qb["makespan_ratio"].mean() <= slime
