"""Real gloo process groups for unit tests: ``size`` forked processes, one per rank.

Forked, not spawned (:func:`_spawn.run_ranks`): no new interpreter and no imports per rank,
a few hundred ms a group, for workers that only need what the test process imported;
results come back through a queue, not files."""

from __future__ import annotations

import multiprocessing as mp

from _spawn import free_port


def run_forked_group(worker, size: int, *args, timeout_s: float = 60) -> dict:
    """Run ``worker(rank, size, port, queue, *args)`` in ``size`` forked processes (``port``: a
    free local port for ``MASTER_PORT``); each puts ``(rank, result)`` on ``queue``. Returns
    ``{rank: result}`` after every process exited 0."""
    port = free_port()
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, size, port, queue, *args)) for r in range(size)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=timeout_s) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return got
