"""torch.distributed (gloo, world size 1) and megatron-core's parallel state in the test process.

For tests that build and run megatron-core models without torchrun: a
context manager that sets the rendezvous variables on a free port, calls the
training worker's own ``setup_process`` and undoes everything afterwards
(process group, parallel state, CPU shim, torch threads, environment).
"""

from __future__ import annotations

import contextlib
import os
import socket

import torch


@contextlib.contextmanager
def single_process_megatron(device: str | None = None):
    """Yield the torch device megatron-core runs on (CUDA when present unless ``device``)."""
    from megatron.core import parallel_state

    from varbatch_kit.train import cpu_shim
    from varbatch_kit.train.loop import setup_process

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    threads = torch.get_num_threads()
    try:
        yield setup_process(device or ("cuda" if torch.cuda.is_available() else "cpu"),
                            threads=threads)
    finally:
        parallel_state.destroy_model_parallel()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        cpu_shim.deactivate()
        torch.set_num_threads(threads)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
