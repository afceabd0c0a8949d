"""Where the package's data and tutorials are: ``data/`` and ``notebooks/``.

The repository keeps them at its top (``data/``, ``notebooks/``: the source of
truth, edited there); the wheel carries them inside the package
(``varbatch_kit/data``, ``varbatch_kit/notebooks``, mapped by ``setup.py``).
:func:`data_dir` and :func:`notebooks_dir` find them either way, so a checkout,
an editable install and a wheel in an empty directory read the same files.
"""

from __future__ import annotations

from importlib import resources
from importlib.abc import Traversable
from pathlib import Path

__all__ = ["DATA_KINDS", "data_dir", "notebooks_dir"]

#: the folders of ``data/``: model presets, rollout traces, recorded calibrations, recorded runs
#: (slime dumps; the RL loop's learning run, ``runs/rl_loop_smollm2_cpu.json``)
DATA_KINDS = ("models", "traces", "timing", "runs")


def _folder(name: str) -> Traversable:
    """``name`` inside the installed package (a wheel), else at the top of the checkout."""
    inside = resources.files("varbatch_kit").joinpath(name)
    if inside.is_dir() and any(p.name != "__pycache__" for p in inside.iterdir()):
        return inside
    checkout = Path(__file__).resolve().parent.parent / name
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError(
        f"varbatch_kit's {name}/ folder is missing: neither {inside} (an installed wheel) nor "
        f"{checkout} (a checkout) exists; reinstall the package")


def data_dir(kind: str) -> Traversable:
    """The folder of package data ``kind``: one of :data:`DATA_KINDS`."""
    if kind not in DATA_KINDS:
        raise ValueError(f"unknown package data {kind!r}; choose one of {', '.join(DATA_KINDS)}")
    return _folder("data").joinpath(kind)


def notebooks_dir() -> Traversable:
    """The folder of the tutorial notebooks (``notebooks/``)."""
    return _folder("notebooks")
