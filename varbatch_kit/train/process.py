"""A worker's process setup: torch.distributed and megatron-core's parallel state.

:func:`setup_process` for a torchrun worker (:mod:`.loop`); :func:`single_process`
for work outside torchrun (calibration, tests): a one-process group, torn down after.
megatron-core is initialised with tensor = pipeline = context parallel size 1,
so its data-parallel group is the whole dp * cp world (see :mod:`.step`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket

import torch
import torch.distributed as dist

__all__ = ["die_with_parent", "setup_process", "single_process"]


def die_with_parent() -> None:
    """Linux: get SIGKILL when the parent (torchrun) dies, so no worker outlives it."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def setup_process(device: str, threads: int = 1) -> torch.device:
    """torch.distributed + megatron-core parallel state for this worker.

    CUDA + NCCL when ``device == "cuda"``; ``"cpu"``: CPU + gloo with the CPU shim,
    whatever the host has (the run's device decides, never ``torch.cuda.is_available()``).
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: give the run's resolved device, 'cpu' or 'cuda'")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local_rank)
        dev, backend = torch.device("cuda", local_rank), "nccl"
    else:
        from varbatch_kit.train import cpu_shim

        cpu_shim.activate("cpu")
        torch.set_num_threads(threads)
        dev, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, rank=rank, world_size=world)
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        # tp = pp = cp = 1: megatron's data-parallel group spans all dp * cp ranks
        parallel_state.initialize_model_parallel(1, 1)
    return dev


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

    from varbatch_kit.train import cpu_shim

    saved_threads = torch.get_num_threads()
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
        if dist.is_initialized():
            dist.destroy_process_group()
        if device == "cpu":
            cpu_shim.deactivate()
        torch.set_num_threads(saved_threads)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
