"""``varbatch-kit`` command line: ``schedule``, ``train``, ``compare``, ``demo``, ``notebooks``.

(and ``calibrate``: the micro-batch cost model of this device, :mod:`varbatch_kit.cli.calibrate`.)

Each subcommand lives with the code it drives; this module only dispatches.
A user error (bad layout, missing trace) prints the message to stderr and
exits with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from varbatch_kit._version import __version__

# subcommand name -> module providing ``add_parser(subparsers)``; the parser
# it adds sets ``func(args) -> int``.
SUBCOMMANDS = {
    "schedule": "varbatch_kit.cli.schedule",
    "train": "varbatch_kit.cli.train",
    "compare": "varbatch_kit.cli.train",
    "demo": "varbatch_kit.cli.demo",
    "notebooks": "varbatch_kit.cli.notebooks",
    "calibrate": "varbatch_kit.cli.calibrate",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="varbatch-kit", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"varbatch-kit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in dict.fromkeys(SUBCOMMANDS.values()):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            continue
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"varbatch-kit {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
