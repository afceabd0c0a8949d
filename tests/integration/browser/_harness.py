"""Start JupyterLab and headless Chromium for the browser tests, and always stop them.

Everything here is plain context managers so that the pytest fixtures (and the
test that checks the cleanup itself) share one implementation:

- :func:`lab_root` copies ``notebooks/`` into a temporary directory (tests never
  write outputs into the working tree) and links the other top-level entries
  the notebooks may read (``data/``) next to it.
- :class:`LabServer` runs ``python -m jupyterlab`` on 127.0.0.1, a free port,
  a random token and temporary config / runtime / data / settings directories,
  in its own process group; :meth:`LabServer.stop` asks the server to shut
  down (which shuts its kernels down), then terminates and finally kills every
  process it started.
- :class:`Browser` launches Debian's Chromium through Playwright with the
  flags this machine needs and closes it the same way.

The kernel imports ``varbatch_kit`` from the tree these tests live in
(``PYTHONPATH`` is set to it), so running the suite from a scratch worktree
tests that worktree, not the editable install.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
from _paths import NOTEBOOKS_DIR
from _paths import REPO as _REPO

REPO = _REPO
CHROMIUM = os.environ.get("VARBATCH_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-dev-shm-usage",  # containers often give /dev/shm only 64 MB
]
START_TIMEOUT_S = 120.0
TIMINGS: dict[str, float] = {}  # seconds per phase, printed at the end of the run

# Settings that keep JupyterLab quiet and the tree clean: no news or update
# prompts over the page, no autosave, no "select kernel" dialog.
USER_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false", "checkForUpdates": False, "doNotDisturbMode": True,
    },
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {
        "windowingMode": "none", "autoStartDefaultKernel": True,
    },
}


def chromium_missing_reason() -> str | None:
    """Why the browser tests cannot run here, or ``None`` when they can."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError as exc:  # pragma: no cover - playwright is a dev dependency
        return f"playwright is not installed ({exc}); `make test` installs the dev extras"
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        who = "root" if os.geteuid() == 0 else f"uid {os.geteuid()}, not root"
        return (f"Chromium not found at {CHROMIUM} (running as {who}); `make test` installs it "
                "with `apt-get install -y chromium` when run as root "
                "(see build/chromium-install.log), or set VARBATCH_CHROMIUM to a Chromium binary")
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def kill_all(procs: list[psutil.Process], grace_s: float = 5.0) -> None:
    """``terminate`` then, after ``grace_s``, ``kill`` whatever is still alive."""
    alive = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            p.terminate()
            alive.append(p)
    _, alive = psutil.wait_procs(alive, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            p.kill()
    psutil.wait_procs(alive, timeout=grace_s)


def kill_pids(pids) -> None:
    """:func:`kill_all` on the processes of ``pids`` that still exist."""
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(pid))
    kill_all(procs)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: the server gets SIGTERM if the pytest process dies without cleaning up."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@contextlib.contextmanager
