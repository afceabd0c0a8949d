"""Launch training from a notebook or the CLI: ``torchrun`` as a subprocess, reports back.

The caller (a notebook kernel) stays a single process. :func:`run` writes the
rollouts and the config to a job folder, starts torchrun's agent
(``--nproc_per_node=dp*cp*pp*tp/nnodes``; one node: on a free local port; on CPU
forked by the launching process's agent server,
:mod:`~varbatch_kit.train.runs.agent_server`, which imported torch and megatron once,
else ``python -m torch.distributed.run`` in a fresh interpreter), follows the
JSON lines rank 0 writes (one per step) with a tqdm bar, and returns a
:class:`Run` whose ``steps`` table holds them.

Failures never hang and never leave processes behind: when a worker writes
its traceback (``errors/rankN.txt``), torchrun exits non-zero, or the
timeout passes, :mod:`varbatch_kit.train.runs.supervise` kills every worker and
torchrun and raises :class:`TrainingError` with the failing rank's
traceback. Workers die with torchrun, and torchrun with the launcher
(``PR_SET_PDEATHSIG``), so a killed notebook kernel leaves nothing behind;
``step_timeout_s`` stops a run whose steps stop reporting. The finished run
is read back by :mod:`varbatch_kit.train.runs.results`.

Checkpoints and resume (``checkpoint.save_every``, ``run(..., resume=True)``) and
several nodes (``NodesConfig``: ``nnodes``, ``node_rank``, ``rdzv_endpoint``: torchrun's c10d
rendezvous, node 0 hosting its store) are described in docs/checkpoints.md.

:func:`run_many` runs several configurations on the same rollouts and seed;
configurations of the same world size share one torchrun launch (they train one after
the other, each from the same initial weights), which saves the start-up cost of a launch
per configuration. :func:`~varbatch_kit.train.runs.comparison.compare` tabulates such runs
against a reference.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.train.config.train_config import TrainConfig
from varbatch_kit.train.parallel.devices import select_device
from varbatch_kit.train.runs.agent_server import agent_server
from varbatch_kit.train.runs.checkpoint import check_resumable, fingerprint, latest_checkpoint
from varbatch_kit.train.runs.plan import PlannedRun, plan_runs
from varbatch_kit.train.runs.results import Run, load_run
from varbatch_kit.train.runs.step_log import read_records, truncate_to_step
from varbatch_kit.train.runs.supervise import (
    FAILED_RANK_EXIT_DELAY_S,
    TrainingError,
    TrainingTimeout,
    _alive,
    ended_ranks,
    kill_job,
    raise_failure,
    read_new_lines,
    tail,
    worker_pids,
)

__all__ = ["run", "run_many"]

#: torchrun's agent learns that a rank died through a pipe the rank holds and then reaps it;
#: once, in a CI run of the whole suite under load, four ranks died before step 1 and the
#: agent never noticed (the launch hung until timeout_s). So the launcher watches the ranks'
#: processes too: a rank dead and not reaped for UNREAPED_GRACE_S (a zombie: the agent is not
#: watching it), or gone for GONE_GRACE_S (torchrun's own shutdown of the peers takes up to
#: 30 s) while a run is unfinished, fails the launch naming the rank (and its signal).
UNREAPED_GRACE_S = 10.0
GONE_GRACE_S = 45.0


# ----------------------------------------------------------------------------- helpers
def _free_port() -> int:
    """A port torchrun's store can bind, outside the kernel's ephemeral range: a port that the
    kernel hands out (bind to port 0) is free now but may be taken by any outgoing connection
    before torchrun binds it (seen: EADDRINUSE with two launches at once, their gloo
    connections drawing from that range); below it, only another listener can take it."""
    import random

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default range starts here
    ports = list(range(max(1024, low - 20000), low))
    random.SystemRandom().shuffle(ports)
    for port in ports[:200]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # all tried are taken
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-")[:60]


def _package_root() -> str:
    import varbatch_kit

    return str(Path(varbatch_kit.__file__).resolve().parent.parent)


# torchrun started through this (``python -c _DIE_WITH_PARENT LAUNCHER_PID TORCHRUN_ARGS...``):
# it gets SIGKILL when the launcher dies (PR_SET_PDEATHSIG; its workers die with it the same
# way), so nothing outlives a killed notebook kernel. It then runs torchrun's own ``main`` (what
# ``python -m torch.distributed.run`` runs) in this process, imported with the cyclic garbage
# collector paused: 1.5 -> 1.1 s of CPU per launch (the collector otherwise runs over and over
# while torch creates its modules; see megatron_import.py, which does the same for the workers).
# With ``--preload-worker`` first (CPU launches) it imports what a worker imports
# (:func:`varbatch_kit.train.runs.worker.preload`) before torchrun forks the ranks from it.
_DIE_WITH_PARENT = (
    "import ctypes, gc, os, signal, sys\n"
    "try:\n"
    "    ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGKILL)\n"
    "except (OSError, AttributeError):\n"
    "    pass  # not Linux: the launcher's own cleanup only\n"
    "if os.getppid() != int(sys.argv[1]): os._exit(1)  # the launcher is already gone\n"
    "if sys.argv[2] == '--preload-worker':  # CPU: the ranks are forked from this process\n"
    "    del sys.argv[2]\n"
    "    from varbatch_kit.train.runs.worker import preload\n"
    "    preload()\n"
    "gc.disable()\n"
    "from torch.distributed import run as torchrun\n"
    "gc.enable()\n"
    "gc.freeze()\n"
    "sys.argv = ['torchrun'] + sys.argv[2:]\n"
    "torchrun.main()\n"
)


def _rendezvous_args(cfg: TrainConfig, rdzv_id: str) -> list[str]:
    """torchrun's node options: one local node, or the c10d rendezvous of ``nnodes`` nodes."""
    n = cfg.nodes
    if n.nnodes == 1 and n.rdzv_endpoint is None:
        return ["--nnodes=1", "--master_addr=127.0.0.1", f"--master_port={_free_port()}"]
    join = max(1, round(n.rdzv_timeout_s))
    is_host = 1 if n.node_rank == 0 else 0  # node 0 hosts the rendezvous store
    return [f"--nnodes={n.nnodes}", f"--node_rank={n.node_rank}", "--rdzv_backend=c10d",
            f"--rdzv_endpoint={n.rdzv_endpoint}", f"--rdzv_id={rdzv_id}",
            f"--rdzv_conf=join_timeout={join},is_host={is_host}"]


