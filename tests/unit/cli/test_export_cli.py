"""``varbatch-kit export RUN_DIR OUT_DIR``: a trained run's weights as a Hugging Face checkpoint,
the model found from the run folder's meta.json."""

from __future__ import annotations

import importlib.util
import json
import warnings

import pytest
from _export_runs import equal, exported, run_folder
from _fake_hf import tiny_hf_checkpoint

from varbatch_kit.cli import main

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("transformers", "safetensors",
                                                      "megatron.core")),
    reason="needs the [train] extra (pip install 'varbatch_kit[train]')")


def test_export_cli_writes_a_run_folders_weights(tmp_path, capsys):
    source = tiny_hf_checkpoint("qwen2_bias_tied", tmp_path / "qwen2")
    folder, states = run_folder(tmp_path / "runs", source, params_at=(2, 3))
    assert main(["export", str(folder), str(tmp_path / "out")]) == 0
    assert str(tmp_path / "out") in capsys.readouterr().out
    assert equal(exported(tmp_path / "out"), states[3])
    # the --out folder of `varbatch-kit train` (one run inside) and --step
    assert main(["export", str(tmp_path / "runs"), str(tmp_path / "out2"), "--step", "2"]) == 0
    assert equal(exported(tmp_path / "out2"), states[2])
    # occupied output folder: --overwrite
    assert main(["export", str(folder), str(tmp_path / "out2")]) == 2
    assert "overwrite" in capsys.readouterr().err
    assert main(["export", str(folder), str(tmp_path / "out2"), "--overwrite"]) == 0
    assert equal(exported(tmp_path / "out2"), states[3])


def test_export_cli_says_what_the_run_folder_lacks(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nowhere"), str(tmp_path / "o")]) == 2
    assert "RUN_DIR" in capsys.readouterr().err
    old, _ = run_folder(tmp_path / "old", None, model=False)  # a run from before meta's model
    assert main(["export", str(old), str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "meta.json" in err and "Run.export_hf" in err
    (tmp_path / "two" / "run00-a").mkdir(parents=True)
    (tmp_path / "two" / "run01-b").mkdir()
    for d in (tmp_path / "two").iterdir():
        (d / "meta.json").write_text(json.dumps({}))
    assert main(["export", str(tmp_path / "two"), str(tmp_path / "o")]) == 2
    assert "run00-a" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
