"""Start a training worker's megatron-core at half the CPU it costs by default.

Every torchrun worker is a new interpreter that imports torch, megatron-core and the engine
before its first step, so a launch pays that once per rank. Measured here (CPU, Python 3.11,
torch 2.13, megatron-core 0.16.1; ``benchmarks/worker_import.py``, ``make bench`` section
``i``): 4.5 s of CPU from a fresh interpreter to a worker's first optimizer step, 2.2 s with
:func:`import_megatron` (each change alone: 3.3 s and 2.8 s). The two changes:

- **``torch.compile`` deferred to the first call.** ``megatron.core.jit`` binds ``jit_fuser =
  torch.compile`` and its fusion modules (``fused_bias_geglu``, ...) decorate their kernels
  with it while they import, which builds ``torch._dynamo`` and ``torch._inductor`` at
  import time, although a CPU run never calls those kernels.
  :func:`deferred_torch_compile` hands megatron a ``torch.compile`` that compiles on the
  first *call* instead, with the same arguments: a kernel that is called is compiled as
  before. (torch's own optimizer still imports ``torch._dynamo`` at its first step.)
- **The cyclic garbage collector paused during the import**, which otherwise runs over and
  over while thousands of modules, classes and functions are created; afterwards
  ``gc.freeze()`` moves them (alive until the process ends) out of the collector's view, so
  later collections, including those of the first step's imports, do not walk them again.

The worker calls :func:`import_megatron` (which first hides megatron's optional-dependency
notices, :mod:`~varbatch_kit.train.parallel.megatron_warnings`) before anything imports
megatron.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
from collections.abc import Callable, Iterator

__all__ = ["WORKER_MODULES", "deferred_torch_compile", "import_megatron", "lazy_compile",
           "moe_without_transformer_engine"]

#: the megatron-core modules a training worker uses (each imports many more)
WORKER_MODULES = (
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.models.gpt",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "megatron.core.optimizer_param_scheduler",
)


def lazy_compile(compile_fn: Callable, model: Callable | None = None, **options):
    """``compile_fn(model, **options)`` deferred to the first call of the result.

    ``lazy_compile(compile_fn, fn)`` wraps ``fn``; ``lazy_compile(compile_fn, **options)``
    returns a decorator, so ``functools.partial(lazy_compile, torch.compile)`` is used as
    ``torch.compile`` is (with or without options).
    The returned function keeps ``model``'s name and docstring; its first call compiles
    ``model`` once with ``options`` and every call runs the compiled function.
    """
    if model is None:
        return functools.partial(lazy_compile, compile_fn, **options)
    compiled: list = []

    @functools.wraps(model)
    def call(*args, **kwargs):
        if not compiled:
            compiled.append(compile_fn(model, **options))
        return compiled[0](*args, **kwargs)

    return call


@contextlib.contextmanager
def deferred_torch_compile() -> Iterator[None]:
    """Within the block, ``torch.compile(fn, ...)`` returns :func:`lazy_compile`'s wrapper
    (the real ``torch.compile`` on first call); restored on exit, also on an error."""
    import torch

    real = torch.compile
    torch.compile = functools.partial(lazy_compile, real)
    try:
        yield
    finally:
        torch.compile = real


def import_megatron(modules: tuple[str, ...] = WORKER_MODULES) -> None:
    """Import ``modules`` (megatron-core's, by default those a worker uses) with
    ``torch.compile`` deferred and the garbage collector paused, then freeze what the import
    made (module docstring). Hides megatron's optional-dependency notices first. Call it in
    a process before anything imports megatron (a module imported earlier keeps what it
    did); calling it again imports nothing new."""
    from varbatch_kit.train.parallel.megatron_warnings import (
        quiet_optional_dependency_warnings,
    )

    quiet_optional_dependency_warnings()
    collecting = gc.isenabled()
    gc.disable()
    try:
        with deferred_torch_compile():
            for name in modules:
                importlib.import_module(name)
    finally:
        if collecting:
            gc.enable()
    gc.freeze()


def moe_without_transformer_engine() -> bool:
    """Make megatron-core's MoE router run without TransformerEngine; True when it had to.
    Also: its expert-bias update runs uncompiled (below).

    megatron-core 0.16.1's ``router_gating_linear`` tests ``te_general_gemm is not None``, a
    name its ``moe_utils`` defines only when TransformerEngine imports: without it every MoE
    forward raises ``NameError`` (on a GPU too). Defined as None here, the router takes its
    own torch path (``torch.matmul`` in the router's dtype)."""
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router import TopKRouter

    # the router's expert-bias update (megatron's @jit_fuser: torch.compile on its first call,
    # ~0.8 s of CPU in every worker) does nothing without an expert bias, which the engine
    # never enables: its plain function, uncompiled
    update = TopKRouter._apply_expert_bias
    TopKRouter._apply_expert_bias = getattr(update, "__wrapped__", update)
    if hasattr(moe_utils, "te_general_gemm"):
        return False
    moe_utils.te_general_gemm = None
    return True
