"""``varbatch-kit schedule``: the table for a trace, HTML figures, errors with exit status 2."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from varbatch_kit import ModelShape, Rollouts, ScheduleConfig, build_schedule
from varbatch_kit.analysis.quality import step_quality
from varbatch_kit.cli import main
from varbatch_kit.core.traces import write_trace


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    r = Rollouts.synthetic(64, samples_per_rollout=(1, 2), prompt_len=(16, 64),
                           response_len=400.0, max_response_len=2048, seed=5)
    path = tmp_path_factory.mktemp("traces") / "small.jsonl"
    write_trace(r, path)
    return path, r


def row_of(out: str, packing: str, distribution: str) -> list[str]:
    for line in out.splitlines():
        cells = line.split()
        if cells[:2] == [packing, distribution]:
            return cells
    raise AssertionError(f"no row for {packing} + {distribution} in:\n{out}")


def test_table_for_one_policy_matches_the_core(trace_file, capsys):
    path, r = trace_file
    rc = main(["schedule", str(path), "--dp", "4", "--global-batch-size", "16",
               "--max-tokens-per-gpu", "2048", "--packing", "first_fit",
               "--distribution", "flops_kk", "--model", "qwen2.5-0.5b"])
    out = capsys.readouterr().out
    assert rc == 0
    s = build_schedule(r, ScheduleConfig(dp=4, global_batch_size=16, max_tokens_per_gpu=2048,
                                         distribution="flops_kk"),
                       ModelShape.preset("qwen2.5-0.5b"))
    q = step_quality(s)
    cells = row_of(out, "first_fit", "flops_kk")
    assert int(cells[2]) == s.num_steps == 4
    assert int(cells[3]) == q["micro_batches"].sum()
    assert int(cells[4]) == q["mb_lower_bound"].sum()
    assert int(cells[5]) == q["cap_violations"].sum()
    assert float(cells[6]) == pytest.approx(q["flops_imbalance"].max(), abs=1e-4)
    assert "--use-dynamic-batch-size --balance-data" in out
    assert "layout: dp=4 cp=1" in out and "model qwen2.5-0.5b" in out


def test_every_registered_policy_by_default(trace_file, capsys):
    from varbatch_kit.ui import viz

    path, _ = trace_file
    assert main(["schedule", str(path), "--dp", "2"]) == 0
    out = capsys.readouterr().out
    for packing, distribution in viz.policy_pairs(ModelShape.preset("qwen3-8b")):
        row_of(out, packing, distribution)


def test_slime_args_and_static_path(capsys):
    rc = main(["schedule", "math", "--dp", "2",
               "--slime-args=--global-batch-size 1024 --micro-batch-size 2 --balance-data"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "micro_batch_size=2" in out and "global_batch_size=1024" in out
    cells = row_of(out, "static", "flops_kk")
    assert int(cells[2]) == 4 and int(cells[3]) == 4 * 512
    assert "--balance-data" in out


def test_html_figures(trace_file, tmp_path, capsys):
    path, _ = trace_file
    out_dir = tmp_path / "figs"
    rc = main(["schedule", str(path), "--dp", "2", "--packing", "first_fit",
               "--distribution", "strided", "--html", str(out_dir)])
    assert rc == 0
    names = sorted(p.name for p in out_dir.iterdir())
    assert names == ["balance-first_fit-strided.html", "lengths.html",
                     "packing-first_fit-strided.html", "plotly.min.js", "policies.html"]
    page = (out_dir / "packing-first_fit-strided.html").read_text()
    assert 'src="plotly.min.js"' in page and "Plotly.newPlot" in page
    assert "wrote 4 figures" in capsys.readouterr().out


def test_bundled_trace_by_name(capsys):
    assert main(["schedule", "long_context", "--packing", "first_fit", "--distribution",
                 "strided", "--dp", "8"]) == 0
    assert "trace long_context: Rollouts(1024 samples" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["missing.jsonl"], "does not exist"),
    (["{bad}", "--dp", "10000"], "dp=10000"),
    (["{bad}", "--packing", "nope"], "unknown packing 'nope'"),
    (["{bad}", "--model", "gpt-17"], "neither a preset"),
    (["{bad}", "--micro-batch-size", "3", "--dp", "4", "--global-batch-size", "16"],
     "not a multiple of dp*mb_group=4"),
])
def test_user_errors_exit_2_with_the_message(trace_file, tmp_path, capsys, args, message):
    path, _ = trace_file
    args = [str(path) if a == "{bad}" else a for a in args]
    if args[0] == "missing.jsonl":
        args[0] = str(tmp_path / "missing.jsonl")
    assert main(["schedule", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("varbatch-kit schedule: error: ")
    assert message in err
    assert "Traceback" not in err


def test_malformed_trace_names_the_path_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_len": 3, "response_len": 4}\n{"prompt_len": 3, oops}\n')
    assert main(["schedule", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "line 2 is not JSON" in err


def test_console_script_end_to_end(trace_file):
    path, _ = trace_file
    exe = Path(sys.executable).with_name("varbatch-kit")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "varbatch_kit.cli"]
    ok = subprocess.run([*cmd, "schedule", str(path), "--packing", "first_fit",
                         "--distribution", "strided", "--dp", "2"],
                        capture_output=True, text=True, timeout=120, check=False)
    assert ok.returncode == 0, ok.stderr
    assert "first_fit" in ok.stdout
    bad = subprocess.run([*cmd, "schedule", str(path) + ".nope"], capture_output=True,
                         text=True, timeout=120, check=False)
    assert bad.returncode == 2
    assert "does not exist" in bad.stderr and "Traceback" not in bad.stderr
    assert np.isfinite(len(ok.stdout))
