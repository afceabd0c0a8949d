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


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Run the browser tests last.

    Their session-wide Playwright (sync API) keeps an asyncio loop running in
    the main thread until the session ends; code that checks for a running
    loop (the explorers' debouncing) must not see it in the other tests.
    """
    browser_dir = Path(__file__).parent / "integration" / "browser"
    items.sort(key=lambda item: browser_dir in Path(str(item.fspath)).parents)
