"""``varbatch-kit schedule RUN_DIR``: a whole slime run, one row per rollout step and policy.

``RUN_DIR`` is a folder of slime debug dumps or slime's
``--save-debug-rollout-data`` template (``run/rollout_{rollout_id}.pt``), read
by :func:`varbatch_kit.core.run_dumps.read_run`. Every rollout step is
scheduled on the layout the options give (``--slime-args`` and the flags, as
for one trace; without them the schedule command's defaults, the global batch
size from the first rollout step) with the layout's own policy (slime's, with
``--slime-args``) and with ``balanced``
(:func:`varbatch_kit.analysis.run_quality.run_quality_table`). The table is
printed with its legend; ``--html DIR`` also writes the per-step figure
(:func:`varbatch_kit.ui.viz.run_quality_figure`) and an ``index.html``.
:func:`varbatch_kit.cli.schedule.run` hands run paths here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from varbatch_kit.analysis.run_quality import RUN_QUALITY_COLUMNS, run_quality_table
from varbatch_kit.core.flops import ModelShape
from varbatch_kit.core.run_dumps import read_run

__all__ = ["RUN_TABLE_COLUMNS", "format_run_table", "run_schedule_run", "write_run_figures"]

#: the printed columns, in order
RUN_TABLE_COLUMNS = ["rollout_id", "policy", "slime", "samples", "steps", "dropped_samples",
                     "micro_batches",
                     "cap_violations", "oversize_alone", "flops_imbalance", "makespan_ratio",
                     "time_s", "above_bound_pct"]
_LEGEND = {**RUN_QUALITY_COLUMNS, "slime": "slime's flags for this policy (blank: slime has "
                                           "no such option)"}


def format_run_table(table) -> str:
    """The per-step table as aligned text, then one line per policy that could not run a step,
    then the legend."""
    import pandas as pd

    out = table[[c for c in RUN_TABLE_COLUMNS if c in table.columns]].copy()
    for c, fmt in (("flops_imbalance", "{:.4f}"), ("makespan_ratio", "{:.4f}"),
                   ("time_s", "{:.4g}"), ("above_bound_pct", "{:.2f}")):
        out[c] = out[c].map(lambda v, f=fmt: "" if pd.isna(v) else f.format(v))
    for c in ("samples", "steps", "dropped_samples", "micro_batches", "cap_violations",
              "oversize_alone"):
        out[c] = out[c].map(lambda v: "" if pd.isna(v) else str(int(v)))
    text = out.to_string(index=False)
    for _, row in table[table["error"] != ""].iterrows():
        text += f"\n  rollout step {row['rollout_id']}, {row['policy']}: {row['error']}"
    cols = [c for c in RUN_TABLE_COLUMNS if c in out.columns]
    width = max(map(len, cols))
    return text + "\n\ncolumns:\n" + "\n".join(f"  {c:{width}s}  {_LEGEND[c]}" for c in cols)


def write_run_figures(out: Path, table, *, title: str, summary: str = "") -> list[Path]:
    """Write the per-step figure as ``run-quality.html`` and an ``index.html`` into ``out``."""
    from varbatch_kit.cli.demo import write_index
    from varbatch_kit.ui import viz

    out.mkdir(parents=True, exist_ok=True)
    path = out / "run-quality.html"
    viz.run_quality_figure(table).write_html(path, include_plotlyjs="directory",
                                             full_html=True)
    write_index(out / "index.html", title,
                [(path.name, "run-quality", "simulated time and FLOPs imbalance per rollout "
                  "step, one line per policy")], preformatted=summary)
    return [path]


def run_schedule_run(args: argparse.Namespace, config_for, model: ModelShape) -> int:
    """``schedule`` on a run; ``config_for(args, rollouts)`` is the schedule command's layout
    and ``model`` its ``--model`` (:func:`varbatch_kit.cli.schedule.run` passes its own).
    ``ValueError`` for what the user can fix."""
    from varbatch_kit.analysis.run_quality import BALANCED_POLICY
    from varbatch_kit.compat.slime.flags import SLIME_FLAGS
    from varbatch_kit.policies.registry import get_distribution

    run = read_run(args.trace)
    config = config_for(args, run.steps[0].rollouts)
    if args.distribution is not None:
        get_distribution(args.distribution)
    own = (config.packing, args.distribution or config.distribution)
    pairs = [own] + ([BALANCED_POLICY] if own != BALANCED_POLICY else [])
    table = run_quality_table(run, config, model, pairs, flag_names=SLIME_FLAGS)
    if (table["error"] != "").all():
        raise ValueError(table["error"].iloc[0])
    layout = (f"dp={config.dp} cp={config.cp} vpp={config.vpp} mb_group={config.mb_group} "
              f"global_batch_size={config.global_batch_size} "
              + (f"max_tokens_per_gpu={config.max_tokens_per_gpu}" if config.dynamic
                 else f"micro_batch_size={config.micro_batch_size}"))
    header = f"run {run.pattern}: {run!r}\nlayout: {layout}; model {model.name}"
    text = format_run_table(table)
    print(header)
    print(text)
    if args.html:
        out = Path(args.html)
        write_run_figures(out, table, title=f"varbatch-kit schedule {args.trace}",
                          summary=header + "\n\n" + text)
        print(f"wrote the per-step figure and index.html to {out.resolve()}/; open "
              f"{(out / 'index.html').resolve()}")
    failed = int((table["error"] != "").sum())
    if failed:
        print(f"{failed} (rollout step, policy) rows cannot run this layout (see above)",
              file=sys.stderr)
    return 0
