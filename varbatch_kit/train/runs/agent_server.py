"""A process that imports torch, megatron-core and the worker once, then forks one torchrun
agent per CPU launch.

A fresh torchrun agent spends about 3 s of CPU importing torch, megatron-core and the
worker's modules before it forks its ranks (measured on the 2-core CI machine: 2.8 s user,
0.3 s system), and a notebook or the test suite makes dozens of launches. The *agent server*
pays that once per launching process: started on the first CPU launch, it imports what a
worker imports (:func:`~varbatch_kit.train.runs.worker.preload`) and torchrun, then waits
for requests on its stdin. For each it forks a child that becomes the launch's torchrun
agent: its own session, its working directory and environment set to the launch's, its
output to the launch's log, then torchrun's ``main`` with the launch's arguments (ranks
forked from it, ``--start-method=fork``, as before). Nothing else changes for the launch.

**Nothing outlives the launcher.** The server gets SIGKILL when the launcher's thread that
started it ends (``PR_SET_PDEATHSIG``; it is started from the main thread only, so that is
the launcher's death), each agent when the server dies, each rank when its agent dies (set
in the rank's first instruction after the fork, ``os.register_at_fork``), so a killed
notebook kernel leaves nothing behind. The server exits when the launcher closes its stdin.

**Never stale.** The server is keyed by what it fixed when it started: the interpreter, the
environment a process reads at start (glibc's ``MALLOC_*``, ``PYTHONPATH``, ...; all of it
but ``OMP_NUM_THREADS``, which each worker sets itself through ``torch.set_num_threads``, and
the package's own ``VARBATCH_KIT_*`` switches, each read where it is used) and the package's
sources (their paths and modification times). When any of them changed, the
next launch starts a new server.

**Identity.** A forked agent and its ranks carry the server's command line, not the job
folder's, so the agent records ``JOB/pids/agent.pid`` (pid and start time, as the ranks do)
and :mod:`~varbatch_kit.train.runs.supervise` finds a job's processes from those files.

The protocol (one line each): the launcher writes a JSON request ``{"argv", "env", "cwd",
"log", "job_dir"}``; the server answers ``started PID``, and ``exit PID CODE`` when that agent
ends (``CODE`` as :attr:`subprocess.Popen.returncode`: negative for a signal).
:class:`ServedAgent` is the launcher's handle, with :class:`subprocess.Popen`'s ``pid``,
``poll``, ``wait`` and ``returncode``.

``VARBATCH_KIT_FRESH_AGENTS=1`` starts every agent as a fresh interpreter, as before
(``benchmarks/launch_overhead.py`` compares the two).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from varbatch_kit.train.runs.pid_files import write_pid_file

__all__ = ["FRESH_AGENTS_ENV", "AgentServer", "ServedAgent", "agent_server", "serve",
           "stop_agent_server"]

#: set to 1: every CPU launch starts its agent as a fresh interpreter (no server)
FRESH_AGENTS_ENV = "VARBATCH_KIT_FRESH_AGENTS"
#: how long a starting server may take to import everything (a loaded machine: several times
#: the 3 s it takes idle)
START_TIMEOUT_S = 300.0
#: read per launch, never at import, so no reason for a new server: the worker's threads (each
#: worker calls torch.set_num_threads) and the package's own switches (each read where used)
_PER_LAUNCH_ENV = ("OMP_NUM_THREADS",)
_PER_LAUNCH_PREFIX = "VARBATCH_KIT_"


def _die_with_parent() -> None:
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the launcher's own cleanup only


# ----------------------------------------------------------------------------- the server
def serve(launcher_pid: int) -> None:
    """The server's main (``python -c '...serve(LAUNCHER_PID)'``): import, then fork agents."""
    import gc

    _die_with_parent()
    if os.getppid() != launcher_pid:
        os._exit(1)  # the launcher is already gone
    from varbatch_kit.train.runs.worker import preload

    preload()
    gc.disable()
    from torch.distributed import run as torchrun

    gc.enable()
    gc.freeze()
    requests = os.fdopen(0, "rb")
    reply = os.dup(1)  # the protocol's pipe; a stray print goes to stderr, never into it
    os.dup2(2, 1)
    me = os.getpid()

    def reap(*_) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            os.write(reply, f"exit {pid} {os.waitstatus_to_exitcode(status)}\n".encode())

    signal.signal(signal.SIGCHLD, reap)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher's Ctrl-C is the launcher's
    os.write(reply, b"ready\n")
    for line in requests:  # EOF: the launcher closed the pipe (it exits), and so do we
        request = json.loads(line)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        pid = os.fork()
        if pid == 0:
            _run_agent(request, torchrun, me, reply)  # never returns
        os.write(reply, f"started {pid}\n".encode())
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
    os._exit(0)


