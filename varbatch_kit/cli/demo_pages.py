"""The demo's own pages: the index (:func:`write_index`) and the figures the library draws
directly, next to the notebook pages.

``make demo`` (:func:`varbatch_kit.cli.demo.main`) writes every page of
:data:`FIGURE_PAGES` into its output folder with :func:`write_figure_pages`
and links them from ``index.html`` after the notebooks. Each page is one
figure computed by library calls (no notebook), so it also renders from an
installed wheel: the data it reads ship in ``data/``.

- ``run-quality``: the bundled slime run (``data/runs/slime_debug``: eight
  rollout steps written by slime's own ``save_debug_rollout_data``), read by
  :func:`varbatch_kit.core.run_dumps.read_run`, scheduled per rollout step with
  slime's ``--use-dynamic-batch-size`` policy and ``balanced``
  (:func:`varbatch_kit.analysis.run_quality.run_quality_table`) and drawn by
  :func:`varbatch_kit.ui.viz.run_quality_figure`. The same table prints with
  ``varbatch-kit schedule <that folder> --dp 2 --max-tokens-per-gpu 64
  --global-batch-size 4``.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DEMO_RUN", "DEMO_RUN_LAYOUT", "FIGURE_PAGES", "INDEX_CSS", "OVERVIEW_HEADER",
           "FigurePage", "run_quality_page", "write_figure_pages", "write_index"]

#: the bundled run the ``run-quality`` page reads (a key of ``bundled_runs()``)
DEMO_RUN = "slime_debug"
#: its layout: the dumps are small (up to 56 tokens a sample), so a small cap and dp 2
DEMO_RUN_LAYOUT = {"dp": 2, "max_tokens_per_gpu": 64, "global_batch_size": 4}


@dataclass(frozen=True)
class FigurePage:
    """One page of the demo: ``<name>.html`` holding ``build()``'s figure."""

    name: str
    description: str
    build: Callable[[], object]


def run_quality_page():
    """The per-rollout-step figure of the bundled slime run (see the module doc)."""
    from varbatch_kit.analysis.run_quality import run_quality_table
    from varbatch_kit.core.config import ScheduleConfig
    from varbatch_kit.core.flops import ModelShape
    from varbatch_kit.core.run_dumps import bundled_runs, read_run
    from varbatch_kit.ui import viz

    run = read_run(bundled_runs()[DEMO_RUN])
    table = run_quality_table(run, ScheduleConfig(**DEMO_RUN_LAYOUT),
                              ModelShape.preset("qwen3-8b"))
    return viz.run_quality_figure(
        table, title=f"a slime run, {len(run)} rollout steps (data/runs/{DEMO_RUN}): simulated "
                     "time and FLOPs imbalance per step, slime's --use-dynamic-batch-size "
                     "against balanced (dp 2, max_tokens_per_gpu 64, Qwen3-8B)")


#: the figure pages the demo writes, in index order
FIGURE_PAGES: tuple[FigurePage, ...] = (
    FigurePage("run-quality",
               "a whole slime run read from its dumps: simulated time and FLOPs imbalance per "
               "rollout step, slime's policy against balanced", run_quality_page),
)


def write_figure_pages(out_dir: Path, pages: Sequence[FigurePage] = FIGURE_PAGES
                       ) -> list[tuple[str, str, str, str]]:
    """Write each page as ``out_dir/<name>.html`` (plotly.js from ``plotly.min.js`` beside it).

    Returns ``(href, name, description, error)`` per page; a page whose
    figure fails is not written and carries the error (``""`` when it was
    written), so the demo reports it and goes on.
    """
    written = []
    for page in pages:
        path = out_dir / f"{page.name}.html"
        try:
            page.build().write_html(path, include_plotlyjs="directory", full_html=True)
            error = ""
        except Exception as e:  # noqa: BLE001 - reported in the index and the exit status
            error = f"{type(e).__name__}: {e}"
        written.append((path.name, page.name, page.description, error))
    return written


#: the columns of :data:`varbatch_kit.cli.demo.NOTEBOOK_OVERVIEW` (the index page's table;
#: README.md has the same)
OVERVIEW_HEADER = ("notebook", "track", "what it shows", "needs", "GPU",
                   "time on a 2-core CPU")


#: the index pages' style: the printed tables (a policy table is ~190 characters wide) get a
#: smaller monospace font and scroll sideways inside the page instead of being cut off
INDEX_CSS = ("body{font-family:sans-serif;max-width:90em;margin:2em auto;padding:0 1em}"
             "li{margin:.4em 0}"
             "table.overview{border-collapse:collapse;margin:1em 0;font-size:14px}"
             "table.overview td,table.overview th{border:1px solid #ccc;padding:.3em .6em;"
             "text-align:left;vertical-align:top}"
             "pre{background:#f6f6f6;padding:1em;font-size:12px;line-height:1.35;"
             "overflow-x:auto;max-width:100%;box-sizing:border-box;white-space:pre}")


def write_index(path: Path, title: str, entries: Sequence[tuple[str, str, str]], *,
                preformatted: str = "", footer: str = "",
                overview: Sequence[Sequence[str]] = ()) -> Path:
    """Write a plain HTML page linking ``entries`` (``(href, name, one-line description)``).

    ``overview``: rows of a table shown above the list (:data:`OVERVIEW_HEADER`'s columns,
    e.g. :data:`varbatch_kit.cli.demo.NOTEBOOK_OVERVIEW`). ``preformatted`` (e.g. a printed
    table) is shown under the list as ``<pre>`` (:data:`INDEX_CSS`: small font, scrolls
    sideways when wider than the page); everything is escaped, the page loads nothing.
    """
    e = html.escape
    table = ""
    if overview:
        head = "".join(f"<th>{e(h)}</th>" for h in OVERVIEW_HEADER)
        rows = "\n".join("  <tr>" + "".join(f"<td>{e(str(v))}</td>" for v in row) + "</tr>"
                         for row in overview)
        table = f'<table class="overview">\n  <tr>{head}</tr>\n{rows}\n</table>\n'
    items = "\n".join(f'  <li><a href="{e(href, quote=True)}">{e(name)}</a>: {e(what)}</li>'
                       for href, name, what in entries)
    pre = f"<pre>{e(preformatted)}</pre>\n" if preformatted else ""
    foot = f"<p>{e(footer)}</p>\n" if footer else ""
    page = (f"<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>{e(title)}</title>\n<style>{INDEX_CSS}</style>\n</head>\n<body>\n"
            f"<h1>{e(title)}</h1>\n{table}"
            f"<ul>\n{items}\n</ul>\n{pre}{foot}</body>\n</html>\n")
    path.write_text(page, encoding="utf-8")
    return path
