"""A worker's megatron import: ``torch.compile`` deferred to first call, the collector paused
(:mod:`varbatch_kit.train.parallel.megatron_import`).

The import checks run in a fresh interpreter (this process may have imported megatron or
``torch._dynamo`` already). Each can fail: without the deferral megatron's fusion modules
import ``torch._dynamo`` / ``torch._inductor`` while they import; a compile that does not
happen on the first call, or happens with other options, changes what a called kernel runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import torch
from _paths import REPO

from varbatch_kit.train.parallel.megatron_import import (
    WORKER_MODULES,
    deferred_torch_compile,
    lazy_compile,
)


def fresh(code: str) -> dict:
    """Run ``code`` in a new interpreter; it prints one JSON line last."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=240, cwd=REPO, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


class Compiler:
    """A compile function that records its calls and returns the function times 10."""

    def __init__(self):
        self.calls = []

    def __call__(self, fn, **options):
        self.calls.append((fn.__name__, options))
        return lambda *a, **k: 10 * fn(*a, **k)


def add(a, b=0):
    """adds"""
    return a + b


def test_lazy_compile_compiles_once_on_the_first_call_with_the_options():
    comp = Compiler()
    f = lazy_compile(comp, add, dynamic=True)
    assert comp.calls == []  # wrapping compiles nothing
    assert (f.__name__, f.__doc__) == ("add", "adds")
    assert f(1, b=2) == 30 and f(2) == 20  # every call runs the compiled function
    assert comp.calls == [("add", {"dynamic": True})]  # once, with the options


def test_lazy_compile_as_a_decorator_with_and_without_options():
    comp = Compiler()
    g = lazy_compile(comp)(add)
    h = lazy_compile(comp, mode="max-autotune")(add)
    assert comp.calls == []
    assert g(1) == h(1) == 10
    assert comp.calls == [("add", {}), ("add", {"mode": "max-autotune"})]


def test_deferred_torch_compile_restores_torch_compile_also_on_an_error():
    real = torch.compile
    try:
        with deferred_torch_compile():
            assert torch.compile is not real
            raise KeyError("x")
    except KeyError:
        pass
    assert torch.compile is real


def test_a_deferred_torch_compile_runs_the_real_compiler_on_first_call():
    out = fresh("""
        import json, sys, torch
        from varbatch_kit.train.parallel.megatron_import import deferred_torch_compile

        def f(x):
            return torch.sin(x) * 2

        with deferred_torch_compile():
            g = torch.compile(f, backend="eager")
        before = "torch._dynamo" in sys.modules
        x = torch.arange(4.0)
        same = bool(torch.equal(g(x), f(x)))
        print(json.dumps({"before": before, "after": "torch._dynamo" in sys.modules,
                          "same": same}))
    """)
    # nothing compiled (no dynamo) until the call; then the real torch.compile ran
    assert out == {"before": False, "after": True, "same": True}


def test_import_megatron_loads_no_compiler_and_leaves_the_process_as_it_was():
    out = fresh(f"""
        import gc, json, sys, warnings, torch
        real = torch.compile
        from varbatch_kit.train.parallel.megatron_import import import_megatron

        import_megatron()
        import megatron.core.jit as jit
        # everything a worker imports besides
        import varbatch_kit.train.runs.worker, varbatch_kit.train.model.gpt
        import varbatch_kit.train.step.train_step, varbatch_kit.train.step.pipeline_schedule
        import varbatch_kit.train.parallel.cpu_shim, varbatch_kit.train.runs.run_state
        print(json.dumps({{
            "loaded": sorted(m for m in {WORKER_MODULES!r} if m in sys.modules),
            "compilers": sorted(m for m in ("torch._dynamo", "torch._inductor")
                                if m in sys.modules),
            "jit_fuser_deferred": jit.jit_fuser is not real,
            "torch_compile_restored": torch.compile is real,
            "gc": gc.isenabled(), "frozen": gc.get_freeze_count() > 0,
            "quiet": any("Transformer Engine and Apex" in str(f[1].pattern)
                         for f in warnings.filters if f[1] is not None),
        }}))
    """)
    assert out == {"loaded": sorted(WORKER_MODULES), "compilers": [],
                   "jit_fuser_deferred": True, "torch_compile_restored": True, "gc": True,
                   "frozen": True, "quiet": True}


def test_the_routers_expert_bias_update_is_not_compiled():
    """megatron's @jit_fuser compiles the router's expert-bias update on its first call (~0.8 s
    of CPU per worker) though without an expert bias it does nothing: the MoE setup hands the
    router the plain function, which behaves the same."""
    import torch

    from varbatch_kit.train.parallel.megatron_import import moe_without_transformer_engine

    moe_without_transformer_engine()
    from megatron.core.transformer.moe.router import TopKRouter

    update = TopKRouter._apply_expert_bias
    assert not hasattr(update, "__wrapped__"), update

    class _Router:
        enable_expert_bias = False

    assert update(_Router(), torch.ones(3, 4, dtype=torch.bool)) is None  # nothing to update
