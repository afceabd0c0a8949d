"""A worker's process setup: torch.distributed and megatron-core's parallel state.

:func:`setup_process` for a torchrun worker (:mod:`~varbatch_kit.train.runs.worker`);
:func:`single_process`
for work outside torchrun (calibration, tests): a one-process group, torn down after.
megatron-core is initialised with the run's tensor- and pipeline-parallel sizes
and context-parallel size 1 (:class:`~varbatch_kit.train.config.parallel_layout.ParallelLayout`):
its data-parallel group at a ``(tp, pp)`` coordinate is the whole dp * cp pool,
where the engine forms its own CP groups (see :mod:`~varbatch_kit.train.step.train_step`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket

import torch
import torch.distributed as dist

__all__ = ["cpu_numerics", "die_with_parent", "setup_process", "single_process", "use_layout"]


def die_with_parent() -> None:
    """Linux: get SIGKILL when the parent (torchrun) dies, so no worker outlives it."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def cpu_numerics(threads: int) -> None:
    """A CPU worker's arithmetic: ``threads`` torch threads, and subnormal floats flushed to
    zero (``torch.set_flush_denormal``). After the first optimizer step a float32 model's
    softmax over a large vocabulary holds probabilities below float32's smallest normal
    (1.2e-38), and x86 arithmetic on subnormals runs in microcode, tens of times slower:
    SmolLM2's second step took 24.8 s against 3.2 s for the first (backward 8-13 s per
    micro-batch against 0.5 s), 3.1 s with them flushed. Values that small change no
    result above 1e-38. (The setting is the CPU's; CUDA kernels are untouched.)"""
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)


def _flushing_subnormals() -> bool:
    """Whether this process flushes subnormal floats to zero (torch has no getter)."""
    return bool((torch.tensor([1e-39], dtype=torch.float32) * 1.0)[0] == 0)


def setup_process(device: str, threads: int = 1, layout=None) -> torch.device:
    """torch.distributed + megatron-core parallel state for this worker.

    CUDA + NCCL when ``device == "cuda"``; ``"cpu"``: CPU + gloo with the CPU shim,
    whatever the host has (the run's device decides, never ``torch.cuda.is_available()``).
    ``layout`` (a :class:`~varbatch_kit.train.config.parallel_layout.ParallelLayout`, default all
    1):
    megatron's tensor, pipeline and virtual-pipeline sizes.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: give the run's resolved device, 'cpu' or 'cuda'")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local_rank)
        dev, backend = torch.device("cuda", local_rank), "nccl"
    else:
        from varbatch_kit.train.parallel import cpu_shim

        cpu_shim.activate("cpu")
        cpu_numerics(threads)
        dev, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, rank=rank, world_size=world)
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        use_layout(layout)
    return dev


_current: list = [None]  # the (tp, pp, vpp, ep) megatron's parallel state was initialised with


def use_layout(layout=None) -> None:
    """(Re)initialise megatron-core's parallel state for ``layout`` (None: all sizes 1).

    Runs of one launch share the world size but not always the layout (``tp2`` and
    ``pp2`` both need 2 ranks): every rank calls this before each run, and the state is
    rebuilt only when the sizes change. megatron's context-parallel size stays 1: its
    data-parallel group at a ``(tp, pp)`` coordinate spans the dp * cp pool; its expert-
    parallel groups (``layout.ep``) are consecutive ranks of that pool.
    """
    from megatron.core import parallel_state

    sizes = (1, 1, 1, 1) if layout is None else (layout.tp, layout.pp, layout.vpp, layout.ep)
    if parallel_state.model_parallel_is_initialized():
        if _current[0] == sizes:
            return
        parallel_state.destroy_model_parallel()
    tp, pp, vpp, ep = sizes
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        expert_model_parallel_size=ep)
    _current[0] = sizes


@contextlib.contextmanager
def single_process(device: str, threads: int = 1):
    """Yield the torch device of a one-process torch.distributed group with megatron-core's
    parallel state (for work outside torchrun: calibration, tests); torn down afterwards.

    If a group already exists it is reused (and left alone); ``threads`` CPU threads.
    ``device``: ``"cpu"`` or ``"cuda"``, the only thing the CPU/CUDA decision is taken from.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: give 'cpu' or 'cuda'")
    from megatron.core import parallel_state

    from varbatch_kit.train.parallel import cpu_shim

    saved_threads = torch.get_num_threads()
    saved_flush = _flushing_subnormals()
    if dist.is_initialized():
        if device == "cpu":
            torch.set_num_threads(threads)
        try:
            yield torch.device("cuda", torch.cuda.current_device()) if device == "cuda" \
                else torch.device("cpu")
        finally:
            torch.set_num_threads(saved_threads)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield setup_process(device, threads=threads)
    finally:
        parallel_state.destroy_model_parallel()
        _current[0] = None
        if dist.is_initialized():
            dist.destroy_process_group()
        if device == "cpu":
            cpu_shim.deactivate()
        torch.set_num_threads(saved_threads)
        torch.set_flush_denormal(saved_flush)  # the caller's process keeps its arithmetic
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