def _progress_mark(out_dirs: list[Path], since_ns: int) -> int:
    """Newest write of a report (meta.json at the start of a run, steps.jsonl per step)."""
    mark = 0
    for out in out_dirs:
        for name in ("meta.json", "steps.jsonl"):
            try:
                t = (out / name).stat().st_mtime_ns
            except OSError:
                continue
            if t >= since_ns:
                mark = max(mark, t)
    return mark


def _finished_but_lingering(job_dir: Path, out_dirs: list[Path], state: dict, now: float,
                            grace_s: float = 15.0) -> bool:
    """True when every run wrote ``done``, no local worker lives, for ``grace_s`` seconds."""
    pids = worker_pids(job_dir)
    if not pids or any(_alive(p) for p in pids) or not all(
            (d / "done").is_file() for d in out_dirs):
        state.pop("since", None)
        return False
    return now - state.setdefault("since", now) > grace_s


def _unreported_exits(job_dir: Path, out_dirs: list[Path], state: dict, now: float
                      ) -> dict[int, int | None]:
    """Ranks dead for longer than torchrun takes to notice (:data:`UNREAPED_GRACE_S` as an
    unreaped zombie, :data:`GONE_GRACE_S` reaped) while a run is unfinished: rank -> exit
    code (None: unknown). Checked once a second; ``state`` keeps when each was first seen
    dead. Empty once every run is done (the ranks then exit on their own)."""
    if now - state.get("checked", -1e9) < 1.0:
        return {}
    state["checked"] = now
    if all((d / "done").is_file() for d in out_dirs):
        return {}
    first = state.setdefault("first", {})
    ended = ended_ranks(job_dir)
    late = {}
    for rank, code in ended.items():
        since = first.setdefault((rank, code is None), now)
        if now - since >= (GONE_GRACE_S if code is None else UNREAPED_GRACE_S):
            late[rank] = code
    return late


