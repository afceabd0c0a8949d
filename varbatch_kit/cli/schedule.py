"""``varbatch-kit schedule TRACE``: schedule a rollout trace, print the quality table.

Examples::

    varbatch-kit schedule math                       # a bundled trace, every policy
    varbatch-kit schedule run.jsonl --dp 16 --max-tokens-per-gpu 16384 \\
        --packing first_fit --distribution flops_kk --html build/figs
    varbatch-kit schedule run.jsonl --dp 8 --slime-args="--global-batch-size 256 \\
        --use-dynamic-batch-size --max-tokens-per-gpu 16384 --balance-data"

With ``--slime-args`` the flags set the layout and the table still compares
every policy of their batching path; the ``marked`` column shows the row of
the flags' own policy (``slime``) and, with ``--packing`` / ``--distribution``,
the rows those name (``packing``), so ``--slime-args=... --packing balanced``
compares slime's choice with ``balanced`` on slime's layout. Without
``--slime-args``, ``--packing`` / ``--distribution`` pick the one row shown.
Samples longer than the token cap are counted (``oversize_alone``) and warned
about once on stderr.

The table is computed by :mod:`varbatch_kit.analysis.sweeps` and printed with a
legend of its columns; plotly is imported only with ``--html``, which writes
one page per figure and an ``index.html`` linking them.

A bad layout, a missing or malformed trace, an unknown policy or a
``--step`` the schedule does not have is a ``ValueError``: the dispatcher in
:mod:`varbatch_kit.cli` prints the message on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any

from varbatch_kit.analysis import sweeps
from varbatch_kit.analysis.quality import OVER_CAP_HELP
from varbatch_kit.checks import int_in_range
from varbatch_kit.compat.slime.flags import SLIME_FLAGS, schedule_config_from_slime_args
from varbatch_kit.core.build import OversizeSampleWarning
from varbatch_kit.core.config import ScheduleConfig
from varbatch_kit.core.flops import ModelShape, as_model_shape, available_presets
from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.core.run_dumps import is_run_path
from varbatch_kit.core.traces import bundled_traces, read_trace

__all__ = ["COLUMN_LEGEND", "add_parser", "check_step", "format_legend", "format_table",
           "load_model", "load_trace", "policy_rows", "run", "write_figures"]

TABLE_COLUMNS = ["packing", "distribution", "steps", "micro_batches", "mb_lower_bound",
                 "cap_violations", "oversize_alone", "max_flops_imbalance",
                 "mean_mb_makespan_ratio", "mean_makespan_ratio", "schedule_s", "slime", "marked"]

#: what each column of the table means, and its unit (printed under the table)
COLUMN_LEGEND = {
    "packing": "how a step's samples become micro-batches (policy name)",
    "distribution": "how the micro-batches are dealt to the DP ranks (policy name)",
    "steps": "training steps of global_batch_size rollouts each (count)",
    "micro_batches": "micro-batches over all steps and ranks (count)",
    "mb_lower_bound": "fewest micro-batches the cap allows: sum over steps of "
                      "ceil(step tokens / cap) (count; blank without a cap)",
    **OVER_CAP_HELP,  # cap_violations, oversize_alone: the words of every table and figure
    "max_flops_imbalance": "busiest rank's forward FLOPs / the mean rank's, worst step "
                           "(ratio; 1 = even)",
    "mean_mb_makespan_ratio": "busiest rank's FLOPs / the bound for this packing, max(step "
                              "FLOPs / dp, largest micro-batch), mean over steps (ratio; 1 = "
                              "the best distribution of these micro-batches)",
    "mean_makespan_ratio": "busiest rank's FLOPs / the bound for any packing, max(step FLOPs / "
                           "dp, largest sample), mean over steps (ratio; 1 = optimal)",
    "schedule_s": "CPU time to build the schedule (seconds)",
    "slime": "slime's flags for this policy (blank: slime has no such option)",
    "marked": "rows the options name: slime = the policy of --slime-args, packing = the "
              "--packing/--distribution ones (text; blank: neither)",
}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``schedule`` subcommand to the dispatcher's subparsers."""
    p = subparsers.add_parser(
        "schedule", help="schedule a rollout trace and print the quality of each policy",
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="TRACE is a .jsonl/.parquet/slime .pt file or a bundled trace name: "
               + ", ".join(bundled_traces()) + "; or a run: a folder of slime dumps or slime's "
               "--save-debug-rollout-data template (run/rollout_{rollout_id}.pt), one row per "
               "rollout step for the layout's policy and balanced")
    p.add_argument("trace", metavar="TRACE", help="trace file or bundled trace name")
    p.add_argument("--dp", type=int, default=None, help="data-parallel size (default 16)")
    p.add_argument("--cp", type=int, default=None, help="context-parallel size (default 1)")
    p.add_argument("--vpp", type=int, default=None, help="virtual pipeline size (default 1)")
    p.add_argument("--mb-group", type=int, default=None,
                   help="micro-batches grouped per virtual-pipeline stage (default 1)")
    p.add_argument("--global-batch-size", type=int, default=None,
                   help="rollouts per step (default: a quarter of the rollouts, i.e. 4 steps)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--max-tokens-per-gpu", type=int, default=None,
                      help="token cap per GPU: dynamic batching (default 16384)")
    size.add_argument("--micro-batch-size", type=int, default=None,
                      help="samples per micro-batch: static batching")
    p.add_argument("--packing", default=None,
                   help="one packing (default: compare every registered one); it picks the "
                        "batching path: 'static' uses --micro-batch-size, the others the token "
                        "cap. With --slime-args every policy is still compared and this one "
                        "is marked")
    p.add_argument("--distribution", default=None,
                   help="one distribution (default: compare every registered one)")
    p.add_argument("--slime-args", default=None, metavar="FLAGS",
                   help="take the layout from a slime command line, written "
                        "--slime-args='--global-batch-size 64 ...' (flags given here override "
                        "it); every policy is compared, the flags' own marked 'slime'")
    p.add_argument("--model", default="qwen3-8b",
                   help=f"model shape preset ({', '.join(available_presets())}) or a Hugging "
                        "Face config.json path (default qwen3-8b)")
    p.add_argument("--html", default=None, metavar="DIR",
                   help="also write the figures as HTML files into DIR")
    p.add_argument("--step", type=int, default=0,
                   help="step drawn in the packing figures of --html (default 0; must be one "
                        "of the schedule's steps)")
    p.set_defaults(func=run)
    return p


