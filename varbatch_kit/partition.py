"""Karmarkar-Karp largest differencing, with slime's exact tie-breaking.

``karmarkar_karp(values, k, equal_size)`` splits item indices into ``k``
parts of near-equal value sums (SLIME_SEMANTICS §3). The result is
deterministic and identical to slime's ``get_seqlen_balanced_partitions`` on
the same inputs, including how ties are broken, because the heap orders and
merges states exactly as described there.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np

__all__ = ["karmarkar_karp"]


class _Set:
    """Items of one part and their value sum; ordered by (sum, count, items)."""

    __slots__ = ("sum", "items")

    def __init__(self, items: list[tuple[int, float]], total: float) -> None:
        self.items = items
        self.sum = total

    def key(self):
        return (self.sum, len(self.items), self.items)

    def __lt__(self, other: "_Set") -> bool:
        return self.key() < other.key()


class _State:
    """k sets kept in descending order; the heap pops the largest spread first."""

    __slots__ = ("sets",)

    def __init__(self, sets: list[_Set]) -> None:
        self.sets = sorted(sets, key=_Set.key, reverse=True)

    @property
    def spread(self) -> float:
        return self.sets[0].sum - self.sets[-1].sum

    def __lt__(self, other: "_State") -> bool:
        # heapq is a min-heap: "smaller" must mean "pops first".
        if self.spread != other.spread:
            return self.spread > other.spread
        return self.sets[0].sum > other.sets[0].sum

    def merge(self, other: "_State") -> "_State":
        k = len(self.sets)
        merged = []
        for i in range(k):
            a, b = self.sets[i], other.sets[k - 1 - i]
            merged.append(_Set(a.items + b.items, a.sum + b.sum))
        return _State(merged)


def karmarkar_karp(values: Sequence[float], k: int, equal_size: bool) -> list[list[int]]:
    """Partition item indices ``0..n-1`` into ``k`` parts by largest differencing.

    Parameters
    ----------
    values:
        Item weights (token counts or FLOPs).
    k:
        Number of parts; every part is non-empty, so ``n >= k``.
    equal_size:
        Every part gets ``n / k`` items (requires ``n % k == 0``).

    Returns
    -------
    list of k lists of item indices, each sorted ascending.
    """
    vals = [v.item() if isinstance(v, np.generic) else v for v in values]
    n = len(vals)
    if int(k) != k or k < 1:
        raise ValueError(f"k (number of partitions) must be a positive integer, got {k!r}")
    k = int(k)
    if n < k:
        raise ValueError(f"cannot split {n} items into k={k} non-empty partitions; need n >= k")
    if equal_size and n % k:
        raise ValueError(
            f"equal_size partitioning needs the item count divisible by k: n={n}, k={k}"
        )
    order = sorted(range(n), key=lambda i: (vals[i], i))
    heap: list[_State] = []
    if equal_size:
        for start in range(0, n, k):
            sets = [_Set([(i, vals[i])], vals[i]) for i in order[start:start + k]]
            heapq.heappush(heap, _State(sets))
    else:
        for i in order:
            sets = [_Set([(i, vals[i])], vals[i])] + [_Set([], 0) for _ in range(k - 1)]
            heapq.heappush(heap, _State(sets))
    while len(heap) > 1:
        first = heapq.heappop(heap)
        second = heapq.heappop(heap)
        heapq.heappush(heap, first.merge(second))
    parts = [sorted(i for i, _ in s.items) for s in heap[0].sets]
    assert all(parts), "Karmarkar-Karp produced an empty partition"
    if equal_size:
        assert all(len(p) == n // k for p in parts)
    return parts
