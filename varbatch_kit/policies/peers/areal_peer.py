"""AReaL 1.0.4 (read from the released package; golden vectors in ``tests/golden/peers/``).

Two schedulers: :func:`areal` (its default ``ffd`` packing) and
:func:`areal_kk` (``packing_algorithm="kk"``), and the package's kernels they
are built from: the DP dispatch :func:`areal_balanced_greedy` and the
allocators :func:`areal_ffd_allocate`, :func:`areal_kk_allocate`.
"""

from __future__ import annotations

import bisect
import heapq
import math

import numpy as np

from varbatch_kit.policies.partition import karmarkar_karp
from varbatch_kit.policies.peers.base import (
    PeerPlan,
    PeerRefusal,
    make_plan,
    refuse_oversize,
    validate,
)

__all__ = [
    "areal",
    "areal_balanced_greedy",
    "areal_ffd_allocate",
    "areal_kk",
    "areal_kk_allocate",
]


def areal_balanced_greedy(nums, k: int) -> list[list[int]]:
    """AReaL 1.0.4's DP dispatch (``balanced_greedy_partition``): equal counts, greedy sums.

    Items by value, descending (ties: index); each to the group of smallest sum
    that is not yet full (ties: lowest group). Needs ``len(nums) % k == 0``.
    """
    vals = [int(v) for v in nums]
    n = len(vals)
    if n < k or n % k:
        raise ValueError(f"AReaL's dispatch needs a multiple of k={k} items, got {n}")
    m = n // k
    groups: list[list[int]] = [[] for _ in range(k)]
    heap = [(0, g) for g in range(k)]
    for i in sorted(range(n), key=lambda i: -vals[i]):
        s, g = heapq.heappop(heap)
        groups[g].append(i)
        if len(groups[g]) < m:
            heapq.heappush(heap, (s + vals[i], g))
    return groups


def _areal_ffd_once(values: np.ndarray, cap: int, min_groups: int) -> list[list[int]]:
    order = np.argsort(-values)  # numpy's default sort, as AReaL calls it
    groups: list[list[int]] = []
    keys: list[tuple[float, int]] = []  # (load, group) ascending
    n = len(values)
    for idx in order.tolist():
        v = values[idx]
        if len(keys) < min_groups or keys[0][0] + v > cap:
            bisect.insort(keys, (float(v), len(groups)))
            groups.append([idx])
            continue
        j_end = bisect.bisect_right(keys, (cap - v, n))
        best = min(range(j_end), key=lambda j: len(groups[keys[j][1]]))
        load, g = keys.pop(best)
        bisect.insort(keys, (float(v + load), g))
        groups[g].append(idx)
    return groups


def _areal_input(values, cap: int, min_groups: int, divisor: int) -> tuple[np.ndarray, int]:
    """The lengths as int64 and the least group count (at least ``divisor``); AReaL refuses
    a sample over the cap and fewer samples than groups."""
    vals = np.asarray(values, dtype=np.int64)
    min_groups = max(min_groups or 0, divisor)
    if int(vals.max()) > cap:
        raise PeerRefusal(f"AReaL refuses a sample of {int(vals.max())} tokens > cap {cap}")
    if vals.size < min_groups:
        raise PeerRefusal(f"AReaL needs at least {min_groups} samples, got {vals.size}")
    return vals, min_groups


def areal_ffd_allocate(values, cap: int, min_groups: int = 1, divisor: int = 1):
    """AReaL 1.0.4's ``ffd_allocate``: first-fit decreasing into the least-populated bin that fits.

    The first ``min_groups`` items each open a bin; then each item (longest
    first) goes to the bin with the fewest items among those it fits in
    (ties: the lightest), else opens a bin; repeated with more ``min_groups``
    until the count is a multiple of ``divisor``.
    """
    vals, min_groups = _areal_input(values, cap, min_groups, divisor)
    while True:
        res = _areal_ffd_once(vals, cap, min_groups)
        min_groups += divisor - min_groups % divisor
        if len(res) % divisor == 0:
            return res
        if vals.size < min_groups:
            raise PeerRefusal(f"AReaL cannot reach a multiple of {divisor} micro-batches")


