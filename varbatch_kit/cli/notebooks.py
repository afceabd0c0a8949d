"""``varbatch-kit notebooks DIR``: copy the tutorial notebooks out of the package to edit and run.

The notebooks travel inside the wheel (``varbatch_kit/notebooks``); an
installed package is no place to edit them, so this copies them to a folder
of the user's (existing files are kept unless ``--force``).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

from varbatch_kit.resources import notebooks_dir

__all__ = ["add_parser", "copy_notebooks"]


def copy_notebooks(dest: str | Path, *, force: bool = False) -> list[Path]:
    """Copy every packaged ``NN_*.ipynb`` into ``dest`` (created); returns the written paths."""
    out = Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for src in sorted(notebooks_dir().iterdir(), key=lambda p: p.name):
        if not src.name.endswith(".ipynb"):
            continue
        target = out / src.name
        if target.exists() and not force:
            raise ValueError(f"{target} exists; pass --force to overwrite it")
        with src.open("rb") as fin, target.open("wb") as fout:
            shutil.copyfileobj(fin, fout)
        written.append(target)
    return written


def _run(args: argparse.Namespace) -> int:
    for path in copy_notebooks(args.dest, force=args.force):
        print(path)
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("notebooks", help="copy the tutorial notebooks into a folder",
                              description=__doc__.splitlines()[0])
    p.add_argument("dest", nargs="?", default="notebooks", help="folder (default ./notebooks)")
    p.add_argument("--force", action="store_true", help="overwrite existing notebooks")
    p.set_defaults(func=_run)
    return p
