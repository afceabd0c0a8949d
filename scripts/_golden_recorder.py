"""What the slime golden-vector recorders share: the checkout's commit, the JSON file of one
function family, and the command line that records every family.

``scripts/record_slime_golden.py`` (scheduling and reports) and
``scripts/record_slime_objective.py`` (the RL objective) differ only in how they
load slime and which families they record.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
from collections.abc import Callable
from pathlib import Path


def checkout_commit(root: Path) -> str | None:
    """The commit a git checkout is at, or None when ``root`` is not a repository."""
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                             text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


def write_family(out: Path, name: str, header: dict, cases: list[dict]) -> int:
    """``out/name.json``: the header's keys, then ``"cases"`` one per line; returns its size."""
    head = json.dumps(header)
    body = ",\n".join(json.dumps(c, separators=(",", ":"), allow_nan=False) for c in cases)
    text = head[:-1] + ', "cases": [\n' + body + "\n]}\n"
    json.loads(text)  # well-formed
    (out / f"{name}.json").write_text(text)
    return len(text)


def record(argv: list[str] | None, *, description: str, families: dict[str, Callable],
           load_slime: Callable, generator: str, commit: str, default_seed: int, out_help: str,
           name_in_header: bool = False, before_family: Callable[[int], None] | None = None,
           name_width: int = 12, count_width: int = 5) -> int:
    """The recorders' ``main``: parse ``--slime --out [--seed --commit --only]``, check the
    checkout's commit, run each family on ``random.Random(seed * 100 + i)`` and write it."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--slime", type=Path, required=True, help="slime checkout (holds slime/)")
    p.add_argument("--out", type=Path, required=True, help=out_help)
    p.add_argument("--seed", type=int, default=default_seed)
    p.add_argument("--commit", default=commit,
                   help="commit of the checkout (verified with git when it is a repository)")
    p.add_argument("--only", nargs="*", choices=sorted(families), help="families to record")
    a = p.parse_args(argv)
    found = checkout_commit(a.slime)
    if found is not None and found != a.commit:
        raise SystemExit(f"{a.slime} is at {found}, not {a.commit}; pass --commit {found}")
    S = load_slime(a.slime)
    a.out.mkdir(parents=True, exist_ok=True)
    total = 0
    for i, (name, fn) in enumerate(families.items()):
        if a.only and name not in a.only:
            continue
        seed = a.seed * 100 + i
        if before_family is not None:
            before_family(seed)
        cases = fn(S, random.Random(seed))
        header = {"slime_commit": a.commit, "generator": generator, "seed": seed}
        if name_in_header:
            header["function"] = name
        size = write_family(a.out, name, header, cases)
        total += size
        n_err = sum("error" in c for c in cases)
        print(f"{name:{name_width}s} {len(cases):{count_width}d} cases ({n_err} errors) "
              f"{size / 1e6:6.2f} MB")
    print(f"total {total / 1e6:.2f} MB")
    return 0
