"""A job's pid files: ``PID STARTTIME`` of each process that records itself.

The ranks write ``JOB/pids/rankN.pid``, and an agent forked by the agent server
(:mod:`~varbatch_kit.train.runs.agent_server`) writes ``JOB/pids/agent.pid``. The start time
(clock ticks since boot, ``/proc/PID/stat`` field 22) names the process together with the
pid: a pid is reused, the pair is not. :mod:`~varbatch_kit.train.runs.supervise` reads them.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["process_start_time", "write_pid_file"]


def process_start_time(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot; None when the process is
    gone or there is no ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def write_pid_file(path: Path) -> None:
    """``PID STARTTIME`` of this process to ``path``."""
    pid = os.getpid()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{pid} {process_start_time(pid) or ''}".strip())
