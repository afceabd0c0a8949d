"""The demo runner on small stand-in notebooks: HTML with figures, an index page, a summary
computed by the library (not read back from the notebooks), failures."""

import re

import nbformat
import pandas as pd
import pytest

from varbatch_kit import ModelShape
from varbatch_kit.analysis import invariance, sweeps
from varbatch_kit.cli import demo, demo_pages
from varbatch_kit.core.traces import bundled_traces, read_trace

pytestmark = pytest.mark.timeout(300)

FIGURE = """from varbatch_kit import Rollouts, ScheduleConfig, build_schedule
from varbatch_kit.ui import viz, widgets
r = Rollouts.synthetic(64, seed=0)
s = build_schedule(r, ScheduleConfig(dp=2, global_batch_size=32, max_tokens_per_gpu=8192))
viz.packing_figure(s)"""
EXPLORER = "widgets.packing_explorer(r, None, config=s.config)"
# a printout that looks like notebook 06's verdict, in a cell tagged as the old demo expected:
# the demo must not take its summary from it
VERDICT = 'print("verdict: sound modes layout-invariant: True")'
# a tqdm.auto bar, as notebooks 05/06 show while training: the page must show its final state
PROGRESS = "from tqdm.auto import tqdm\nfor _ in tqdm(range(272), desc='training'): pass"


def notebook(path, *sources, tags=None, title="A stand-in"):
    cells = [nbformat.v4.new_markdown_cell(f"# {title}\n\nSome text.")]
    for i, src in enumerate(sources):
        c = nbformat.v4.new_code_cell(src)
        if tags and i in tags:
            c.metadata["tags"] = [tags[i]]
        cells.append(c)
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, path)


def test_demo_renders_figures_an_index_and_the_summary(tmp_path, capsys):
    nbdir, out = tmp_path / "nb", tmp_path / "out"
    nbdir.mkdir()
    notebook(nbdir / "01_small.ipynb", FIGURE, EXPLORER, VERDICT, PROGRESS, tags={2: "verdict"},
             title="01 · A small figure")
    notebook(nbdir / "02_broken.ipynb", "1 / 0", "print('never')", title="02 · Broken")
    rc = demo.main(["--notebooks-dir", str(nbdir), "--out", str(out), "--no-progress"])
    text = capsys.readouterr()
    assert rc == 1  # one notebook failed; the other still ran and rendered
    assert "FAILED 02_broken: cell" in text.err and "ZeroDivisionError" in text.err
    assert "1/2 notebooks ran" in text.out
    # the summary is not scraped from printouts: notebooks 02 and 06 did not run
    assert "verdict: sound modes layout-invariant" not in text.out
    assert "(not available: notebook 02 did not run or failed)" in text.out
    assert "(not available: notebook 06 did not run or failed)" in text.out
    assert sorted(p.name for p in out.iterdir()) == [
        "01_small.html", "01_small.ipynb", "02_broken.html", "02_broken.ipynb", "index.html",
        "plotly.min.js", "run-quality.html"]  # the last: a figure page, drawn without a notebook
    assert f"open {out / 'index.html'} in a browser" in text.out

    page = (out / "01_small.html").read_text()
    # plotly.js is loaded once from the file next to the page, before require.js
    assert page.index('<script src="plotly.min.js"></script>') < page.index("require")
    assert page.count("Plotly.newPlot") == 2  # the figure and the explorer's snapshot
    assert 'class="vbk-static"' in page and "vbk-micro-batches" in page
    assert len(page) < 2_000_000  # no inlined copy of plotly.js
    assert "varbatch_kit_demo" not in page  # the injected setup cell is gone
    assert "272/272" in page and "0/272" not in page  # the bar's final state, not its first
    assert "without encryption" not in text.err  # the kernel's TCP warning is left out

    index = (out / "index.html").read_text()
    links = re.findall(r'<li><a href="([^"]+)">[^<]+</a>: ([^<]+)</li>', index)
    assert sorted(href for href, _ in links) == sorted(p.name for p in out.glob("*.html")
                                                      if p.name != "index.html")
    described = dict(links)
    assert described["01_small.html"].startswith("01 · A small figure (ran, ")
    assert described["02_broken.html"].startswith("02 · Broken (FAILED, ")
    assert described["run-quality.html"].startswith("a whole slime run read from its dumps")
    assert "run-quality                    figure page  ok" in text.out
    assert "(not available: notebook 06 did not run or failed)" in index

    executed = nbformat.read(out / "01_small.ipynb", as_version=4)
    counts = [c.execution_count for c in executed.cells if c.cell_type == "code"]
    assert counts == [1, 2, 3, 4]
    assert "ZeroDivisionError" in (out / "02_broken.html").read_text()


def test_summary_sections_follow_the_notebooks_that_ran(monkeypatch):
    calls = []
    fake = (("02", "policies", lambda progress: calls.append("02") or "policy text"),
            ("06", "verdict", lambda progress: calls.append("06") or "verdict text"))
    monkeypatch.setattr(demo, "SUMMARIES", fake)
    runs = [demo.NotebookRun("02_dp", ok=True), demo.NotebookRun("06_inv", ok=False)]
    assert demo._summary(runs, progress=False) == [
        ("policies", "policy text"),
        ("verdict", "  (not available: notebook 06 did not run or failed)")]
    assert calls == ["02"]

    def broken(progress):
        raise RuntimeError("no workers")

    monkeypatch.setattr(demo, "SUMMARIES", (("02", "policies", broken),))
    assert demo._summary(runs, progress=False) == [
        ("policies", "  (failed: RuntimeError: no workers)")]


