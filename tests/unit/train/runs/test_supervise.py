"""The launcher's own watch over the ranks' processes (supervise.ended_ranks, launch's
unreported-exit check): a dead rank torchrun does not reap is named, with its signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from varbatch_kit.train.runs import launch
from varbatch_kit.train.runs.pid_files import process_start_time
from varbatch_kit.train.runs.supervise import ended_ranks

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")


def _record(job_dir, rank: int, pid: int) -> None:
    (job_dir / "pids").mkdir(parents=True, exist_ok=True)
    (job_dir / "pids" / f"rank{rank}.pid").write_text(f"{pid} {process_start_time(pid)}")


def _wait_zombie(pid: int) -> None:
    for _ in range(500):
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return
        time.sleep(0.01)
    raise AssertionError("the child did not end")


def test_ended_ranks_reads_a_zombies_signal_and_forgets_nothing(tmp_path):
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    exited = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    try:
        for rank, p in enumerate((alive, dead, exited)):
            _record(tmp_path, rank, p.pid)
        os.kill(dead.pid, signal.SIGKILL)
        _wait_zombie(dead.pid)
        _wait_zombie(exited.pid)
        # unreaped: their exit status, as Popen would give it; the live rank is not listed
        assert ended_ranks(tmp_path) == {1: -signal.SIGKILL, 2: 3}
        dead.wait()  # reaped: gone, status unknown to us
        assert ended_ranks(tmp_path) == {1: None, 2: 3}
        # a pid file whose pid now names another process (start time differs): gone
        (tmp_path / "pids" / "rank0.pid").write_text(f"{alive.pid} 1")
        assert ended_ranks(tmp_path)[0] is None
    finally:
        for p in (alive, dead, exited):
            p.kill()
            p.wait()


def test_a_dead_rank_torchrun_did_not_notice_fails_the_launch_after_the_grace(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _record(tmp_path, 5, dead.pid)
        os.kill(dead.pid, signal.SIGKILL)
        _wait_zombie(dead.pid)
        state: dict = {}
        assert launch._unreported_exits(tmp_path, [out], state, now=100.0) == {}  # first seen
        assert launch._unreported_exits(tmp_path, [out], state, now=100.5) == {}  # once a second
        late_at = 100.0 + launch.UNREAPED_GRACE_S
        assert launch._unreported_exits(tmp_path, [out], state, now=late_at) == {
            5: -signal.SIGKILL}
        message = launch._ended_message({5: -signal.SIGKILL, 7: None})
        assert message.startswith("training worker rank 5 was killed by SIGKILL (exit code -9) "
                                  "without a traceback (also ended: rank 7)")
        # every run finished: ranks exit on their own, nothing to report
        (out / "done").write_text("ok\n")
        assert launch._unreported_exits(tmp_path, [out], {}, now=1e6) == {}
        dead.wait()  # reaped, as torchrun does when it noticed: only after the long grace
        (out / "done").unlink()
        state = {}
        assert launch._unreported_exits(tmp_path, [out], state, now=0.0) == {}
        assert launch._unreported_exits(tmp_path, [out], state, now=launch.UNREAPED_GRACE_S
                                        + 1) == {}
        assert launch._unreported_exits(tmp_path, [out], state,
                                        now=launch.GONE_GRACE_S) == {5: None}
    finally:
        dead.kill()
        dead.wait()
