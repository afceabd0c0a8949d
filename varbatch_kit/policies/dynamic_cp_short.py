"""The degree-1 phase of the dynamic-CP planner: deal the short samples, then refine.

After the groups of degree > 1 are list-scheduled, each rank is free at
``free[r]``; the samples trained without CP (degree 1) run after that, each
rank packing its own micro-batches under ``cap`` tokens. :func:`deal_short`
deals them longest first to the rank that finishes first (next-fit per rank);
:func:`refine_short` then moves a sample off the rank that finishes last, or
swaps it for a shorter one, while that lowers the pair's later finish.

Both are written for speed (a few numpy calls per sample or per move, per-rank
arrays cached between moves, exact pre-tests that skip ranks which cannot take
a move) and give, bit for bit, the plans of the plain versions they replace:
the same float expressions are evaluated in the same order wherever a
decision depends on them.

``cost`` is the planner's :class:`~varbatch_kit.policies.dynamic_cp.CPCostModel`
(not imported here: that module imports this one).
"""

from __future__ import annotations

import bisect
import heapq
import math

import numpy as np

__all__ = ["deal_short", "refine_short"]

_EPS = 1e-12


def deal_short(short: np.ndarray, lengths: np.ndarray, free: np.ndarray, cap: int,
               cost) -> list[list[list[int]]]:
    """Degree-1 samples, longest first, each to the rank that finishes first (next-fit).

    A rank's key is its finish, plus one micro-batch overhead when the sample
    does not fit its open micro-batch; the lowest key wins (the lowest rank
    on ties). Returns every rank's micro-batches (step-local positions).

    The keys live in one array, changed only where they change: at the chosen
    rank, and at the ranks whose open micro-batch the (shrinking) samples
    start to fit, taken from a heap of the ranks that do not fit yet.
    """
    pool = free.size
    oh = cost.microbatch_overhead_s
    short = short[np.argsort(-lengths[short], kind="stable")]
    Ls = lengths[short].astype(np.float64)
    works = cost.compute(Ls, Ls * Ls, 1)
    fin = free.tolist()
    open_tok = [math.inf] * pool  # tokens of each rank's open micro-batch (inf: none)
    fits = [False] * pool  # the current sample fits the rank's open micro-batch
    key = free + oh  # no rank has an open micro-batch yet
    waiting: list[tuple[float, int]] = []  # (open tokens, rank) of ranks it does not fit
    per_rank: list[list[list[int]]] = [[] for _ in range(pool)]
    for i, L, work in zip(short.tolist(), Ls.tolist(), works.tolist()):
        thr = cap - L  # fits: open_tok + L <= cap, in exact integer arithmetic
        while waiting and waiting[0][0] <= thr:
            tok, q = heapq.heappop(waiting)
            if not fits[q] and open_tok[q] == tok:  # else a stale entry
                fits[q] = True
                key[q] = fin[q]
        r = int(key.argmin())
        f = fin[r]
        if fits[r]:
            per_rank[r][-1].append(i)
            open_tok[r] += L
        else:
            per_rank[r].append([i])
            open_tok[r] = L
            f += oh
        f += work
        fin[r] = f
        if open_tok[r] <= thr:  # later samples are no longer
            fits[r] = True
            key[r] = f
        else:
            fits[r] = False
            key[r] = f + oh
            heapq.heappush(waiting, (open_tok[r], r))
    return per_rank


class _View:
    """One rank's degree-1 samples as numpy arrays (in the rank's sample order):
    ``s`` samples, ``w`` work, ``l`` tokens, ``mb`` their micro-batch, ``room`` the
    tokens their micro-batch can take in exchange for them (``cap`` minus its
    tokens without them), ``alone`` whether they are alone in it; ``wlow`` the
    least work (``None`` until asked for); ``low``: the open micro-batch with the
    fewest tokens (the first one on ties; -1 without one) and ``low_tok`` its
    tokens; ``at``: positions by micro-batch (filled on use)."""

    __slots__ = ("s", "w", "l", "mb", "room", "alone", "wlow", "wcol", "lcol", "roomcol", "low",
                 "low_tok", "at")