def load_trace(spec: str) -> tuple[str, Rollouts]:
    """A trace by path, or by bundled name; returns ``(name, rollouts)``."""
    bundled = bundled_traces()
    if spec in bundled and not Path(spec).exists():
        return spec, read_trace(bundled[spec])
    return Path(spec).stem, read_trace(spec)


def load_model(spec: str) -> ModelShape:
    """A model shape preset by name, or a Hugging Face ``config.json`` path."""
    return as_model_shape(spec, name="--model")


#: the layout when neither the flags nor ``--slime-args`` give one (the cap: dynamic batching)
DEFAULT_DP = 16
DEFAULT_MAX_TOKENS_PER_GPU = 16384


def _config(args: argparse.Namespace, rollouts: Rollouts) -> ScheduleConfig:
    """The config the options describe: ``--slime-args`` (or the defaults) changed by the flags.

    The batching path is decided by :meth:`ScheduleConfig.with_batching`:
    ``--micro-batch-size`` -> static, ``--max-tokens-per-gpu`` -> dynamic, a
    ``--packing`` its own path (with the base's size when no size flag is
    given); none of them keeps the base's path (dynamic, cap 16384, without
    ``--slime-args``). Every field no flag names is the base's. With
    ``--slime-args`` the flags' own policy stays in the config: a
    ``--packing`` there only picks the rows to mark (:func:`policy_rows`).
    """
    if args.slime_args is not None:
        base = schedule_config_from_slime_args(args.slime_args, dp=args.dp or None)
        packing = None
    else:
        base = ScheduleConfig(dp=DEFAULT_DP, global_batch_size=max(1, rollouts.num_rollouts // 4),
                              max_tokens_per_gpu=DEFAULT_MAX_TOKENS_PER_GPU)
        packing = args.packing
    layout = {name: getattr(args, name)
              for name in ("dp", "cp", "vpp", "mb_group", "global_batch_size")
              if getattr(args, name) is not None}
    return base.with_batching(micro_batch_size=args.micro_batch_size,
                              max_tokens_per_gpu=args.max_tokens_per_gpu, packing=packing,
                              **layout)


def policy_rows(args: argparse.Namespace, config: ScheduleConfig, model: ModelShape
                ) -> tuple[list[tuple[str, str]], dict[tuple[str, str], str]]:
    """The ``(packing, distribution)`` rows of the table and the ``marked`` text of some.

    Without ``--slime-args``: ``--packing`` / ``--distribution`` name one row
    (their config's), else every registered pair of the config's path. With
    ``--slime-args``: every pair of the path the flags set, the flags' own
    policy marked ``slime``; ``--packing`` / ``--distribution`` mark the pairs
    they name ``packing`` (a packing of the other batching path is a
    ``ValueError`` saying which flag sets the path).
    """
    from varbatch_kit.policies.registry import get_distribution, get_packer

    if args.distribution is not None:
        get_distribution(args.distribution)
    if args.slime_args is None:
        if args.packing is not None or args.distribution is not None:
            return [(config.packing, args.distribution or config.distribution)], {}
        return sweeps.policy_pairs(model, dynamic=config.dynamic), {}
    pairs = sweeps.policy_pairs(model, dynamic=config.dynamic)
    own = (config.packing, config.distribution)
    if own not in pairs:
        pairs.insert(0, own)
    marks = {own: "slime"}
    if args.packing is not None or args.distribution is not None:
        if args.packing is not None and get_packer(args.packing).dynamic != config.dynamic:
            path = "dynamic" if config.dynamic else "static"
            raise ValueError(
                f"--packing {args.packing!r} is not a {path}-batching packing, and --slime-args "
                f"{'with' if config.dynamic else 'without'} --use-dynamic-batch-size set the "
                f"{path} path: pick one of "
                f"{', '.join(sorted({p for p, _ in pairs}))} (or give --micro-batch-size / "
                "--max-tokens-per-gpu to switch the path)")
        named = [pq for pq in pairs if (args.packing in (None, pq[0]))
                 and (args.distribution in (None, pq[1]))]
        if not named:  # a pair the registry does not list together: compare it as asked
            named = [(args.packing or config.packing, args.distribution or config.distribution)]
            pairs += named
        for pq in named:
            marks[pq] = "slime,packing" if pq == own else "packing"
    return pairs, marks


def format_table(table) -> str:
    """The policy table as aligned text (numbers rounded for reading)."""
    import pandas as pd

    df = table.copy()
    cols = [c for c in TABLE_COLUMNS if c in df.columns]
    out = df[cols].copy()
    for c in ("max_flops_imbalance", "mean_mb_makespan_ratio", "mean_makespan_ratio"):
        if c in out:
            out[c] = out[c].map(lambda v: "" if pd.isna(v) else f"{v:.4f}")
    if "schedule_s" in out:
        out["schedule_s"] = out["schedule_s"].map(lambda v: f"{v:.3f}")
    for c in ("steps", "micro_batches", "mb_lower_bound", "cap_violations", "oversize_alone"):
        if c in out:
            out[c] = out[c].map(lambda v: "" if pd.isna(v) else str(int(v)))
    text = out.to_string(index=False)
    errors = df[df.get("error", "") != ""] if "error" in df.columns else df.iloc[:0]
    for _, row in errors.iterrows():
        text += f"\n  {row['packing']} + {row['distribution']}: {row['error']}"
    return text


def format_legend(columns=TABLE_COLUMNS) -> str:
    """One line per column of the table: what it means and its unit."""
    cols = [c for c in columns if c in COLUMN_LEGEND]
    width = max(len(c) for c in cols)
    return "columns:\n" + "\n".join(f"  {c:{width}s}  {COLUMN_LEGEND[c]}" for c in cols)


def check_step(step: int, num_steps: int) -> int:
    """``step`` if the schedule has it, else a ``ValueError`` naming the valid range.

    :func:`varbatch_kit.checks.int_in_range` (the check of ``Schedule.step``)
    with the flag's name; ``num_steps`` comes from the policy table, before any
    schedule is kept.
    """
    return int_in_range("--step", step, 0, num_steps,
                        what=f"the schedule has {num_steps} step{'s' if num_steps != 1 else ''}, "
                             f"0..{num_steps - 1}")


def run(args: argparse.Namespace) -> int:
    """Run the subcommand; ``ValueError`` for anything the user can fix."""
    if is_run_path(args.trace):
        return _run_of_dumps(args)
    name, rollouts = load_trace(args.trace)
    model = load_model(args.model)
    config = _config(args, rollouts)  # holds --packing (checked there)
    pairs, marks = policy_rows(args, config, model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", OversizeSampleWarning)
        table = sweeps.policy_table(rollouts, config, model, pairs, flag_names=SLIME_FLAGS)
    for message in dict.fromkeys(str(w.message) for w in caught
                                 if issubclass(w.category, OversizeSampleWarning)):
        print(f"varbatch-kit schedule: warning: {message}", file=sys.stderr)
    for w in caught:  # any other warning as Python would show it
        if not issubclass(w.category, OversizeSampleWarning):
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    table["marked"] = [marks.get((p, d), "") for p, d in zip(table["packing"],
                                                             table["distribution"])]
    ok = table[table["error"] == ""]
    if ok.empty:
        # every policy failed: the layout itself is impossible; say why once
        raise ValueError(table["error"].iloc[0])
    check_step(args.step, int(ok["steps"].iloc[0]))
    layout = (f"dp={config.dp} cp={config.cp} vpp={config.vpp} mb_group={config.mb_group} "
              f"global_batch_size={config.global_batch_size} "
              + (f"max_tokens_per_gpu={config.max_tokens_per_gpu} (cap {config.cap})"
                 if config.batching == "dynamic"
                 else f"micro_batch_size={config.micro_batch_size}"))
    header = f"trace {name}: {rollouts!r}\nlayout: {layout}; model {model.name}"
    text = format_table(table) + "\n\n" + format_legend()
    print(header)
    print(text)
    if args.html:
        out = Path(args.html)
        paths = write_figures(out, rollouts, config, model, table, step=args.step,
                              title=f"varbatch-kit schedule {name}",
                              summary=header + "\n\n" + text)
        print(f"wrote {len(paths)} figures and index.html to {out.resolve()}/; open "
              f"{(out / 'index.html').resolve()}")
    if len(ok) < len(table):
        print(f"{len(table) - len(ok)} policies cannot run this layout (see above)",
              file=sys.stderr)
    return 0


def _run_of_dumps(args: argparse.Namespace) -> int:
    """A folder of slime dumps or slime's template: a row per rollout step and policy
    (:mod:`varbatch_kit.cli.schedule_run`, on the layout :func:`_config` gives)."""
    from varbatch_kit.cli.schedule_run import run_schedule_run

    return run_schedule_run(args, _config, load_model(args.model))


def write_figures(out: Path, rollouts: Rollouts, config: ScheduleConfig, model: ModelShape,
                  table, *, step: int = 0, title: str = "varbatch-kit schedule",
                  summary: str = "") -> list[Path]:
    """Write the length, policy, packing and balance figures as HTML files into ``out``.

    plotly.js is written once next to them (``plotly.min.js``), so the files
    open offline and stay small; ``index.html`` links every figure with one
    line saying what it shows, under ``summary`` (the printed table). Returns
    the figure files (not the index). A ``step`` the schedule does not have
    is a ``ValueError``.
    """
    from varbatch_kit.analysis.warn_once import warn_once
    from varbatch_kit.cli.demo import write_index
    from varbatch_kit.core.build import build_schedule
    from varbatch_kit.ui import viz

    out.mkdir(parents=True, exist_ok=True)
    figs = {"lengths": (viz.length_figure(rollouts, model),
                        "length distribution: share of samples, tokens and FLOPs per length "
                        "bin, and forward FLOPs per token against length"),
            "policies": (viz.policy_figure(table),
                         "every policy side by side: busiest rank against the bound for any "
                         "packing, micro-batch count against ceil(tokens / cap), micro-batches "
                         "over the cap")}
    ok = table[table["error"] == ""]
    with warn_once("figures", hold_back=True) as tally:  # the table's run has said them once
        scheds = []
        for _, row in ok.iterrows():
            with tally.case():
                scheds.append(build_schedule(rollouts, config.with_(
                    packing=row["packing"], distribution=row["distribution"]), model))
    for (_, row), sched in zip(ok.iterrows(), scheds):
        policy = f"{row['packing']} + {row['distribution']}"
        tag = f"{row['packing']}-{row['distribution']}"
        figs[f"packing-{tag}"] = (viz.packing_figure(sched, check_step(step, sched.num_steps)),
                                  f"{policy}: step {step} packed into micro-batches, grouped "
                                  "by DP rank, the token cap and over-cap micro-batches marked")
        figs[f"balance-{tag}"] = (viz.balance_figure(sched),
                                  f"{policy}: forward FLOPs and tokens per DP rank per step, "
                                  "with the bound for this packing on the busiest rank")
    paths, entries = [], []
    for fname, (fig, what) in figs.items():
        path = out / f"{fname}.html"
        fig.write_html(path, include_plotlyjs="directory", full_html=True)
        paths.append(path)
        entries.append((path.name, fname, what))
    write_index(out / "index.html", title, entries, preformatted=summary)
    return paths
