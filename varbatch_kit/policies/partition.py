"""Karmarkar-Karp largest differencing, with slime's exact tie-breaking.

``karmarkar_karp(values, k, equal_size)`` splits item indices into ``k``
parts of near-equal value sums (docs/reference_semantics.md §3). The result is
deterministic and identical to slime's ``get_seqlen_balanced_partitions`` on
the same inputs, including how ties are broken, because the heap orders and
merges states exactly as described there.

Two implementations give the same partitions:

- :func:`karmarkar_karp_reference`: a plain transcription (one Python object
  per set, ``k`` sets per state). It costs ``O(n * k)`` Python operations and
  memory, which is what makes slime's ``--balance-by-flops`` slow (k grows
  with n: tens of seconds at 16k samples).
- the fast path used by :func:`karmarkar_karp` for non-negative values of one
  numeric kind. It relies on three facts of the reference semantics:

  1. sets are compared by ``(sum, count, items)``; the item lists of two
     distinct non-empty sets are disjoint, so comparing the lists is
     comparing their first item's index. A set is summarised by
     ``(sum, count, first index)`` plus a node of a merge forest;
  2. with non-negative values every non-empty set sorts before every empty
     set, so a state is stored as its ``m <= k`` non-empty sets only (empty
     sets are identical, their order does not matter); memory stays linear
     in ``n``;
  3. merging pairs set ``i`` of the first state with set ``k-1-i`` of the
     second: non-empty sets overlap only on ``max(0, m1 + m2 - k)``
     positions, which numpy adds in one go.

  The item lists are rebuilt at the end from the merge forest (at most
  ``n - k`` internal nodes). Sums are the reference's to the last bit, so
  every comparison, and hence every heap operation, is identical: a merged
  set's sum grows by the other set's items one at a time (slime's order;
  with rounding floats ``a + (b1 + b2)`` may differ from ``(a + b1) + b2``),
  which the fast path reproduces by folding the item values of overlapping
  sets. Integer values need no fold (int64 sums are exact), nor do integral
  floats (FLOPs estimates) while a merged sum stays below ``2**53``: then
  whole set sums are added, and only the rare larger sums are folded.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from varbatch_kit.checks import positive_int

__all__ = ["karmarkar_karp", "karmarkar_karp_reference"]


# --------------------------------------------------------------------------- reference
class _Set:
    """Items of one part and their value sum; ordered by (sum, count, items)."""

    __slots__ = ("items", "sum")

    def __init__(self, items: list[tuple[int, float]], total: float) -> None:
        self.items = items
        self.sum = total

    def key(self):
        return (self.sum, len(self.items), self.items)

    def __lt__(self, other: _Set) -> bool:
        return self.key() < other.key()


class _State:
    """k sets kept in descending order; the heap pops the largest spread first."""

    __slots__ = ("sets",)

    def __init__(self, sets: list[_Set]) -> None:
        self.sets = sorted(sets, key=_Set.key, reverse=True)

    @property
    def spread(self) -> float:
        return self.sets[0].sum - self.sets[-1].sum

    def __lt__(self, other: _State) -> bool:
        # heapq is a min-heap: "smaller" must mean "pops first".
        if self.spread != other.spread:
            return self.spread > other.spread
        # equal spread: the state whose largest set is larger under the full set order
        return other.sets[0] < self.sets[0]

    def merge(self, other: _State) -> _State:
        k = len(self.sets)
        merged = []
        for i in range(k):
            a, b = self.sets[i], other.sets[k - 1 - i]
            total = a.sum
            for _, v in b.items:  # one item at a time: float sums round as slime's do
                total += v
            merged.append(_Set(a.items + b.items, total))
        return _State(merged)


def _validate(n: int, k, equal_size: bool, allow_empty: bool = False) -> int:
    k = positive_int("k (number of partitions)", k, whole_floats=True)
    if allow_empty and not equal_size:
        if n < 1:
            raise ValueError("cannot partition 0 items; pass at least one value")
    elif n < k:
        raise ValueError(f"cannot split {n} items into k={k} non-empty partitions; need n >= k")
    if equal_size and n % k:
        raise ValueError(
            f"equal_size partitioning needs the item count divisible by k: n={n}, k={k}"
        )
    return k


def karmarkar_karp_reference(values: Sequence[float], k: int, equal_size: bool, *,
                             sort_parts: bool = True,
                             allow_empty: bool = False) -> list[list[int]]:
    """The plain ``O(n * k)`` transcription (docs/reference_semantics.md §3), as slime runs it.

    Kept as the executable specification: the fast path is tested against
    it, and it handles the inputs the fast path does not (negative values,
    lists mixing Python ints and floats). ``allow_empty=True`` (without
    ``equal_size``) returns the final state's sets even when some are empty,
    e.g. for fewer items than parts, as slime's raw ``karmarkar_karp`` does.
    """
    vals = [v.item() if isinstance(v, np.generic) else v for v in values]
    n = len(vals)
    k = _validate(n, k, equal_size, allow_empty)
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
    parts = [[i for i, _ in s.items] for s in heap[0].sets]
    if sort_parts:
        parts = [sorted(p) for p in parts]
    if not (allow_empty and not equal_size):
        assert all(parts), "Karmarkar-Karp produced an empty partition"
    if equal_size:
        assert all(len(p) == n // k for p in parts)
    return parts


# --------------------------------------------------------------------------- fast path
class _FastState:
    """A state as its non-empty sets, sorted descending by (sum, count, first index).

    ``sums`` holds the set sums, ``meta`` the rows (count, first index, forest
    node). ``spread`` and ``top`` are Python scalars so heap comparisons are
    exactly the reference's (same values, same ``__lt__``).
    """

    __slots__ = ("meta", "spread", "sums", "top", "top_key")

    def __init__(self, sums: np.ndarray, meta: np.ndarray, k: int) -> None:
        if sums.size > 1:
            order = np.argsort(-sums)  # descending by sum
            ss = sums[order]
            tie = np.flatnonzero(ss[1:] == ss[:-1])
            if 4 * tie.size > sums.size:  # many ties: sort by the full key
                order = np.lexsort((meta[1], meta[0], sums))[::-1]
                ss = sums[order]
            elif tie.size:  # order the runs of equal sums by the full key, in place
                mask = np.zeros(sums.size, dtype=bool)
                mask[tie] = True
                mask[tie + 1] = True
                pos = np.flatnonzero(mask)
                sub = order[pos]
                order[pos] = sub[np.lexsort((meta[1, sub], meta[0, sub], sums[sub]))[::-1]]
            sums, meta = ss, meta[:, order]
        self.sums, self.meta = sums, meta
        top = sums[0].item()
        self.top = top
        # the largest set's full order key: (sum, count, first index). The largest sets of two
        # states in the heap are disjoint, so comparing their item lists is comparing their
        # first (index, value) pair, i.e. the first index.
        self.top_key = (top, int(meta[0, 0]), int(meta[1, 0]))
        # the smallest set is empty (sum 0, an int in the reference) unless all k are used
        self.spread = top - (sums[-1].item() if sums.size == k else 0)

    def __lt__(self, other: _FastState) -> bool:
        if self.spread != other.spread:
            return self.spread > other.spread
        return self.top_key > other.top_key


def _numeric_kind(vals: np.ndarray, values: Sequence) -> str | None:
    """'int' / 'float' when the fast path reproduces the reference exactly, else None."""
    if vals.dtype.kind in "iu":
        if vals.size and (vals.min() < 0 or float(np.abs(vals).sum()) >= 2.0 ** 62):
            return None
        return "int"
    if vals.dtype.kind == "f":
        if isinstance(values, np.ndarray):
            kinds = {values.dtype.kind}
        else:
            kinds = {"i" if isinstance(v, (int, np.integer)) and not isinstance(v, bool)
                     else "f" if isinstance(v, (float, np.floating)) else "?" for v in values}
        if kinds != {"f"} or not np.isfinite(vals).all() or (vals < 0).any():
            return None  # mixed int/float sums, NaN or negative values: use the reference
        return "float"
    return None


def _fold_sums(a_sums: np.ndarray, b_sums: np.ndarray, a_nodes: np.ndarray,
               b_nodes: np.ndarray, first_node: int, item_vals: list | None,
               val_list: list[float], left: np.ndarray, right: np.ndarray,
               n: int) -> np.ndarray:
    """Merged sums of overlapping sets, each grown by the other set's items one at a time.

    A set's sum is the left fold from 0 of its item values in item order (slime
    accumulates it so), hence merging ``b`` into ``a`` gives ``a.sum + b1 + b2 + ...``.
    With ``item_vals`` (non-integral floats) ``item_vals[node]`` lists each set's item
    values and the merged set ``first_node + t`` takes over the list of ``a_nodes[t]``
    extended by that of ``b_nodes[t]``. Without it the values are integral: a merged sum
    below ``2**53`` is exact in any order and is added whole; the others read ``b``'s
    items off the merge forest (``left``/``right``, leaves ``< n``).
    """
    out = a_sums + b_sums
    b_list = b_nodes.tolist()
    if item_vals is None:
        for t in np.flatnonzero(out >= 2.0 ** 53).tolist():
            total, stack = float(a_sums[t]), [b_list[t]]
            while stack:  # items of b in order: a node lists its left child's, then its right's
                v = stack.pop()
                if v < n:
                    total += val_list[v]
                else:
                    stack.append(int(right[v - n]))
                    stack.append(int(left[v - n]))
            out[t] = total
        return out
    for t, (total, an, bn) in enumerate(zip(a_sums.tolist(), a_nodes.tolist(), b_list)):
        items = item_vals[bn]
        for v in items:
            total += v
        out[t] = total
        merged = item_vals[an]
        merged.extend(items)
        item_vals[first_node + t] = merged
        item_vals[an] = item_vals[bn] = None
    return out


def karmarkar_karp(values: Sequence[float], k: int, equal_size: bool, *,
                   sort_parts: bool = True) -> list[list[int]]:
    """Partition item indices ``0..n-1`` into ``k`` parts by largest differencing.

    Parameters
    ----------
    values:
        Item weights (token counts or FLOPs).
    k:
        Number of parts; every part is non-empty, so ``n >= k``.
    equal_size:
        Every part gets ``n / k`` items (requires ``n % k == 0``).

    sort_parts:
        Sort each part's indices ascending (default). With False a part lists
        its items in merge order (slime's ``karmarkar_karp`` before its caller
        sorts them).

    Returns
    -------
    list of k lists of item indices (parts in the final state's order). Identical to
    :func:`karmarkar_karp_reference` (slime's result); fast path in
    ``O(n log n + merges * k)`` numpy work and ``O(n)`` memory.
    """
    try:
        vals = np.asarray(values)
    except (TypeError, ValueError):
        vals = np.asarray([], dtype=object)
    n = len(values)
    if vals.ndim != 1 or vals.size != n:
        return karmarkar_karp_reference(values, k, equal_size, sort_parts=sort_parts)
    k = _validate(n, k, equal_size)
    if k == 1 and sort_parts:  # every merge lands in the one part: all items, ascending
        return [list(range(n))]
    kind = _numeric_kind(vals, values)
    if kind is None:
        return karmarkar_karp_reference(values, k, equal_size, sort_parts=sort_parts)
    vals = vals.astype(np.int64 if kind == "int" else np.float64)
    # float sums round: slime grows a merged set's sum item by item, so the sums of
    # overlapping sets are folded in that order (``fold``) unless every partial sum is exact
    integral = kind == "float" and bool(np.all(vals == np.floor(vals)))
    fold = kind == "float" and not (integral and float(vals.sum()) < 2.0 ** 52)
    # item values per set, in item order: kept up to date for non-integral floats (every
    # overlapping merge folds); integral floats fold only merged sums >= 2**53, rarely, and
    # then read the items off the merge forest
    item_vals: list | None = ([[v] for v in vals.tolist()] + [None] * n
                              if fold and not integral else None)
    val_list = vals.tolist() if fold else []
    order = np.lexsort((np.arange(n), vals))  # ascending by (value, index)
    heap: list[_FastState] = []
    if equal_size:
        for start in range(0, n, k):
            idx = order[start:start + k]
            heapq.heappush(heap, _FastState(vals[idx], np.stack((np.ones(k, np.int64), idx, idx)),
                                            k))
    else:
        for i in order.tolist():
            heapq.heappush(heap, _FastState(vals[i:i + 1], np.array([[1], [i], [i]]), k))
    left = np.empty(max(n, 1), dtype=np.int64)  # merge forest: node n+j = left[j] ++ right[j]
    right = np.empty(max(n, 1), dtype=np.int64)
    n_nodes = 0
    while len(heap) > 1:
        a = heapq.heappop(heap)
        b = heapq.heappop(heap)
        ma, mb = a.sums.size, b.sums.size
        lo = k - mb  # first merged position that receives a set of b
        if lo >= ma:  # no overlap: the non-empty sets are carried over unchanged
            state = _FastState(np.concatenate((a.sums, b.sums)),
                               np.concatenate((a.meta, b.meta), axis=1), k)
        else:
            bo = slice(mb - 1, k - ma - 1 if k - ma > 0 else None, -1)  # pairs a[lo:ma]
            n_ov = ma - lo
            left[n_nodes:n_nodes + n_ov] = a.meta[2, lo:ma]
            right[n_nodes:n_nodes + n_ov] = b.meta[2, bo]
            mid = np.empty((3, n_ov), dtype=np.int64)
            mid[0] = a.meta[0, lo:ma] + b.meta[0, bo]
            mid[1] = a.meta[1, lo:ma]
            mid[2] = np.arange(n + n_nodes, n + n_nodes + n_ov)
            if fold:
                merged = _fold_sums(a.sums[lo:ma], b.sums[bo], a.meta[2, lo:ma], b.meta[2, bo],
                                    n + n_nodes, item_vals, val_list, left, right, n)
            else:
                merged = a.sums[lo:ma] + b.sums[bo]
            n_nodes += n_ov
            state = _FastState(
                np.concatenate((a.sums[:lo], merged, b.sums[:k - ma])),
                np.concatenate((a.meta[:, :lo], mid, b.meta[:, :k - ma]), axis=1), k)
        heapq.heappush(heap, state)
    final = heap[0]
    assert final.sums.size == k, "Karmarkar-Karp produced an empty partition"
    lft, rgt = left[:n_nodes].tolist(), right[:n_nodes].tolist()
    parts = []
    for root in final.meta[2].tolist():
        items, stack = [], [root]
        while stack:
            v = stack.pop()
            if v < n:
                items.append(v)
            else:  # node = left ++ right: visit left first (merge order)
                stack.append(rgt[v - n])
                stack.append(lft[v - n])
        if sort_parts:
            items.sort()
        parts.append(items)
    if equal_size:
        assert all(len(p) == n // k for p in parts)
    return parts
