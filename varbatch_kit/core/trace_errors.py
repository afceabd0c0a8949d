"""The error of reading a trace: one class, below both trace readers.

:class:`TraceError` is what :mod:`varbatch_kit.core.traces` (JSONL, Parquet)
and :mod:`varbatch_kit.core.slime_dumps` (slime's ``.pt`` dumps) raise for a
trace file that is missing, malformed or unsafe to load; it lives here so the
two readers share it without importing each other.
"""

from __future__ import annotations

__all__ = ["TraceError"]


class TraceError(ValueError):
    """A trace file is missing, malformed or unsafe to load."""
