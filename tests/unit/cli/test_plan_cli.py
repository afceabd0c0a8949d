"""``varbatch-kit plan``: the fastest layouts that fit, the slime flags alone last."""

import json
from pathlib import Path

import pytest

from varbatch_kit.cli import main
from varbatch_kit.compat.slime.flag_search import recommended_config

#: a slime dump of 16 samples, a small model, 8 GPUs: a few seconds
DUMP = str(Path(__file__).parents[2] / "golden" / "dumps" / "rollout_12.pt")
ARGS = ["plan", DUMP, "--model", "qwen2.5-0.5b", "--gpus", "8", "--global-batch-size", "2",
        "--caps", "64,128", "--top", "4"]


def test_the_table_then_the_slime_flags_last(capsys, tmp_path):
    html = tmp_path / "plan.html"
    rc = main([*ARGS, "--html", str(html)])
    out = capsys.readouterr()
    assert rc == 0, out.err
    lines = out.out.rstrip("\n").splitlines()
    assert lines[-2] == "slime flags (next line):"
    config = recommended_config(lines[-1] + " --actor-num-gpus-per-node 8")
    assert config.dynamic and config.max_tokens_per_gpu in (64, 128)
    assert "peak_gib" in out.out and "gpu_hours" in out.out and "8 x H100" in out.out
    assert html.is_file() and "plotly" in html.read_text()[:5000].lower()


def test_json(capsys):
    rc = main([*ARGS, "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0 and data["gpus"] == 8 and len(data["candidates"]) == 4
    assert all(c["fits"] and c["peak_gib"] <= data["memory_gib"] for c in data["candidates"])
    assert data["best"]["time_s"] == min(c["time_s"] for c in data["candidates"])


def test_errors_exit_2_naming_the_value(capsys):
    assert main([*ARGS, "--caps", "a,b"]) == 2
    assert "--caps 'a,b'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main([*ARGS, "--gpus", "0"])
    assert exit_.value.code == 2
    assert "--gpus: expected a positive whole number, got 0" in capsys.readouterr().err
