"""``varbatch-kit recommend TRACE --slime-args "..."``: the slime flags to run on a trace.

Examples::

    varbatch-kit recommend agentic --slime-args="--actor-num-gpus-per-node 8 \\
        --global-batch-size 512 --use-dynamic-batch-size --max-tokens-per-gpu 16384" \\
        --max-tokens-headroom 1.5 --vary-global-batch-size
    FLAGS=$(varbatch-kit recommend rollout_11.pt --slime-args="$FLAGS" | tail -1)

Prints the candidates (:func:`varbatch_kit.compat.slime.recommend`) fastest
first, the user's row and the best one marked, a short explanation and, as
the LAST line, the recommended slime command line alone (the user's flags
with the changed ones replaced), so ``$(... | tail -1)`` can be pasted or
scripted. ``--json`` prints one JSON object instead (its ``command`` key).
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from varbatch_kit.analysis.candidates import CANDIDATE_COLUMNS
from varbatch_kit.cli.schedule import load_model, load_trace
from varbatch_kit.compat.slime.flag_search import recommend
from varbatch_kit.core.hardware import DEFAULT_HARDWARE, HARDWARE
from varbatch_kit.core.traces import bundled_traces

__all__ = ["add_parser", "format_candidates", "plain", "run"]

#: the model when neither --model nor slime's model flags give one
DEFAULT_MODEL = "qwen3-8b"
#: rows printed besides the user's and the best
SHOWN_ROWS = 10
_COLUMNS = ["mark", "changed", "time_s", "step_s", "above_bound", "mb_per_rank",
            "peak_gpu_tokens", "oversize", "over_limit"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``recommend`` subcommand to the dispatcher's subparsers."""
    p = subparsers.add_parser(
        "recommend", help="search slime's scheduling flags on a trace, print the best command line",
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="TRACE is a .jsonl/.parquet/slime .pt file or a bundled trace name: "
               + ", ".join(bundled_traces()))
    p.add_argument("trace", metavar="TRACE", help="trace file or bundled trace name")
    p.add_argument("--slime-args", required=True, metavar="FLAGS",
                   help="your slime command line, written --slime-args='--global-batch-size 64 "
                        "...' (its parallel sizes are kept)")
    p.add_argument("--model", default=None,
                   help="model shape preset or a config.json path (default: the model flags "
                        f"of --slime-args, --num-layers ..., else {DEFAULT_MODEL})")
    room = p.add_mutually_exclusive_group()
    room.add_argument("--max-tokens-headroom", type=float, default=1.0, metavar="X",
                      help="--max-tokens-per-gpu may grow up to X times yours (default 1.0: "
                           "not at all; memory is yours to state)")
    room.add_argument("--max-tokens-limit", type=int, default=None, metavar="N",
                      help="instead: the most tokens per GPU a micro-batch may hold")
    p.add_argument("--vary-global-batch-size", action="store_true",
                   help="also search the batch size: --num-steps-per-rollout when given, else "
                        "--global-batch-size (it changes the RL algorithm: optimizer updates "
                        "per rollout batch; by default both are yours)")
    p.add_argument("--hardware", default=DEFAULT_HARDWARE, choices=sorted(HARDWARE),
                   help=f"accelerator of the step-time model (default {DEFAULT_HARDWARE})")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.set_defaults(func=run)
    return p


def _shown(table):
    rows = table[(table.index < SHOWN_ROWS) | table["user"] | table["best"]]
    return rows[rows["error"] == ""]


def format_candidates(rec) -> str:
    """The candidates as aligned text: ``*`` marks the best row, ``you`` the user's."""
    df = _shown(rec.table).copy()
    df["mark"] = ["*you" if b and u else "*" if b else "you" if u else ""
                  for b, u in zip(df["best"], df["user"])]
    out = df[_COLUMNS].copy()
    for c in ("time_s", "step_s"):
        out[c] = out[c].map(lambda v: f"{v:.3f}")
    out["above_bound"] = out["above_bound"].map(lambda v: f"{v:.3f}")
    out["mb_per_rank"] = out["mb_per_rank"].map(lambda v: f"{v:.1f}")
    for c in ("peak_gpu_tokens", "oversize", "over_limit"):
        out[c] = out[c].map(lambda v: str(int(v)))
    hidden = len(rec.table) - len(df)
    text = out.to_string(index=False)
    if hidden:
        text += f"\n({hidden} slower or impossible candidates not shown)"
    legend = {"mark": "* recommended, you: your flags", "changed": "flags changed from yours",
              **{c: CANDIDATE_COLUMNS[c] for c in _COLUMNS[2:]}}
    width = max(map(len, legend))
    return text + "\n\ncolumns:\n" + "\n".join(f"  {c:{width}s}  {v}" for c, v in legend.items())


def plain(value: Any) -> Any:
    """``value`` as JSON takes it: numpy scalars as Python numbers, NaN as None."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if hasattr(value, "item"):
        return plain(value.item())
    return value


def run(args: argparse.Namespace) -> int:
    """Run the subcommand; ``ValueError`` for anything the user can fix."""
    name, rollouts = load_trace(args.trace)
    if args.model is not None:
        model = load_model(args.model)
    else:  # slime's own model flags, as slime computes FLOPs from them; else the default
        from varbatch_kit.compat.slime.model_flags import model_shape_from_slime_args

        model = model_shape_from_slime_args(args.slime_args) or load_model(DEFAULT_MODEL)
    rec = recommend(rollouts, args.slime_args, model, max_tokens_headroom=args.max_tokens_headroom,
                    max_tokens_limit=args.max_tokens_limit,
                    vary_global_batch_size=True if args.vary_global_batch_size else None,
                    hardware=args.hardware)
    if args.json:
        rows = [{k: plain(v) for k, v in r.items()} for r in rec.table.to_dict("records")]
        print(json.dumps({"trace": name, "command": rec.command, "changes": rec.changes,
                          "user": {k: plain(v) for k, v in rec.user.items()},
                          "best": {k: plain(v) for k, v in rec.best.items()},
                          "balanced": rec.balanced, "memory_limit": rec.memory_limit,
                          "search_s": rec.search_s, "candidates": rows}, indent=1))
        return 0
    print(f"trace {name}: {rollouts!r}; model {model.name}; {rec.hardware}; "
          f"{len(rec.table)} candidates in {rec.search_s:.1f} s")
    print(format_candidates(rec))
    print()
    print(rec.explain())
    print("recommended slime flags (next line):")
    print(rec.command)
    return 0
