"""The notebooks: committed clean, self-explaining, and run top to bottom under nbval.

The notebooks are committed without outputs, but nbval checks a cell marked
``# NBVAL_CHECK_OUTPUT`` only against a stored output. So each test copies
its notebook, puts the expected printout of every marked cell (from
``tests/notebook_outputs.json``) into the copy, and runs
``pytest --nbval-lax`` on it in a subprocess: every cell must run, and the
marked cells must print exactly what is stored.

After a deliberate change of a printed value, regenerate the expected
outputs with ``python tests/integration/test_notebooks.py --update [01 02 ...]`` and
review the diff. The notebooks run with ``VARBATCH_KIT_MODELS=build/models`` and
``VARBATCH_KIT_CACHE=build/cache`` (:data:`SHARED_CACHES`), the tests' caches. The notebooks
call the real ``compare`` / ``rl_loop`` / ``generate_rollouts``; their kernels start with an
IPython startup file (:func:`ipython_dir`) that runs
:data:`varbatch_kit.cli.experiment_cache.KERNEL_SETUP`, the code ``make demo``'s kernel setup
runs too: with the cache set, those calls become their cached twins, so a notebook and a test
making the same call share one computation.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

if __name__ == "__main__":  # run as a script (--update): tests/ on sys.path, as pytest puts it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _paths import NOTEBOOKS_DIR, REPO  # noqa: E402

from varbatch_kit.cli.experiment_cache import KERNEL_SETUP  # noqa: E402

ROOT = REPO
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb"))
EXPECTED = Path(__file__).with_name("notebook_outputs.json")
MARK = "# NBVAL_CHECK_OUTPUT"
# notebooks that start torchrun workers (the training engine)
TRAINING = {"05_variable_gbs_training", "06_metric_report_invariance", "07_rl_loop"}
# the caches the notebooks share with the tests: the SmolLM2 checkpoint (built once, as the
# tests' fixtures build it) and the experiment cache (varbatch_kit.cli.experiment_cache), where
# notebook 06 section 5 and tests/integration/test_train_real.py find each other's SmolLM2
# rollouts and layout matrix
SHARED_CACHES = {"VARBATCH_KIT_MODELS": str(ROOT / "build" / "models"),
                 "VARBATCH_KIT_CACHE": str(ROOT / "build" / "cache")}


def ipython_dir(root: Path) -> Path:
    """An ``IPYTHONDIR`` whose default profile's startup file runs :data:`KERNEL_SETUP` (the
    experiment cache's twins of compare / rl_loop / generate_rollouts) in every kernel started
    with it; ``root`` is created."""
    startup = root / "profile_default" / "startup"
    startup.mkdir(parents=True, exist_ok=True)
    (startup / "00-varbatch-kit-cache.py").write_text(KERNEL_SETUP)
    return root


def _marked(nb) -> list:
    return [c for c in nb.cells if c.cell_type == "code" and c.source.lstrip().startswith(MARK)]


# the limits of a notebook's run, in s: generous safety nets (not speed checks) for a loaded
# machine; notebook 06 trains the SmolLM2 layout matrix (21 runs) in one cell
CELL_TIMEOUT = {"06_metric_report_invariance": 1200}
# ... the matrix test_train_real.py reads back from the experiment cache: under pytest-xdist both
# run in one worker (one trains it, the other reads it; never one waiting on the other's lock)
SHARES_THE_SMOLLM2_MATRIX = {"06_metric_report_invariance"}
SMOLLM2_MATRIX_GROUP = "smollm2_matrix"
# ... and notebook 07 the RL loop tests/integration/test_train_rl_loop.py checks (one xdist group)
SHARES_THE_RL_LOOP = {"07_rl_loop"}
RL_LOOP_GROUP = "rl_loop"
RUN_TIMEOUT = {"06_metric_report_invariance": 1500}
# the longest notebook outside a group: dispatched first (tests/conftest.py)
STARTS_EARLY = {"05_variable_gbs_training"}


def _params():
    for path in NOTEBOOKS:
        marks = [pytest.mark.timeout(RUN_TIMEOUT.get(path.stem, 900) + 60)]
        if path.stem in TRAINING:
            marks.append(pytest.mark.multiprocess)
        if path.stem in SHARES_THE_SMOLLM2_MATRIX:
            marks.append(pytest.mark.xdist_group(SMOLLM2_MATRIX_GROUP))
        if path.stem in SHARES_THE_RL_LOOP:
            marks.append(pytest.mark.xdist_group(RL_LOOP_GROUP))
        if path.stem in STARTS_EARLY:
            marks.append(pytest.mark.start_early)
        yield pytest.param(path, id=path.stem, marks=marks)


def test_seven_notebooks_exist_in_two_tracks():
    assert [p.stem for p in NOTEBOOKS] == ["01_packing_explorer", "02_dp_flops_balance",
                                           "03_dynamic_cp", "04_tune_slime_flags",
                                           "05_variable_gbs_training",
                                           "06_metric_report_invariance", "07_rl_loop"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_without_outputs_and_self_explaining(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name}: cell {cell.id} has outputs"
            assert cell.execution_count is None, f"{path.name}: cell {cell.id} has a count"
    kinds = [c.cell_type for c in nb.cells]
    assert kinds[0] == "markdown" and nb.cells[0].source.startswith("# ")
    assert kinds.count("markdown") >= 6
    assert "What to look at" in "".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert any("Scaling up" in c.source for c in nb.cells if c.cell_type == "markdown")
    assert 1 <= len(_marked(nb)) <= 4


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_no_latex_and_no_removed_calls(path):
    """The demo's HTML export loads MathJax from a CDN (not there offline), so math is written
    in Unicode; schedules and tables come from varbatch_kit.analysis.sweeps, not from viz."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            assert "$" not in cell.source, f"{path.name}: LaTeX in markdown cell {cell.id}"
            assert "\\frac" not in cell.source and "\\text{" not in cell.source
        else:
            for name in ("viz.sweep_table", "viz.policy_table", "viz.policy_pairs"):
                assert name not in cell.source, f"{path.name}: cell {cell.id} calls {name}"
            tags = cell.metadata.get("tags", [])
            # the settings cell alone is tagged (papermill's "parameters": the cell to edit)
            assert tags == (["parameters"] if cell is nb.cells[1] else []), (
                f"{path.name}: cell {cell.id} is tagged {tags}")


