"""The package works when installed as a wheel, from a directory outside the checkout.

Builds the wheel, installs it into a fresh virtual environment (torch 2.13.0
first, the CPU build pip takes from its cache or local index, then the wheel
with its dependencies) and, from an empty temporary directory: reads the
version, loads a model preset and a bundled trace, schedules the trace
through the CLI, copies the notebooks out and runs one of them through the
demo into a directory the test names.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from _paths import REPO

import varbatch_kit

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]


def _run(cmd, cwd, timeout=900, env=None):
    res = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True,
                         timeout=timeout, env=env)
    assert res.returncode == 0, f"{cmd} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
    return res.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
          "-w", out, REPO], cwd=out)
    (whl,) = out.glob("varbatch_kit-*.whl")
    return whl


def test_wheel_carries_data_and_notebooks(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert f"varbatch_kit-{varbatch_kit.__version__}.dist-info/METADATA" in names
    for needed in ("varbatch_kit/data/models/qwen3-8b.json",
                   "varbatch_kit/data/traces/agentic.jsonl",
                   "varbatch_kit/data/traces/traces.json",
                   "varbatch_kit/data/timing/cpu_toy_calibration.json",
                   "varbatch_kit/notebooks/01_packing_explorer.ipynb",
                   "varbatch_kit/notebooks/04_metric_report_invariance.ipynb",
                   "varbatch_kit/notebooks/05_dynamic_cp.ipynb",
                   "varbatch_kit/py.typed"):
        assert needed in names, needed
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "scripts/"))]


def _clean_env(venv: Path) -> dict:
    """The environment of a user of ``venv``: no PYTHONPATH, the venv's bin first on PATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("venv")
    _run([sys.executable, "-m", "venv", root / "v"], cwd=root)
    py, env = root / "v" / "bin" / "python", _clean_env(root / "v")
    _run([py, "-m", "pip", "install", "-q", "torch==2.13.0"], cwd=root, timeout=1200, env=env)
    _run([py, "-m", "pip", "install", "-q", wheel], cwd=root, timeout=1200, env=env)
    return root / "v"


def test_installed_wheel_works_outside_the_checkout(venv, tmp_path):
    py, env = venv / "bin" / "python", _clean_env(venv)
    probe = (
        "import json, varbatch_kit\n"
        "from varbatch_kit import ModelShape, available_presets\n"
        "from varbatch_kit.io import bundled_traces, read_trace\n"
        "r = read_trace(bundled_traces()['agentic'])\n"
        "print(json.dumps({'file': varbatch_kit.__file__, 'version': varbatch_kit.__version__,"
        " 'layers': ModelShape.preset('qwen3-8b').num_layers, 'presets': available_presets(),"
        " 'traces': sorted(bundled_traces()), 'samples': len(r)}))\n"
    )
    got = json.loads(_run([py, "-c", probe], cwd=tmp_path, env=env))
    assert str(REPO) not in got["file"] and "site-packages" in got["file"]
    assert got["version"] == varbatch_kit.__version__
    assert got["layers"] == 36
    assert "qwen3-8b" in got["presets"] and got["traces"] == ["agentic", "long_context", "math"]
    assert got["samples"] == 7178

    exe = venv / "bin" / "varbatch-kit"
    assert _run([exe, "--version"], cwd=tmp_path, env=env).strip() == \
        f"varbatch-kit {varbatch_kit.__version__}"
    table = _run([exe, "schedule", "agentic", "--dp", "16", "--global-batch-size", "512",
                  "--max-tokens-per-gpu", "16384"], cwd=tmp_path, env=env)
    assert "first_fit" in table and "flops_kk" in table

    copied = _run([exe, "notebooks", tmp_path / "nb"], cwd=tmp_path, env=env).split()
    assert len(copied) == 5 and all(Path(p).is_file() for p in copied)

    out = tmp_path / "demo_out"
    _run([py, "-m", "varbatch_kit.demo", "--notebooks", "01", "--out", out, "--no-progress"],
         cwd=tmp_path, env=env, timeout=900)
    assert (out / "01_packing_explorer.html").stat().st_size > 10_000
    assert not (tmp_path / "build").exists()  # wrote where it was told, nowhere else
