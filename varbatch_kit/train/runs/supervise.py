"""Supervise a torchrun job: find its processes, stop them all, report a failure.

Workers record their pids (and start times) in ``JOB/pids/rankN.pid`` and their
tracebacks in ``JOB/errors/rankN.txt``; a process started fresh names the job folder
on its command line, and an agent forked by the agent server records itself in
``JOB/pids/agent.pid``, so a worker that had not yet written its pid file is found
too (by its command line, or as the recorded agent's descendant). :func:`kill_job`
leaves no process behind; :func:`raise_failure` stops the job and raises
:class:`TrainingError` with the failing rank's traceback.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from varbatch_kit.train.runs.pid_files import process_start_time

#: a worker of a launch of several ranks that failed (its traceback written) waits this long
#: before it exits: on CPU the ranks are forked by torchrun's agent, which then names only the
#: first rank it sees exit; a rank killed by a signal (the cause) exits at once, the peers'
#: tracebacks that follow ("Connection reset by peer") must not exit before it
FAILED_RANK_EXIT_DELAY_S = 1.0

__all__ = ["FAILED_RANK_EXIT_DELAY_S", "TrainingError", "TrainingTimeout", "job_processes",
           "kill_job", "raise_failure", "read_new_lines", "tail", "ended_ranks",
           "worker_pids"]


class TrainingError(RuntimeError):
    """A training launch failed; the message carries the failing rank's traceback.

    Attributes: ``rank`` (failing rank or None), ``worker_error`` (its
    traceback text), ``job_dir``, ``worker_pids``, ``torchrun_pid``, ``log_tail``.
    """

    def __init__(self, message: str, *, rank=None, worker_error="", job_dir=None,
                 worker_pids=(), torchrun_pid=None, log_tail=""):
        super().__init__(message)
        self.rank = rank
        self.worker_error = worker_error
        self.job_dir = job_dir
        self.worker_pids = list(worker_pids)
        self.torchrun_pid = torchrun_pid
        self.log_tail = log_tail


class TrainingTimeout(TrainingError):
    """The launch ran past its timeout (the sum of its configurations' ``run.timeout_s``)."""


def _alive(pid: int) -> bool:
    """True when ``pid`` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False


def _recorded(job_dir: Path) -> dict[int, str]:
    """pid -> start time of the processes the job recorded (``JOB/pids/*.pid``: its ranks and
    a served agent, :mod:`~varbatch_kit.train.runs.agent_server`; an old file: no time)."""
    out = {}
    for p in (job_dir / "pids").glob("*.pid"):
        try:
            pid, *start = p.read_text().split()
            out[int(pid)] = start[0] if start else ""
        except (OSError, ValueError, IndexError):
            pass
    return out


def _is_our_worker(pid: int, job_dir: Path, recorded: dict[int, str] | None = None) -> bool:
    """``pid`` is a process of the job: a fresh interpreter names the job folder on its
    command line; a forked one (an agent of the agent server and its ranks carry the
    server's command line) is the process its pid file recorded, the start time the same
    (``recorded``: :func:`_recorded`, read once by a caller that asks for many pids)."""
    start = (_recorded(job_dir) if recorded is None else recorded).get(pid)
    if start:
        return process_start_time(pid) == start
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return str(job_dir).encode() in f.read().split(b"\0")  # JOB_DIR is an argument
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    except OSError:  # no /proc: trust the pid file
        return _alive(pid)


def worker_pids(job_dir: Path) -> list[int]:
    pids = []
    for p in sorted((job_dir / "pids").glob("rank*.pid")):
        try:
            pids.append(int(p.read_text().split()[0]))
        except (OSError, ValueError, IndexError):
            pass
    return pids


def ended_ranks(job_dir: Path) -> dict[int, int | None]:
    """Ranks whose recorded process (``JOB/pids/rankN.pid``: pid and start time) has ended:
    rank -> its exit code as :attr:`subprocess.Popen.returncode` (negative: the signal) while
    it is a zombie its parent has not reaped, None once it is gone (reaped, or the pid names
    another process now). Linux ``/proc``; elsewhere nothing."""
    recorded = _recorded(job_dir)
    out: dict[int, int | None] = {}
    for p in (job_dir / "pids").glob("rank*.pid"):
        try:
            rank, pid = int(p.stem[4:]), int(p.read_text().split()[0])
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            out[rank] = None
            continue
        except (OSError, ValueError, IndexError):
            continue
        if recorded.get(pid) and fields[19] != recorded[pid]:
            out[rank] = None  # the pid was reused
        elif fields[0] == "Z":
            status = int(fields[49]) if len(fields) > 49 else 0  # waitpid's status (Linux 3.5+)
            out[rank] = os.waitstatus_to_exitcode(status)
    return out


def _children() -> dict[int, list[int]]:
    """ppid -> pids of every live process (Linux ``/proc``)."""
    out: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            with open(entry / "stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        out.setdefault(ppid, []).append(int(entry.name))
    return out


def job_processes(job_dir: Path) -> list[int]:
    """Live processes of the job (Linux): those whose command line names ``job_dir`` (torchrun
    and its workers started fresh), the recorded ones and, under a recorded agent of the
    agent server, every descendant (a rank that had not yet written its pid file)."""
    me, found, recorded = os.getpid(), set(), _recorded(job_dir)
    for entry in Path("/proc").glob("[0-9]*"):
        pid = int(entry.name)
        if pid != me and _is_our_worker(pid, job_dir, recorded) and _alive(pid):
            found.add(pid)
    children, todo = None, [p for p in found if p in recorded]
    while todo:
        children = children if children is not None else _children()
        pid = todo.pop()
        for child in children.get(pid, []):
            if child not in found and _alive(child):
                found.add(child)
                todo.append(child)
    return sorted(found)


def kill_job(proc: subprocess.Popen, job_dir: Path) -> None:
    """SIGKILL every worker (its own session), then stop torchrun so it reaps them."""
    for pid in worker_pids(job_dir):
        if _is_our_worker(pid, job_dir):
            try:
                os.killpg(pid, signal.SIGKILL)  # the worker leads its own session (torchrun)
            except (ProcessLookupError, PermissionError):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)
    # a worker that had not yet written its pid file: by its command line or its agent
    for pid in job_processes(job_dir):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (job_processes(job_dir) or any(
            _alive(p) for p in worker_pids(job_dir))):
        time.sleep(0.05)


def tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def read_new_lines(path: Path, state: dict) -> list[dict]:
    """Complete JSON lines appended to ``path`` since the last call.

    For progress display only: a log that was cut back (a resume on another node) restarts
    from its beginning, and a line that does not parse is skipped.
    """
    if not path.is_file():
        return []
    with open(path, "rb") as f:
        if f.seek(0, os.SEEK_END) < state.get("offset", 0):
            state["offset"] = 0
        f.seek(state.get("offset", 0))
        chunk = f.read()
    end = chunk.rfind(b"\n") + 1
    state["offset"] = state.get("offset", 0) + end
    out = []
    for line in chunk[:end].splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def raise_failure(proc, job_dir: Path, errors: list[Path], log_path: Path,
                   message: str = "", rank: int | None = None) -> None:
    pids = worker_pids(job_dir)
    kill_job(proc, job_dir)
    text = ""
    if errors:
        first = errors[0]
        rank = int(re.search(r"rank(\d+)", first.name).group(1))
        text = first.read_text(errors="replace")
        others = [p.name for p in errors[1:]]
        message = message or (
            f"training worker rank {rank} failed"
            + (f" (later also: {', '.join(others)})" if others else "")
            + f"; all workers were stopped.\n{text}")
    else:
        message = message or (
            f"torchrun exited with status {proc.returncode} and no worker traceback; "
            f"log tail:\n{tail(log_path)}")
    raise TrainingError(message, rank=rank, worker_error=text, job_dir=job_dir,
                        worker_pids=pids, torchrun_pid=proc.pid, log_tail=tail(log_path))
