"""Real multi-process tests: spawn gloo ranks, wait with a deadline, read what each wrote.

A worker function ``fn(rank, world, port, out_dir, *extra)`` (torch.multiprocessing's
signature: the rank first) writes ``out_dir/rank{r}.pt``; :func:`run_ranks` starts
``world`` of them with a free port, fails the test when they do not finish within
``timeout_s`` (killing only the processes it started) and returns the files' contents.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(fn, world: int, out_dir, *extra, timeout_s: float = 120) -> list[dict]:
    """Spawn ``world`` ranks of ``fn(rank, world, port, str(out_dir), *extra)``; their results."""
    ctx = mp.start_processes(fn, args=(world, free_port(), str(out_dir), *extra), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                pytest.fail(f"{world} gloo workers did not finish within {timeout_s} s")
    finally:
        for p in ctx.processes:  # only the processes this test started
            if p.is_alive():
                p.kill()
                p.join(5)
    return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world)]
