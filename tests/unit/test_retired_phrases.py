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
    "a second micro-batch timer for pipelines": (r"\bStageTimer\b", "pipeline_schedule.StageTimer"),
    "generation normalising rewards itself": (r"\bgroup_advantages\b", "generate.group_advantages"),
    "the CLI rewriting core's error text": (r"_FLAG_WORDS\b", "for word, flag in _FLAG_WORDS:"),
    "the megatron layout read back from its global state": (
        r"_tp_size\(\)|_tp_rank_and_size\(\)", "tensor_model_parallel_size=_tp_size(),"),
}
#: retired only in the notebooks: what the caching harness does for them (the demo, the tests)
RETIRED_IN_NOTEBOOKS = {
    "notebooks calling the cache instead of the library": (
        r"\bcached_(compare|rl_loop|rollouts)\b", "table = cached_compare(configs, rollouts)"),
}
SEARCHED = ("varbatch_kit", "docs", "notebooks", "README.md")


def _texts(searched=SEARCHED):
    for top in searched:
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


@pytest.mark.parametrize("name", RETIRED_IN_NOTEBOOKS)
def test_no_notebook_calls_the_cache(name):
    pattern, example = RETIRED_IN_NOTEBOOKS[name]
    assert re.search(pattern, example), (name, example)
    found = [f"{p.relative_to(REPO)}: {m.group(0)!r}" for p, text in _texts(("notebooks",))
             for m in re.finditer(pattern, text)]
    assert not found, f"{name}:\n" + "\n".join(found)
