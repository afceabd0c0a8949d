"""``varbatch-kit recommend``: the table, the explanation, the command line alone last."""

import json
import shlex
import warnings
from pathlib import Path

import pytest

from varbatch_kit.cli import main
from varbatch_kit.compat.slime.flag_search import recommended_config

DUMP = str(Path(__file__).parents[2] / "golden" / "dumps" / "rollout_12.pt")
ARGS = ("--actor-num-gpus-per-node 2 --rollout-batch-size 4 --n-samples-per-prompt 4 "
        "--num-steps-per-rollout 2 --use-dynamic-batch-size --max-tokens-per-gpu 64 --lr 1e-6")


def _run(capsys, *extra):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = main(["recommend", DUMP, "--slime-args", ARGS, "--max-tokens-headroom", "2", *extra])
    return rc, capsys.readouterr()


def test_the_last_line_is_the_recommended_command(capsys):
    rc, out = _run(capsys)
    assert rc == 0, out.err
    lines = out.out.rstrip("\n").splitlines()
    command = lines[-1]
    assert lines[-2] == "recommended slime flags (next line):"
    config = recommended_config(command)  # the line parses back: the recommended config
    assert config.max_tokens_per_gpu == 128 and config.distribution == "flops_kk"
    assert config.dp == 2
    assert shlex.split(command)[:2] == ["--actor-num-gpus-per-node", "2"]
    assert "--lr 1e-6" in command
    table = "\n".join(lines)
    assert any(line.lstrip().startswith("*") for line in lines)  # the best row
    assert any(line.lstrip().startswith("you") for line in lines)  # the user's row
    assert "your flags:" in table and "recommended:" in table and "beyond slime" in table
    assert "over_limit" in table  # the legend


def test_json(capsys):
    rc, out = _run(capsys, "--json")
    assert rc == 0
    data = json.loads(out.out)
    assert recommended_config(data["command"]).max_tokens_per_gpu == 128
    assert data["best"]["time_s"] <= data["user"]["time_s"]
    assert len(data["candidates"]) > 10 and data["memory_limit"] == 128


@pytest.mark.parametrize("extra, message", [
    (["--max-tokens-headroom", "0.5"], "max_tokens_headroom"),
    (["--slime-args", "--global-batch-size 8 --micro-batch-size x"], "--micro-batch-size"),
])
def test_errors_exit_2_naming_the_value(capsys, extra, message):
    rc, out = _run(capsys, *extra)
    assert rc == 2
    assert message in out.err and out.out == ""
