"""Packers: how one step's samples become micro-batches ("bins").

Every packer has the same interface: it takes a :class:`PackInput` (the
step's samples in arrival order) and returns a list of bins, each a list of
step-local sample positions. Packers are registered by name in
:data:`PACKERS`; :func:`register_packer` plugs in new ones.

slime's three behaviours (SLIME_SEMANTICS §2.3-2.4) are here: ``static``
chunks, ``first_fit`` in arrival order, ``flops_kk`` (Karmarkar-Karp on FLOPs
into ``ceil(tokens/cap)`` bins, cap not enforced), and the bin splitting that
aligns the bin count on the dynamic path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from varbatch_kit.partition import karmarkar_karp

__all__ = [
    "PackInput",
    "PackerSpec",
    "PACKERS",
    "register_packer",
    "get_packer",
    "static_chunks",
    "first_fit",
    "flops_kk",
    "split_to_target",
    "AlignmentError",
]


class AlignmentError(ValueError):
    """The bin count cannot be brought to a multiple of the alignment."""


@dataclass(frozen=True)
class PackInput:
    """One step's samples, in arrival order.

    ``lengths`` are token counts; ``flops`` forward FLOPs (None when no model
    shape was given); ``cap`` the token cap per micro-batch on the dynamic
    path (``max_tokens_per_gpu * cp``); ``micro_batch_size`` on the static path.
    """

    lengths: np.ndarray
    flops: np.ndarray | None = None
    cap: int | None = None
    micro_batch_size: int | None = None


Bins = list[list[int]]


@dataclass(frozen=True)
class PackerSpec:
    """A registered packer and what it needs."""

    name: str
    fn: Callable[[PackInput], Bins]
    dynamic: bool  # needs a token cap (max_tokens_per_gpu), not micro_batch_size
    needs_flops: bool  # needs a model shape
    respects_cap: bool  # only a single over-cap sample may exceed the cap
    doc: str = ""


PACKERS: dict[str, PackerSpec] = {}


def register_packer(
    name: str, *, dynamic: bool, needs_flops: bool, respects_cap: bool, doc: str = ""
):
    """Decorator registering ``fn(PackInput) -> bins`` under ``name``."""

    def wrap(fn: Callable[[PackInput], Bins]) -> Callable[[PackInput], Bins]:
        PACKERS[name] = PackerSpec(name, fn, dynamic, needs_flops, respects_cap,
                                   doc or (fn.__doc__ or "").strip().splitlines()[0])
        return fn

    return wrap


def get_packer(name: str) -> PackerSpec:
    if name not in PACKERS:
        raise ValueError(f"unknown packing {name!r}; choose one of {sorted(PACKERS)}")
    return PACKERS[name]


@register_packer("static", dynamic=False, needs_flops=False, respects_cap=False)
def static_chunks(inp: PackInput) -> Bins:
    """Consecutive chunks of ``micro_batch_size`` samples (the last may be short)."""
    n, m = len(inp.lengths), int(inp.micro_batch_size)
    return [list(range(s, min(s + m, n))) for s in range(0, n, m)]


@register_packer("first_fit", dynamic=True, needs_flops=False, respects_cap=True)
def first_fit(inp: PackInput) -> Bins:
    """First-fit in arrival order: each sample joins the first bin it fits under the cap."""
    cap = int(inp.cap)
    lengths = np.asarray(inp.lengths, dtype=np.int64)
    room = np.empty(len(lengths), dtype=np.int64)  # free tokens per open bin
    bins: Bins = []
    for i, length in enumerate(lengths.tolist()):
        k = len(bins)
        fits = np.flatnonzero(room[:k] >= length) if k else ()
        if len(fits):
            b = int(fits[0])
            bins[b].append(i)
            room[b] -= length
        else:
            bins.append([i])
            room[k] = cap - length  # an over-cap sample opens a bin nothing else fits
    return bins


@register_packer("flops_kk", dynamic=True, needs_flops=True, respects_cap=False)
def flops_kk(inp: PackInput) -> Bins:
    """Karmarkar-Karp on FLOPs into ceil(tokens/cap) bins (slime --balance-by-flops; may exceed the cap)."""
    n = len(inp.lengths)
    k = max(1, math.ceil(int(np.sum(inp.lengths)) / int(inp.cap)))
    if k >= n:
        return [[i] for i in range(n)]
    return karmarkar_karp(list(np.asarray(inp.flops, dtype=np.float64)), k, equal_size=False)


def split_to_target(bins: Bins, lengths: np.ndarray, target: int, *, step: int | None = None) -> Bins:
    """Split bins until there are ``target`` of them (slime's alignment splitting).

    Repeatedly the multi-sample bin with the largest token sum (ties: the
    highest position) is split in two: its samples, by descending length
    (stable), go to the lighter half (half 0 on ties). Half 0 stays in place,
    half 1 is appended. Raises :class:`AlignmentError` when only singletons
    are left before ``target`` is reached.
    """
    bins = [list(b) for b in bins]
    lengths = np.asarray(lengths, dtype=np.int64)
    sums = [int(lengths[b].sum()) for b in bins]
    while len(bins) < target:
        best = -1
        for j, b in enumerate(bins):
            if len(b) > 1 and (best < 0 or sums[j] >= sums[best]):
                best = j
        if best < 0:
            where = f"step {step}: " if step is not None else ""
            n = sum(len(b) for b in bins)
            raise AlignmentError(
                f"{where}cannot split {n} samples into the {target} micro-batches the layout "
                f"needs (bin count must be a multiple of dp*mb_group); each micro-batch needs at "
                f"least one sample, so the step needs >= {target} samples. Use a smaller dp or "
                "mb_group, or a larger global_batch_size"
            )
        members = bins[best]
        by_len = sorted(members, key=lambda i: -lengths[i])
        halves: tuple[list[int], list[int]] = ([], [])
        half_sums = [0, 0]
        for i in by_len:
            h = 0 if half_sums[0] <= half_sums[1] else 1
            halves[h].append(i)
            half_sums[h] += int(lengths[i])
        bins[best] = halves[0]
        sums[best] = half_sums[0]
        bins.append(halves[1])
        sums.append(half_sums[1])
    return bins