def areal_kk_allocate(values, cap: int, min_groups: int = 1, divisor: int = 1):
    """AReaL 1.0.4's ``kk_allocate``: Karmarkar-Karp into ``max(min_groups, ceil(total/cap))``.

    Rounded up to a multiple of ``divisor``, at most one group per item; if a
    group exceeds the cap, the whole allocation falls back to :func:`areal_ffd_allocate`.
    """
    return _areal_kk(values, cap, min_groups, divisor)[0]


def _areal_kk(values, cap, min_groups, divisor):
    """:func:`areal_kk_allocate` and whether it fell back to first-fit decreasing."""
    vals, min_groups = _areal_input(values, cap, min_groups, divisor)
    k = max(min_groups, math.ceil(int(vals.sum()) / cap))
    k = min(math.ceil(k / divisor) * divisor, vals.size)
    parts = karmarkar_karp(vals.tolist(), k, False, sort_parts=False)
    if any(int(vals[p].sum()) > cap for p in parts):
        return areal_ffd_allocate(vals, cap, min_groups, divisor), True
    return parts, False


def _areal(lengths, dp, cap, workload, algorithm, kernels):
    lens, dp, cap, _ = validate(lengths, dp, cap, workload)
    refuse_oversize("AReaL", lens, cap)
    kernels = kernels or {}
    dispatch = kernels.get("dispatch", areal_balanced_greedy)
    n = lens.size
    pad = (-n) % dp
    padded = np.concatenate((lens, np.zeros(pad, dtype=np.int64)))
    ranks = [[i for i in g if i < n] for g in dispatch(padded.tolist(), dp)]
    if min(len(r) for r in ranks) == 0:
        raise PeerRefusal(f"AReaL needs at least one sample per rank: {n} samples, dp={dp}")
    n_mbs = 1
    fallbacks = 0
    while True:  # allocate_balanced_mbs_synced: redo with the largest count until all agree
        out, fallbacks = [], 0
        for r in ranks:
            v = lens[r]
            if "allocate" in kernels:  # the package's own allocator (fallback not counted)
                parts = kernels["allocate"](v.tolist(), cap, n_mbs, 1)
            elif algorithm == "kk":
                parts, fell = _areal_kk(v, cap, n_mbs, 1)
                fallbacks += fell
            else:
                parts = areal_ffd_allocate(v, cap, n_mbs)
            out.append(sorted(sorted(p) for p in parts))
        counts = {len(p) for p in out}
        if len(counts) == 1:
            break
        n_mbs = max(counts)
    notes = (f"KK broke the cap on {fallbacks} rank(s): FFD fallback",) if fallbacks else ()
    return make_plan([[[r[i] for i in p] for p in parts] for r, parts in zip(ranks, out)],
                 notes=notes)


def areal(lengths, *, dp: int, cap: int, workload=None, kernels=None) -> PeerPlan:
    """AReaL 1.0.4, default packing (``ffd``).

    Read from AReaL 1.0.4: the train controller deals samples to DP ranks by
    :func:`areal_balanced_greedy` on token counts (padding to a multiple of
    ``dp`` with empty items, which we drop); each rank packs its samples by
    :func:`areal_ffd_allocate` under the cap; if ranks disagree on the count,
    all repack with the largest as ``min_groups``
    (``allocate_balanced_mbs_synced``). Micro-batches sorted by first index.
    A sample over the cap is refused, as AReaL raises. Balances tokens.
    ``kernels`` (``dispatch``, ``allocate``) replace the two kernels by the
    package's own (the bench passes them).
    """
    return _areal(lengths, dp, cap, workload, "ffd", kernels)


def areal_kk(lengths, *, dp: int, cap: int, workload=None, kernels=None) -> PeerPlan:
    """AReaL 1.0.4, ``packing_algorithm="kk"``: :func:`areal` with :func:`areal_kk_allocate`."""
    return _areal(lengths, dp, cap, workload, "kk", kernels)
