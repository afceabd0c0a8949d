"""The notebooks run on a user's own data by editing only their settings cell.

Every notebook opens with one code cell tagged ``parameters`` (its settings: trace or dump,
model, dp / cp, the token cap, the global batch size, ...). Here notebook 01 (packing) and
notebook 04 (slime's flags) are executed on a slime rollout dump of another size than the
bundled traces, with only that cell's values replaced
(:func:`varbatch_kit.cli.notebook_settings.set_parameters`, the mechanism ``make demo`` uses
for its smaller matrices): every cell must run, and the output must speak of the dump's own
rollouts.
"""

from __future__ import annotations

import nbformat
import numpy as np
import pytest
import torch
from _paths import NOTEBOOKS_DIR

from varbatch_kit import Rollouts, read_trace
from varbatch_kit.cli.notebook_settings import parameters_cell, set_parameters

pytest.importorskip("nbclient")
pytestmark = pytest.mark.timeout(600)

N_ROLLOUTS = 384  # the bundled traces hold 1024, 2048 and 4096 rollouts


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    """A slime rollout dump (``torch.save`` of ``{"rollout_id", "samples"}``, as slime's
    ``--save-debug-rollout-data`` writes) of 384 rollouts of 1-4 samples each."""
    r = Rollouts.synthetic(N_ROLLOUTS, samples_per_rollout=(1, 4), response_len=1500.0,
                           max_response_len=6000, seed=7)
    samples = [{"tokens": torch.arange(int(p) + int(q)) % 1000, "response_length": int(q),
                "rollout_id": int(rid), "group_index": int(rid) // 4, "reward": float(i % 2)}
               for i, (p, q, rid) in enumerate(zip(r.prompt_len, r.response_len, r.rollout_id))]
    path = tmp_path_factory.mktemp("dump") / "rollout_0.pt"
    torch.save({"rollout_id": 0, "samples": samples}, path)
    read = read_trace(path)
    assert read.num_rollouts == N_ROLLOUTS and len(read) == len(r) != N_ROLLOUTS
    return path


def execute(name: str, values: dict, tmp_path):
    """Notebook ``name`` with only its settings changed, executed top to bottom; its text."""
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOKS_DIR / name, as_version=4)
    set_parameters(nb, values)
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    out = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            assert o.output_type != "error", f"{name}: {o.ename}: {o.evalue}"
            out.append(o.get("text", "") + str(o.get("data", {}).get("text/plain", "")))
    return nb, "\n".join(out)


# ------------------------------------------------------------------------- the mechanism
def _nb(source, tags=("parameters",)):
    cell = nbformat.v4.new_code_cell(source)
    cell.metadata["tags"] = list(tags)
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# t"), cell,
                                           nbformat.v4.new_code_cell("DP = 99")])


def test_set_parameters_rewrites_the_settings_cell_only():
    nb = _nb('TRACE = "math"  # a name or a path\nDP = 8\nLAYOUTS = [(1, 1),\n           (2, 1)]\n'
             'CAP: int = 16384\nX = "×"; Y = 2\n')
    set_parameters(nb, {"TRACE": "/data/dump 1.pt", "LAYOUTS": [(1, 1)], "CAP": 4096, "Y": 3})
    assert nb.cells[1].source == ("TRACE = '/data/dump 1.pt'  # a name or a path\nDP = 8\n"
                                  "LAYOUTS = [(1, 1)]\nCAP: int = 4096\nX = \"×\"; Y = 3\n")
    assert nb.cells[2].source == "DP = 99"  # later cells untouched


def test_set_parameters_refuses_a_name_the_cell_does_not_set():
    with pytest.raises(KeyError, match=r"assigns no \['DPP'\]; its settings are \['DP'\]"):
        set_parameters(_nb("DP = 8\n"), {"DPP": 2})
    with pytest.raises(ValueError, match="0 code cells tagged 'parameters'"):
        set_parameters(_nb("DP = 8\n", tags=()), {"DP": 2})
    with pytest.raises(ValueError, match="not a Python literal"):
        set_parameters(_nb("DP = 8\n"), {"DP": np.arange(2)})


@pytest.mark.parametrize("path", sorted(NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb")),
                         ids=lambda p: p.stem)
def test_every_notebook_opens_with_one_settings_cell(path):
    nb = nbformat.read(path, as_version=4)
    cell = parameters_cell(nb)
    assert nb.cells[0].cell_type == "markdown" and nb.cells[1] is cell, (
        f"{path.name}: the settings cell must come right after the title")
    assert cell.source.lstrip().startswith("# Settings"), path.name


# ------------------------------------------------------------------------- a user's dump
def test_notebook_01_on_a_dump_by_editing_only_the_trace(dump, tmp_path):
    """Only the trace changed: the dump holds fewer rollouts than the global batch size,
    so the notebook makes one step of all of them and every cell still runs."""
    _, text = execute("01_packing_explorer.ipynb", {"TRACE": str(dump)}, tmp_path)
    assert f"{N_ROLLOUTS} rollouts, {N_ROLLOUTS} per step: 1 step(s)" in text
    assert "4096" not in text.split("Rollouts(", 2)[1][:80]  # the dump's, not the bundled


def test_notebook_01_on_a_dump_and_its_own_layout(dump, tmp_path):
    values = {"TRACE": str(dump), "MODEL": "qwen2.5-0.5b", "DP": 4,
              "MAX_TOKENS_PER_GPU": 8192, "GLOBAL_BATCH_SIZE": 96}
    _, text = execute("01_packing_explorer.ipynb", values, tmp_path)
    assert f"{N_ROLLOUTS} rollouts, 96 per step: 4 step(s) of dp=4" in text
    assert f"{N_ROLLOUTS} rollouts" in text


def test_notebook_04_recommends_flags_for_a_dump(dump, tmp_path):
    values = {"TRACE": str(dump),
              "SLIME_ARGS": "--actor-num-nodes 1 --actor-num-gpus-per-node 4 "
                            "--global-batch-size 96 --use-dynamic-batch-size "
                            "--max-tokens-per-gpu 8192"}
    _, text = execute("04_tune_slime_flags.ipynb", values, tmp_path)
    assert f"{N_ROLLOUTS} rollouts" in text
    assert "--global-batch-size" in text and "--max-tokens-per-gpu" in text
