"""The torchrun agent server (train/runs/agent_server.py): one import per launching process,
agents that behave as the fresh interpreters they replace (their arguments, environment,
working directory, log, exit status, session), found and stopped by the supervisor.

Real processes throughout: a real server forks real torchrun agents, which run tiny scripts
(the training launches themselves: tests/integration, every CPU launch)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork, /proc")


@pytest.fixture
def server_mod():
    from varbatch_kit.train.runs import agent_server

    yield agent_server
    agent_server.stop_agent_server()


def _env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **extra}


def _torchrun_args(script: Path) -> list[str]:
    from varbatch_kit.train.runs.launch import _free_port

    return ["--nproc_per_node=1", "--nnodes=1", "--master_addr=127.0.0.1",
            f"--master_port={_free_port()}", "--max_restarts=0", "--monitor_interval=0.2",
            "--start-method=fork", "--run-path", str(script)]


def _start(server, tmp_path: Path, argv: list[str], env: dict, name: str = "job"):
    job = tmp_path / name
    job.mkdir()
    log = job / "torchrun.log"
    return server.start(argv, env, str(job), str(log), str(job)), job, log


def test_launches_share_one_server_and_each_agent_reports_its_own_exit(server_mod, tmp_path):
    env = _env()
    server = server_mod.agent_server(env)
    assert server is not None and server.alive()
    # read per launch: the worker's threads, the package's own switches
    assert server_mod.agent_server({**env, "OMP_NUM_THREADS": "3"}) is server
    assert server_mod.agent_server({**env, "VARBATCH_KIT_PRETEND_CUDA": "8"}) is server
    script = tmp_path / "w.py"
    script.write_text("import os, pathlib, sys\n"
                      "pathlib.Path('seen.txt').write_text(os.getcwd() + '|' + "
                      "os.environ['VBK_PROBE'] + '|' + os.environ['RANK'])\n"
                      "print('hello from the rank')\nsys.exit(0)\n")
    ok, job, log = _start(server, tmp_path, _torchrun_args(script), {**env, "VBK_PROBE": "x1"})
    bad, _, bad_log = _start(server, tmp_path, ["--no-such-torchrun-flag"], env, "job2")
    assert ok.pid != bad.pid
    assert ok.wait(timeout=120) == 0
    assert bad.wait(timeout=120) == 2  # argparse's exit status, as a fresh torchrun gives
    assert "usage" in bad_log.read_text()
    # the rank ran in the launch's folder, with the launch's environment; output in its log
    assert (job / "seen.txt").read_text() == f"{job}|x1|0"
    assert "hello from the rank" in log.read_text()
    # the agent recorded itself (pid and start time): the supervisor's way to know it
    pid, start = (job / "pids" / "agent.pid").read_text().split()
    assert int(pid) == ok.pid and start.isdigit()


def test_a_changed_start_environment_or_source_starts_a_new_server(server_mod, monkeypatch):
    env = _env()
    first = server_mod.agent_server(env)
    second = server_mod.agent_server({**env, "MALLOC_ARENA_MAX": "2"})  # read at start
    assert second is not first and not first.alive() and second.alive()
    stamp = server_mod._sources_stamp()
    monkeypatch.setattr(server_mod, "_sources_stamp", lambda: (*stamp, ("edited",)))
    third = server_mod.agent_server({**env, "MALLOC_ARENA_MAX": "2"})
    assert third is not second and third.alive()


def test_fresh_agents_when_asked_or_off_the_main_thread(server_mod):
    assert server_mod.agent_server(_env(VARBATCH_KIT_FRESH_AGENTS="1")) is None

    def from_a_thread(env):
        got = []
        t = threading.Thread(target=lambda: got.append(server_mod.agent_server(env)))
        t.start()
        t.join()
        return got[0]

    # PR_SET_PDEATHSIG follows the thread that started the server: a thread starts none
    assert from_a_thread(_env()) is None
    # ... but uses the one the main thread started, for the same environment only
    server = server_mod.agent_server(_env())
    assert from_a_thread(_env()) is server
    assert from_a_thread(_env(MALLOC_ARENA_MAX="2")) is None  # another start environment
    assert server_mod.agent_server(_env()) is server


def test_a_hanging_agent_times_out_is_found_with_its_rank_and_is_stopped(server_mod, tmp_path):
    """wait(timeout) raises as Popen's does; job_processes finds the agent and the rank it
    forked (neither names the job folder on its command line); kill_job leaves nothing."""
    from varbatch_kit.train.runs.supervise import _alive, job_processes, kill_job

    server = server_mod.agent_server(_env())
    script = tmp_path / "hang.py"
    script.write_text("import time\ntime.sleep(600)\n")
    agent, job, _ = _start(server, tmp_path, _torchrun_args(script), _env())
    with pytest.raises(subprocess.TimeoutExpired):
        agent.wait(timeout=0.2)
    assert agent.poll() is None and agent.returncode is None
    deadline = time.monotonic() + 60
    while len(job_processes(job)) < 2:  # the agent, then the rank it forks
        assert time.monotonic() < deadline, job_processes(job)
        time.sleep(0.1)
    procs = job_processes(job)
    assert agent.pid in procs
    assert os.getpgid(agent.pid) == agent.pid  # its own session, as a Popen'd agent
    kill_job(agent, job)
    assert agent.returncode is not None
    assert not any(_alive(p) for p in procs) and job_processes(job) == []


def test_agents_die_with_the_server(server_mod, tmp_path):
    from varbatch_kit.train.runs.supervise import _alive, job_processes

    server = server_mod.agent_server(_env())
    script = tmp_path / "hang.py"
    script.write_text("import time\ntime.sleep(600)\n")
    agent, job, _ = _start(server, tmp_path, _torchrun_args(script), _env())
    deadline = time.monotonic() + 60
    while len(job_processes(job)) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    procs = job_processes(job)
    server.proc.send_signal(signal.SIGKILL)  # as when the launcher dies
    assert agent.wait(timeout=30) == -signal.SIGKILL
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in procs)
    assert server_mod.agent_server(_env()).alive()  # the next launch gets a new server