def lab_root(tmp: Path, notebooks: Path = NOTEBOOKS_DIR):
    """A server root holding a copy of ``notebooks`` and links to the rest of the repo."""
    root = tmp / "root"
    root.mkdir(parents=True)
    shutil.copytree(notebooks, root / "notebooks",
                    ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    for entry in REPO.iterdir():
        if entry.name in {"notebooks", "build", ".git", ".venv"} or entry.name.startswith("."):
            continue
        (root / entry.name).symlink_to(entry)
    yield root


class LabServer:
    """A JupyterLab server in its own process group and temporary directories."""

    def __init__(self, root: Path, tmp: Path):
        self.root = root
        self.tmp = tmp
        self.token = secrets.token_hex(24)
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.log_path = tmp / "jupyterlab.log"
        self.pids: set[int] = set()

    # ------------------------------------------------------------ start
    def _env(self) -> dict[str, str]:
        dirs = {name: self.tmp / name for name in ("config", "runtime", "data", "ipython")}
        for d in dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        settings = dirs["config"] / "lab" / "user-settings"
        for rel, value in USER_SETTINGS.items():
            path = settings / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(value))
        # extensions the tests do not use stay off (faster start, fewer processes)
        (dirs["config"] / "jupyter_server_config.json").write_text(json.dumps({
            "ServerApp": {"jpserver_extensions": {"jupyter_lsp": False,
                                                  "jupyter_server_terminals": False}},
        }))
        env = dict(os.environ)
        for key in ("JUPYTER_PATH", "JUPYTER_CONFIG_PATH", "JUPYTERLAB_DIR"):
            env.pop(key, None)
        env.update(
            JUPYTER_CONFIG_DIR=str(dirs["config"]),
            JUPYTER_RUNTIME_DIR=str(dirs["runtime"]),
            # user data dir only: labextensions and the python3 kernelspec live in
            # the environment's share/jupyter, which stays on the search path
            JUPYTER_DATA_DIR=str(dirs["data"]),
            JUPYTERLAB_SETTINGS_DIR=str(settings),
            JUPYTERLAB_WORKSPACES_DIR=str(dirs["config"] / "lab" / "workspaces"),
            IPYTHONDIR=str(dirs["ipython"]),
            PYTHONPATH=os.pathsep.join([str(REPO)] + (
                [env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])),
            PYTHONUNBUFFERED="1",
            MPLBACKEND="Agg",
        )
        return env

    def _argv(self) -> list[str]:
        return [
            sys.executable, "-m", "jupyterlab",
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={self.port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.root}",
            "--ServerApp.allow_root=True",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LabApp.news_url=",
            "--LabApp.expose_app_in_browser=True",
            # safety net should every cleanup path fail: idle kernels are culled,
            # then the idle server exits by itself
            "--MappingKernelManager.cull_idle_timeout=600",
            "--MappingKernelManager.cull_interval=60",
            "--ServerApp.shutdown_no_activity_timeout=900",
        ]

    def start(self) -> LabServer:
        env = self._env()
        last_error = ""
        for _attempt in range(3):  # a free port can be taken between probe and bind
            self.port = free_port()
            with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
                # preexec_fn only calls prctl; Popen runs before the suite starts any thread
                self.proc = subprocess.Popen(
                    self._argv(), cwd=self.root, env=env, stdin=subprocess.DEVNULL,
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                    preexec_fn=_die_with_parent if sys.platform == "linux" else None,  # noqa: PLW1509
                )
            self.pids.add(self.proc.pid)
            try:
                self._wait_ready()
                return self
            except RuntimeError as exc:
                last_error = str(exc)
                self.stop()
        raise RuntimeError(f"JupyterLab did not start: {last_error}")

    def _request(self, method: str, path: str, timeout: float = 10.0) -> int:
        req = urllib.request.Request(
            f"{self.base_url}{path}", method=method,
            headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if self._request("GET", "/api/status", timeout=2.0) == 200:
                    return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.25)
        raise RuntimeError(f"no answer on port {self.port} after {START_TIMEOUT_S:.0f} s:\n"
                           f"{self.log_tail()}")

    # ------------------------------------------------------------ use
    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def lab_url(self, path: str) -> str:
        """The JupyterLab URL opening ``path`` (relative to the root) in a fresh workspace."""
        return f"{self.base_url}/lab/tree/{path}?reset&token={self.token}"

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def remember_children(self) -> None:
        """Record the server's descendants (kernels) so :meth:`stop` can reap them."""
        if self.proc is not None:
            self.pids.update(p.pid for p in descendants(self.proc.pid))

    # ------------------------------------------------------------ stop
    def stop(self) -> None:
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        self.pids.update(p.pid for p in descendants(proc.pid))
        if proc.poll() is None:
            with contextlib.suppress(Exception):
                self._request("POST", "/api/shutdown", timeout=5.0)  # kernels too
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=5)
        kill_pids(self.pids)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class Browser:
    """Headless Chromium through Playwright; :meth:`close` reaps the driver and browser."""

    def __init__(self, viewport=(1280, 900)):
        self.viewport = {"width": viewport[0], "height": viewport[1]}
        self._pw = None
        self.browser = None
        self.context = None
        self.pids: set[int] = set()

    def start(self) -> Browser:
        from playwright.sync_api import sync_playwright

        before = {p.pid for p in descendants(os.getpid())}
        try:
            self._pw = sync_playwright().start()
            self.browser = self._pw.chromium.launch(
                executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True,
                timeout=START_TIMEOUT_S * 1000)
            self.context = self.browser.new_context(viewport=self.viewport,
                                                    device_scale_factor=1)
            self.context.set_default_timeout(START_TIMEOUT_S * 1000)
        finally:
            self.pids = {p.pid for p in descendants(os.getpid())} - before
        return self

    def new_page(self):
        return self.context.new_page()

    def close(self) -> None:
        self.pids.update(p.pid for p in descendants(os.getpid()) if p.pid in self.pids
                         or _is_browser_process(p))
        for step in (lambda: self.context and self.context.close(),
                     lambda: self.browser and self.browser.close(),
                     lambda: self._pw and self._pw.stop()):
            with contextlib.suppress(Exception):
                step()
        self.context = self.browser = self._pw = None
        kill_pids(self.pids)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def _is_browser_process(p: psutil.Process) -> bool:
    try:
        name = " ".join(p.cmdline()[:2])
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
    return "chrom" in name or "playwright" in name or "node" in name


def alive(pids: set[int]) -> list[str]:
    """Descriptions of the processes among ``pids`` that still run (zombies excluded)."""
    out = []
    for pid in sorted(pids):
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{pid} {' '.join(p.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return out
