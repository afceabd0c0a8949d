"""Optional extras: a shell package says which extra to install when its library is missing.

The pure layers (``policies``, ``core``, ``report``, ``analysis``, ``compat``,
``resources``) need numpy, pandas and torch only. The shells need more:
``varbatch_kit.ui`` plotly and ipywidgets (extra ``[ui]``), ``varbatch_kit.train``
megatron-core (extra ``[train]``); Parquet traces pyarrow (extra ``[parquet]``,
checked when one is read or written). Each shell's ``__init__.py`` calls
:func:`require` once, so ``import varbatch_kit.ui.viz`` in a bare install fails
with the command that fixes it, not with ``No module named 'plotly'`` deep
inside a figure module.
"""

from __future__ import annotations

import importlib.util

__all__ = ["MissingExtraError", "require"]


class MissingExtraError(ModuleNotFoundError):
    """A library of an optional extra is not installed.

    A :class:`ModuleNotFoundError` (so an :class:`ImportError`, and
    ``pytest.importorskip`` skips on it) whose ``name`` is the first missing library.
    """


def require(package: str, extra: str, libraries: tuple[str, ...]) -> None:
    """Raise :class:`MissingExtraError` naming ``extra`` unless every one of ``libraries`` imports.

    ``package`` is the shell asking (``"varbatch_kit.ui"``) or the feature that
    needs the libraries (``"reading a .parquet trace"``); ``libraries`` are
    import names (``"plotly"``; a dotted ``"megatron.core"`` imports its parent
    package, a namespace for megatron). Only the libraries' specs are looked
    up (:func:`importlib.util.find_spec`), nothing is imported, so the check costs
    microseconds.
    """
    missing = []
    for lib in libraries:
        try:
            found = importlib.util.find_spec(lib) is not None
        except (ImportError, ValueError):  # a finder refused it, or a broken half-import
            found = False
        if not found:
            missing.append(lib)
    if missing:
        raise MissingExtraError(
            f"{package} needs the [{extra}] extra: pip install 'varbatch_kit[{extra}]' "
            f"(missing: {', '.join(missing)})", name=missing[0])
