"""NeMo-RL (a transcription of its documented sequence packing; no package to check against)."""

from __future__ import annotations

import bisect

import numpy as np

from varbatch_kit.policies.packers import PackInput, first_fit_decreasing
from varbatch_kit.policies.peers.base import PeerPlan, lpt_split, make_plan, validate

__all__ = ["mffd", "nemo_rl"]


def mffd(lens: np.ndarray, cap: int) -> list[list[int]]:
    """Modified first-fit decreasing (Johnson & Garey 1985), as NeMo-RL names its packer.

    Items: large ``> cap/2``, medium ``(cap/3, cap/2]``, small ``(cap/6, cap/3]``,
    tiny the rest (and over-cap samples, each alone, first).
    1. every large item opens a bin (decreasing);
    2. forward over the large bins: add the largest medium item that fits;
    3. backward over large bins without a medium item: if the two smallest
       small items fit, add the smallest small item, then the largest small
       item that still fits;
    4. forward over all bins: while the smallest remaining item fits, add the
       largest remaining item that fits;
    5. the rest by first-fit decreasing into new bins.
    """
    n = lens.size
    order = np.argsort(-lens, kind="stable").tolist()
    L = lens.tolist()
    big = [i for i in order if L[i] * 2 > cap]
    med = [i for i in order if L[i] * 3 > cap >= L[i] * 2]
    small = [i for i in order if L[i] * 6 > cap >= L[i] * 3]
    rest = [i for i in order if L[i] * 6 <= cap]
    bins = [[i] for i in big]
    room = [cap - L[i] for i in big]
    has_med = [False] * len(bins)

    def take_largest_fitting(pool_keys, pool, r):
        # pool sorted ascending by (length, -index): largest fitting = rightmost <= r
        j = bisect.bisect_right(pool_keys, (r, 1))
        if j == 0:
            return None
        pool_keys.pop(j - 1)
        return pool.pop(j - 1)

    def put(b, i):
        bins[b].append(i)
        room[b] -= L[i]

    def ascending(ids):
        ids = sorted(ids, key=lambda i: (L[i], -i))
        return [(L[i], -i) for i in ids], ids

    mk, mp = ascending(med)
    for b in range(len(bins)):
        if mp and mk[0][0] <= room[b]:
            i = take_largest_fitting(mk, mp, room[b])
            put(b, i)
            has_med[b] = True
    sk, sp = ascending(small)
    for b in range(len(bins) - 1, -1, -1):
        if has_med[b] or len(sp) < 2 or sk[0][0] + sk[1][0] > room[b]:
            continue
        sk.pop(0)
        i = sp.pop(0)
        put(b, i)
        i = take_largest_fitting(sk, sp, room[b])
        if i is not None:
            put(b, i)
    pool = mp + sp + rest
    pk, pp = ascending(pool)
    for b in range(len(bins)):
        while pp and pk[0][0] <= room[b]:
            i = take_largest_fitting(pk, pp, room[b])
            put(b, i)
    left = sorted(pp, key=lambda i: (-L[i], i))
    if left:
        sub = np.asarray([L[i] for i in left], dtype=np.int64)
        for b in first_fit_decreasing(PackInput(lengths=sub, cap=cap)):
            bins.append([left[j] for j in b])
    assert sorted(i for b in bins for i in b) == list(range(n))
    return [sorted(b) for b in bins]


def nemo_rl(lengths, *, dp: int, cap: int, workload=None) -> PeerPlan:
    """NeMo-RL (transcription of its documented sequence packing; no package to check against).

    Modified first-fit decreasing under the cap (:func:`mffd`); the bin count
    is raised to a multiple of ``dp`` by splitting the fullest bin of two or
    more samples in two (longest first, each to the lighter half), or with
    empty micro-batches when nothing splits; bin ``j`` goes to rank ``j % dp``
    (dealt round-robin). Balances tokens; ``workload`` is ignored.
    """
    lens, dp, cap, _ = validate(lengths, dp, cap, workload)
    bins = mffd(lens, cap)
    w = lens.astype(np.float64)
    notes = []
    while len(bins) % dp:
        cand = [(int(lens[b].sum()), -j) for j, b in enumerate(bins) if len(b) > 1]
        if not cand:
            notes.append("empty micro-batches to reach a multiple of dp")
            bins.append([])
            continue
        j = -max(cand)[1]
        a, b = lpt_split(bins[j], w)
        bins[j] = a
        bins.insert(j + 1, b)
    return make_plan([[bins[j] for j in range(r, len(bins), dp)] for r in range(dp)],
                     notes=notes)
