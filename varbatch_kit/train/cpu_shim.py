"""Run megatron-core on a CPU-only machine: the one place that redirects its CUDA calls.

megatron-core assumes CUDA in a few hard-coded spots that the training path
of :mod:`varbatch_kit.train` goes through:

- ``torch.cuda.current_device()`` as an allocation device (global memory
  buffer, DDP grad buffers, optimizer scalars),
- ``device="cuda"`` literals (token counters in the pipeline schedule,
  scalars in the optimizer and the grad-norm code),
- the ``param.grad.type() == 'torch.cuda.FloatTensor'`` assertion in
  gradient clipping,
- ``torch.cuda.synchronize()`` after the pipeline's p2p exchanges (a no-op here).

The shim does **not** touch the global ``torch`` module. Instead it gives each
listed megatron-core module its own view of ``torch`` (:class:`_TorchOnCpu`)
in which ``torch.cuda.current_device()`` is the CPU device and tensor
factories map a CUDA device argument to the CPU; every other attribute is the
real ``torch``. Gradient clipping is redirected to an equivalent CPU function
in the one namespace that calls it. The CUDA RNG tracker is avoided by
seeding with ``model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)``
(a no-op tracker: the tiny model uses no dropout), done by the training loop,
not here.

:func:`activate` does nothing when CUDA is available (real GPUs use the real
code paths); :func:`patched` lists what it changed; :func:`deactivate`
restores it. Tests check that exactly :data:`PATCHED_MODULES` and
:data:`PATCHED_FUNCTIONS` are touched and that the global ``torch`` is not.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "PATCHED_FUNCTIONS",
    "PATCHED_MODULES",
    "activate",
    "active",
    "deactivate",
    "needed",
    "patched",
]

# megatron-core modules whose module-level name ``torch`` is replaced by the CPU view.
PATCHED_MODULES: tuple[str, ...] = (
    "megatron.core.utils",  # GlobalMemoryBuffer: torch.cuda.current_device()
    "megatron.core.pipeline_parallel.schedules",  # total_num_tokens on device="cuda"
    "megatron.core.distributed.param_and_grad_buffer",  # grad buffers on current_device()
    "megatron.core.optimizer.optimizer",  # found_inf / scale scalars on device="cuda"
    "megatron.core.optimizer.clip_grads",  # grad-norm scratch tensors on device="cuda"
    # pipeline p2p: shape / receive buffers on current_device(), torch.cuda.synchronize()
    "megatron.core.pipeline_parallel.p2p_communication",
)

# (module, function name) -> replacement factory; the function is replaced in that module only.
PATCHED_FUNCTIONS: tuple[tuple[str, str], ...] = (
    # asserts param.grad.type() == 'torch.cuda.FloatTensor'
    ("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32"),
)

_FACTORIES = frozenset({
    "empty", "zeros", "ones", "full", "tensor", "arange", "as_tensor", "randn", "rand",
})

_saved: dict[tuple[str, str], Any] = {}


def _to_cpu_device(device: Any) -> Any:
    """A CUDA device spec (``"cuda"``, ``"cuda:0"``, ``0``, ``torch.device("cuda")``) → CPU."""
    if isinstance(device, bool):
        return device
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _factory_on_cpu(fn: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    wrapper.__name__ = getattr(fn, "__name__", "factory")
    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


class _CudaOnCpu:
    """``torch.cuda`` as seen by a patched module: the current device is the CPU."""

    def current_device(self) -> torch.device:
        return torch.device("cpu")

    def synchronize(self, device: Any = None) -> None:
        """Nothing to wait for: CPU ops (and gloo's p2p, once waited on) are synchronous."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchOnCpu:
    """``torch`` as seen by a patched module; everything else is the real module."""

    def __init__(self) -> None:
        self.cuda = _CudaOnCpu()
        self._factories = {name: _factory_on_cpu(getattr(torch, name)) for name in _FACTORIES}

    def __getattr__(self, name: str) -> Any:
        factories = self.__dict__.get("_factories", {})
        if name in factories:
            return factories[name]
        return getattr(torch, name)

    def __repr__(self) -> str:
        return "<torch as seen by megatron-core on CPU (varbatch_kit.train.cpu_shim)>"


def _clip_grad_by_total_norm_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """megatron-core's ``clip_grad_by_total_norm_fp32`` without its CUDA-type assertion."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    for g in grads:
        if g.dtype != torch.float32:
            raise AssertionError(f"gradient clipping expects float32 gradients, got {g.dtype}")
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


_REPLACEMENTS: dict[str, Callable] = {
    "clip_grad_by_total_norm_fp32": _clip_grad_by_total_norm_cpu,
}


def needed() -> bool:
    """True when the shim is required: no CUDA device is available."""
    return not torch.cuda.is_available()


def active() -> bool:
    return bool(_saved)


def activate() -> bool:
    """Redirect megatron-core's CUDA calls to the CPU; no-op (returns False) under CUDA.

    Idempotent. Returns True when the shim is (now) active.
    """
    if not needed():
        return False
    if _saved:
        return True
    view = _TorchOnCpu()
    for name in PATCHED_MODULES:
        mod = importlib.import_module(name)
        _saved[(name, "torch")] = mod.torch
        mod.torch = view
    for name, fn in PATCHED_FUNCTIONS:
        mod = importlib.import_module(name)
        _saved[(name, fn)] = getattr(mod, fn)
        setattr(mod, fn, _REPLACEMENTS[fn])
    return True


def deactivate() -> None:
    """Undo :func:`activate` (restores every saved attribute)."""
    for (name, attr), value in list(_saved.items()):
        setattr(importlib.import_module(name), attr, value)
    _saved.clear()


def patched() -> list[tuple[str, str]]:
    """``(module, attribute)`` pairs currently replaced by the shim."""
    return sorted(_saved)
