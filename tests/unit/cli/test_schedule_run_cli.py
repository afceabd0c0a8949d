"""``varbatch-kit schedule RUN_DIR``: a run of slime dumps, one row per rollout step and policy
(in-process, through the dispatcher)."""

import shutil

import pytest
from _paths import GOLDEN

from varbatch_kit import ModelShape
from varbatch_kit.analysis.run_quality import run_quality_table
from varbatch_kit.cli import main
from varbatch_kit.cli.schedule_run import RUN_TABLE_COLUMNS
from varbatch_kit.compat.slime import SLIME_FLAGS
from varbatch_kit.compat.slime.flags import schedule_config_from_slime_args
from varbatch_kit.core.config import ScheduleConfig
from varbatch_kit.core.run_dumps import read_run

LAYOUT = ["--dp", "2", "--max-tokens-per-gpu", "64", "--global-batch-size", "4"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("run")
    for k in (1, 2, 10):
        shutil.copy(GOLDEN / "dumps" / f"rollout_{k}.pt", folder / f"rollout_{k}.pt")
    return folder


def rows(out: str) -> list[list[str]]:
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["rollout_id", "policy"])
    body = []
    for line in lines[head + 1:]:
        if not line.strip():
            break
        body.append(line.split())
    return body


def test_a_row_per_rollout_step_and_policy(run_dir, capsys):
    assert main(["schedule", str(run_dir), *LAYOUT]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].startswith("layout: dp=2 cp=1 vpp=1 mb_group=1 "
                                          "global_batch_size=4 max_tokens_per_gpu=64")
    got = rows(out)
    assert [(r[0], " ".join(r[1:4])) for r in got] == [
        (str(k), p) for k in (1, 2, 10)
        for p in ("first_fit + strided", "balanced + balanced")]
    want = run_quality_table(read_run(run_dir),
                             ScheduleConfig(dp=2, global_batch_size=4, max_tokens_per_gpu=64),
                             ModelShape.preset("qwen3-8b"), flag_names=SLIME_FLAGS)
    for cells, (_, w) in zip(got, want.iterrows()):
        # the first-fit row carries slime's flag (one more cell), balanced has none
        tail = cells[-10:]
        assert tail[0] == str(w["samples"]) and tail[1] == str(w["steps"])
        assert tail[3] == str(w["micro_batches"])
        assert float(tail[6]) == pytest.approx(w["flops_imbalance"], abs=1e-4)
        assert float(tail[8]) == pytest.approx(w["time_s"], rel=1e-3)
    assert got[0][4] == "--use-dynamic-batch-size"
    assert "columns:" in out and all(f"  {c} " in out for c in RUN_TABLE_COLUMNS)


def test_the_template_and_slime_args_give_slimes_policy(run_dir, capsys):
    flags = "--global-batch-size 4 --use-dynamic-batch-size --max-tokens-per-gpu 64 --balance-data"
    assert main(["schedule", str(run_dir / "rollout_{rollout_id}.pt"), "--dp", "2",
                 "--slime-args", flags]) == 0
    got = rows(capsys.readouterr().out)
    config = schedule_config_from_slime_args(flags, dp=2)
    assert (config.packing, config.distribution) == ("first_fit", "flops_kk")
    assert [" ".join(r[1:4]) for r in got[:2]] == ["first_fit + flops_kk",
                                                    "balanced + balanced"]
    assert " ".join(got[0][4:6]) == "--use-dynamic-batch-size --balance-data"


def test_html_writes_the_per_step_figure(run_dir, tmp_path, capsys):
    assert main(["schedule", str(run_dir), *LAYOUT, "--html", str(tmp_path / "figs")]) == 0
    page = (tmp_path / "figs" / "run-quality.html").read_text()
    assert "rollout step (rollout_id)" in page and "balanced + balanced" in page
    assert 'href="run-quality.html"' in (tmp_path / "figs" / "index.html").read_text()


def test_errors_exit_2_with_the_message(tmp_path, capsys):
    assert main(["schedule", str(tmp_path)]) == 2
    assert "no slime dump found" in capsys.readouterr().err
    (tmp_path / "rollout_13.pt").write_bytes((GOLDEN / "dumps" / "rollout_13.pt").read_bytes())
    assert main(["schedule", str(tmp_path), "--dp", "2", "--global-batch-size", "4"]) == 2
    assert "global_batch_size=4" in capsys.readouterr().err  # every row failed: said once
