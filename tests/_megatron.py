"""torch.distributed (gloo, world size 1) and megatron-core's parallel state in the test process.

For tests that build and run megatron-core models without torchrun: the
training package's own :func:`varbatch_kit.train.parallel.process_setup.single_process`
(a free port, the worker's ``setup_process``, and everything undone
afterwards: process group, parallel state, CPU shim, torch threads,
environment), with CUDA when present and the test process's thread count.
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def single_process_megatron(device: str | None = None):
    """Yield the torch device megatron-core runs on (CUDA when present unless ``device``)."""
    from varbatch_kit.train.parallel.process_setup import single_process

    with single_process(device or ("cuda" if torch.cuda.is_available() else "cpu"),
                        threads=torch.get_num_threads()) as dev:
        yield dev
