import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "dev", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


def pytest_configure(config):
    """Import the package's warning classes in the main thread first. pytest-xdist's
    controller rebuilds a worker's warning by importing its class's module in the thread that
    receives that worker's messages; two such threads importing the package at once
    deadlocked on its module locks (``_DeadlockError`` on ``varbatch_kit.core.build``, an
    INTERNALERROR that failed ``pytest -n 2 tests/unit/core`` every time)."""
    import varbatch_kit.core.build  # noqa: F401  OversizeSampleWarning
    import varbatch_kit.core.slime_dumps  # noqa: F401  OlderSlimeDumpWarning
    import varbatch_kit.train.runs.step_log  # noqa: F401  TornLogWarning


#: the longest chain of the integration tier (notebook 06 trains the SmolLM2 matrix that
#: test_train_real.py reads back; the SmolLM2 layout matrix of test_train_parallel.py joins it,
#: so that no two float64 SmolLM2 launches of 4 ranks share the machine's memory): started
#: first, so that under pytest-xdist it is not the tail
FIRST_GROUP = "smollm2_matrix"


def _xdist_group(item) -> str | None:
    mark = item.get_closest_marker("xdist_group")
    return None if mark is None else (mark.args[0] if mark.args else mark.kwargs.get("name"))


def _start_rank(item) -> float:
    """``start_early(rank)`` marks go first, the lowest rank first (default 1); others last."""
    mark = item.get_closest_marker("start_early")
    return float("inf") if mark is None else (mark.args[0] if mark.args else 1)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Run the longest chain first, then the tests marked ``start_early`` (the longest single
    tests: dispatched late, one of them was the tier's tail, the other worker idle), and the
    browser tests last (stable: the rest keep their order).

    The browser tests' session-wide Playwright (sync API) keeps an asyncio loop
    running in the main thread until the session ends; code that checks for a
    running loop (the explorers' debouncing) must not see it in the other tests.
    (``make test`` runs them in a session of their own, beside the tiers; this order keeps
    a plain ``pytest tests`` safe.)
    """
    browser_dir = Path(__file__).parent / "integration" / "browser"
    items.sort(key=lambda item: (browser_dir in Path(str(item.fspath)).parents,
                                 _xdist_group(item) != FIRST_GROUP,
                                 _start_rank(item)))
    if getattr(config.option, "loadgroup", False):  # a pytest-xdist worker, --dist loadgroup
        _group_node_ids(items)


def _group_node_ids(items) -> None:
    """Give each ``xdist_group`` test the ``@group`` node-id suffix ``--dist loadgroup`` schedules
    by. pytest-xdist 3.8 sets it on ``item._nodeid``, which pytest 9 no longer reads (a node's
    id is ``item._id``), so without this every group is split across the workers (measured:
    notebook 06 and the matrix test it feeds ran side by side, one waiting on the other's lock).
    """
    from _pytest.nodeid import coerce_node_id

    for item in items:
        group = _xdist_group(item)
        nodeid = item.nodeid
        if group and nodeid.rfind("@") <= nodeid.rfind("]"):
            item._id = coerce_node_id(f"{nodeid}@{group}")
