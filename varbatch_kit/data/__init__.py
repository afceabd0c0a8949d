"""Package data: model presets (``models/*.json``) and bundled rollout traces (``traces/``).

Read through :func:`files`, which works the same from a checkout, an
editable install and a wheel.
"""

from importlib import resources
from importlib.abc import Traversable

__all__ = ["files", "notebooks"]


def files(kind: str) -> Traversable:
    """The folder of package data ``kind`` (``"models"`` or ``"traces"``)."""
    if kind not in ("models", "traces"):
        raise ValueError(f"unknown package data {kind!r}; choose 'models' or 'traces'")
    return resources.files(__name__).joinpath(kind)


def notebooks() -> Traversable:
    """The folder of the tutorial notebooks shipped with the package."""
    return resources.files("varbatch_kit").joinpath("notebooks")
