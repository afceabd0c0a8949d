"""``varbatch-kit`` command line: one subcommand per entry of :data:`SUBCOMMANDS`.

The summary ``varbatch-kit --help`` prints is generated from :data:`SUBCOMMANDS`
(:func:`summary`), so a subcommand registered there is always listed.

Each subcommand lives with the code it drives; this module only dispatches.
Only the module of the subcommand being run is imported, so ``varbatch-kit
schedule ...`` and ``varbatch-kit --version`` work in a bare install (no
``[ui]`` or ``[train]`` extra); a subcommand whose extra is missing says which
one to install. A user error (bad layout, missing trace, missing extra)
prints the message to stderr and exits with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from varbatch_kit._extras import MissingExtraError
from varbatch_kit._version import __version__

# subcommand name -> (module providing ``add_parser(subparsers)``, one-line help for
# ``varbatch-kit --help``); the parser the module adds sets ``func(args) -> int``.
SUBCOMMANDS = {
    "schedule": ("varbatch_kit.cli.schedule",
                 "schedule a rollout trace and print the quality of each policy"),
    "recommend": ("varbatch_kit.cli.recommend",
                  "search slime's scheduling flags on a trace, print the best command line"),
    "plan": ("varbatch_kit.cli.plan",
             "the fastest tp/pp/cp/dp layout, cap and recomputation that fits memory"),
    "train": ("varbatch_kit.cli.train", "train a megatron-core GPT on rollouts [train]"),
    "compare": ("varbatch_kit.cli.train", "train several layouts/modes, compare reports [train]"),
    "demo": ("varbatch_kit.cli.demo",
             "run the notebooks headless into HTML pages (build/demo) [ui,train]"),
    "notebooks": ("varbatch_kit.cli.notebooks", "copy the tutorial notebooks into a folder"),
    "calibrate": ("varbatch_kit.cli.calibrate",
                  "fit the micro-batch cost model on this device [train]"),
    "export": ("varbatch_kit.cli.export",
               "write a trained run's weights as a Hugging Face checkpoint [train]"),
}


#: subcommands that parse their own arguments: ``main(rest of argv)`` of their module
#: (``varbatch-kit demo --out DIR`` is ``python -m varbatch_kit.cli.demo --out DIR``)
OWN_PARSER = {"demo"}


def _command(argv: list[str]) -> str | None:
    """The subcommand ``argv`` asks for (the first word that is not an option), if any."""
    return next((a for a in argv if not a.startswith("-")), None)


def summary() -> str:
    """The one-line description of ``varbatch-kit --help``: every registered subcommand."""
    return "varbatch-kit command line: " + ", ".join(SUBCOMMANDS)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported (the others are listed by name).

    Raises :class:`ImportError` when that module needs an extra that is not installed.
    """
    parser = argparse.ArgumentParser(prog="varbatch-kit", description=summary())
    parser.add_argument("--version", action="version", version=f"varbatch-kit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    if command in SUBCOMMANDS:
        importlib.import_module(SUBCOMMANDS[command][0]).add_parser(sub)
    for name, (_, help_) in SUBCOMMANDS.items():
        if name not in sub.choices:
            sub.add_parser(name, help=help_, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = _command(argv)
    try:
        if command in OWN_PARSER and argv.index(command) == 0:
            return int(importlib.import_module(SUBCOMMANDS[command][0]).main(argv[1:]) or 0)
        parser = build_parser(command)
    except ImportError as e:
        print(f"varbatch-kit {command}: error: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, MissingExtraError) as e:
        print(f"varbatch-kit {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
