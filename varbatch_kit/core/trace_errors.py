"""The error of reading a trace: one class, below both trace readers.

:class:`TraceError` is what :mod:`varbatch_kit.core.traces` (JSONL, Parquet)
and :mod:`varbatch_kit.core.slime_dumps` (slime's ``.pt`` dumps) raise for a
trace file that is missing, malformed or unsafe to load; it lives here so the
two readers share it without importing each other.

Two helpers word the messages a user reads: :func:`at_file_rows` turns the
sample indices of a :class:`~varbatch_kit.core.rollouts.Rollouts` error
(``response_len[3]``) into the file's own line or row numbers, and
:func:`missing_trace` lists the bundled trace names (with the closest ones
first) when a name matches no file.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence

__all__ = ["TraceError", "at_file_rows", "missing_trace"]


class TraceError(ValueError):
    """A trace file is missing, malformed or unsafe to load."""


_INDEXED = re.compile(r"\b([A-Za-z_]\w*)\[(\d+)\]")


def at_file_rows(message: str, rows: Sequence[int], unit: str = "line") -> str:
    """``message`` with every ``name[i]`` (sample ``i``) as ``name``, prefixed by its place.

    ``rows[i]`` is sample ``i``'s line (JSONL, 1-based, blank lines counted)
    or row (Parquet, 1-based) in the file; ``unit`` names it. A message
    naming no sample index is returned as it is.

    >>> at_file_rows("response_len[2] = '20' is a str", [1, 2, 4])
    "line 4: response_len = '20' is a str"
    """
    found = _INDEXED.search(message)
    if found is None:
        return message
    i = int(found.group(2))
    if i >= len(rows):
        return message
    return f"{unit} {rows[i]}: " + _INDEXED.sub(
        lambda m: m.group(1) if int(m.group(2)) == i else m.group(0), message)


def missing_trace(spec: str, bundled: Iterable[str]) -> str:
    """The message for a trace ``spec`` that is no file: it lists the bundled trace names."""
    names = sorted(bundled)
    close = difflib.get_close_matches(str(spec), names, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return (f"trace file {str(spec)!r} does not exist and is not a bundled trace{hint} "
            f"(bundled traces: {', '.join(names)}; or give a .jsonl, .parquet or slime .pt "
            "path)")