def _rank_stacks(job_dir: Path, pids: list[int], *, wait_s: float = 2.0,
                 lines: int = 14) -> str:
    """Where each live rank of a hung job is: every worker is asked for its Python stacks
    (:data:`~varbatch_kit.train.runs.worker.STACKS_SIGNAL`, written to ``JOB_DIR/stacks``);
    returns the innermost ``lines`` lines of each rank's main thread, or "" when none
    answered within ``wait_s``."""
    from varbatch_kit.train.runs.worker import STACKS_SIGNAL

    folder = job_dir / "stacks"
    for pid in pids:
        try:
            os.kill(pid, getattr(signal, STACKS_SIGNAL))
        except OSError:
            pass
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not any(
            f.stat().st_size for f in folder.glob("rank*.txt")):
        time.sleep(0.1)
    time.sleep(0.3)  # the other ranks' dumps
    out = []
    for f in sorted(folder.glob("rank*.txt"), key=lambda f: int(f.stem[4:] or 0)):
        text = f.read_text(errors="replace").strip()
        if not text:
            continue
        # faulthandler: "Thread 0x... (most recent call first):" blocks, the current first
        main = text.split("\n\n")[0].splitlines()
        out.append(f"{f.stem} (most recent call first):\n" + "\n".join(main[1:lines + 1]))
    return ("the ranks' Python stacks when the job was stopped (all in "
            f"{folder}):\n" + "\n".join(out) + "\n") if out else ""


def _ended_message(late: dict[int, int | None]) -> str:
    rank, code = min(late.items())
    if code is None:
        how = "ended"
    elif code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    others = sorted(set(late) - {rank})
    return (f"training worker rank {rank} {how} without a traceback"
            + (f" (also ended: rank {', '.join(map(str, others))})" if others else "")
            + ", and torchrun had not noticed; all workers were stopped")


