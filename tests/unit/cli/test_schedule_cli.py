"""``varbatch-kit schedule``: the table for a trace and its legend, HTML figures with an index,
errors with exit status 2, and no plotly unless figures are asked for."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from varbatch_kit import ModelShape, Rollouts, ScheduleConfig, build_schedule
from varbatch_kit.analysis import sweeps
from varbatch_kit.analysis.quality import step_quality
from varbatch_kit.cli import main
from varbatch_kit.cli.schedule import COLUMN_LEGEND, TABLE_COLUMNS
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
    col = TABLE_COLUMNS.index
    assert int(cells[col("cap_violations")]) == q["cap_violations"].sum()
    assert int(cells[col("oversize_alone")]) == q["oversize_alone"].sum()
    assert float(cells[col("max_flops_imbalance")]) == pytest.approx(q["flops_imbalance"].max(),
                                                                     abs=1e-4)
    assert float(cells[col("mean_mb_makespan_ratio")]) == pytest.approx(
        q["mb_makespan_ratio"].mean(), abs=1e-4)
    assert float(cells[col("mean_makespan_ratio")]) == pytest.approx(
        q["makespan_ratio"].mean(), abs=1e-4)
    assert "--use-dynamic-batch-size --balance-data" in out
    assert "layout: dp=4 cp=1" in out and "model qwen2.5-0.5b" in out


def test_every_registered_policy_by_default(trace_file, capsys):
    path, _ = trace_file
    assert main(["schedule", str(path), "--dp", "2"]) == 0
    out = capsys.readouterr().out
    for packing, distribution in sweeps.policy_pairs(ModelShape.preset("qwen3-8b")):
        row_of(out, packing, distribution)


def test_a_legend_line_per_column_under_the_table(trace_file, capsys):
    path, _ = trace_file
    assert main(["schedule", str(path), "--dp", "2", "--packing", "first_fit"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["packing",
                                                                           "distribution"])
    assert lines[header].split() == TABLE_COLUMNS
    start = lines.index("columns:")
    assert start > header + 1  # under the table
    legend = lines[start + 1:start + 1 + len(TABLE_COLUMNS)]
    assert [line.split()[0] for line in legend] == TABLE_COLUMNS
    for column, line in zip(TABLE_COLUMNS, legend):
        assert line.split(None, 1)[1] == COLUMN_LEGEND[column]
    assert "(seconds)" in COLUMN_LEGEND["schedule_s"] and "(count" in COLUMN_LEGEND["steps"]
    assert all("(" in text for text in COLUMN_LEGEND.values())  # every line names its unit


def test_no_plotly_without_html(trace_file, tmp_path):
    path, _ = trace_file
    code = ("import sys\n"
            "from varbatch_kit.cli import main\n"
            f"rc = main(['schedule', {str(path)!r}, '--dp', '2', '--packing', 'first_fit'{{}}])\n"
            "print('rc', rc, 'plotly', any(m.split('.')[0] == 'plotly' for m in sys.modules))\n")
    plain = subprocess.run([sys.executable, "-c", code.format("")], capture_output=True,
                           text=True, timeout=120, check=True).stdout
    assert plain.splitlines()[-1] == "rc 0 plotly False"
    html = subprocess.run([sys.executable, "-c", code.format(f", '--html', {str(tmp_path)!r}")],
                          capture_output=True, text=True, timeout=120, check=True).stdout
    assert html.splitlines()[-1] == "rc 0 plotly True"


def test_slime_args_and_static_path(capsys):
    rc = main(["schedule", "math", "--dp", "2",
               "--slime-args=--global-batch-size 1024 --micro-batch-size 2 --balance-data"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "micro_batch_size=2" in out and "global_batch_size=1024" in out
    cells = row_of(out, "static", "flops_kk")
    assert int(cells[2]) == 4 and int(cells[3]) == 4 * 512
    assert "--balance-data" in out


SLIME_DYNAMIC = ("--slime-args=--global-batch-size 16 --use-dynamic-batch-size "
                 "--max-tokens-per-gpu 2048 --balance-data")


def marked_rows(out: str) -> dict[tuple[str, str], str]:
    """(packing, distribution) -> the text of the marked column, for the rows that have one."""
    rows = {}
    for line in out.splitlines():
        cells = line.split()
        if cells and cells[-1] in ("slime", "packing", "slime,packing"):
            rows[tuple(cells[:2])] = cells[-1]
    return rows


def test_slime_args_set_the_layout_and_every_policy_is_compared(trace_file, capsys):
    path, _ = trace_file
    assert main(["schedule", str(path), "--dp", "2", SLIME_DYNAMIC]) == 0
    out = capsys.readouterr().out
    for packing, distribution in sweeps.policy_pairs(ModelShape.preset("qwen3-8b")):
        row_of(out, packing, distribution)
    assert marked_rows(out) == {("first_fit", "flops_kk"): "slime"}
    assert "global_batch_size=16 max_tokens_per_gpu=2048 (cap 2048)" in out


def test_slime_args_with_packing_balanced_marks_both(trace_file, capsys):
    path, _ = trace_file
    assert main(["schedule", str(path), "--dp", "2", SLIME_DYNAMIC, "--packing", "balanced"]) == 0
    out = capsys.readouterr().out
    assert marked_rows(out) == {("first_fit", "flops_kk"): "slime",
                                ("balanced", "balanced"): "packing"}
    assert main(["schedule", str(path), "--dp", "2", SLIME_DYNAMIC, "--distribution",
                 "flops_kk", "--packing", "first_fit"]) == 0
    assert marked_rows(capsys.readouterr().out) == {("first_fit", "flops_kk"): "slime,packing"}


def test_slime_args_with_a_packing_of_the_other_path_says_which_flag(trace_file, capsys):
    path, _ = trace_file
    assert main(["schedule", str(path), "--dp", "2", SLIME_DYNAMIC, "--packing", "static"]) == 2
    err = capsys.readouterr().err
    assert "--packing 'static' is not a dynamic-batching packing" in err
    assert "--use-dynamic-batch-size" in err


def test_samples_over_the_cap_are_counted_and_warned_once(capsys):
    r = Rollouts(prompt_len=[0] * 8, response_len=[5, 3000, 8, 2, 2500, 1, 4, 6])
    from varbatch_kit.cli.main import build_parser
    from varbatch_kit.cli.schedule import run

    args = build_parser("schedule").parse_args(["schedule", "x", "--dp", "2",
                                                "--global-batch-size", "4",
                                                "--max-tokens-per-gpu", "2048"])
    import varbatch_kit.cli.schedule as mod

    orig = mod.load_trace
    mod.load_trace = lambda spec: ("x", r)
    try:
        assert run(args) == 0
    finally:
        mod.load_trace = orig
    captured = capsys.readouterr()
    warned = [ln for ln in captured.err.splitlines() if "warning:" in ln]
    assert len(warned) == 1  # once, not once per policy
    assert "2 of 8 samples (25.0 %) are longer than the token cap 2048" in warned[0]
    for packing, distribution in sweeps.policy_pairs(ModelShape.preset("qwen3-8b")):
        cells = row_of(captured.out, packing, distribution)
        assert int(cells[TABLE_COLUMNS.index("oversize_alone")]) == 2
        assert int(cells[TABLE_COLUMNS.index("cap_violations")]) == 0


def test_dropped_rollouts_are_logged_once_not_once_per_policy_or_figure(tmp_path, caplog,
                                                                        monkeypatch):
    import logging

    import varbatch_kit.cli.schedule as mod
    from varbatch_kit.cli.main import build_parser

    r = Rollouts(prompt_len=[0] * 9, response_len=[5, 30, 8, 2, 25, 1, 4, 6, 7])
    monkeypatch.setattr(mod, "load_trace", lambda spec: ("x", r))  # 9 rollouts, steps of 4
    parser = build_parser("schedule")
    base = ["schedule", "x", "--dp", "2", "--global-batch-size", "4",
            "--max-tokens-per-gpu", "2048"]
    drop = ("dropping 1 trailing rollouts (1 samples) that do not fill a step of "
            "global_batch_size=4")
    n = len(sweeps.policy_pairs(ModelShape.preset("qwen3-8b")))
    for extra, want in (([], f"in {n} of {n} policies: {drop}"),  # every policy: once
                        (["--packing", "first_fit", "--distribution", "strided", "--html",
                          str(tmp_path / "figs")], drop)):  # the figures' schedules: silent
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="varbatch_kit"):
            assert mod.run(parser.parse_args(base + extra)) == 0
        assert [x.getMessage() for x in caplog.records] == [want]


def test_html_figures(trace_file, tmp_path, capsys):
    path, _ = trace_file
    out_dir = tmp_path / "figs"
    rc = main(["schedule", str(path), "--dp", "2", "--packing", "first_fit",
               "--distribution", "strided", "--html", str(out_dir), "--step", "2"])
    assert rc == 0
    names = sorted(p.name for p in out_dir.iterdir())
    assert names == ["balance-first_fit-strided.html", "index.html", "lengths.html",
                     "packing-first_fit-strided.html", "plotly.min.js", "policies.html"]
    page = (out_dir / "packing-first_fit-strided.html").read_text()
    assert 'src="plotly.min.js"' in page and "Plotly.newPlot" in page
    assert "step 2:" in page  # the step asked for
    out = capsys.readouterr().out
    assert "wrote 4 figures and index.html" in out


def test_html_index_links_every_figure(trace_file, tmp_path, capsys):
    path, _ = trace_file
    out_dir = tmp_path / "all"
    assert main(["schedule", str(path), "--dp", "2", "--html", str(out_dir)]) == 0
    out = capsys.readouterr().out
    pages = sorted(p.name for p in out_dir.glob("*.html") if p.name != "index.html")
    pairs = sweeps.policy_pairs(ModelShape.preset("qwen3-8b"))
    assert len(pages) == 2 + 2 * len(pairs)
    assert f"wrote {len(pages)} figures and index.html" in out
    index = (out_dir / "index.html").read_text()
    links = re.findall(r'<a href="([^"]+)">', index)
    assert sorted(links) == pages
    for packing, distribution in pairs:  # one line of description per figure
        assert re.search(rf'<a href="packing-{packing}-{distribution}.html">[^<]+</a>: '
                         rf'{packing} \+ {distribution}: step 0 packed', index)
    assert "<script" not in index  # a plain page
    assert "mean_makespan_ratio" in index and "columns:" in index  # the table and its legend


@pytest.mark.parametrize("step", ["99", "4", "-1"])
def test_step_out_of_range_is_an_error(trace_file, tmp_path, capsys, step):
    path, _ = trace_file
    out_dir = tmp_path / "figs"
    rc = main(["schedule", str(path), "--dp", "2", "--global-batch-size", "16", "--packing",
               "first_fit", "--html", str(out_dir), "--step", step])
    assert rc == 2
    captured = capsys.readouterr()
    assert captured.err == (f"varbatch-kit schedule: error: --step {step} is out of range: "
                            "the schedule has 4 steps, 0..3\n")
    assert captured.out == ""  # nothing printed, no figure written
    assert not out_dir.exists()


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
    path, r = trace_file
    exe = Path(sys.executable).with_name("varbatch-kit")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "varbatch_kit.cli"]
    ok = subprocess.run([*cmd, "schedule", str(path), "--packing", "first_fit",
                         "--distribution", "strided", "--dp", "2"],
                        capture_output=True, text=True, timeout=120, check=False)
    assert ok.returncode == 0, ok.stderr
    assert ok.stderr == ""
    lines = ok.stdout.splitlines()
    assert lines[0] == f"trace small: {r!r}"
    assert lines[1] == ("layout: dp=2 cp=1 vpp=1 mb_group=1 global_batch_size=16 "
                        "max_tokens_per_gpu=16384 (cap 16384); model qwen3-8b")
    assert lines[2].split() == TABLE_COLUMNS
    # exactly one policy row, with the core's numbers (64 rollouts / 4 = 16 per step)
    s = build_schedule(r, ScheduleConfig(dp=2, global_batch_size=16, max_tokens_per_gpu=16384),
                       ModelShape.preset("qwen3-8b"))
    q = step_quality(s)
    cells = lines[3].split()
    assert cells[:2] == ["first_fit", "strided"]
    assert [int(c) for c in cells[2:6]] == [s.num_steps, q["micro_batches"].sum(),
                                            q["mb_lower_bound"].sum(),
                                            q["cap_violations"].sum()]
    col = TABLE_COLUMNS.index
    assert int(cells[col("oversize_alone")]) == q["oversize_alone"].sum()
    assert float(cells[col("max_flops_imbalance")]) == pytest.approx(q["flops_imbalance"].max(),
                                                                     abs=1e-4)
    assert float(cells[col("mean_makespan_ratio")]) == pytest.approx(q["makespan_ratio"].mean(),
                                                                     abs=1e-4)
    assert float(cells[col("schedule_s")]) >= 0
    assert cells[col("slime"):] == ["--use-dynamic-batch-size"]  # the marked cell blank
    assert lines[4] == "" and lines[5] == "columns:"
    assert len(lines) == 6 + len(TABLE_COLUMNS)
    bad = subprocess.run([*cmd, "schedule", str(path) + ".nope"], capture_output=True,
                         text=True, timeout=120, check=False)
    assert bad.returncode == 2
    assert "does not exist" in bad.stderr and "Traceback" not in bad.stderr
    assert bad.stdout == ""
    step = subprocess.run([*cmd, "schedule", str(path), "--packing", "first_fit", "--dp", "2",
                           "--step", "99"], capture_output=True, text=True, timeout=120,
                          check=False)
    assert step.returncode == 2 and step.stdout == ""
    assert step.stderr == ("varbatch-kit schedule: error: --step 99 is out of range: the "
                           "schedule has 4 steps, 0..3\n")


# ------------------------------------------- the batching path (decide_batching)
def layout_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("layout: "))


def test_packing_flag_picks_the_batching_path(trace_file, capsys):
    path, r = trace_file
    assert main(["schedule", str(path), "--dp", "1", "--global-batch-size", "16",
                 "--packing", "static", "--micro-batch-size", "2"]) == 0
    out = capsys.readouterr().out
    assert layout_line(out).startswith("layout: dp=1 cp=1 vpp=1 mb_group=1 "
                                       "global_batch_size=16 micro_batch_size=2;")
    s = build_schedule(r, ScheduleConfig(dp=1, global_batch_size=16, micro_batch_size=2),
                       ModelShape.preset("qwen3-8b"))
    cells = row_of(out, "static", "strided")
    assert int(cells[3]) == sum(len(st.micro_batches) for st in s.steps)


def test_packing_flag_whose_path_lacks_its_size_is_an_error(trace_file, capsys):
    path, _ = trace_file
    assert main(["schedule", str(path), "--dp", "2", "--packing", "static"]) == 2
    err = capsys.readouterr().err
    assert "packing='static' needs micro_batch_size (static batching)" in err


def test_a_packing_that_needs_a_distribution_gets_it(trace_file, capsys):
    path, _ = trace_file
    assert main(["schedule", str(path), "--dp", "2", "--packing", "balanced"]) == 0
    cells = row_of(capsys.readouterr().out, "balanced", "balanced")
    assert int(cells[2]) == 4


def test_a_size_flag_switches_the_slime_path_and_keeps_the_rest(capsys):
    slime = ("--slime-args=--global-batch-size 1024 --use-dynamic-batch-size "
             "--max-tokens-per-gpu 8192 --log-probs-max-tokens-per-gpu 16384 --balance-data")
    assert main(["schedule", "math", "--dp", "2", slime, "--micro-batch-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "global_batch_size=1024 micro_batch_size=2;" in layout_line(out)
    row_of(out, "static", "flops_kk")  # the slime distribution is kept
    assert main(["schedule", "math", "--dp", "2", slime, "--max-tokens-per-gpu", "4096"]) == 0
    assert "max_tokens_per_gpu=4096 (cap 4096)" in layout_line(capsys.readouterr().out)


def test_config_from_the_flags_is_the_with_batching_of_the_base(trace_file):
    from varbatch_kit.cli.main import build_parser
    from varbatch_kit.cli.schedule import _config

    path, r = trace_file
    parser = build_parser("schedule")
    base = ScheduleConfig(dp=16, global_batch_size=16, max_tokens_per_gpu=16384)
    assert _config(parser.parse_args(["schedule", str(path)]), r) == base
    got = _config(parser.parse_args(["schedule", str(path), "--cp", "2", "--vpp", "2",
                                     "--micro-batch-size", "4"]), r)
    assert got == base.with_batching(micro_batch_size=4, cp=2, vpp=2)
    assert (got.batching, got.packing, got.cp, got.vpp) == ("static", "static", 2, 2)
