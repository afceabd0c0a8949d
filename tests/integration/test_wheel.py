"""The package works when installed as a wheel, from a directory outside the checkout.

Builds the wheel and installs it into a fresh virtual environment: torch
2.13.0 first (the CPU build pip takes from its cache or local index), then
the bare wheel, no extras. From an empty temporary directory the scheduler
works (a bundled trace, a model preset, ``varbatch-kit schedule``) and a
shell without its extra says which one to install. Then the same environment
gets the extras ``[ui,train]``: the version, a preset and a bundled trace, the
notebooks copied out, and one of them run through the demo into a directory
the test names. (One environment for both, so torch is installed once; the
bare tests come first in this file and the full install only adds to it.)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from _paths import REPO

import varbatch_kit

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

#: pip's install options here: ``--no-compile`` skips byte-compiling every installed module
#: (torch's alone: 19.8 s against 6.4 s of CPU on this machine); the modules the tests import
#: are compiled when imported, as for any user whose site-packages is writable
PIP_INSTALL = ("-q", "--no-compile")


def _run(cmd, cwd, timeout=900, env=None):
    res = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True,
                         timeout=timeout, env=env)
    assert res.returncode == 0, f"{cmd} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
    return res.stdout


def _clean_source(dest: Path) -> Path:
    """The checkout's tracked files (as they are in the working tree) copied to ``dest``: what
    a fresh clone builds. Built in place, setuptools' ``build/lib`` of an earlier build would
    add files since removed or renamed (it never deletes): a wheel of seven notebooks shipped
    eleven, four of them under their old names. Outside a git checkout: the tree itself."""
    if not (REPO / ".git").exists():
        return REPO
    names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for name in filter(None, names):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    src = _clean_source(tmp_path_factory.mktemp("source"))
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
          "-w", out, src], cwd=out)
    (whl,) = out.glob("varbatch_kit-*.whl")
    return whl


def test_wheel_carries_data_and_notebooks(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert f"varbatch_kit-{varbatch_kit.__version__}.dist-info/METADATA" in names
    for needed in ("varbatch_kit/data/models/qwen3-8b.json",
                   "varbatch_kit/data/traces/agentic.jsonl",
                   "varbatch_kit/data/traces/traces.json",
                   "varbatch_kit/data/timing/cpu_toy_calibration.json",
                   "varbatch_kit/data/runs/slime_debug/rollout_8.pt",
                   "varbatch_kit/data/runs/rl_loop_smollm2_cpu.json",
                   "varbatch_kit/notebooks/01_packing_explorer.ipynb",
                   "varbatch_kit/notebooks/06_metric_report_invariance.ipynb",
                   "varbatch_kit/notebooks/03_dynamic_cp.ipynb",
                   "varbatch_kit/notebooks/04_tune_slime_flags.ipynb",
                   "varbatch_kit/notebooks/07_rl_loop.ipynb",
                   "varbatch_kit/py.typed"):
        assert needed in names, needed
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "scripts/"))]
    for gone in ("io", "viz", "widgets", "quality", "simulate", "sweeps", "demo", "optimal"):
        assert f"varbatch_kit/{gone}.py" not in names, gone


def _requires(wheel: Path) -> tuple[set[str], dict[str, set[str]]]:
    """The wheel's runtime requirements (names) and, per extra, the extra's."""
    meta = zipfile.ZipFile(wheel).read(
        f"varbatch_kit-{varbatch_kit.__version__}.dist-info/METADATA").decode()
    bare, extras = set(), {}
    for line in meta.splitlines():
        if not line.startswith("Requires-Dist: "):
            continue
        req = line.removeprefix("Requires-Dist: ")
        name = req.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0]
        name = name.split("!")[0].split("~")[0].strip().lower()
        if "extra ==" in req:
            extras.setdefault(req.split("extra ==")[1].strip().strip("'\""), set()).add(name)
        else:
            bare.add(name)
    return bare, extras


def test_wheel_requires_only_the_core_and_offers_the_extras(wheel):
    bare, extras = _requires(wheel)
    assert bare == {"numpy", "pandas", "torch", "tqdm"}
    assert {"plotly", "ipywidgets", "jupyterlab", "nbclient", "nbconvert"} <= \
        extras["ui"] and "anywidget" not in extras["ui"]
    assert {"megatron-core", "transformers", "safetensors", "tokenizers", "accelerate",
            "gguf"} <= extras["train"]
    assert extras["parquet"] == {"pyarrow"}
    assert {"pytest", "pytest-timeout", "nbval", "hypothesis", "ruff", "ortools",
            "playwright"} <= extras["dev"]
    assert "model" not in extras


def _clean_env(venv: Path) -> dict:
    """The environment of a user of ``venv``: no PYTHONPATH, the venv's bin first on PATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh environment with torch 2.13.0 and the bare wheel (no extras)."""
    root = tmp_path_factory.mktemp("venv")
    _run([sys.executable, "-m", "venv", root / "v"], cwd=root)
    py, env = root / "v" / "bin" / "python", _clean_env(root / "v")
    _run([py, "-m", "pip", "install", *PIP_INSTALL, "torch==2.13.0"], cwd=root, timeout=1200,
         env=env)
    _run([py, "-m", "pip", "install", *PIP_INSTALL, wheel], cwd=root, timeout=1200, env=env)
    return root / "v"


