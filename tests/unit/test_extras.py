"""Optional extras: without its library a shell says which extra to install; the core works.

Each test runs a fresh interpreter whose ``sys.meta_path`` starts with a finder
that refuses the libraries of an extra (as if they were not installed), so the
real import machinery and our real modules run; nothing of ours is mocked.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap

import pytest
from _paths import REPO

pytestmark = pytest.mark.timeout(300)

UI_LIBS = ("plotly", "ipywidgets", "nbclient", "nbconvert")
TRAIN_LIBS = ("megatron", "transformers")

#: a meta-path finder refusing the top-level packages in BLOCKED (first in sys.meta_path)
BLOCKER = textwrap.dedent("""\
    import sys

    class _Missing:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _Missing())
""")


def _python(code: str, blocked: tuple[str, ...], cwd=None) -> subprocess.CompletedProcess:
    src = f"BLOCKED = {set(blocked)!r}\n" + BLOCKER + textwrap.dedent(code)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", src], capture_output=True, text=True,
                          timeout=240, cwd=cwd, env=env)


def test_the_blocker_blocks():
    res = _python("import plotly\n", ("plotly",))
    assert res.returncode == 1 and "No module named 'plotly'" in res.stderr


@pytest.mark.parametrize("module", ["varbatch_kit.ui.viz", "varbatch_kit.ui.widgets",
                                    "varbatch_kit.ui.figures.schedule", "varbatch_kit.ui"])
def test_ui_without_its_extra_names_the_extra(module):
    res = _python(f"""
        try:
            import {module}
        except ImportError as e:
            print(type(e).__name__, "|", e)
        """, ("plotly",))
    assert res.returncode == 0, res.stderr
    kind, message = res.stdout.strip().split(" | ")
    assert kind == "MissingExtraError"
    assert message == ("varbatch_kit.ui needs the [ui] extra: pip install 'varbatch_kit[ui]' "
                       "(missing: plotly)")


def test_ui_names_every_missing_library_and_is_an_import_error():
    res = _python("""
        import varbatch_kit._extras as x
        try:
            import varbatch_kit.ui.viz
        except ImportError as e:
            print(isinstance(e, x.MissingExtraError), e.name, "|", e)
        """, ("plotly", "ipywidgets"))
    assert res.stdout.strip() == (
        "True plotly | varbatch_kit.ui needs the [ui] extra: pip install 'varbatch_kit[ui]' "
        "(missing: plotly, ipywidgets)")


def _extra(name: str) -> set[str]:
    """The distribution names an extra of pyproject.toml lists."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].strip().lower()
            for req in project["optional-dependencies"][name]}


def _imported_by_the_package() -> set[str]:
    """Top-level names of everything the package's modules import (also inside functions)."""
    names = set()
    for path in (REPO / "varbatch_kit").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
    return names


def test_the_ui_extra_lists_only_libraries_the_package_uses():
    """Every [ui] library is imported somewhere in the package, except JupyterLab (the app the
    notebooks open in); the explorers show figures in an ipywidgets Output, not an anywidget,
    so anywidget is not in the extra. UI_LIBS above are the extra's imported libraries."""
    ui = _extra("ui")
    assert "anywidget" not in ui
    used = _imported_by_the_package()
    assert ui - {"jupyterlab"} <= used, sorted(ui - {"jupyterlab"} - used)
    assert "anywidget" not in used
    assert set(UI_LIBS) <= ui


def test_train_without_megatron_names_the_train_extra():
    res = _python("""
        try:
            from varbatch_kit.train import TrainConfig
        except ImportError as e:
            print(e)
        """, ("megatron",))
    assert res.stdout.strip() == ("varbatch_kit.train needs the [train] extra: "
                                  "pip install 'varbatch_kit[train]' (missing: megatron.core)")


