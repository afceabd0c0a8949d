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
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from varbatch_kit.policies.dynamic_cp import CPCostModel

__all__ = ["deal_short", "refine_short"]

_EPS = 1e-12


def deal_short(short: np.ndarray, lengths: np.ndarray, free: np.ndarray, cap: int,
               cost: CPCostModel) -> list[list[list[int]]]:
    """Degree-1 samples, longest first, each to the rank that finishes first (next-fit).

    A rank's key is its finish, plus one micro-batch overhead when the sample
    does not fit its open micro-batch; the lowest key wins (the lowest rank
    on ties). Returns every rank's micro-batches (step-local positions).
    """
    pool = free.size
    fin = free.copy()
    oh = cost.microbatch_overhead_s
    fin_oh = fin + oh  # a rank's key when the sample opens a new micro-batch there
    short = short[np.argsort(-lengths[short], kind="stable")]
    open_tok = np.full(pool, np.inf)  # tokens of each rank's open micro-batch (inf: none)
    per_rank: list[list[list[int]]] = [[] for _ in range(pool)]
    Ls = lengths[short].astype(np.float64)
    works = cost.compute(Ls, Ls * Ls, 1)
    where, greater = np.where, np.greater
    for i, L, work in zip(short.tolist(), Ls.tolist(), works.tolist()):
        thr = cap - L  # open_tok + L > cap, in exact integer arithmetic
        r = int(where(greater(open_tok, thr), fin_oh, fin).argmin())
        f = float(fin[r])
        if open_tok[r] > thr:
            per_rank[r].append([i])
            open_tok[r] = L
            f += oh
        else:
            per_rank[r][-1].append(i)
            open_tok[r] += L
        f += work
        fin[r] = f
        fin_oh[r] = f + oh
    return per_rank


class _Ranks:
    """The degree-1 micro-batches of every rank during :func:`refine_short`, with
    per-rank numpy views cached until a move touches the rank."""

    def __init__(self, per_rank, L: np.ndarray, w: np.ndarray) -> None:
        self.L, self.w = L, w
        self.members: list[list[int]] = [list(mb) for mbs in per_rank for mb in mbs]
        k = len(self.members)
        cap_mbs = 2 * k + 16  # room for the micro-batches moves open (grown when full)
        self.mb_of = np.zeros(len(L), dtype=np.int64)
        self.mb_tok = np.zeros(cap_mbs)
        self.mb_len = np.zeros(cap_mbs, dtype=np.int64)
        self.rank_mbs: list[list[int]] = []
        m = 0
        for mbs in per_rank:
            ids = []
            for mb in mbs:
                self.mb_of[mb] = m
                self.mb_tok[m] = float(L[mb].sum())
                self.mb_len[m] = len(mb)
                ids.append(m)
                m += 1
            self.rank_mbs.append(ids)
        self.on_rank: list[list[int]] = [[i for mb in mbs for i in mb] for mbs in per_rank]
        self._cache: dict[int, tuple] = {}

    def view(self, r: int) -> tuple:
        """``(s, w, l, a, alone, low, low_tok)`` of rank r: its samples in order, their
        work, tokens, the tokens of their micro-batch without them, whether they are
        alone in it; the open micro-batch with the fewest tokens (the first one on
        ties; -1 without one) and its tokens."""
        v = self._cache.get(r)
        if v is None:
            s = np.array(self.on_rank[r], dtype=np.int64)
            mb = self.mb_of[s]
            li = self.L[s]
            mbs = self.rank_mbs[r]
            low, low_tok = -1, 0.0
            if mbs:
                ids = np.array(mbs, dtype=np.int64)
                toks = np.where(self.mb_len[ids] > 0, self.mb_tok[ids], np.inf)
                j = int(toks.argmin())
                if toks[j] < np.inf:
                    low, low_tok = mbs[j], float(toks[j])
            v = (s, self.w[s], li, self.mb_tok[mb] - li, self.mb_len[mb] == 1, low, low_tok)
            self._cache[r] = v
        return v

    def touched(self, *ranks: int) -> None:
        for r in ranks:
            self._cache.pop(r, None)

    def take(self, i: int) -> int:
        m = int(self.mb_of[i])
        self.members[m].remove(i)
        self.mb_tok[m] -= self.L[i]
        self.mb_len[m] -= 1
        return m

    def put(self, i: int, m: int) -> None:
        self.members[m].append(i)
        self.mb_of[i] = m
        self.mb_tok[m] += self.L[i]
        self.mb_len[m] += 1

    def new_mb(self, t: int) -> int:
        m = len(self.members)
        self.members.append([])
        if m == self.mb_tok.size:
            self.mb_tok = np.concatenate([self.mb_tok, np.zeros(m)])
            self.mb_len = np.concatenate([self.mb_len, np.zeros(m, dtype=np.int64)])
        self.rank_mbs[t].append(m)
        return m

    def result(self) -> list[list[list[int]]]:
        return [[sorted(self.members[m]) for m in mbs if self.members[m]]
                for mbs in self.rank_mbs]


