"""``varbatch-kit schedule TRACE``: schedule a rollout trace, print the quality table.

Examples::

    varbatch-kit schedule math                       # a bundled trace, every policy
    varbatch-kit schedule run.jsonl --dp 16 --max-tokens-per-gpu 16384 \\
        --packing first_fit --distribution flops_kk --html build/figs
    varbatch-kit schedule run.jsonl --dp 8 --slime-args="--global-batch-size 256 \\
        --use-dynamic-batch-size --max-tokens-per-gpu 16384 --balance-data"

A bad layout, a missing or malformed trace, or an unknown policy is a
``ValueError``: the dispatcher in :mod:`varbatch_kit.cli` prints the message
on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from varbatch_kit.compat.slime.flags import schedule_config_from_slime_args
from varbatch_kit.core.config import ScheduleConfig
from varbatch_kit.core.flops import ModelShape, available_presets
from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.core.traces import bundled_traces, read_trace

__all__ = ["add_parser", "format_table", "load_model", "load_trace", "run"]

TABLE_COLUMNS = ["packing", "distribution", "steps", "micro_batches", "mb_lower_bound",
                 "cap_violations", "max_flops_imbalance", "mean_makespan_ratio", "schedule_s",
                 "slime"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``schedule`` subcommand to the dispatcher's subparsers."""
    p = subparsers.add_parser(
        "schedule", help="schedule a rollout trace and print the quality of each policy",
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="TRACE is a .jsonl/.parquet/slime .pt file or a bundled trace name: "
               + ", ".join(bundled_traces()))
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
                   help="one packing (default: compare every registered one)")
    p.add_argument("--distribution", default=None,
                   help="one distribution (default: compare every registered one)")
    p.add_argument("--slime-args", default=None, metavar="FLAGS",
                   help="take the layout and policy from a slime command line, written "
                        "--slime-args='--global-batch-size 64 ...' (flags given here override "
                        "it)")
    p.add_argument("--model", default="qwen3-8b",
                   help=f"model shape preset ({', '.join(available_presets())}) or a Hugging "
                        "Face config.json path (default qwen3-8b)")
    p.add_argument("--html", default=None, metavar="DIR",
                   help="also write the figures as HTML files into DIR")
    p.add_argument("--step", type=int, default=0, help="step drawn in the packing figure")
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
    if spec in available_presets():
        return ModelShape.preset(spec)
    if Path(spec).suffix == ".json" or Path(spec).exists():
        return ModelShape.from_hf_config(spec)
    raise ValueError(f"--model {spec!r} is neither a preset ({', '.join(available_presets())}) "
                     "nor a config.json path")


def _config(args: argparse.Namespace, rollouts: Rollouts) -> ScheduleConfig:
    if args.slime_args is not None:
        base = schedule_config_from_slime_args(args.slime_args, dp=args.dp or None)
    else:
        gbs = args.global_batch_size or max(1, rollouts.num_rollouts // 4)
        if args.micro_batch_size is not None:
            base = ScheduleConfig(dp=args.dp or 16, global_batch_size=gbs,
                                  micro_batch_size=args.micro_batch_size)
        else:
            base = ScheduleConfig(dp=args.dp or 16, global_batch_size=gbs,
                                  max_tokens_per_gpu=args.max_tokens_per_gpu or 16384)
    changes: dict[str, Any] = {}
    for name in ("dp", "cp", "vpp", "mb_group", "global_batch_size", "max_tokens_per_gpu",
                 "micro_batch_size"):
        value = getattr(args, name)
        if value is not None and value != getattr(base, name):
            changes[name] = value
    return base.with_(**changes) if changes else base


def format_table(table) -> str:
    """The policy table as aligned text (numbers rounded for reading)."""
    import pandas as pd

    df = table.copy()
    cols = [c for c in TABLE_COLUMNS if c in df.columns]
    out = df[cols].copy()
    for c in ("max_flops_imbalance", "mean_makespan_ratio"):
        if c in out:
            out[c] = out[c].map(lambda v: "" if pd.isna(v) else f"{v:.4f}")
    if "schedule_s" in out:
        out["schedule_s"] = out["schedule_s"].map(lambda v: f"{v:.3f}")
    for c in ("steps", "micro_batches", "mb_lower_bound", "cap_violations"):
        if c in out:
            out[c] = out[c].map(lambda v: "" if pd.isna(v) else str(int(v)))
    text = out.to_string(index=False)
    errors = df[df.get("error", "") != ""] if "error" in df.columns else df.iloc[:0]
    for _, row in errors.iterrows():
        text += f"\n  {row['packing']} + {row['distribution']}: {row['error']}"
    return text


def run(args: argparse.Namespace) -> int:
    """Run the subcommand; ``ValueError`` for anything the user can fix."""
    from varbatch_kit.policies.registry import get_distribution, get_packer
    from varbatch_kit.ui import viz

    name, rollouts = load_trace(args.trace)
    model = load_model(args.model)
    config = _config(args, rollouts)
    if args.packing is not None:
        get_packer(args.packing)
    if args.distribution is not None:
        get_distribution(args.distribution)
    if args.packing is not None or args.distribution is not None or args.slime_args:
        pairs = [(args.packing or config.packing, args.distribution or config.distribution)]
    else:
        pairs = viz.policy_pairs(model, dynamic=config.dynamic)
    table = viz.policy_table(rollouts, config, model, pairs)
    ok = table[table["error"] == ""]
    if ok.empty:
        # every policy failed: the layout itself is impossible; say why once
        raise ValueError(table["error"].iloc[0])
    layout = (f"dp={config.dp} cp={config.cp} vpp={config.vpp} mb_group={config.mb_group} "
              f"global_batch_size={config.global_batch_size} "
              + (f"max_tokens_per_gpu={config.max_tokens_per_gpu} (cap {config.cap})"
                 if config.dynamic else f"micro_batch_size={config.micro_batch_size}"))
    print(f"trace {name}: {rollouts!r}")
    print(f"layout: {layout}; model {model.name}")
    print(format_table(table))
    if args.html:
        paths = write_figures(Path(args.html), rollouts, config, model, table, step=args.step)
        print(f"wrote {len(paths)} figures to {Path(args.html).resolve()}/: "
              + ", ".join(p.name for p in paths))
    if len(ok) < len(table):
        print(f"{len(table) - len(ok)} policies cannot run this layout (see above)",
              file=sys.stderr)
    return 0


def write_figures(out: Path, rollouts: Rollouts, config: ScheduleConfig, model: ModelShape,
                  table, *, step: int = 0) -> list[Path]:
    """Write the length, policy, packing and balance figures as HTML files into ``out``.

    plotly.js is written once next to them (``plotly.min.js``), so the files
    open offline and stay small.
    """
    from varbatch_kit.core.schedule import build_schedule
    from varbatch_kit.ui import viz

    out.mkdir(parents=True, exist_ok=True)
    figs = {"lengths": viz.length_figure(rollouts, model),
            "policies": viz.policy_figure(table)}
    for _, row in table[table["error"] == ""].iterrows():
        cfg = config.with_(packing=row["packing"], distribution=row["distribution"])
        sched = build_schedule(rollouts, cfg, model)
        tag = f"{row['packing']}-{row['distribution']}"
        figs[f"packing-{tag}"] = viz.packing_figure(sched, min(step, sched.num_steps - 1))
        figs[f"balance-{tag}"] = viz.balance_figure(sched)
    paths = []
    for fname, fig in figs.items():
        path = out / f"{fname}.html"
        fig.write_html(path, include_plotlyjs="directory", full_html=True)
        paths.append(path)
    return paths
