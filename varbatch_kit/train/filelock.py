"""An exclusive advisory file lock, for caches that several processes fill (one build each)."""

from __future__ import annotations

import contextlib
from pathlib import Path

__all__ = ["locked"]


@contextlib.contextmanager
def locked(path: Path):
    """An exclusive advisory lock on ``path`` (POSIX ``flock``; no lock where it is missing)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
