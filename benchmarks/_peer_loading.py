"""Load one module of a peer framework's package without its top-level ``__init__``.

The peers' packages (verl, areal, openrlhf) pull GPU and cluster machinery
into their package ``__init__``; their balancing modules need none of it.
:func:`load_bare` imports such a module with every package above it stood in
for by an empty module of the right ``__path__``; the module itself, and
whatever it imports, are the package's own, unchanged.

Shared by :mod:`benchmarks.peers` (``--peer-packages``) and
``scripts/record_peer_golden.py``; ``varbatch_kit`` itself never imports a
peer's package.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path

__all__ = ["load_bare"]


def load_bare(module: str):
    """Import ``module`` without running the ``__init__`` of the packages above it.

    Raises ``ModuleNotFoundError`` when its top-level package is not on ``sys.path``.
    """
    parts = module.split(".")
    if parts[0] in sys.modules:
        root = Path(list(sys.modules[parts[0]].__path__)[0]).parent
    else:
        top = importlib.util.find_spec(parts[0])
        if top is None or not top.submodule_search_locations:
            raise ModuleNotFoundError(f"package {parts[0]} not found on sys.path "
                                      "(PYTHONPATH or --peer-packages)", name=parts[0])
        root = Path(list(top.submodule_search_locations)[0]).parent
    for i in range(1, len(parts)):
        name = ".".join(parts[:i])
        if name not in sys.modules:
            m = types.ModuleType(name)
            m.__path__ = [os.path.join(root, *parts[:i])]
            sys.modules[name] = m
    return importlib.import_module(module)
