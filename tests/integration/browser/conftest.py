"""Fixtures of the browser tests: one JupyterLab server and one headless Chromium per session.

Both are started lazily by the first browser test and stopped in the fixture
finalizers, whatever the tests did (the finalizers run on failures and
errors too). Without Chromium (or Playwright) every test here is skipped with
the reason; ``make test`` installs Chromium first when it runs as root.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from _harness import (
    REPO,
    TIMINGS,
    Browser,
    LabServer,
    alive,
    chromium_missing_reason,
    lab_root,
    port_open,
)

SCREENSHOTS = REPO / "build" / "screenshots"


def pytest_terminal_summary(terminalreporter):
    if TIMINGS:
        terminalreporter.write_line(
            "browser suite: " + ", ".join(f"{k} {v:.1f} s" for k, v in TIMINGS.items()))


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    reason = None
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.browser)
            if reason is None:
                reason = chromium_missing_reason() or ""
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def lab_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("jupyterlab")
    t0 = time.monotonic()
    with lab_root(tmp) as root, LabServer(root, tmp) as server:
        TIMINGS["JupyterLab start"] = time.monotonic() - t0
        yield server
        server.remember_children()
    # stopped (also after failures): nothing of it may survive
    assert alive(server.pids) == [], "JupyterLab processes left running"
    assert not port_open(server.port), f"port {server.port} still open"


@pytest.fixture(scope="session")
def browser():
    with Browser(viewport=(1280, 1000)) as b:
        yield b
    assert alive(b.pids) == [], "Chromium / Playwright processes left running"


@pytest.fixture(scope="session")
def screenshots_dir():
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    return SCREENSHOTS
