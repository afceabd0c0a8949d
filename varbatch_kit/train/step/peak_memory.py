"""A rank's peak memory over a training step: CUDA's allocator peak, or live tensor bytes on CPU.

On CUDA the figure is ``torch.cuda.max_memory_allocated`` since the step began
(what the caching allocator handed to tensors; its reserved-but-free blocks
are not counted). The CPU has no allocator statistics, so :class:`LiveTensorBytes`
counts them itself: a ``TorchDispatchMode`` that sees every tensor an op returns
(forward, backward, optimizer and collectives alike, in this thread and in
autograd's), counts each *storage* once (views and ``main_grad`` slices of a
buffer are free) until it is freed, and keeps the most ever live at once. The
tensors that exist before the step (parameters, megatron's gradient buffers,
the optimizer's states and fp32 main parameters) are counted from the start
with :meth:`LiveTensorBytes.track`.

It counts tensor bytes, not process memory: the allocator's fragmentation,
the interpreter and the libraries are outside it (the unit test checks it once
against the process's resident set). It costs a Python call per op, so the
engine runs it only under ``RunConfig.track_memory``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from functools import partial

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["LiveTensorBytes", "memory_watch", "resident_tensors", "step_peak_bytes"]


class LiveTensorBytes(TorchDispatchMode):
    """Live bytes of the tensor storages made under it and of those given to :meth:`track`.

    :attr:`live` is the bytes live now, :attr:`peak` the most live at once since
    the start (or :meth:`reset_peak`).
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._storages = WeakIdKeyDictionary()

    def track(self, *tensors: torch.Tensor) -> None:
        """Count these tensors' storages (once each) from now until they are freed."""
        for t in tensors:  # meta tensors too: their storages have sizes, not data
            try:
                storage = t.untyped_storage()
            except (NotImplementedError, RuntimeError):  # a tensor subclass without storage
                continue
            if storage in self._storages:
                continue
            nbytes = storage.nbytes()
            self._storages[storage] = weakref.ref(storage, partial(self._freed, nbytes))
            self.live += nbytes
            if self.live > self.peak:
                self.peak = self.live

    def reset_peak(self) -> None:
        self.peak = self.live

    def _freed(self, nbytes: int, _ref) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.track(*(t for t in tree_leaves(out) if isinstance(t, torch.Tensor)))
        return out


def resident_tensors(models: Iterable[torch.nn.Module], optimizer) -> Iterator[torch.Tensor]:
    """The tensors a rank holds between steps: the models' parameters, buffers and megatron
    gradient buffers (``main_grad``), the optimizer's parameters (fp32 main copies under
    bf16) and states (Adam's moments), through megatron's chained optimizers, and megatron's
    global memory buffer."""
    for m in models:
        yield from torch.nn.Module.parameters(m)
        yield from torch.nn.Module.buffers(m)  # megatron's DDP names its grad buffers .buffers
        for p in torch.nn.Module.parameters(m):
            g = getattr(p, "main_grad", None)
            if isinstance(g, torch.Tensor):
                yield g
            if p.grad is not None:
                yield p.grad
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_opt = getattr(inner, "optimizer", None)
        if torch_opt is None:
            continue
        for group in torch_opt.param_groups:
            yield from group["params"]
        for state in torch_opt.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))
    # megatron's global memory buffer (sequence parallelism's all-gathers), kept by the
    # process at the largest size any pass asked for
    try:
        from megatron.core import parallel_state

        pool = parallel_state._GLOBAL_MEMORY_BUFFER
    except ImportError:  # pragma: no cover - the engine always has megatron-core
        pool = None
    if pool is not None:
        yield from (t for t in pool.buffer.values() if isinstance(t, torch.Tensor))


class step_peak_bytes:  # noqa: N801 - used as a context manager, named for what it measures
    """``with step_peak_bytes(device, tensors) as m: ...``; then ``m.peak``: the peak bytes
    of the block (CUDA: the allocator's peak; CPU: :class:`LiveTensorBytes`, counting
    ``tensors`` from the start) and ``m.resident``: the bytes live when it began."""

    def __init__(self, device: torch.device, tensors: Iterable[torch.Tensor] = ()) -> None:
        self.device = device
        self._tensors = tensors
        self.peak = self.resident = None
        self._mode: LiveTensorBytes | None = None

    def __enter__(self) -> step_peak_bytes:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.resident = int(torch.cuda.memory_allocated(self.device))
            return self
        self._mode = LiveTensorBytes()
        self._mode.track(*self._tensors)
        self.resident = int(self._mode.live)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = int(torch.cuda.max_memory_allocated(self.device))
            return
        self._mode.__exit__(*exc)
        self.peak = int(self._mode.peak)


class memory_watch:  # noqa: N801 - a context manager
    """The engine's per-step watch: :class:`step_peak_bytes` over this rank's models and
    optimizer when the device is CUDA or ``track_cpu`` is set, else nothing.
    :meth:`gathered` (a collective of every rank, after the block) returns
    ``{"peak_memory_bytes": [...], "resident_memory_bytes": [...]}`` per world rank, or
    ``{}`` when not watched."""

    def __init__(self, device: torch.device, track_cpu: bool, models, optimizer) -> None:
        self.on = device.type == "cuda" or bool(track_cpu)
        self.device = device
        self._watch = (step_peak_bytes(device, resident_tensors(models, optimizer))
                       if self.on else None)

    def __enter__(self) -> memory_watch:
        if self._watch is not None:
            self._watch.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._watch is not None:
            self._watch.__exit__(*exc)

    def gathered(self) -> dict:
        if not self.on:
            return {}
        import torch.distributed as dist

        mine = torch.tensor([self._watch.peak, self._watch.resident], dtype=torch.int64,
                            device=self.device)
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        return {"peak_memory_bytes": [int(t[0]) for t in every],
                "resident_memory_bytes": [int(t[1]) for t in every]}
