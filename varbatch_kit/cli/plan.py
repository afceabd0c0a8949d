"""``varbatch-kit plan TRACE --model M --gpus N --hardware H100``: the fastest layout that fits.

Examples::

    varbatch-kit plan agentic --model qwen3-8b --gpus 64 --hardware H100
    varbatch-kit plan rollout_11.pt --model config.json --gpus 16 --html plan.html

Searches tp x pp x cp x dp, the token cap, recomputation and the packing
(:func:`varbatch_kit.compat.slime.planner.plan_layouts`), prints the fastest
candidates whose predicted peak memory fits the device (step time, peak memory,
GPU-hours per rollout batch, the slime flags), then, as the LAST line, the flags of
the fastest candidate slime can run (``$(... | tail -1)``). ``--html`` writes the
figure of time against memory for every candidate; ``--json`` prints one object.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from varbatch_kit.cli.recommend import plain
from varbatch_kit.cli.schedule import load_model, load_trace
from varbatch_kit.compat.slime.flags import positive_int
from varbatch_kit.core.hardware import DEFAULT_HARDWARE, HARDWARE
from varbatch_kit.core.traces import bundled_traces

__all__ = ["add_parser", "run"]

_SHOWN = ["tp", "pp", "cp", "dp", "max_tokens_per_gpu", "packing", "recompute", "time_s",
          "step_s", "peak_gib", "gpu_hours"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``plan`` subcommand to the dispatcher's subparsers."""
    p = subparsers.add_parser(
        "plan", help="the fastest tp/pp/cp/dp layout, cap and recomputation that fits memory",
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="TRACE is a .jsonl/.parquet/slime .pt file or a bundled trace name: "
               + ", ".join(bundled_traces()))
    p.add_argument("trace", metavar="TRACE", help="trace file or bundled trace name")
    p.add_argument("--model", required=True, help="model shape preset or a config.json path")
    p.add_argument("--gpus", type=positive_int, required=True, help="GPUs of the training job")
    p.add_argument("--hardware", default=DEFAULT_HARDWARE, choices=sorted(HARDWARE),
                   help=f"the GPUs (default {DEFAULT_HARDWARE}): speed and memory")
    p.add_argument("--global-batch-size", type=positive_int, default=None, metavar="N",
                   help="rollouts per step (default: the whole trace in one step)")
    p.add_argument("--caps", default="8192,16384,32768", metavar="LIST",
                   help="--max-tokens-per-gpu values to try (default 8192,16384,32768)")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"),
                   help="training precision (default bf16, as slime runs)")
    p.add_argument("--top", type=positive_int, default=10, help="candidates printed (default 10)")
    p.add_argument("--html", default=None, metavar="FILE",
                   help="also write the time-against-memory figure to FILE")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.set_defaults(func=run)
    return p


def _caps(text: str) -> list[int]:
    try:
        caps = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        caps = []
    if not caps or any(c < 1 for c in caps):
        raise ValueError(f"--caps {text!r}: give positive whole numbers separated by commas")
    return caps


def run(args: argparse.Namespace) -> int:
    """Run the subcommand; ``ValueError`` for anything the user can fix."""
    from varbatch_kit.compat.slime.planner import plan_layouts

    name, rollouts = load_trace(args.trace)
    model = load_model(args.model)
    plan = plan_layouts(rollouts, model, args.gpus, hardware=args.hardware,
                        global_batch_size=args.global_batch_size, caps=_caps(args.caps),
                        precision=args.precision, top=args.top, progress=not args.json)
    fits = plan.top(len(plan.table))
    slime = fits[fits["command"].notna()]
    if args.html:
        plan.figure().write_html(args.html, include_plotlyjs="cdn")
    if args.json:
        print(json.dumps({
            "trace": name, "model": model.name, "gpus": plan.gpus, "hardware": plan.hardware,
            "memory_gib": plan.memory_gib, "search_s": plan.search_s, "pruned": plan.pruned,
            "best": {k: plain(v) for k, v in (plan.best or {}).items()},
            "command": None if slime.empty else slime.iloc[0]["command"],
            "candidates": [{k: plain(v) for k, v in r.items()}
                           for r in fits.head(args.top).to_dict("records")]}, indent=1))
        return 0
    print(f"trace {name}: {rollouts!r}; model {model.name}; {plan.gpus} x {plan.hardware} "
          f"({plan.memory_gib:g} GiB); {len(plan.table)} candidates in {plan.search_s:.1f} s "
          f"(pruned: " + ", ".join(f"{v} by {k}" for k, v in plan.pruned.items() if v) + ")")
    if fits.empty:
        print("no candidate fits: more GPUs, a smaller cap (--caps) or a larger device")
        return 1
    out = fits.head(args.top)[_SHOWN].copy()
    for c in ("time_s", "step_s", "peak_gib"):
        out[c] = out[c].map(lambda v: f"{v:.2f}")
    out["gpu_hours"] = out["gpu_hours"].map(lambda v: f"{v:.3f}")
    print(out.to_string(index=False))
    print("time_s: simulated seconds per rollout batch; peak_gib: predicted peak memory of the "
          "busiest GPU (varbatch_kit.core.memory); gpu_hours: per rollout batch")
    if args.html:
        print(f"figure: {args.html}")
    if plan.best is not None and plan.best["command"] is None:
        print(f"fastest: varbatch_kit's balanced packing ({plan.best['time_s']:.2f} s; not a "
              "slime flag); the fastest slime flags follow")
    if slime.empty:
        print("no slime packing fits")
        return 1
    print("slime flags (next line):")
    print(slime.iloc[0]["command"])
    return 0