def refine_short(per_rank: list[list[list[int]]], lengths: np.ndarray, free: np.ndarray,
                 cap: int, cost: CPCostModel, max_moves: int = 4000) -> np.ndarray:
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
    ranks = _Ranks(per_rank, L, w)
    on_rank = ranks.on_rank
    fin = free + np.array([sum(oh + float(w[mb].sum()) for mb in mbs) for mbs in per_rank])
    eps = _EPS
    for _ in range(max_moves):
        r = int(np.argmax(fin))
        top = float(fin[r])
        if not on_rank[r]:
            break
        si, wi, li, ai, alone, _, _ = ranks.view(r)
        gain = wi + oh * alone
        pos = gain > eps
        # fin[t] + add >= fin[t] + w for every sample: below this no move fits on any t
        wmin = float(wi[pos].min()) if pos.any() else np.inf
        limit = top - eps
        fl = fin.tolist()
        moved = False
        for t in np.argsort(fin, kind="stable").tolist():
            ft = fl[t]
            if t == r or ft >= limit:
                continue
            if ft + wmin < limit:  # a move may fit: test it exactly
                _, _, _, _, _, low, low_tok = ranks.view(t)
                room = (low_tok + li <= cap) if low >= 0 else np.zeros(si.size, dtype=bool)
                add = wi + oh * ~room
                ok = (ft + add < limit) & pos
                if ok.any():  # move the heaviest sample that fits
                    x = int(np.flatnonzero(ok)[np.argmax(wi[ok])])
                    i = int(si[x])
                    ranks.take(i)
                    on_rank[r].remove(i)
                    ranks.put(i, low if room[x] else ranks.new_mb(t))
                    on_rank[t].append(i)
                    fin[r] -= gain[x]
                    fin[t] += add[x]
                    ranks.touched(r, t)
                    moved = True
                    break
            if not on_rank[t]:
                continue
            sk, wk, lk, ak, _, _, _ = ranks.view(t)
            d = wi[:, None] - wk[None, :]
            ok = ((d > eps) & (ft + d < limit)
                  & (ai[:, None] + lk[None, :] <= cap)
                  & (ak[None, :] + li[:, None] <= cap))
            if ok.any():  # the swap that leaves the pair's later finish lowest
                after = np.where(ok, np.maximum(top - d, ft + d), np.inf)
                x, y = np.unravel_index(int(np.argmin(after)), after.shape)
                i, k = int(si[x]), int(sk[y])
                mi = ranks.take(i)
                mk = ranks.take(k)
                ranks.put(k, mi)
                ranks.put(i, mk)
                on_rank[r][on_rank[r].index(i)] = k
                on_rank[t][on_rank[t].index(k)] = i
                fin[r] -= d[x, y]
                fin[t] += d[x, y]
                ranks.touched(r, t)
                moved = True
                break
        if not moved:
            break
    per_rank[:] = ranks.result()
    return fin
