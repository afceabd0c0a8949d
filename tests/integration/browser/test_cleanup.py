"""The browser suite leaves nothing behind, also when a test fails.

A test that raises in the middle of using a JupyterLab server (with a running
kernel) and a Chromium page must still end with every process the two started
gone and the server's port closed. The session fixtures check the same after
the real tests (see ``conftest.py``).
"""

from __future__ import annotations

import os
import urllib.request

import pytest
from _harness import Browser, LabServer, alive, descendants, lab_root, port_open

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300), pytest.mark.xdist_group("lab")]


class Boom(RuntimeError):
    pass


def test_server_kernel_and_browser_are_gone_after_a_failure(tmp_path):
    before = {p.pid for p in descendants(os.getpid())}
    started: set[int] = set()
    port = None
    with (
        pytest.raises(Boom),
        lab_root(tmp_path) as root,
        LabServer(root, tmp_path) as server,
        Browser(viewport=(800, 600)) as browser,
    ):
        port = server.port
        req = urllib.request.Request(
            f"{server.base_url}/api/kernels", method="POST", data=b"{}",
            headers={"Authorization": f"token {server.token}",
                     "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert resp.status == 201
        page = browser.new_page()
        page.goto(f"{server.base_url}/api/status?token={server.token}")
        started = {p.pid for p in descendants(os.getpid())} - before
        kinds = " ".join(alive(started))
        assert "jupyterlab" in kinds and "ipykernel" in kinds and "chrom" in kinds, kinds
        raise Boom("a test failing while the server, a kernel and the browser run")
    assert started, "nothing was started"
    assert alive(started) == [], "left running after the failure"
    assert not port_open(port), f"port {port} still accepts connections"