@pytest.fixture(scope="module")
def full_venv(venv, wheel) -> Path:
    """The same environment with the extras the notebooks and the demo need."""
    py, env = venv / "bin" / "python", _clean_env(venv)
    _run([py, "-m", "pip", "install", *PIP_INSTALL, f"{wheel}[ui,train]"], cwd=venv, timeout=1500,
         env=env)
    return venv


def test_bare_install_schedules_and_names_the_missing_extras(venv, tmp_path):
    py, env = venv / "bin" / "python", _clean_env(venv)
    probe = (
        "import importlib.util, json, sys\n"
        "from varbatch_kit import (ModelShape, ScheduleConfig, build_schedule, bundled_traces,\n"
        "                          read_trace)\n"
        "r = read_trace(bundled_traces()['agentic'])\n"
        "cfg = ScheduleConfig(dp=16, global_batch_size=512, max_tokens_per_gpu=16384,\n"
        "                     distribution='flops_kk')\n"
        "s = build_schedule(r, cfg, ModelShape.preset('qwen3-8b')).check()\n"
        "errors = {}\n"
        "for m in ('varbatch_kit.ui.viz', 'varbatch_kit.train', 'varbatch_kit.viz'):\n"
        "    try:\n"
        "        __import__(m)\n"
        "    except ImportError as e:\n"
        "        errors[m] = [type(e).__name__, str(e)]\n"
        "print(json.dumps({'samples': len(r), 'steps': len(s.steps),\n"
        "  'flops': float(s.stats()['flops'].sum()), 'errors': errors,\n"
        "  'installed': sorted(m for m in ('plotly', 'ipywidgets', 'megatron', 'pyarrow')\n"
        "                      if importlib.util.find_spec(m))}))\n"
    )
    got = json.loads(_run([py, "-c", probe], cwd=tmp_path, env=env))
    assert got["samples"] == 7178 and got["steps"] == 4 and got["flops"] > 0
    assert got["installed"] == []
    assert got["errors"]["varbatch_kit.ui.viz"] == [
        "MissingExtraError", "varbatch_kit.ui needs the [ui] extra: pip install "
        "'varbatch_kit[ui]' (missing: plotly, ipywidgets)"]
    assert got["errors"]["varbatch_kit.train"][1].startswith(
        "varbatch_kit.train needs the [train] extra: pip install 'varbatch_kit[train]'")
    assert got["errors"]["varbatch_kit.viz"][0] == "ModuleNotFoundError"  # no alias any more

    exe = venv / "bin" / "varbatch-kit"
    assert _run([exe, "--version"], cwd=tmp_path, env=env).strip() == \
        f"varbatch-kit {varbatch_kit.__version__}"
    table = _run([exe, "schedule", "agentic", "--dp", "16", "--global-batch-size", "512",
                  "--max-tokens-per-gpu", "16384"], cwd=tmp_path, env=env)
    assert "first_fit" in table and "flops_kk" in table
    res = subprocess.run([exe, "demo", "--out", tmp_path / "d"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "pip install 'varbatch_kit[ui]'" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # wrote nothing


def test_installed_wheel_works_outside_the_checkout(full_venv, tmp_path):
    venv = full_venv
    py, env = venv / "bin" / "python", _clean_env(venv)
    probe = (
        "import json, varbatch_kit\n"
        "from varbatch_kit import ModelShape, available_presets, bundled_traces, read_trace\n"
        "from varbatch_kit.ui import viz\n"
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
    copied = _run([exe, "notebooks", tmp_path / "nb"], cwd=tmp_path, env=env).split()
    assert len(copied) == 7 and all(Path(p).is_file() for p in copied)

    assert "--notebooks" in _run([exe, "demo", "--help"], cwd=tmp_path, env=env)
    out = tmp_path / "demo_out"
    _run([py, "-m", "varbatch_kit.cli.demo", "--notebooks", "01", "--out", out,
          "--no-progress"], cwd=tmp_path, env=env, timeout=900)
    assert (out / "01_packing_explorer.html").stat().st_size > 10_000
    assert not (tmp_path / "build").exists()  # wrote where it was told, nowhere else
