"""The demo's figure pages: figures the library draws directly, next to the notebook pages.

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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DEMO_RUN", "DEMO_RUN_LAYOUT", "FIGURE_PAGES", "FigurePage", "run_quality_page",
           "write_figure_pages"]

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