def test_expected_outputs_cover_exactly_the_marked_cells():
    expected = json.loads(EXPECTED.read_text())
    for path in NOTEBOOKS:
        ids = {c.id for c in _marked(nbformat.read(path, as_version=4))}
        assert set(expected.get(path.stem, {})) == ids, (
            f"{path.name}: marked cells {sorted(ids)} but expected outputs for "
            f"{sorted(expected.get(path.stem, {}))}; run "
            "python tests/integration/test_notebooks.py --update")


def _with_expected_outputs(path: Path, out_dir: Path) -> Path:
    nb = nbformat.read(path, as_version=4)
    expected = json.loads(EXPECTED.read_text()).get(path.stem, {})
    for cell in _marked(nb):
        cell.outputs = [nbformat.from_dict(o) for o in expected.get(cell.id, [])]
        cell.execution_count = 1
    target = out_dir / path.name
    nbformat.write(nb, target)
    return target


@pytest.mark.parametrize("path", list(_params()))
def test_notebook_runs_under_nbval(path, tmp_path):
    if path.stem in TRAINING:
        pytest.importorskip("varbatch_kit.train")
    target = _with_expected_outputs(path, tmp_path)
    env = dict(os.environ, **SHARED_CACHES, IPYTHONDIR=str(ipython_dir(tmp_path / "ipython")),
               PYTHONPATH=os.pathsep.join(
                   [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
         f"--nbval-cell-timeout={CELL_TIMEOUT.get(path.stem, 600)}", "--rootdir",
         str(tmp_path), str(target)],
        cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=RUN_TIMEOUT.get(path.stem, 900), check=False)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"nbval failed for {path.name}:\n{tail}"
    assert " passed" in proc.stdout and "failed" not in proc.stdout.split("\n")[-2], tail


def test_the_kernels_compare_and_rl_loop_are_the_cached_twins(tmp_path):
    """The startup file the nbval runs use: in a kernel started with it and a cache set, the
    names the notebooks import are the experiment cache's twins (without a cache, the real
    functions)."""
    pytest.importorskip("varbatch_kit.train")
    from nbclient import NotebookClient

    probe = ("import varbatch_kit.train as t\n"
             "from varbatch_kit.train.rl.generate import generate_rollouts\n"
             "print([hasattr(f, '__vbk_original__') for f in "
             "(t.compare, t.rl_loop, generate_rollouts)])")
    seen = []
    for cache in (str(tmp_path / "cache"), ""):
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(probe)])
        env = dict(IPYTHONDIR=str(ipython_dir(tmp_path / "ipython")), VARBATCH_KIT_CACHE=cache)
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # the kernel inherits them
        try:
            NotebookClient(nb, timeout=120, kernel_name="python3").execute()
        finally:
            for k, v in old.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        seen.append(nb.cells[0].outputs[0]["text"].strip())
    assert seen == ["[True, True, True]", "[False, False, False]"]


def _update(prefixes: list[str]) -> None:
    """Execute the notebooks (all, or those whose name starts with a prefix) and store the
    printout of their marked cells."""
    import tempfile

    from nbclient import NotebookClient

    for name, value in SHARED_CACHES.items():  # the kernels inherit them
        os.environ.setdefault(name, value)
    os.environ["IPYTHONDIR"] = str(ipython_dir(Path(tempfile.mkdtemp(prefix="vbk_ipython_"))))
    result = json.loads(EXPECTED.read_text()) if EXPECTED.exists() else {}
    for path in NOTEBOOKS:
        if prefixes and not any(path.stem.startswith(p) for p in prefixes):
            continue
        nb = copy.deepcopy(nbformat.read(path, as_version=4))
        print(f"running {path.name} ...", flush=True)
        NotebookClient(nb, timeout=CELL_TIMEOUT.get(path.stem, 900), kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent)}}).execute()
        result[path.stem] = {
            c.id: [{k: v for k, v in o.items()} for o in c.outputs if o.output_type == "stream"]
            for c in _marked(nb)}
        for cid, outs in result[path.stem].items():
            print(f"  {cid}:\n    " + "".join(o["text"] for o in outs).replace("\n", "\n    "))
    EXPECTED.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"wrote {EXPECTED}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--update"]:
        _update(sys.argv[2:])
    else:
        print(__doc__)
