"""The demo runner on small stand-in notebooks: HTML with figures, summary, failures."""

import nbformat
import pytest

from varbatch_kit.cli import demo

pytestmark = pytest.mark.timeout(300)

FIGURE = """from varbatch_kit import Rollouts, ScheduleConfig, build_schedule, viz, widgets
r = Rollouts.synthetic(64, seed=0)
s = build_schedule(r, ScheduleConfig(dp=2, global_batch_size=32, max_tokens_per_gpu=8192))
viz.packing_figure(s)"""
EXPLORER = "widgets.packing_explorer(r, None, config=s.config)"
VERDICT = 'print("verdict: sound modes layout-invariant: True")'


def notebook(path, *sources, tags=None):
    cells = [nbformat.v4.new_markdown_cell("# A stand-in")]
    for i, src in enumerate(sources):
        c = nbformat.v4.new_code_cell(src)
        if tags and i in tags:
            c.metadata["tags"] = [tags[i]]
        cells.append(c)
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, path)


def test_demo_renders_figures_and_prints_the_summary(tmp_path, capsys):
    nbdir, out = tmp_path / "nb", tmp_path / "out"
    nbdir.mkdir()
    notebook(nbdir / "01_small.ipynb", FIGURE, EXPLORER, VERDICT, tags={2: "verdict"})
    notebook(nbdir / "02_broken.ipynb", "1 / 0", "print('never')")
    rc = demo.main(["--notebooks-dir", str(nbdir), "--out", str(out), "--no-progress"])
    text = capsys.readouterr()
    assert rc == 1  # one notebook failed; the other still ran and rendered
    assert "FAILED 02_broken: cell" in text.err and "ZeroDivisionError" in text.err
    assert "1/2 notebooks ran" in text.out
    assert "verdict: sound modes layout-invariant: True" in text.out
    assert "(not available: notebook 02 did not run or failed)" in text.out
    assert sorted(p.name for p in out.iterdir()) == [
        "01_small.html", "01_small.ipynb", "02_broken.html", "02_broken.ipynb", "plotly.min.js"]

    page = (out / "01_small.html").read_text()
    # plotly.js is loaded once from the file next to the page, before require.js
    assert page.index('<script src="plotly.min.js"></script>') < page.index("require")
    assert page.count("Plotly.newPlot") == 2  # the figure and the explorer's snapshot
    assert 'class="vbk-static"' in page and "vbk-micro-batches" in page
    assert len(page) < 2_000_000  # no inlined copy of plotly.js
    assert "varbatch_kit_demo" not in page  # the injected setup cell is gone

    executed = nbformat.read(out / "01_small.ipynb", as_version=4)
    counts = [c.execution_count for c in executed.cells if c.cell_type == "code"]
    assert counts == [1, 2, 3]
    assert "ZeroDivisionError" in (out / "02_broken.html").read_text()


def test_tagged_text_and_selection(tmp_path, capsys):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x")])
    nb.cells[0].metadata["tags"] = ["verdict"]
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", name="stdout", text="ok\n"),
                           nbformat.v4.new_output("execute_result", data={"text/plain": "1"})]
    assert demo._tagged_text(nb, "verdict") == "ok\n1"
    assert demo._tagged_text(nb, "policy-summary") == ""
    assert demo.main(["--notebooks-dir", str(tmp_path), "--notebooks", "07"]) == 2
    assert "no notebooks to run" in capsys.readouterr().err