class _Ranks:
    """The degree-1 micro-batches of every rank during :func:`refine_short`, with
    per-rank :class:`_View` s built on first use, updated in place by a swap and
    rebuilt after a move. Token counts are integers (exact in floats)."""

    def __init__(self, per_rank, L: np.ndarray, w: np.ndarray, cap: int, oh: float) -> None:
        self.L, self.w, self.cap, self.oh = L, w, cap, oh
        self.Lpy, self.wpy = L.tolist(), w.tolist()
        self.members: list[list[int]] = [list(mb) for mbs in per_rank for mb in mbs]
        self.mb_of = [0] * len(L)
        self.mb_tok = [float(L[mb].sum()) for mb in self.members]
        self.mb_len = [len(mb) for mb in self.members]
        self.rank_mbs: list[list[int]] = []
        m = 0
        for mbs in per_rank:
            self.rank_mbs.append(list(range(m, m + len(mbs))))
            for mb in mbs:
                for i in mb:
                    self.mb_of[i] = m
                m += 1
        self.on_rank: list[list[int]] = [[i for mb in mbs for i in mb] for mbs in per_rank]
        self._cache: dict[int, _View] = {}

    def _low(self, v: _View, r: int) -> None:
        low, low_tok = -1, 0.0
        mb_tok, mb_len = self.mb_tok, self.mb_len
        for m in self.rank_mbs[r]:
            if mb_len[m] and (low < 0 or mb_tok[m] < low_tok):
                low, low_tok = m, mb_tok[m]
        v.low, v.low_tok = low, low_tok

    def view(self, r: int) -> _View:
        v = self._cache.get(r)
        if v is None:
            v = _View()
            s = self.on_rank[r]
            mbs = [self.mb_of[i] for i in s]
            v.s = np.array(s, dtype=np.int64)
            v.mb = np.array(mbs, dtype=np.int64)
            v.w, v.l = self.w[v.s], self.L[v.s]
            v.room = self.cap - (np.array([self.mb_tok[m] for m in mbs], dtype=np.float64) - v.l)
            v.alone = np.array([self.mb_len[m] == 1 for m in mbs], dtype=bool)
            v.wcol, v.lcol, v.roomcol = v.w[:, None], v.l[:, None], v.room[:, None]
            v.wlow = None
            v.at = {}
            self._low(v, r)
            self._cache[r] = v
        return v

    def as_top(self, r: int) -> _View:
        """:meth:`view`, with ``wlow`` (for the rank finishing last)."""
        v = self.view(r)
        if v.wlow is None:
            v.wlow = float(v.w.min()) if v.w.size else math.inf
        return v

    def swapped(self, r: int, x: int, k: int) -> None:
        """Rank r's sample at position x is now k (in the same micro-batch)."""
        v = self._cache[r]
        v.s[x] = k
        old_w, new_w = float(v.w[x]), self.wpy[k]
        v.w[x], v.l[x] = new_w, self.Lpy[k]
        m = int(v.mb[x])
        at = v.at.get(m)
        if at is None:
            at = v.at[m] = np.flatnonzero(v.mb == m)
        v.room[at] = self.cap - (self.mb_tok[m] - v.l[at])
        if v.wlow is not None:
            if old_w == v.wlow:
                v.wlow = None  # maybe the least one left: found again when needed
            elif new_w < v.wlow:
                v.wlow = new_w
        self._low(v, r)

    def touched(self, *ranks: int) -> None:
        for r in ranks:
            self._cache.pop(r, None)

    def take(self, i: int) -> int:
        m = self.mb_of[i]
        self.members[m].remove(i)
        self.mb_tok[m] -= self.Lpy[i]
        self.mb_len[m] -= 1
        return m

    def put(self, i: int, m: int) -> None:
        self.members[m].append(i)
        self.mb_of[i] = m
        self.mb_tok[m] += self.Lpy[i]
        self.mb_len[m] += 1

    def new_mb(self, t: int) -> int:
        self.members.append([])
        self.mb_tok.append(0.0)
        self.mb_len.append(0)
        self.rank_mbs[t].append(len(self.members) - 1)
        return len(self.members) - 1

    def result(self) -> list[list[list[int]]]:
        return [[sorted(self.members[m]) for m in mbs if self.members[m]]
                for mbs in self.rank_mbs]


def refine_short(per_rank: list[list[list[int]]], lengths: np.ndarray, free: np.ndarray,
                 cap: int, cost, max_moves: int = 4000) -> np.ndarray:
    """Local search on the degree-1 micro-batches (they run last on each rank, so a
    rank's finish is its time after the groups plus their sum): move a sample off
    the rank that finishes last, or swap it for a shorter one, while that lowers
    the pair's later finish. Returns every rank's finish; edits ``per_rank``.

    Each move: the rank ``r`` finishing last; the other ranks ``t`` by rising
    finish; the first ``t`` that can take one of r's samples (its heaviest one
    that fits) or swap one for a shorter one (the swap leaving the pair's later
    finish lowest) gets it.
    """
    oh = cost.microbatch_overhead_s
    L = lengths.astype(np.float64)
    w = cost.compute(L, L * L, 1)
    ranks = _Ranks(per_rank, L, w, cap, oh)
    on_rank = ranks.on_rank
    fin = (free + np.array([sum(oh + float(w[mb].sum()) for mb in mbs)
                            for mbs in per_rank])).tolist()
    order = sorted((f, r) for r, f in enumerate(fin))  # = a stable argsort of fin
    eps = _EPS

    def refile(r: int, f: float) -> None:
        del order[bisect.bisect_left(order, (fin[r], r))]
        fin[r] = f
        bisect.insort(order, (f, r))

    for _ in range(max_moves):
        top = order[-1][0]
        r = order[bisect.bisect_left(order, (top, -1))][1]  # the first rank at the max
        if not on_rank[r]:
            break
        v = ranks.as_top(r)
        limit = top - eps
        done = False
        j, width = 0, 1
        while not done and j < len(order):
            # the next ranks below r's finish, by rising finish: tested together
            chunk: list[tuple[float, int]] = []
            cols = 0
            while j < len(order) and len(chunk) < width and cols * v.s.size <= _CHUNK:
                ft, t = order[j]
                if ft >= limit:  # so are all later ranks
                    j = len(order)
                    break
                j += 1
                if t != r:
                    chunk.append((ft, t))
                    cols += len(on_rank[t])
            width *= 2
            done = _try_chunk(ranks, r, v, chunk, top, limit, cap, oh, refile)
        if not done:
            break
    per_rank[:] = ranks.result()
    return np.array(fin, dtype=np.float64)


