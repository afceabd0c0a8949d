"""Text that no longer matches the code stays out of the package, the docs and the notebooks.

Each pattern is a phrase that was true once and is not now: the world of a run is
``dp * cp * pp * tp`` workers (not ``dp * cp``); context parallelism runs all-gather style by
default (emulation is the ``cp_impl="emulated"`` reference, not what the CPU does); the policy
modules live in ``varbatch_kit.policies``; the SmolLM2 matrix test is under
``tests/integration/``. (``dp * cp`` itself stays: it is the pool the schedule places
micro-batches on.)
"""

from __future__ import annotations

import re

import pytest
from _paths import REPO

#: retired phrase -> (pattern, an example the pattern must catch)
RETIRED = {
    "a run's workers counted as dp * cp": (
        r"dp ?\* ?cp ?(/ ?nnodes|workers|processes|torchrun)|``dp \* cp`` ``?torchrun|"
        r"`dp × cp` `torchrun`|world size \(dp \* cp\)|dp\*cp=\{(cfg\.)?world_size|smaller dp\*cp",
        "each starts dp*cp/nnodes workers"),
    "CP emulated on the CPU or at the loss level": (
        r"emulated (on CPU|at the\s+loss level)|emulates\s+context parallelism",
        "context-parallel size, emulated on CPU"),
    "policy modules that do not exist": (
        r"varbatch_kit\.(packing|distribution)\b", "`varbatch_kit.packing`"),
    "the SmolLM2 matrix test at the old path": (
        r"(?<!integration/)tests/test_train_real\.py", "`tests/test_train_real.py`"),
}
SEARCHED = ("varbatch_kit", "docs", "notebooks", "README.md")


def _texts():
    for top in SEARCHED:
        root = REPO / top
        paths = [root] if root.is_file() else sorted(
            p for p in root.rglob("*") if p.suffix in {".py", ".md", ".ipynb"})
        for p in paths:
            yield p, p.read_text()


@pytest.mark.parametrize("name", RETIRED)
def test_the_pattern_catches_its_example(name):
    pattern, example = RETIRED[name]
    assert re.search(pattern, example), (name, example)


@pytest.mark.parametrize("name", RETIRED)
def test_no_retired_phrase_remains(name):
    pattern = re.compile(RETIRED[name][0])
    found = [f"{p.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
             for p, text in _texts() for m in pattern.finditer(text)]
    assert not found, f"{name}:\n" + "\n".join(found)