def test_the_core_works_without_any_extra(tmp_path):
    """Scheduler, traces, reports, simulator and slime compat with every shell library absent."""
    res = _python("""
        import sys
        import varbatch_kit as vk
        from varbatch_kit.compat.slime import to_slime
        from varbatch_kit.report import get_report_mode
        r = vk.read_trace(vk.bundled_traces()["agentic"])
        cfg = vk.ScheduleConfig(dp=16, global_batch_size=512, max_tokens_per_gpu=16384,
                                distribution="flops_kk")
        s = vk.build_schedule(r, cfg, vk.ModelShape.preset("qwen3-8b")).check()
        to_slime(s)
        t = vk.simulate(s, "H100")
        get_report_mode("per_rollout_mean")
        print(len(r), len(s.steps), len(t.step_times), sorted({m.split(".")[0] for m in sys.modules}
              & {"plotly", "ipywidgets", "megatron", "pyarrow", "nbclient"}))
        """, UI_LIBS + TRAIN_LIBS + ("pyarrow",), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["7178", "4", "4", "[]"]


def test_parquet_without_pyarrow_names_the_parquet_extra(tmp_path):
    res = _python(f"""
        from varbatch_kit import Rollouts, write_trace
        try:
            write_trace(Rollouts.synthetic(8, seed=0), {str(tmp_path / "t.parquet")!r})
        except ImportError as e:
            print(e)
        """, ("pyarrow",))
    assert res.stdout.strip() == ("writing a .parquet trace needs the [parquet] extra: "
                                  "pip install 'varbatch_kit[parquet]' (missing: pyarrow)")


def test_the_exact_solver_without_ortools_names_the_dev_extra():
    res = _python("""
        from varbatch_kit.policies.optimal import solve_min_max_rank_flops
        try:
            solve_min_max_rank_flops([10, 20, 30], [1.0, 2.0, 3.0], 64, 2, 1)
        except ImportError as e:
            print(e)
        """, ("ortools",))
    assert res.stdout.strip() == (
        "the exact solver (solve_min_max_rank_flops) needs the [dev] extra: "
        "pip install 'varbatch_kit[dev]' (missing: ortools)"), res.stderr


def _cli(args: list[str], blocked, cwd) -> subprocess.CompletedProcess:
    return _python(f"""
        import sys
        from varbatch_kit.cli import main
        rc = main({args!r})
        print("loaded:", sorted({{m.split(".")[0] for m in sys.modules}}
              & {{"plotly", "ipywidgets", "megatron"}}))
        sys.exit(rc)
        """, blocked, cwd=cwd)


def test_cli_schedule_and_version_work_without_the_extras(tmp_path):
    res = _cli(["schedule", "agentic", "--dp", "16", "--global-batch-size", "512",
                "--max-tokens-per-gpu", "16384", "--packing", "first_fit",
                "--distribution", "flops_kk"], UI_LIBS + TRAIN_LIBS, tmp_path)
    assert res.returncode == 0, res.stderr
    assert "first_fit" in res.stdout and "flops_kk" in res.stdout
    assert "loaded: []" in res.stdout
    res = _cli(["--version"], UI_LIBS + TRAIN_LIBS, tmp_path)
    assert res.returncode == 0 and res.stdout.startswith("varbatch-kit ")
    res = _cli(["--help"], UI_LIBS + TRAIN_LIBS, tmp_path)
    assert res.returncode == 0
    for name in ("schedule", "train", "compare", "demo", "notebooks", "calibrate"):
        assert f"    {name}" in res.stdout, name


@pytest.mark.parametrize("args,extra", [
    (["demo", "--help"], "ui"), (["train", "--help"], "train"), (["compare", "--help"], "train"),
    (["calibrate", "--out", "model.json"], "train"),  # checked when it runs
    (["schedule", "agentic", "--dp", "16", "--html", "figs"], "ui"),  # figures need plotly
])
def test_cli_subcommand_without_its_extra_says_which(args, extra, tmp_path):
    command = args[0]
    res = _cli(args, UI_LIBS + TRAIN_LIBS, tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"varbatch-kit {command}: error: " in res.stderr
    assert f"needs the [{extra}] extra: pip install 'varbatch_kit[{extra}]'" in res.stderr
    assert "Traceback" not in res.stderr
