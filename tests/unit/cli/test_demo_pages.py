"""The demo's figure pages (:mod:`varbatch_kit.cli.demo_pages`): the per-rollout-step figure of
the bundled slime run is one of them, and renders."""

import numpy as np

from varbatch_kit.cli import demo_pages
from varbatch_kit.core.run_dumps import bundled_runs, read_run


def test_the_page_list_includes_the_run_figure():
    names = [p.name for p in demo_pages.FIGURE_PAGES]
    assert "run-quality" in names
    page = demo_pages.FIGURE_PAGES[names.index("run-quality")]
    assert page.build is demo_pages.run_quality_page


def test_the_bundled_run_is_slimes_dumps_in_rollout_order():
    run = read_run(bundled_runs()[demo_pages.DEMO_RUN])
    assert run.rollout_ids == list(range(1, 9))
    assert [len(s.rollouts) for s in run] == [6, 9, 13, 11, 5, 9, 12, 16]


def test_the_run_page_renders_a_line_per_policy_over_the_steps(tmp_path):
    fig = demo_pages.run_quality_page()
    top = [t for t in fig.data if t.xaxis == "x"]
    assert [t.name for t in top] == ["first_fit + strided", "balanced + balanced"]
    assert all(list(t.x) == list(range(1, 9)) for t in top)
    ff, bal = (np.asarray(t.y, dtype=float) for t in top)
    assert np.isfinite(ff).all() and np.isfinite(bal).all()
    assert (bal <= ff + 1e-12).all() and (bal < ff).sum() >= 6  # balanced is faster per step
    written = demo_pages.write_figure_pages(tmp_path)
    assert written[0][0] == "run-quality.html" and written[0][3] == ""
    html = (tmp_path / "run-quality.html").read_text()
    assert 'src="plotly.min.js"' in html and "balanced + balanced" in html
    assert (tmp_path / "plotly.min.js").is_file()


def test_a_failing_page_is_reported_not_raised(tmp_path):
    def broken():
        raise ValueError("no figure")

    bad = demo_pages.FigurePage("broken", "a page that fails", broken)
    assert demo_pages.write_figure_pages(tmp_path, [bad]) == [
        ("broken.html", "broken", "a page that fails", "ValueError: no figure")]
    assert not (tmp_path / "broken.html").exists()
