"""``varbatch-kit`` dispatch: every subcommand listed, only the one run imported, demo's options
passed through to the demo's own parser."""

import subprocess
import sys

import pytest

from varbatch_kit.cli import main
from varbatch_kit.cli.main import SUBCOMMANDS


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert f"    {name}" in out, name


def test_demo_options_reach_the_demo(tmp_path, capsys):
    """``varbatch-kit demo --out DIR --notebooks NAME`` is the demo's own command line."""
    rc = main(["demo", "--notebooks", "no-such-notebook", "--out", str(tmp_path / "out")])
    assert rc == 2
    assert "no notebooks to run" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["demo", "--help"])
    assert e.value.code == 0
    assert "--notebooks" in capsys.readouterr().out


def test_schedule_imports_no_other_subcommand():
    code = ("import sys\n"
            "from varbatch_kit.cli import main\n"
            "main(['schedule', 'agentic', '--dp', '16', '--global-batch-size', '512'])\n"
            "print(sorted(m for m in sys.modules if m.startswith('varbatch_kit.cli.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=240, check=True).stdout
    assert out.strip().splitlines()[-1] == "['varbatch_kit.cli.main', 'varbatch_kit.cli.schedule']"


def test_python_m_cli_demo_runs_the_demo(tmp_path):
    res = subprocess.run([sys.executable, "-m", "varbatch_kit.cli.demo", "--notebooks", "zz",
                          "--out", str(tmp_path / "out")], capture_output=True, text=True,
                         timeout=240, cwd=tmp_path)
    assert res.returncode == 2 and "no notebooks to run" in res.stderr, res.stderr


def test_help_summary_names_every_registered_subcommand(capsys):
    """The description line is generated from SUBCOMMANDS (it once omitted ``calibrate``)."""
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    para = next(p for p in out.split("\n\n") if p.startswith("varbatch-kit command line:"))
    line = " ".join(para.split())  # argparse wraps the description
    named = [w.strip() for w in line.split(":", 1)[1].split(",")]
    assert named == list(SUBCOMMANDS)
    assert "calibrate" in named
