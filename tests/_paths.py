"""Where things are, for tests in any folder of ``tests/`` (which is on ``sys.path``)."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
PACKAGE = REPO / "varbatch_kit"
NOTEBOOKS_DIR = REPO / "notebooks"
DATA_DIR = REPO / "data"
GOLDEN = TESTS / "golden"
