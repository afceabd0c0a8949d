"""Packers: how one step's samples become micro-batches ("bins").

Every packer has the same interface: it takes a :class:`PackInput` (the
step's samples in arrival order) and returns a list of bins, each a list of
step-local sample positions. The names users choose them by are assembled
in :mod:`varbatch_kit.policies.registry`.

slime's three behaviours (docs/reference_semantics.md §2.3-2.4) are here: ``static``
chunks, ``first_fit`` in arrival order, ``flops_kk`` (Karmarkar-Karp on FLOPs
into ``ceil(tokens/cap)`` bins, cap not enforced), and the bin splitting that
aligns the bin count on the dynamic path. They give exactly slime's bins, in
``O(n log n)``: first-fit walks a segment tree of the bins' free room instead
of scanning every open bin, and the splitting keeps its candidates in a heap.

Beyond slime: ``ffd`` (first-fit decreasing), ``bfd`` (best-fit decreasing)
and ``balanced`` (FLOPs-balanced micro-batches under the cap, with a local
search over micro-batches and ranks; see :mod:`varbatch_kit.policies.balance`).
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, insort
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from varbatch_kit.policies.partition import karmarkar_karp

__all__ = [
    "AlignmentError",
    "Bins",
    "Refiner",
    "PackInput",
    "aligned_count",
    "best_fit_decreasing",
    "first_fit",
    "first_fit_decreasing",
    "flops_kk",
    "split_to_target",
    "static_chunks",
]


class AlignmentError(ValueError):
    """The bin count cannot be brought to a multiple of the alignment."""


@dataclass(frozen=True)
class PackInput:
    """One step's samples, in arrival order.

    ``lengths`` are token counts; ``flops`` the per-sample weights the
    FLOPs-aware packers balance: forward FLOPs, or the configured workload's
    measured cost ``c1 L + c2 L^2`` (None when neither was given); ``cap``
    the token cap per micro-batch on the dynamic path (``max_tokens_per_gpu
    * cp``); ``micro_batch_size`` on the static path; ``align`` the multiple
    the step's micro-batch count is rounded up to (``dp``, times
    ``mb_group`` under virtual pipelining). slime's packers ignore ``align``
    (the bins are split to it afterwards); packers that plan
    for the final count (``balanced``) use it.
    """

    lengths: np.ndarray
    flops: np.ndarray | None = None
    cap: int | None = None
    micro_batch_size: int | None = None
    align: int = 1


Bins = list[list[int]]
#: ``refine(inp, bins, rank_bins) -> (bins, rank_bins)``: a stage run after the
#: distribution that may move samples between micro-batches and ranks, keeping
#: the micro-batch count of every rank.
Refiner = Callable[[PackInput, Bins, list[list[int]]], tuple[Bins, list[list[int]]]]


def aligned_count(k: int, align: int) -> int:
    """The micro-batch count a step of ``k`` bins ends with: ``max(ceil(k/align)*align, align)``."""
    return max(math.ceil(k / align) * align, align)


def static_chunks(inp: PackInput) -> Bins:
    """Consecutive chunks of ``micro_batch_size`` samples (the last may be short)."""
    n, m = len(inp.lengths), int(inp.micro_batch_size)
    return [list(range(s, min(s + m, n))) for s in range(0, n, m)]


def _first_fit_in_order(lengths: list[int], cap: int, order) -> Bins:
    """First-fit of the samples visited in ``order``, in O(n log n).

    A segment tree holds the free room of bins ``0..n-1`` (a bin not yet
    opened has room ``cap``), each node the maximum of its children. The
    leftmost leaf with room >= length is the first open bin the sample fits
    in, or else the next unopened bin: exactly first-fit. A sample longer
    than the cap opens the next bin, whose room becomes negative.
    """
    n = len(lengths)
    size = 1
    while size < n:
        size *= 2
    tree = [cap] * (2 * size)
    bins: Bins = []
    for i in order:
        length = lengths[i]
        if tree[1] >= length:
            v = 1
            while v < size:
                v += v
                if tree[v] < length:
                    v += 1
            b = v - size
        else:
            b = len(bins)
            v = b + size
        if b == len(bins):
            bins.append([i])
        else:
            bins[b].append(i)
        tree[v] -= length
        v >>= 1
        while v:
            left, right = tree[v + v], tree[v + v + 1]
            best = max(right, left)
            if tree[v] == best:
                break
            tree[v] = best
            v >>= 1
    return bins


def first_fit(inp: PackInput) -> Bins:
    """First-fit in arrival order: each sample joins the first bin it fits under the cap."""
    lengths = np.asarray(inp.lengths, dtype=np.int64).tolist()
    return _first_fit_in_order(lengths, int(inp.cap), range(len(lengths)))


def _decreasing(lengths: np.ndarray) -> np.ndarray:
    """Sample positions by descending length (ties: arrival order)."""
    return np.argsort(-np.asarray(lengths, dtype=np.int64), kind="stable")


def first_fit_decreasing(inp: PackInput) -> Bins:
    """First-fit decreasing: longest samples first, each into the first bin it fits."""
    lengths = np.asarray(inp.lengths, dtype=np.int64)
    bins = _first_fit_in_order(lengths.tolist(), int(inp.cap), _decreasing(lengths).tolist())
    return [sorted(b) for b in bins]


def best_fit_decreasing(inp: PackInput) -> Bins:
    """Best-fit decreasing: longest samples first, each into the fullest bin it fits."""
    lengths = np.asarray(inp.lengths, dtype=np.int64)
    cap = int(inp.cap)
    n = len(lengths)
    lens = lengths.tolist()
    shift = n + 1
    keys: list[int] = []  # room * shift + bin, ascending: fullest bin first, then lowest id
    bins: Bins = []
    for i in _decreasing(lengths).tolist():
        length = lens[i]
        j = bisect_left(keys, length * shift)
        if j < len(keys):
            room, b = divmod(keys.pop(j), shift)
            bins[b].append(i)
            room -= length
        else:
            b = len(bins)
            bins.append([i])
            room = cap - length
        if room >= 0:
            insort(keys, room * shift + b)
    return [sorted(b) for b in bins]


def flops_kk(inp: PackInput) -> Bins:
    """Karmarkar-Karp on FLOPs into ceil(tokens/cap) bins (slime --balance-by-flops; over cap).

    The cap is not enforced: micro-batches may exceed it (slime documents the
    out-of-memory risk).
    """
    n = len(inp.lengths)
    k = max(1, math.ceil(int(np.sum(inp.lengths)) / int(inp.cap)))
    if k >= n:
        return [[i] for i in range(n)]
    return karmarkar_karp(list(np.asarray(inp.flops, dtype=np.float64)), k, equal_size=False)


def split_to_target(bins: Bins, lengths: np.ndarray, target: int, *,
                    step: int | None = None) -> Bins:
    """Split bins until there are ``target`` of them (slime's alignment splitting).

    Repeatedly the multi-sample bin with the largest token sum (ties: the
    highest position) is split in two: its samples, by descending length
    (stable), go to the lighter half (half 0 on ties). Half 0 stays in place,
    half 1 is appended. Raises :class:`AlignmentError` when only singletons
    are left before ``target`` is reached. The candidates sit in a heap keyed
    by ``(-tokens, -position)``, so each split costs ``O(log bins)`` plus the
    split bin's size.
    """
    bins = [list(b) for b in bins]
    if len(bins) >= target:
        return bins
    lens = np.asarray(lengths, dtype=np.int64).tolist()
    heap = [(-sum(lens[i] for i in b), -j) for j, b in enumerate(bins) if len(b) > 1]
    heapq.heapify(heap)
    while len(bins) < target:
        if not heap:
            where = f"step {step}: " if step is not None else ""
            n = sum(len(b) for b in bins)
            raise AlignmentError(
                f"{where}cannot split {n} samples into the {target} micro-batches the layout "
                f"needs (bin count must be a multiple of dp*mb_group); each micro-batch needs at "
                f"least one sample, so the step needs >= {target} samples. Use a smaller dp or "
                "mb_group, or a larger global_batch_size"
            )
        best = -heapq.heappop(heap)[1]
        halves: tuple[list[int], list[int]] = ([], [])
        s0 = s1 = 0
        for i in sorted(bins[best], key=lambda i: -lens[i]):
            if s0 <= s1:
                halves[0].append(i)
                s0 += lens[i]
            else:
                halves[1].append(i)
                s1 += lens[i]
        bins[best] = halves[0]
        bins.append(halves[1])
        if len(halves[0]) > 1:
            heapq.heappush(heap, (-s0, -best))
        if len(halves[1]) > 1:
            heapq.heappush(heap, (-s1, -(len(bins) - 1)))
    return bins