def _run_agent(request: dict, torchrun, server_pid: int, reply: int) -> None:
    """In the forked child: become the launch's torchrun agent, then exit with its status."""
    import io
    import traceback

    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        os.setsid()  # the launcher stops the agent's process group, as a Popen'd one
        _die_with_parent()
        if os.getppid() != server_pid:
            os._exit(1)
        os.close(reply)
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        sys.stdin = open(os.devnull)  # noqa: SIM115 (the process's own stdin, for its lifetime)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True,
                                      line_buffering=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                      line_buffering=True, errors="backslashreplace")
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        write_pid_file(Path(request["job_dir"]) / "pids" / "agent.pid")
        # every rank torchrun forks dies with this agent from its first instruction on
        os.register_at_fork(after_in_child=_die_with_parent)
        sys.argv = ["torchrun", *request["argv"]]
        try:
            torchrun.main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 (reported in the launch's log, then the exit code)
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


_SERVE = ("import sys\nfrom varbatch_kit.train.runs.agent_server import serve\n"
          "serve(int(sys.argv[1]))\n")


# ----------------------------------------------------------------------------- the client
class ServedAgent:
    """A launch's torchrun agent, forked by the server: :class:`subprocess.Popen`'s ``pid``,
    ``returncode``, ``poll()`` and ``wait(timeout)``."""

    def __init__(self, server: AgentServer, pid: int):
        self._server, self.pid, self.args = server, pid, ["torchrun (agent server)"]

    @property
    def returncode(self) -> int | None:
        return self._server.exit_codes.get(self.pid)

    def poll(self) -> int | None:
        self._server.collect()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._server.collect(wait=0.05 if left is None else min(0.05, left))
        return self.returncode


class AgentServer:
    """The launcher's side of one server process (module docstring)."""

    def __init__(self, env: dict, key: tuple):
        self.key, self.exit_codes, self.agents = key, {}, []
        self.owner = os.getpid()  # a forked copy of the launcher must not talk to it
        self._lock = threading.RLock()
        self._buf = b""
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVE, str(os.getpid())], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._stderr, env=env, cwd=tempfile.gettempdir(),
            start_new_session=True)
        os.set_blocking(self.proc.stdout.fileno(), False)
        lines = self._read_lines(START_TIMEOUT_S, until=lambda ls: b"ready" in ls)
        if b"ready" not in lines:
            self.close()
            raise RuntimeError("the torchrun agent server did not start (set "
                               f"{FRESH_AGENTS_ENV}=1 to start agents without it); its "
                               f"output:\n{self.stderr_tail()}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stderr_tail(self, n: int = 4000) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-n:]

    def _read_lines(self, timeout: float, until) -> list[bytes]:
        """Lines the server wrote, waiting up to ``timeout`` s until ``until(lines)``."""
        fd, out = self.proc.stdout.fileno(), []
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left > 0 and not select.select([fd], [], [], left)[0]:
                continue
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                chunk = None
            if chunk == b"":  # the server is gone
                out += self._split(b"\n")
                return out
            if chunk:
                out += self._split(chunk)
            if until(out) or left <= 0:
                return out

    def _split(self, chunk: bytes) -> list[bytes]:
        self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        return [ln for ln in lines if ln]

    def _note(self, lines: list[bytes]) -> list[int]:
        started = []
        for ln in lines:
            word, *rest = ln.split()
            if word == b"exit":
                self.exit_codes[int(rest[0])] = int(rest[1])
            elif word == b"started":
                started.append(int(rest[0]))
        return started

    def collect(self, wait: float = 0.0) -> None:
        """Read the server's exit notices (waiting up to ``wait`` s for one); once the server
        is gone, every agent it had is gone too (SIGKILL, ``PR_SET_PDEATHSIG``)."""
        with self._lock:
            lines = self._read_lines(wait, until=lambda ls: True)
            self._note(lines)
            if not self.alive():
                for pid in self.agents:
                    self.exit_codes.setdefault(pid, -signal.SIGKILL)

    def pending(self) -> list[int]:
        """Agents forked here that have not exited yet (as far as the server told)."""
        self.collect()
        return [p for p in self.agents if p not in self.exit_codes]

    def start(self, argv: list[str], env: dict, cwd: str, log: str, job_dir: str
              ) -> ServedAgent:
        """Fork a torchrun agent for one launch; its output is appended to ``log``."""
        with self._lock:
            request = json.dumps(dict(argv=argv, env=env, cwd=cwd, log=log, job_dir=job_dir))
            self.proc.stdin.write(request.encode() + b"\n")
            self.proc.stdin.flush()
            lines = self._read_lines(START_TIMEOUT_S,
                                     until=lambda ls: any(ln.startswith(b"started") for ln in ls))
            started = self._note(lines)
            if not started:
                raise RuntimeError("the torchrun agent server did not fork an agent; its "
                                   f"output:\n{self.stderr_tail()}")
            self.agents.append(started[0])
            return ServedAgent(self, started[0])

    def close(self) -> None:
        """Close the server's stdin (it exits; an agent still running dies with it)."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self._stderr.close()


_server: AgentServer | None = None
_server_lock = threading.Lock()


def _sources_stamp() -> tuple:
    """The package's source files, with their sizes and modification times."""
    import varbatch_kit

    root = Path(varbatch_kit.__file__).resolve().parent
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for name in filenames:
            if name.endswith(".py"):
                st = os.stat(os.path.join(dirpath, name))
                out.append((dirpath, name, st.st_mtime_ns, st.st_size))
    return tuple(sorted(out))


def agent_server(env: dict) -> AgentServer | None:
    """The server for launches with environment ``env`` (started, or restarted when what it
    fixed at its start changed); None where agents start fresh: ``VARBATCH_KIT_FRESH_AGENTS=1``,
    or no ``fork`` (not Linux). A launch from a thread other than the main thread uses the
    server the main thread started for the same environment (the RL loop's trainer,
    :mod:`~varbatch_kit.train.runs.loop_trainer`, has it started first) and never starts
    one: the server's death signal follows the thread that started it."""
    global _server
    if (env.get(FRESH_AGENTS_ENV, "").strip() not in ("", "0") or not hasattr(os, "fork")
            or not sys.platform.startswith("linux")):
        return None
    start_env = {k: v for k, v in env.items() if k not in _PER_LAUNCH_ENV}
    key = (sys.executable, _sources_stamp(), tuple(sorted(
        (k, v) for k, v in start_env.items() if not k.startswith(_PER_LAUNCH_PREFIX))))
    with _server_lock:
        if _server is not None and _server.owner != os.getpid():
            _server = None  # this process is a fork of the launcher: the server is its parent's
        if threading.current_thread() is not threading.main_thread():
            usable = _server is not None and _server.key == key and _server.alive()
            return _server if usable else None
        if _server is not None and (_server.key != key or not _server.alive()):
            if _server.alive() and _server.pending():
                return None  # another launch still runs on it: this one starts fresh
            _server.close()
            _server = None
        if _server is None:
            _server = AgentServer({**start_env, "OMP_NUM_THREADS": "1"}, key)
        return _server


def stop_agent_server() -> None:
    """Stop this process's server, if any (the next CPU launch starts a new one)."""
    global _server
    with _server_lock:
        if _server is not None and _server.owner == os.getpid():
            _server.close()
        _server = None


atexit.register(stop_agent_server)
