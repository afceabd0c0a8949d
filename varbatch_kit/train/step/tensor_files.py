"""The files a run writes for itself, and the one write loop of the engine's files.

A run saves its parameters and gradients after chosen steps (``save_params_at``,
``save_grads_at``: what :func:`~varbatch_kit.train.compare` reads back) and each rollout
batch's log-prob pass (read back on resume). :func:`save_tensors` is ``torch.save`` with two
changes:

- **no CRC-32.** ``torch.save`` computes a CRC-32 of every record by default; for the float64
  parameters of truncated SmolLM2 (42M values, 336 MB) that was three quarters of the save
  (1.12 s against 0.27 s without), twice per run. These files live one run long in the run's
  own folder and are written whole then renamed, so they are saved without it; the loader
  reads both kinds. Checkpoints (:mod:`varbatch_kit.train.runs.checkpoint`), which outlive
  the run, keep their checksum.
- **written in pieces of at most** :data:`WRITE_PIECE` **bytes** (:func:`write_all`, also
  the write loop of checkpoints and step logs). ``torch.save`` writes each tensor's bytes in
  one call; a write of several MiB makes the kernel's page cache (Linux 6.x, ext4) take 2 MiB
  folios for it, and on the CI machine's virtual machine, whose free memory is handed back to
  its host, a fresh 2 MiB folio costs about 7x the copy: a 336 MB parameter file took 0.88 s
  of CPU, in 1 MiB pieces 0.12 s, the same bytes (``python -m benchmarks.file_writes``). On
  other machines the pieces cost one system call per MiB.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["WRITE_PIECE", "save_tensors", "write_all"]

#: the largest single ``os.write`` of the engine's files (1 MiB: below the page cache's 2 MiB
#: folios; measured 0.10 s per 336 MB at 1 MiB, 0.55 s at 4 MiB, 0.88 s written whole)
WRITE_PIECE = 1 << 20


def write_all(fd: int, data) -> int:
    """Write all of ``data`` (bytes or any buffer) to the file descriptor ``fd`` in pieces of
    at most :data:`WRITE_PIECE` bytes; returns the number of bytes written. An ``OSError``
    (a full disk, ...) propagates."""
    view = memoryview(data).cast("B")
    total = len(view)
    while view:
        view = view[os.write(fd, view[:WRITE_PIECE]):]
    return total


class _PieceFile:
    """The write-only file object ``torch.save`` writes to: each write through
    :func:`write_all`."""

    def __init__(self, fd: int):
        self._fd = fd

    def write(self, data) -> int:
        return write_all(self._fd, data)

    def flush(self) -> None:
        pass


def save_tensors(obj, path: str | os.PathLike) -> Path:
    """``torch.save(obj, path)`` without the CRC-32, in pieces of at most :data:`WRITE_PIECE`
    bytes, to a hidden file beside it and then renamed: a reader never sees half a file.
    Returns ``path``."""
    import torch  # here: write_all (the step log's writes) needs no torch
    from torch.utils.serialization import config as serialization_config

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        with serialization_config.patch({"save.compute_crc32": False}):
            torch.save(obj, _PieceFile(fd))
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    tmp.replace(path)
    return path