def _torchrun_failure(cfg: TrainConfig, log_text: str, *, traceback: bool = False
                      ) -> tuple[str, int | None] | None:
    """A clear message for a failure without a worker traceback (rendezvous, killed rank)."""
    if "RendezvousTimeoutError" in log_text or "RendezvousClosedError" in log_text:
        n = cfg.nodes
        return (f"node {n.node_rank}: the rendezvous at {n.rdzv_endpoint} did not complete "
                f"within rdzv_timeout_s={n.rdzv_timeout_s:g} s: not all nnodes={n.nnodes} "
                "nodes joined (start the same command with every --node-rank); all local "
                "processes were stopped", None)
    # torchrun's summary lists every failed rank; one killed by a signal wrote no traceback
    # and is the cause (the others' tracebacks are follow-ups: "Connection closed by peer")
    summary = log_text[log_text.rfind("Failures:"):] if "Failures:" in log_text else log_text
    killed = [(int(r), int(c)) for r, c in re.findall(
        r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)", summary) if int(c) < 0]
    # torchrun stops the other ranks with SIGTERM once one failed; which of them it lists
    # first depends on timing (the machine's load), so a SIGTERM is named only when alone
    killed.sort(key=lambda rc: rc[1] == -signal.SIGTERM)
    if traceback:  # a rank wrote a traceback: a SIGTERM is torchrun stopping the others
        killed = [rc for rc in killed if rc[1] != -signal.SIGTERM]
    if killed:
        rank, code = killed[0]
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return (f"training worker rank {rank} was killed by {name} (exit code {code}) without "
                "a traceback (killed from outside, e.g. by the out-of-memory killer); all "
                "workers were stopped", rank)
    return None


def write_job(job_dir: Path, plans: list[PlannedRun], rollouts: Rollouts, device: str,
              out_dirs: list[Path], *, resume_from: list | None = None,
              fingerprints: list | None = None, feed=None,
              params_refs: list | None = None) -> Path:
    """``job_dir/job.pkl`` for the workers: the configs, their resolved models and the
    steps of their schedules (built once, by :func:`~varbatch_kit.train.runs.plan.plan_runs`);
    ``feed``: the :class:`~varbatch_kit.train.runs.rollout_feed.RolloutFeed` of a job that
    stays up across rollout batches; ``params_refs``: per plan, the folder of the run whose
    saved parameters it compares its own with instead of saving them (or None)."""
    from varbatch_kit.train.runs.worker import Job

    if job_dir.exists():  # pids and errors of an earlier (killed) launch must not count
        shutil.rmtree(job_dir)
    job_dir.mkdir(parents=True, exist_ok=True)
    job = Job([p.config for p in plans], [p.model for p in plans], [p.steps for p in plans],
              [p.log_prob_steps for p in plans], rollouts, [str(d) for d in out_dirs], device,
              resume_from=resume_from, fingerprints=fingerprints, feed=feed,
              params_refs=None if params_refs is None else [
                  None if r is None else str(r) for r in params_refs])
    with open(job_dir / "job.pkl", "wb") as f:
        pickle.dump(job, f)
    return job_dir / "job.pkl"


#: CPU workers: glibc serves every allocation above 32 MiB (a float64 LM head's gradient and
#: logits are hundreds of MiB, every micro-batch) with a fresh ``mmap``, which the kernel
#: zero-fills page by page and ``munmap`` returns; served from the heap and kept there when
#: freed, the next micro-batch reuses them. Measured on a 3-run SmolLM2 float64 launch: 43 s
#: -> 34 s, system time 17 s -> 7 s (benchmarks/worker_malloc.py). A value the user set wins.
CPU_MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}


def _torchrun_command(c0: TrainConfig, job_dir: Path, fingerprints,
                      device: str = "cpu") -> tuple[list[str], dict]:
    """The torchrun command line and its environment, for a launch whose configs share
    ``c0``'s world size and nodes, on ``device``. The workers run
    :mod:`varbatch_kit.train.runs.worker` with ``JOB_DIR``: on CPU forked from the agent after
    :func:`~varbatch_kit.train.runs.worker.preload` (and with :data:`CPU_MALLOC_ENV`), on CUDA
    one ``python -m varbatch_kit.train.runs.worker`` per rank."""
    env = dict(os.environ)
    if device == "cpu":
        for key, value in CPU_MALLOC_ENV.items():
            env.setdefault(key, value)
    env.update(OMP_NUM_THREADS=str(c0.run.threads_per_worker), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [_package_root(),
                                                         env.get("PYTHONPATH")])))
    rdzv_id = hashlib.sha256(json.dumps([fingerprints, c0.nodes.rdzv_endpoint], sort_keys=True,
                                        default=str).encode()).hexdigest()[:16]
    if device == "cpu":  # ranks forked from the agent, which imported their modules once
        from varbatch_kit.train.runs import worker

        preload = ["--preload-worker"]
        entry = ["--start-method=fork", "--run-path", str(Path(worker.__file__).resolve())]
    else:  # CUDA: a fresh interpreter per rank (no CUDA state inherited through fork)
        preload, entry = [], ["-m", "varbatch_kit.train.runs.worker"]
    cmd = [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *preload,
           f"--nproc_per_node={c0.world_size // c0.nodes.nnodes}",
           *_rendezvous_args(c0, rdzv_id),
           "--max_restarts=0", "--monitor_interval=0.2", *entry, str(job_dir)]
    return cmd, env


