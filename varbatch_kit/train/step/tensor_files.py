"""``torch.save`` for the files a run writes for itself: no CRC-32 over their bytes.

A run saves its parameters and gradients after chosen steps (``save_params_at``,
``save_grads_at``: what :func:`~varbatch_kit.train.compare` reads back) and each rollout
batch's log-prob pass (read back on resume). ``torch.save`` computes a CRC-32 of every
record by default; for the float64 parameters of truncated SmolLM2 (42M values, 336 MB)
that was three quarters of the save (1.12 s against 0.27 s without), twice per run.
These files live one run long in the run's own folder and are written whole then renamed,
so they are saved without it; the loader reads both kinds. Checkpoints
(:mod:`varbatch_kit.train.runs.checkpoint`), which outlive the run, keep their checksum.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.utils.serialization import config as serialization_config

__all__ = ["save_tensors"]


def save_tensors(obj, path: str | os.PathLike) -> Path:
    """``torch.save(obj, path)`` without the CRC-32, written to a hidden file beside it and
    then renamed: a reader never sees half a file. Returns ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with serialization_config.patch({"save.compute_crc32": False}):
        torch.save(obj, tmp)
    tmp.replace(path)
    return path
