"""Durable step logs: one JSON line per step, written whole, fsynced; truncated on resume.

``steps.jsonl`` is appended by rank 0 after every step. :func:`append_record`
writes the whole line with one ``write`` on an ``O_APPEND`` descriptor (a line is far below
the 1 MiB of a write), then
``fsync`` s it, so a kill leaves either the full line or none of it (a torn
line can only come from a crash of the machine or an older writer).
:func:`read_records` drops a torn last line with a warning;
:func:`truncate_to_step` cuts the log back to a checkpoint's step before a
resumed run appends again, so no step appears twice.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

from varbatch_kit.train.step.tensor_files import write_all

__all__ = ["TornLogWarning", "append_record", "fsync_dir", "read_records", "truncate_to_step",
           "write_atomic", "write_synced"]


class TornLogWarning(UserWarning):
    """A step log ended in an incomplete line (dropped)."""


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (no-op where directories cannot open)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_synced(path: Path, data: bytes | memoryview, *, append: bool = False) -> None:
    """Write all of ``data`` to ``path`` (created 0o644; truncated, or appended to), then fsync:
    plain writes (:func:`~varbatch_kit.train.step.tensor_files.write_all`: pieces of at most
    1 MiB), so a full disk is an ``OSError`` naming it."""
    flags = os.O_APPEND if append else os.O_TRUNC
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o644)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def append_record(path: Path, record: dict) -> None:
    """Append ``record`` as one JSON line: a single write, then fsync."""
    write_synced(path, (json.dumps(record) + "\n").encode(), append=True)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``: temporary file, fsync, rename, fsync of the folder."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write_synced(tmp, data)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _split(raw: bytes) -> tuple[list[dict], bytes]:
    """Complete, parseable lines; and the torn rest ('' when the log ends cleanly)."""
    records, rest = [], b""
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    elif lines:
        rest = lines.pop()  # no newline at the end: the last write did not finish
    for k, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if k == len(lines) - 1 and not rest:
                rest = line
            else:
                raise ValueError(f"step log line {k + 1} is not JSON: {line[:80]!r}") from None
    return records, rest


def read_records(path: Path, *, warn: bool = True) -> list[dict]:
    """The step records of ``path``; a torn last line is dropped with a :class:`TornLogWarning`."""
    path = Path(path)
    if not path.is_file():
        return []
    records, rest = _split(path.read_bytes())
    if rest and warn:
        warnings.warn(
            f"{path}: dropped a torn last line ({len(rest)} bytes, an interrupted write of "
            f"an earlier crash): {rest[:60]!r}", TornLogWarning, stacklevel=2)
    return records


def truncate_to_step(path: Path, step: int) -> int:
    """Keep the records with ``step <= step`` (and drop a torn line); returns how many remain."""
    path = Path(path)
    if not path.is_file():
        return 0
    records, _ = _split(path.read_bytes())
    kept = [r for r in records if int(r["step"]) <= step]
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept).encode())
    return len(kept)