def warm_agent_server(config: TrainConfig, job_dir: Path, fingerprints, device: str) -> bool:
    """Start (from the calling thread, the main one) the agent server a launch of ``config``
    on ``device`` will use, so that a launch from another thread forks its agent from it
    instead of starting a fresh interpreter (:func:`~varbatch_kit.train.runs.agent_server.
    agent_server`). True when there is one."""
    if device != "cpu":
        return False
    _, env = _torchrun_command(config, job_dir, fingerprints, device)
    return agent_server(env) is not None


def _start_agent(cmd: list[str], env: dict, job_dir: Path, log_path: Path, device: str):
    """Start the launch's torchrun agent: on CPU forked by this process's agent server
    (:mod:`~varbatch_kit.train.runs.agent_server`: torch and megatron imported once, not per
    launch), else (CUDA, ``VARBATCH_KIT_FRESH_AGENTS=1``, a launch from another thread when the
    main thread started no server: :func:`warm_agent_server`) as a fresh interpreter, ``cmd``.
    Either way its own session, its output in ``log_path``."""
    server = agent_server(env) if device == "cpu" else None
    if server is not None:
        log_path.touch()
        argv = cmd[cmd.index("--preload-worker") + 1:]  # torchrun's own arguments
        return server.start(argv, env, str(job_dir), str(log_path), str(job_dir))
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, cwd=str(job_dir))