_CHUNK = 4096  # pair tests per chunk of ranks (numpy calls cost more than their elements)


def _try_chunk(ranks: _Ranks, r: int, v: _View, chunk, top: float, limit: float, cap: int,
               oh: float, refile) -> bool:
    """Try the ranks ``t`` of ``chunk`` in turn, as :func:`refine_short` does one by one:
    a move from r to t (where one may fit), then a swap. Applies the first move or
    swap found; True if one.

    A swap of r's sample i for t's sample k must lower r, keep t below r's finish
    and fit both micro-batches; of those, the one leaving the pair's later finish
    lowest (the first on ties) is made. The finish conditions of all the chunk's
    pairs are evaluated at once; the caps only at the best pair that passes them,
    and over all pairs only when that one breaks a cap (the first best pair of a
    set is the first best of any subset that holds it).
    """
    eps = _EPS
    on_rank = ranks.on_rank
    us = [ranks.view(t) for _, t in chunk]
    sizes = [u.s.size for u in us]
    if len(chunk) == 1:
        d = v.wcol - us[0].w
        e = chunk[0][0] + d  # t's finish after the swap
        ok = d > eps
        ok &= e < limit
        hits = [bool(ok.any())]
    elif sum(sizes):
        d = v.wcol - np.concatenate([u.w for u in us])
        e = np.repeat(np.array([ft for ft, _ in chunk]), sizes) + d
        ok = d > eps
        ok &= e < limit
        seen = np.concatenate(([0], np.cumsum(ok.any(axis=0))))
        ends = np.cumsum(sizes)
        hits = (seen[ends] > seen[ends - np.array(sizes)]).tolist()
    else:
        hits = [False] * len(chunk)
    start = 0
    for (ft, t), u, n, hit in zip(chunk, us, sizes, hits):
        # fin[t] + add >= fin[t] + w for every sample: a move can fit only below this
        if ft + v.wlow < limit:
            gain = v.w + oh * v.alone  # r's saving without the sample
            room = (u.low_tok + v.l <= cap) if u.low >= 0 else np.zeros(v.s.size, dtype=bool)
            add = v.w + oh * ~room
            ok_move = (ft + add < limit) & (gain > eps)
            if ok_move.any():  # move the heaviest sample that fits
                x = int(np.flatnonzero(ok_move)[np.argmax(v.w[ok_move])])
                i = int(v.s[x])
                ranks.take(i)
                on_rank[r].remove(i)
                ranks.put(i, u.low if room[x] else ranks.new_mb(t))
                on_rank[t].append(i)
                gx, ax = float(gain[x]), float(add[x])
                ranks.touched(r, t)
                refile(r, top - gx)
                refile(t, ft + ax)
                return True
        if hit:
            if n == d.shape[1]:
                db, eb, okb = d, e, ok
            else:
                db, eb, okb = (d[:, start:start + n], e[:, start:start + n],
                               ok[:, start:start + n])
            after = np.where(okb, np.maximum(top - db, eb), np.inf)
            x, y = divmod(int(after.argmin()), n)
            if not (u.l[y] <= v.room[x] and v.l[x] <= u.room[y]):  # it breaks a cap
                okb = okb & (u.l <= v.roomcol) & (v.lcol <= u.room)
                if not okb.any():
                    start += n
                    continue
                after = np.where(okb, np.maximum(top - db, eb), np.inf)
                x, y = divmod(int(after.argmin()), n)
            i, k = int(v.s[x]), int(u.s[y])
            dxy = float(db[x, y])
            mi = ranks.take(i)
            mk = ranks.take(k)
            ranks.put(k, mi)
            ranks.put(i, mk)
            on_rank[r][x] = k
            on_rank[t][y] = i
            ranks.swapped(r, x, k)
            ranks.swapped(t, y, i)
            refile(r, top - dxy)
            refile(t, ft + dxy)
            return True
        start += n
    return False