def test_policy_summary_is_the_library_pivot():
    traces = {name: read_trace(path) for name, path in bundled_traces().items()}
    table = sweeps.policy_table_by_trace(traces, ModelShape.preset("qwen3-8b"), dp=16,
                                         max_tokens_per_gpu=16384, steps=4)
    pivot = sweeps.policy_pivot(table)
    text = demo.policy_summary()
    assert text == pivot.to_string(float_format="{:.4f}".format)
    lines = text.splitlines()
    assert lines[0].split() == [w for c in pivot.columns for w in c.split()]
    first_fit = next(line for line in lines if line.startswith("first_fit + strided"))
    row = table[(table.trace == "math") & (table.packing == "first_fit")
                & (table.distribution == "strided")].iloc[0]
    assert f"{row.mean_makespan_ratio:.4f}" in first_fit


def test_invariance_summary_trains_the_library_matrix_and_judges_it(monkeypatch):
    pytest.importorskip("varbatch_kit.train")
    from varbatch_kit.train.runs import comparison

    seen = {}

    def fake_compare(configs, rollouts, progress=True, **kwargs):
        seen["configs"], seen["rollouts"] = configs, rollouts
        rows = []
        for k, c in enumerate(configs):
            ref = next(j for j, d in enumerate(configs) if d.mode == c.mode)
            drift = 0.0 if k == ref else (1e-7 if c.mode in ("per_rollout_mean", "per_token")
                                          else 0.2)
            rows.append({"config": k, "reference": ref, "mode": c.mode, "step": 1,
                         "loss_rel_diff": drift, "grad_norm_rel_diff": drift,
                         "param_rel_diff": drift})
        return pd.DataFrame(rows)

    # caching off (a fake table must never reach a shared cache): the summary trains, through
    # the engine's compare
    monkeypatch.delenv("VARBATCH_KIT_CACHE", raising=False)
    monkeypatch.setattr(comparison, "compare", fake_compare)
    text = demo.invariance_summary()
    experiment = invariance.invariance_experiment()
    assert [(c.schedule, c.mode) for c in seen["configs"]] == experiment.runs()
    assert len(seen["rollouts"]) == len(experiment.rollouts)
    assert text.splitlines() == [
        "per_rollout_mean       identical across layouts",
        "per_token              identical across layouts",
        "naive_microbatch_mean  drifts with the layout, as expected",
        "naive_rank_mean        drifts with the layout, as expected",
        "verdict: sound modes layout-invariant: True; naive modes drift: True"]


def test_titles_index_and_selection(tmp_path, capsys):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x"),
                                         nbformat.v4.new_markdown_cell("intro\n# 03 · Title")])
    assert demo.notebook_title(nb) == "03 · Title"
    assert demo.notebook_title(nbformat.v4.new_notebook()) == ""
    page = demo_pages.write_index(tmp_path / "index.html", "T <&>", [("a b.html", "a", "x < y")],
                            preformatted="<pre>")
    html = page.read_text()
    assert '<a href="a b.html">a</a>: x &lt; y' in html and "<h1>T &lt;&amp;&gt;</h1>" in html
    assert "<pre>&lt;pre&gt;</pre>" in html
    assert demo.main(["--notebooks-dir", str(tmp_path), "--notebooks", "07"]) == 2
    assert "no notebooks to run" in capsys.readouterr().err


def test_demo_settings_change_the_settings_cell_and_the_pages_say_so(tmp_path, capsys,
                                                                     monkeypatch):
    """A notebook of DEMO_SETTINGS runs with those values in its settings cell (the same
    set_parameters the notebook tests use); its page and the index say what changed; the index
    opens with the overview table of the notebooks that ran."""
    nbdir, out = tmp_path / "nb", tmp_path / "out"
    nbdir.mkdir()
    path = nbdir / "06_stand_in.ipynb"
    notebook(path, "# Settings: the one cell to edit\nRUNS = 21  # the full matrix\n",
             "print(f'trained {RUNS} runs')", tags={0: "parameters"}, title="06 · Stand-in")
    monkeypatch.setattr(demo, "DEMO_SETTINGS", {"06_stand_in": ({"RUNS": 10},
                                                                "a smaller matrix (10 runs)")})
    monkeypatch.setattr(demo, "SUMMARIES", ())
    assert demo.main(["--notebooks-dir", str(nbdir), "--out", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "06_stand_in" in text and "(demo settings: RUNS)" in text
    executed = nbformat.read(out / "06_stand_in.ipynb", as_version=4)
    assert executed.cells[1].source.startswith("# Settings") and "RUNS = 10" in \
        executed.cells[1].source
    assert executed.cells[2].cell_type == "markdown"
    assert "ran this notebook with its settings changed" in executed.cells[2].source
    assert "a smaller matrix (10 runs)" in executed.cells[2].source
    assert "trained 10 runs" in executed.cells[3].outputs[0]["text"]
    page = (out / "06_stand_in.html").read_text()
    assert "a smaller matrix (10 runs)" in page and "trained 10 runs" in page
    index = (out / "index.html").read_text()
    assert "ran with a smaller matrix (10 runs)" in index
    assert '<table class="overview">' in index and "<th>time on a 2-core CPU</th>" in index
    row = next(r for r in demo.NOTEBOOK_OVERVIEW if r[0] == "06")
    assert f"<td>06_stand_in</td><td>{row[1]}</td>" in index  # only the notebooks that ran
    assert "<td>01_" not in index
    # the source notebook is untouched
    assert "RUNS = 21" in nbformat.read(path, as_version=4).cells[1].source