def _launch(plans: list[PlannedRun], rollouts: Rollouts, device: str, job_dir: Path,
            out_dirs: list[Path], progress: bool, *,
            resume_from: list | None = None, fingerprints: list | None = None,
            done_steps: list[int] | None = None, feed=None, abort=None,
            params_refs: list | None = None) -> float:
    """One torchrun for ``plans`` (same world size); returns its wall time. ``feed``: see
    :func:`write_job`; ``abort``: a ``threading.Event`` that, once set, kills the job (a
    launch in a thread of its own) and raises :class:`TrainingError`."""
    configs = [p.config for p in plans]
    planned = [p.num_steps for p in plans]
    c0 = configs[0]
    write_job(job_dir, plans, rollouts, device, out_dirs, resume_from=resume_from,
              fingerprints=fingerprints, feed=feed, params_refs=params_refs)
    cmd, env = _torchrun_command(c0, job_dir, fingerprints, device)
    timeout = sum(c.run.timeout_s for c in configs) + (
        c0.nodes.rdzv_timeout_s if c0.nodes.nnodes > 1 else 0)
    step_timeout = c0.run.step_timeout_s
    log_path = job_dir / "torchrun.log"
    bar = None
    done_steps = done_steps or [0] * len(configs)
    if progress:
        from tqdm.auto import tqdm

        first = sum(done_steps) if c0.nodes.node_rank == 0 else 0
        bar = tqdm(total=sum(planned), initial=first,
                   desc=c0.name, unit="step", leave=True)
    t0 = time.monotonic()
    since_ns = time.time_ns() - 1_000_000_000
    proc = _start_agent(cmd, env, job_dir, log_path, device)
    # resumed runs: the lines before the checkpoint are not news
    # (node 0 cut the log back before it launched; another node may have looked earlier)
    states: list[dict] = [{"offset": (out / "steps.jsonl").stat().st_size}
                          if n and c0.nodes.node_rank == 0 and (out / "steps.jsonl").is_file()
                          else {}
                          for out, n in zip(out_dirs, done_steps)]
    last_mark, last_progress = 0, None
    linger: dict = {}
    ended: dict = {}

    def follow_reports() -> None:  # the progress bar is fed by the JSON lines rank 0 writes
        for k, (out, st) in enumerate(zip(out_dirs, states)):
            for rec in read_new_lines(out / "steps.jsonl", st):
                if bar is not None:
                    bar.set_description(configs[k].name)
                    bar.set_postfix(loss=f"{rec.get('loss', float('nan')):.4g}",
                                    step=rec.get("step"))
                    bar.update(1)

    try:
        while True:
            follow_reports()
            errors = sorted((job_dir / "errors").glob("rank*.txt"),
                            key=lambda p: p.stat().st_mtime_ns)
            rc = proc.poll()
            if errors or (rc is not None and rc != 0):
                if not errors:  # torchrun failed: give a dying worker a moment to report
                    time.sleep(0.5)
                    errors = sorted((job_dir / "errors").glob("rank*.txt"),
                                    key=lambda p: p.stat().st_mtime_ns)
                else:  # a traceback may follow a peer's death: let torchrun name the cause
                    try:  # (a failing worker exits FAILED_RANK_EXIT_DELAY_S after its report)
                        proc.wait(timeout=FAILED_RANK_EXIT_DELAY_S + 5)
                    except subprocess.TimeoutExpired:
                        pass
                known = _torchrun_failure(c0, tail(log_path, 20000), traceback=bool(errors))
                if known is not None and (not errors or known[1] is not None):
                    after = ("\nthen the other ranks failed, first:\n"
                             + errors[0].read_text(errors="replace")) if errors else ""
                    raise_failure(proc, job_dir, [], log_path,
                                  f"{known[0]}.{after}\ntorchrun log tail:\n{tail(log_path)}",
                                  rank=known[1])
                raise_failure(proc, job_dir, errors, log_path)
            if rc == 0:
                missing = [str(d) for d in out_dirs if not (d / "done").is_file()]
                if missing:
                    raise_failure(proc, job_dir, [], log_path,
                                   f"torchrun exited 0 but runs did not finish: {missing}")
                follow_reports()
                break
            if abort is not None and abort.is_set():
                kill_job(proc, job_dir)
                raise TrainingError("the launch was aborted by its caller; workers killed",
                                    job_dir=job_dir)
            now = time.monotonic()
            late = _unreported_exits(job_dir, out_dirs, ended, now)
            if late:
                raise_failure(proc, job_dir, [], log_path,
                              f"{_ended_message(late)}.\ntorchrun log tail:\n{tail(log_path)}",
                              rank=min(late))
            if c0.nodes.nnodes > 1 and _finished_but_lingering(job_dir, out_dirs, linger, now):
                # every run is done and our workers exited, but torchrun waits in its exit
                # barrier for an agent on another node that is gone: the job is complete
                kill_job(proc, job_dir)
                follow_reports()
                break
            if step_timeout is not None:
                mark = _progress_mark(out_dirs, since_ns)
                if mark != last_mark:
                    last_mark, last_progress = mark, now
            if now - t0 > timeout or (last_progress is not None
                                      and now - last_progress > step_timeout):
                pids = worker_pids(job_dir)
                stacks = _rank_stacks(job_dir, pids)
                kill_job(proc, job_dir)
                what = (f"training timed out after {timeout:.0f} s (timeout_s)"
                        if now - t0 > timeout else
                        f"no step finished within step_timeout_s={step_timeout:g} s of the "
                        "previous report (a rank hangs?)")
                raise TrainingTimeout(
                    f"{what}; workers killed.\n{stacks}torchrun log tail:\n{tail(log_path)}",
                    job_dir=job_dir, worker_pids=pids, torchrun_pid=proc.pid,
                    log_tail=tail(log_path))
            time.sleep(0.1)
    except BaseException:
        kill_job(proc, job_dir)  # also on KeyboardInterrupt in a notebook: no orphans
        raise
    finally:
        if bar is not None:
            bar.close()
    return time.monotonic() - t0


