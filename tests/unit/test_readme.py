"""The README's Python snippets run as written (the self-contained ones), and the
``to_slime(schedule)`` one converts a schedule of the config it builds."""

import re

import pytest
from _paths import REPO

README = (REPO / "README.md").read_text(encoding="utf-8")
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def self_contained(block: str) -> bool:
    """A snippet that runs alone in a fresh namespace: no ``(...)`` placeholder, and no
    training (``varbatch_kit.train`` starts torchrun workers: the integration tests')."""
    return "(...)" not in block and "varbatch_kit.train" not in block


RUNNABLE = [b for b in BLOCKS if self_contained(b)]


def test_the_readme_has_runnable_snippets():
    assert len(BLOCKS) >= 4
    assert any("to_slime(schedule)" in b for b in RUNNABLE)


@pytest.mark.parametrize("block", RUNNABLE, ids=[f"snippet{i}" for i in range(len(RUNNABLE))])
def test_readme_snippet_runs(block):
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - our own README
    if "to_slime(schedule)" in block:
        schedule, config = namespace["schedule"], namespace["config"]
        assert schedule.config == config  # the schedule of the config the snippet builds
        out = namespace["to_slime"](schedule)
        assert len(out[0]) == config.dp  # one partition per DP rank


def test_the_notebook_table_is_the_demo_index_table():
    """README's notebook overview and the demo's index page (demo.NOTEBOOK_OVERVIEW) say the
    same, one row per notebook, in order."""
    pytest.importorskip("plotly")
    from varbatch_kit.cli import demo

    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in README.splitlines() if line.startswith("| `0")]
    names = sorted(p.stem for p in (REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert [r[0].strip("`") for r in rows] == names
    for row, (prefix, *rest) in zip(rows, demo.NOTEBOOK_OVERVIEW, strict=True):
        assert row[0].strip("`").startswith(prefix + "_")
        assert [c.replace("`", "") for c in row[1:]] == rest, row[0]
