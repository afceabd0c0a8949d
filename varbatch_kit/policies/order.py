"""Micro-batch order on a pipeline: the sequence in which one DP rank trains its micro-batches.

With pipeline parallelism (``pp > 1`` stages, non-interleaved 1F1B) the order
of a rank's micro-batches changes the pipeline bubble when their costs
differ: the first micro-batches' forwards fill the pipeline and the last
ones' backwards drain it, and in the steady state each stage pairs the
forward of micro-batch ``j + pp - 1`` with the backward of ``j``. The sum of
the work is the same in every order; the idle time is not.

Everything here works on plain arrays: per micro-batch forward and backward
times of one stage (any unit; FLOPs are fine), in arrival order. An *order*
is a permutation ``perm`` of ``range(m)``: ``perm[i]`` is the arrival
position of the micro-batch trained i-th.

Orders (:data:`ORDERS`, chosen by name):

``arrival``
    The given order (the identity).
``small_ends``
    Small micro-batches at both ends, the largest in the middle: sorted by
    cost, then dealt alternately to the front and to the back (the order
    verl and ROLL use to shrink the warm-up and cool-down bubbles).
``min_bubble``
    The order with the shortest simulated 1F1B makespan: exact (every
    permutation, evaluated at once) for ``m <= EXACT_MAX``; otherwise a local
    search (swaps and moves) started from the best of ``arrival``,
    ``small_ends`` and the sorted orders.
    Never longer than ``arrival`` or ``small_ends`` under the model; ties go
    to the arrival order.

:func:`~varbatch_kit.policies.pipeline.pipeline_makespan` is the objective:
the makespan of the 1F1B simulator (:mod:`varbatch_kit.policies.pipeline`:
communication free, every stage holding an equal share of the layers),
vectorised over many candidate orders.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from functools import lru_cache

import numpy as np

from varbatch_kit.checks import positive_int
from varbatch_kit.policies.pipeline import pipeline_makespan

__all__ = [
    "EXACT_MAX",
    "ORDERS",
    "apply_order",
    "get_order",
    "min_bubble",
    "small_ends",
]

#: largest micro-batch count searched exhaustively by ``min_bubble`` (8! = 40320 orders)
EXACT_MAX = 8

#: ``order(fwd, bwd, pp) -> perm``
OrderFn = Callable[[np.ndarray, np.ndarray, int], np.ndarray]


def _check_pp(pp) -> int:
    return positive_int("pp", pp, note=" (pipeline stages)")


def _check_costs(fwd, bwd) -> tuple[np.ndarray, np.ndarray]:
    fwd = np.asarray(fwd, dtype=np.float64)
    bwd = np.asarray(bwd, dtype=np.float64)
    if fwd.ndim != 1 or fwd.shape != bwd.shape:
        raise ValueError(f"fwd and bwd must be 1-D arrays of equal length (one cost per "
                         f"micro-batch); got shapes {fwd.shape} and {bwd.shape}")
    if not (np.all(np.isfinite(fwd)) and np.all(np.isfinite(bwd))
            and np.all(fwd >= 0) and np.all(bwd >= 0)):
        raise ValueError("micro-batch costs must be finite and >= 0")
    return fwd, bwd


def arrival(fwd, bwd, pp: int) -> np.ndarray:
    """The given order."""
    fwd, _ = _check_costs(fwd, bwd)
    _check_pp(pp)
    return np.arange(fwd.size, dtype=np.int64)


def small_ends(fwd, bwd, pp: int = 1) -> np.ndarray:
    """Small micro-batches at both ends, the largest in the middle.

    The micro-batches by ascending cost ``fwd + bwd`` (ties: arrival order)
    are dealt alternately to a front list (kept ascending) and a back list
    (kept descending): the smallest trains first, the second smallest last,
    the largest in the middle. Independent of ``pp``.
    """
    fwd, bwd = _check_costs(fwd, bwd)
    _check_pp(pp)
    by_cost = np.argsort(fwd + bwd, kind="stable")
    front, back = by_cost[0::2], by_cost[1::2]
    return np.concatenate([front, back[::-1]]).astype(np.int64)


@lru_cache(maxsize=EXACT_MAX + 1)
def _all_perms(m: int) -> np.ndarray:
    return np.array(list(itertools.permutations(range(m))), dtype=np.int64).reshape(-1, m)


def _best(perms: np.ndarray, fwd: np.ndarray, bwd: np.ndarray, pp: int) -> tuple[int, float]:
    """Row of ``perms`` with the smallest makespan (the first within a relative 1e-12)."""
    spans = pipeline_makespan(fwd[perms], bwd[perms], pp)
    lo = float(spans.min())
    tol = 1e-12 * max(abs(lo), 1e-300)
    i = int(np.flatnonzero(spans <= lo + tol)[0])
    return i, float(spans[i])


#: above this many micro-batches the local search only moves a micro-batch up to
#: ``WINDOW`` positions (the neighbourhood stays ~ ``4 * WINDOW * m`` orders)
FULL_NEIGHBOURHOOD_MAX = 32
WINDOW = 8


@lru_cache(maxsize=64)
def _moves(m: int) -> np.ndarray:
    """Swaps of two positions and moves of one position to another, as index rows.

    All of them up to :data:`FULL_NEIGHBOURHOOD_MAX` micro-batches, else those
    spanning at most :data:`WINDOW` positions.
    """
    rows = []
    ident = list(range(m))
    reach = m if m <= FULL_NEIGHBOURHOOD_MAX else WINDOW
    for a in range(m):
        for b in range(max(0, a - reach), min(m, a + reach + 1)):
            if a < b:
                r = ident.copy()
                r[a], r[b] = r[b], r[a]
                rows.append(r)
            if abs(a - b) > 1:  # moving to a neighbour is a swap, already listed
                r = ident.copy()
                r.insert(b, r.pop(a))
                rows.append(r)
    return np.array(rows, dtype=np.int64).reshape(-1, m)


def min_bubble(fwd, bwd, pp: int, *, exact_max: int = EXACT_MAX,
               max_rounds: int | None = None) -> np.ndarray:
    """The order with the shortest 1F1B makespan (see the module doc).

    Exact for ``m <= exact_max`` (every permutation; ties: the one first in
    lexicographic order, so the arrival order when it is optimal). For
    larger ``m``: start from the best of ``arrival``, ``small_ends`` and the
    ascending and descending cost orders, and repeatedly apply the best
    improving move (every swap of two positions and every move of one
    micro-batch to another position, about ``1.5 m^2`` candidates evaluated
    at once; above 32 micro-batches only those within 8 positions) until
    none improves or ``max_rounds`` moves were made (default ``min(2 m,
    64)``, fewer for very long pipelines so that a search stays within about
    a second). The result is never worse than ``arrival`` or ``small_ends``
    under :func:`~varbatch_kit.policies.pipeline.pipeline_makespan`.
    """
    fwd, bwd = _check_costs(fwd, bwd)
    pp = _check_pp(pp)
    m = fwd.size
    ident = np.arange(m, dtype=np.int64)
    if pp == 1 or m <= 1:
        return ident
    if m <= exact_max:
        perms = _all_perms(m)
        return perms[_best(perms, fwd, bwd, pp)[0]].copy()
    by_cost = np.argsort(fwd + bwd, kind="stable")
    starts = np.stack([ident, small_ends(fwd, bwd, pp), by_cost, by_cost[::-1]])
    i, span = _best(starts, fwd, bwd, pp)
    perm = starts[i].copy()
    moves = _moves(m)
    if max_rounds is None:  # and a work budget: ~1e8 operation-candidates in all
        max_rounds = max(1, min(2 * m, 64, int(1e8 // (2 * pp * m * len(moves)))))
    for _ in range(max_rounds):
        cand = perm[moves]
        j, cand_span = _best(cand, fwd, bwd, pp)
        if not cand_span < span * (1 - 1e-12):
            break
        perm, span = cand[j], cand_span
    return perm


#: the orders users choose by name
ORDERS: dict[str, OrderFn] = {"arrival": arrival, "small_ends": small_ends,
                              "min_bubble": min_bubble}


def get_order(name: str) -> OrderFn:
    """The order called ``name`` (``ValueError`` listing the choices otherwise)."""
    if name not in ORDERS:
        raise ValueError(f"unknown microbatch_order {name!r}; choose one of {sorted(ORDERS)}")
    return ORDERS[name]


def apply_order(name: str, fwd, bwd, pp: int) -> np.ndarray:
    """``get_order(name)(fwd, bwd, pp)``, checked to be a permutation of ``range(m)``."""
    perm = np.asarray(get_order(name)(fwd, bwd, pp), dtype=np.int64)
    m = np.asarray(fwd).size
    if perm.shape != (m,) or not np.array_equal(np.sort(perm), np.arange(m)):
        raise AssertionError(f"order {name!r} did not return a permutation of range({m})")
    return perm