def _run_dir(root: Path, k: int, cfg: TrainConfig, resume: bool) -> Path:
    """``root/runNN-<label>``; on resume the existing ``runNN-*`` (the label may have changed)."""
    if resume:
        found = sorted(p for p in root.glob(f"run{k:02d}-*") if p.is_dir())
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise ValueError(f"cannot resume: several run folders for run {k} in {root}: "
                             f"{[p.name for p in found]}")
    return root / f"run{k:02d}-{_slug(cfg.name)}"


def _prepare_resume(cfg: TrainConfig, out: Path, fp: dict, planned: int
                    ) -> tuple[str | None, int, bool]:
    """(checkpoint to continue from, steps already logged, whether the run is finished).

    Refuses a checkpoint whose fingerprint differs; on node 0 it cuts the step log back
    to the checkpoint's step (later steps are trained again).
    """
    found = latest_checkpoint(out / "checkpoints")
    if found is not None:
        path, meta = found
        check_resumable(meta.get("fingerprint", {}), fp, path)
    if (out / "done").is_file() and len(read_records(out / "steps.jsonl", warn=False)) == planned:
        return None, planned, True
    if found is None:
        if cfg.nodes.node_rank == 0 and out.exists():
            warnings.warn(f"resume: no complete checkpoint in {out}; training from scratch",
                          stacklevel=3)
            for name in ("steps.jsonl", "done", "meta.json"):
                (out / name).unlink(missing_ok=True)
        elif cfg.nodes.node_rank == 0:
            warnings.warn(f"resume: {out} holds no run yet; training from scratch", stacklevel=3)
        return None, 0, False
    step = int(meta["step"])
    kept = step
    if cfg.nodes.node_rank == 0:
        (out / "done").unlink(missing_ok=True)
        kept = truncate_to_step(out / "steps.jsonl", step)
        truncate_to_step(out / "checkpoints.jsonl", step)  # save timings, one per checkpoint
    return str(path), kept, False


# ----------------------------------------------------------------------------- public API
def run_many(configs: Sequence[TrainConfig], rollouts: Rollouts, *, out_dir=None,
             progress: bool = True, resume: bool = False,
             params_against: Sequence[int | None] | None = None) -> list[Run]:
    """Train every configuration on ``rollouts``; one :class:`Run` per configuration, in order.

    Every model is resolved and every schedule built once, here, before any worker starts
    (:func:`~varbatch_kit.train.runs.plan.plan_runs`); the workers receive the steps.
    Configurations with the same world size (dp * cp * pp * tp), device, ``run.threads_per_worker``
    and nodes share one torchrun launch. Run ``k`` lives in ``out_dir/runKK-<label>``.

    ``resume=True`` (needs ``out_dir``) continues every run from the newest complete
    checkpoint in its folder (``checkpoint.save_every``; docs/checkpoints.md): the step log
    is cut back to that step and training goes on from there; a finished run is read back
    as is; a run without a checkpoint starts from scratch (with a warning). A checkpoint
    whose model, optimiser, mode, seed, rollouts, ... differ from the configuration is
    refused (ValueError naming the differences); the layout (dp, cp, packing,
    distribution) may change.

    Several nodes (``nodes.nnodes > 1``): call this with the same arguments on every node
    (only ``nodes.node_rank`` differs); ``out_dir`` must be a folder every node sees (a shared
    filesystem). Rank 0 — wherever the rendezvous put it — writes reports and checkpoints
    there; each node's launcher keeps its torchrun log in ``out_dir/jobG-...-nodeR``.

    ``params_against`` (what ``compare(..., keep_params=False)`` passes): per configuration,
    the index of another whose parameter files it compares its own with, or None. At each
    step of its ``run.save_params_at`` such a run's rank 0 computes ``||p - p_ref||^2`` and
    ``||p_ref||^2`` against that run's file of the step, when it exists already (an earlier
    launch, or earlier in the same one), and records them in its step log (``param_sq_diff``,
    ``param_sq_ref``) instead of writing its own file; otherwise it writes its file.
    """
    configs = list(configs)
    if not configs:
        raise ValueError("configs is empty: pass at least one TrainConfig")
    if not isinstance(rollouts, Rollouts):
        raise ValueError(  # noqa: TRY004 - user errors are ValueError (docs/architecture.md)
            f"rollouts must be a varbatch_kit.Rollouts, got {type(rollouts).__name__}")
    if resume and out_dir is None:
        raise ValueError("resume=True needs out_dir: the folder of the run to continue")
    against = [None] * len(configs) if params_against is None else list(params_against)
    if len(against) != len(configs) or any(
            r is not None and (isinstance(r, bool) or not isinstance(r, int)
                               or not 0 <= r < len(configs) or r == k)
            for k, r in enumerate(against)):
        raise ValueError(f"params_against={params_against!r}: give one entry per configuration "
                         f"({len(configs)}), each None or the index of another configuration")
    plans = plan_runs(configs, rollouts)  # each model resolved, each schedule built: once
    # the device of each run, before any worker starts (ValueError when "cuda" cannot serve
    # the layout; "auto" falls back to the CPU with the reason, in each Run's meta)
    choices = [select_device(c) for c in configs]
    devices = [ch.device for ch in choices]
    root = (Path(out_dir).expanduser().resolve() if out_dir is not None  # workers run in it
            else Path(tempfile.mkdtemp(prefix="varbatch_train_")))
    root.mkdir(parents=True, exist_ok=True)
    out_dirs = [_run_dir(root, k, c, resume) for k, c in enumerate(configs)]
    prints = [fingerprint(p.config, rollouts, p.steps) for p in plans]
    resume_from: list[str | None] = [None] * len(configs)
    done_steps, finished = [0] * len(configs), [False] * len(configs)
    for k, (c, d) in enumerate(zip(configs, out_dirs)):
        if resume:
            resume_from[k], done_steps[k], finished[k] = _prepare_resume(
                c, d, prints[k], plans[k].num_steps)
        elif c.nodes.node_rank == 0 and (d / "steps.jsonl").exists():
            raise ValueError(f"{d} already holds a run; pass a fresh out_dir (or resume=True)")
    groups: dict[tuple, list[int]] = {}
    for k, (c, dev) in enumerate(zip(configs, devices)):
        if not finished[k]:
            key = (c.world_size, dev, c.run.threads_per_worker, c.nodes.nnodes,
                   c.nodes.node_rank, c.nodes.rdzv_endpoint)
            groups.setdefault(key, []).append(k)
    walls = [float("nan")] * len(configs)
    for g, ((world, dev, _, nnodes, node, _), members) in enumerate(groups.items()):
        name = f"job{g}-world{world}-{dev}" + (f"-node{node}" if nnodes > 1 else "")
        wall = _launch([plans[k] for k in members], rollouts, dev, root / name,
                       [out_dirs[k] for k in members], progress,
                       resume_from=[resume_from[k] for k in members],
                       fingerprints=[prints[k] for k in members],
                       done_steps=[done_steps[k] for k in members],
                       params_refs=[None if against[k] is None else out_dirs[against[k]]
                                    for k in members])
        for k in members:
            walls[k] = wall
    runs = [load_run(c, d, w) for c, d, w in zip(configs, out_dirs, walls)]
    for r, ch in zip(runs, choices):
        r.meta["device_choice"] = ch.to_dict()
    return runs


def run(config: TrainConfig, rollouts: Rollouts, *, out_dir=None, progress: bool = True,
        resume: bool = False) -> Run:
    """Train one configuration in ``dp * cp * pp * tp`` torchrun workers; return its reports.

    Raises :class:`TrainingError` (with the failing rank's traceback) when a
    worker fails or ``config.run.timeout_s`` passes; no worker is left running.
    ``resume=True``: continue the run in ``out_dir`` from its newest complete
    checkpoint (see :func:`run_many`).
    """
    return run_many([config], rollouts, out_dir=out_dir, progress=progress, resume=resume)[0]
