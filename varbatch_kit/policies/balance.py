"""FLOPs balance under the token cap: the ``balanced`` packing and distribution.

slime either respects the token cap and balances FLOPs only across whole
micro-batches (first-fit + ``--balance-data``), or balances FLOPs and ignores
the cap (``--balance-by-flops``). ``balanced`` does both, in three stages:

1. **pack** (:func:`balanced_pack`): the step needs ``K`` micro-batches, the
   fewest that first-fit decreasing (or first-fit, if it needs fewer) reaches,
   rounded up to the alignment; so ``K`` never exceeds first-fit's count.
   Samples, heaviest first, go to the micro-batch with the least FLOPs that
   still has room for them ("worst-fit decreasing" on FLOPs under the cap):
   micro-batches of near-equal FLOPs. A sample longer than the cap gets a
   micro-batch of its own. If the FLOPs-balanced fill does not fit into ``K``
   micro-batches, the first-fit-decreasing micro-batches are used instead.
2. **distribute** (distribution ``balanced``, :func:`balanced_distribution`):
   equal-count Karmarkar-Karp on micro-batch FLOPs, then swaps of whole
   micro-batches between the busiest rank and the least busy ones.
3. **refine** (:func:`refine_balanced`): a bounded local search
   (:func:`local_search`: rounds that pair busy ranks with light ones, then
   rounds of the busiest ranks) that moves single samples to micro-batches of
   other ranks, or swaps two samples between ranks, whenever that lowers the
   busy rank's FLOPs, keeping every micro-batch under the cap (a single
   over-cap sample only ever swaps with another sample that then sits alone)
   and every micro-batch non-empty, so each rank keeps its micro-batch count.
   It stops within 0.01% of the lower bound ``max(step FLOPs / dp, largest
   sample)``, or when its rounds stop gaining that much. When it stops more
   than 0.1% above the bound (a rank stuck with a very long sample and a full
   micro-batch), a second start fills the ranks directly (heaviest sample to
   the least loaded rank with room) and, unless it groups the samples as the
   first did, is searched the same way; the better of the two is kept.

``ScheduleConfig(max_tokens_per_gpu=..., packing="balanced")`` selects it; the
distribution defaults to (and must be) ``"balanced"``. The distribution
``"balanced"`` alone (stage 2) also works after any other packing, e.g.
``packing="first_fit", distribution="balanced"``, and then never changes the
micro-batches.

All stages are deterministic and ``O(n log n)`` per step plus a bounded number
of local-search rounds of vectorised work each (``O(n)`` to ``O(n * samples per
rank)``, capped by ``full_scan`` and ``pair_elements``).
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from varbatch_kit.policies.distributions import BinWeights
from varbatch_kit.policies.packers import (
    Bins,
    PackInput,
    _decreasing,
    _first_fit_in_order,
    aligned_count,
)
from varbatch_kit.policies.partition import karmarkar_karp

__all__ = [
    "SearchStats",
    "balanced_distribution",
    "balanced_pack",
    "local_search",
    "refine_balanced",
]


def _weights(inp: PackInput) -> np.ndarray:
    """Per-sample FLOPs, or the token counts when no FLOPs were given."""
    if inp.flops is not None:
        return np.asarray(inp.flops, dtype=np.float64)
    return np.asarray(inp.lengths, dtype=np.float64)


def _flops_balanced_fill(lengths: np.ndarray, weights: np.ndarray, cap: int, k: int) -> Bins | None:
    """Heaviest sample first into the lightest (by weight) of ``k`` bins that has room.

    Over-cap samples first get a bin of their own. Bins without room for the
    current sample wait in a second heap (by room) until the samples get short
    enough; each bin moves between the heaps at most once per sample it
    receives, so the fill is ``O((n + k) log k)``. Returns None when a sample
    fits nowhere or a bin stays empty.
    """
    n = lengths.size
    lens = lengths.tolist()
    over = np.flatnonzero(lengths > cap)
    if over.size > k:
        return None
    bins: Bins = [[] for _ in range(k)]
    room = [cap] * k
    load = [0.0] * k
    for b, i in enumerate(over.tolist()):
        bins[b].append(i)
        room[b] = cap - lens[i]
        load[b] = float(weights[i])
    heap = [(0.0, b) for b in range(over.size, k)]
    waiting: list[tuple[int, int]] = []  # (-room, bin)
    rest = np.flatnonzero(lengths <= cap)
    order = rest[np.lexsort((rest, -weights[rest]))].tolist()
    w = weights.tolist()
    for i in order:
        length = lens[i]
        while waiting and -waiting[0][0] >= length:
            b = heapq.heappop(waiting)[1]
            heapq.heappush(heap, (load[b], b))
        while heap:
            _, b = heapq.heappop(heap)
            if room[b] >= length:
                break
            heapq.heappush(waiting, (-room[b], b))
        else:
            return None
        bins[b].append(i)
        room[b] -= length
        load[b] += w[i]
        heapq.heappush(heap, (load[b], b))
    if any(not b for b in bins):
        return None
    assert sum(len(b) for b in bins) == n
    return [sorted(b) for b in bins]


def balanced_pack(inp: PackInput) -> Bins:
    """FLOPs-balanced micro-batches under the cap, as many as first-fit(-decreasing) needs.

    See the module docstring, stage 1. The count is
    ``aligned_count(min(ffd, first_fit), inp.align)``; first-fit is only run
    when first-fit decreasing misses the lower bound ``over-cap samples +
    ceil(other tokens / cap)`` after alignment.
    """
    lengths = np.asarray(inp.lengths, dtype=np.int64)
    cap, align = int(inp.cap), int(inp.align)
    n = lengths.size
    lens = lengths.tolist()
    base = [sorted(b) for b in _first_fit_in_order(lens, cap, _decreasing(lengths).tolist())]
    over = lengths > cap
    lower = int(over.sum()) + math.ceil(int(lengths[~over].sum()) / cap)
    if aligned_count(len(base), align) > aligned_count(lower, align):
        ff = _first_fit_in_order(lens, cap, range(n))
        if len(ff) < len(base):
            base = ff
    k = aligned_count(len(base), align)
    if k > n:
        return base  # the schedule builder reports the impossible layout
    filled = _flops_balanced_fill(lengths, _weights(inp), cap, k)
    return filled if filled is not None else base


# --------------------------------------------------------------------------- local search
#: paired rounds in a row that may improve nothing (each with other partners) before the
#: single-operation rounds take over
PAIR_MISSES = 2
BUSIEST_ELEMENTS = 1 << 12
#: rounds of the busiest rank that must together lower it by ``tol`` x bound to go on
STALL_ROUNDS = 4

class SearchStats:
    """What a :func:`local_search` run did: rounds, moves, swaps and the max load before/after."""

    __slots__ = ("after", "before", "bound", "moves", "rounds", "swaps")

    def __init__(self) -> None:
        self.rounds = self.moves = self.swaps = 0
        self.before = self.after = self.bound = 0.0

    def __repr__(self) -> str:
        return (f"SearchStats(rounds={self.rounds}, moves={self.moves}, swaps={self.swaps}, "
                f"max/bound {self.before / self.bound:.5f} -> {self.after / self.bound:.5f})")


def local_search(
    lengths: np.ndarray,
    flops: np.ndarray,
    cap: float,
    bin_of: np.ndarray,
    rank_bins: np.ndarray,
    *,
    max_rounds: int | None = None,
    tol: float = 1e-4,
    width: int = 4,
    neighbours: int = 8,
    full_scan: int = 1 << 16,
    pair_elements: int = 1 << 18,
    stats: SearchStats | None = None,
) -> np.ndarray:
    """Lower the busiest rank's FLOPs by moving and swapping samples; returns the new ``bin_of``.

    Parameters
    ----------
    lengths, flops:
        Per-sample tokens and FLOPs.
    cap:
        Token cap of a micro-batch holding two or more samples.
    bin_of:
        Micro-batch of each sample (not modified).
    rank_bins:
        ``(dp, m)`` array: the micro-batches of each rank (they stay there).
    max_rounds:
        Bound on the rounds (default ``8 * dp + 64``).
    tol:
        Stop when the busiest rank is within ``1 + tol`` of the lower bound
        ``max(total / dp, largest sample)``, or when ``STALL_ROUNDS`` rounds
        in a row together lowered it by less than ``tol`` x that bound.
    width:
        Single-rank rounds on large steps try swaps with the ``width`` least
        busy ranks.
    neighbours:
        On large steps, the swap partners tried on a rank for each sample of
        the busiest rank are the ``neighbours`` samples on either side of
        the ideal partner (by FLOPs) and lighter samples at geometrically
        growing distances; when that finds nothing, every rank is tried once.
    full_scan:
        Steps where (samples of the busiest rank) x (all samples) is at most
        this try every partner instead.
    pair_elements:
        Paired rounds run while their pairs hold at most this many (sample,
        sample) combinations in all.

    Every round applies moves and swaps, each of them one of

    - a *move*: a sample of a busy rank ``R`` from a micro-batch that keeps
      another sample, into the fullest micro-batch of another rank ``r`` that
      has room for it;
    - a *swap*: a sample of ``R`` against a lighter sample of ``r``, when both
      micro-batches stay under the cap (or hold a single sample afterwards);

    the one of ``R`` that minimises ``max(new load of R, new load of r,
    threshold)``, if that is below ``R``'s load (moves first on ties). The
    search runs three kinds of rounds:

    1. *paired rounds*: the ``i``-th busiest rank above the threshold is
       paired with the ``(i + shift)``-th least busy (at most ``dp // 2``
       disjoint pairs) and every pair's best operation is applied at once:
       all ranks move towards the mean in a few rounds where one operation
       per round would need about ``dp`` of them. When a round does not lower
       the busiest rank, ``shift`` grows (other partners); after
       ``PAIR_MISSES`` such rounds in a row, then
    2. on steps small enough (``full_scan``), rounds of the busiest ranks
       with every other rank as partner, the busiest first, each rank in at
       most one operation of the round (the busiest rank's operation is the
       best one it has); on larger steps
    3. the busiest rank alone, against ``width`` partner ranks (see
       ``neighbours``).

    Rounds 2 and 3 end when the busiest rank cannot be lowered. Each applied
    operation lowers the sum of squared rank loads, so the search ends.
    Micro-batch counts per rank never change; no micro-batch empties or goes
    over the cap with two or more samples.
    """
    st = stats if stats is not None else SearchStats()
    search = _Search(lengths, flops, cap, bin_of, rank_bins)
    if search.dp < 2 or search.L.size == 0:
        return search.bin_of
    st.bound, st.before = search.bound, float(search.load.max())
    thr = search.bound * (1.0 + tol)
    if max_rounds is None:
        max_rounds = 8 * search.dp + 64
    progress = _Progress(search, st, max_rounds, tol * search.bound)
    shift = misses = 0  # paired rounds in a row that did not lower the busiest rank
    while progress.going(thr) and misses < PAIR_MISSES:
        top = progress.top
        done = search.pair_round(thr, pair_elements, shift)
        if done:
            progress.add(done)
        if not done or progress.top >= top:  # the busiest rank needs another partner
            misses += 1
            shift += 1
        else:
            misses = 0
    progress.restart()
    stuck = False
    while progress.going(thr):
        done = search.busiest_round(thr, full_scan, BUSIEST_ELEMENTS)
        if done is None:  # too many samples to try every partner: the busiest alone
            done, stuck = search.one_round(thr, width, neighbours, full_scan, stuck)
            if done == (0, 0):  # widen the swap search to all ranks for one more try
                continue
        if done is None or done == (0, 0):  # the busiest rank cannot be lowered
            break
        progress.add(done)
    st.after = float(np.bincount(search.smp_rank, weights=search.f, minlength=search.dp).max())
    return search.bin_of


class _Progress:
    """The rounds of a :func:`local_search` and its stop rules: the round budget, and a stall:
    the last ``STALL_ROUNDS`` rounds together lowered the busiest rank by less than ``stall``
    (``tol`` x bound: what is left to gain that way is below the tolerance too)."""

    def __init__(self, search: _Search, stats: SearchStats, max_rounds: int,
                 stall: float) -> None:
        self.search, self.stats, self.left, self.stall = search, stats, max_rounds, stall
        self.history = [float(search.load.max())]

    @property
    def top(self) -> float:
        return self.history[-1]

    def going(self, thr: float) -> bool:
        """Whether another round may run: rounds left, the busiest above ``thr``, no stall."""
        h = self.history
        stalled = len(h) > STALL_ROUNDS and h[-STALL_ROUNDS - 1] - h[-1] < self.stall
        return self.left > 0 and h[-1] > thr and not stalled

    def add(self, done: tuple[int, int]) -> None:
        """Count a round that applied ``done = (moves, swaps)``."""
        self.left -= 1
        self.stats.rounds += 1
        self.stats.moves += done[0]
        self.stats.swaps += done[1]
        self.history.append(float(self.search.load.max()))

    def restart(self) -> None:
        """Judge the stall afresh (the next kind of round may find larger steps)."""
        self.history = self.history[-1:]


class _Search:
    """State of :func:`local_search`: where every sample is, micro-batch fill, rank loads."""

    def __init__(self, lengths, flops, cap, bin_of, rank_bins) -> None:
        self.L = np.asarray(lengths, dtype=np.int64)
        self.f = np.asarray(flops, dtype=np.float64)
        self.cap = cap
        self.bin_of = np.array(bin_of, dtype=np.int64)
        self.RB = np.asarray(rank_bins, dtype=np.int64)
        self.dp, m = self.RB.shape
        k = self.dp * m
        self.tok = np.bincount(self.bin_of, weights=self.L, minlength=k).astype(np.int64)
        self.cnt = np.bincount(self.bin_of, minlength=k)
        bin_rank = np.empty(k, dtype=np.int64)
        bin_rank[self.RB] = np.arange(self.dp)[:, None]
        self.smp_rank = bin_rank[self.bin_of]
        self.load = np.bincount(self.smp_rank, weights=self.f, minlength=self.dp)
        self.bound = (max(float(self.f.sum()) / self.dp, float(self.f.max()))
                      if self.f.size else 0.0)
        self.spread = np.unique(np.rint(1.5 ** np.arange(40)).astype(np.int64))  # 1, 2, 3, 5, ..
        # the samples by FLOPs (stable), each sample's place in that order, the sorted FLOPs
        self.by_f = np.argsort(self.f, kind="stable")
        self.f_rank = np.empty(self.f.size, dtype=np.int64)
        self.f_rank[self.by_f] = np.arange(self.f.size)
        self.f_sorted = self.f[self.by_f]

    def pair_round(self, thr: float, budget: int, shift: int = 0) -> tuple[int, int] | None:
        """One paired round (see :func:`local_search`): the moves and swaps applied, or None
        when no pair improves (or the pairs would exceed ``budget`` combinations). The
        ``i``-th busiest rank is paired with the ``(i + shift) % (dp // 2)``-th least busy."""
        load, n = self.load, self.f.size
        order = np.argsort(load, kind="stable")
        half = self.dp // 2
        heavy, light = order[::-1][:half], order[:half]
        P = int(np.count_nonzero(load[heavy] > thr))
        if P == 0:
            return None
        Rp, rp = heavy[:P], light[(np.arange(P) + shift) % half]
        members = np.argsort(self.smp_rank, kind="stable")
        counts = np.bincount(self.smp_rank, minlength=self.dp)
        starts = np.cumsum(counts) - counts

        def rows(ranks):  # (P, widest) samples of each rank, and which entries are real
            width = int(counts[ranks].max())
            idx = starts[ranks][:, None] + np.arange(width)
            real = np.arange(width) < counts[ranks][:, None]
            return members[np.minimum(idx, n - 1)], real

        S, s_real = rows(Rp)
        T, t_real = rows(rp)
        if P * S.shape[1] * T.shape[1] > budget:
            return None
        L, f, cnt, tok, cap = self.L, self.f, self.cnt, self.tok, self.cap
        FR, Fr = load[Rp][:, None], load[rp][:, None]
        X, Y = self.bin_of[S], self.bin_of[T]
        LS, LT, fS = L[S], L[T], f[S]
        # moves: a sample of R from a micro-batch keeping another, into r's fullest with room
        room = (cap - tok[self.RB]).max(axis=1)[rp][:, None]
        mval = np.maximum(np.maximum(FR - fS, Fr + fS), thr)
        mval[~(s_real & (cnt[X] >= 2) & (LS <= room))] = np.inf
        # swaps: a sample of R against a lighter one of r, both micro-batches under the cap
        d = fS[:, :, None] - f[T][:, None, :]
        ok = s_real[:, :, None] & t_real[:, None, :] & (d > 0)
        ok &= ((cnt[X] == 1)[:, :, None]
               | (tok[X][:, :, None] - LS[:, :, None] + LT[:, None, :] <= cap))
        ok &= ((cnt[Y] == 1)[:, None, :]
               | (tok[Y][:, None, :] - LT[:, None, :] + LS[:, :, None] <= cap))
        sval = np.maximum(np.maximum(FR[:, :, None] - d, Fr[:, :, None] + d), thr)
        sval[~ok] = np.inf
        sval = sval.reshape(P, -1)
        bm, bs = mval.argmin(axis=1), sval.argmin(axis=1)
        vm, vs = mval[np.arange(P), bm], sval[np.arange(P), bs]
        moves = swaps = 0
        for p in range(P):
            limit = float(FR[p, 0]) * (1.0 - 1e-12)  # lower the busier rank beyond rounding
            if vs[p] < vm[p] and vs[p] < limit:
                si, ti = divmod(int(bs[p]), T.shape[1])
                self.apply_swap(int(S[p, si]), int(T[p, ti]))
                swaps += 1
            elif vm[p] < limit:
                self.apply_move(int(S[p, bm[p]]), int(rp[p]))
                moves += 1
        return (moves, swaps) if moves + swaps else None

    def busiest_round(self, thr: float, full_scan: int, budget: int) -> tuple[int, int] | None:
        """One round of the busiest ranks at once (see :func:`local_search`): the moves and
        swaps applied, ``(0, 0)`` when no rank is above ``thr`` or the busiest has none that
        lowers it, None when the step is too large to try every partner (``full_scan``)."""
        load, n, dp = self.load, self.f.size, self.dp
        order = np.argsort(-load, kind="stable")
        heavy = order[load[order] > thr]
        if heavy.size == 0:
            return 0, 0
        counts = np.bincount(self.smp_rank, minlength=dp)
        width = int(counts[heavy].max())
        if width * n > full_scan:
            return None
        heavy = heavy[:max(1, budget // (width * n))]
        H = heavy.size
        members = np.argsort(self.smp_rank, kind="stable")
        idx = (np.cumsum(counts) - counts)[heavy][:, None] + np.arange(width)
        s_real = np.arange(width) < counts[heavy][:, None]
        S = members[np.minimum(idx, n - 1)]
        L, f, cnt, tok, cap = self.L, self.f, self.cnt, self.tok, self.cap
        FR = load[heavy][:, None, None]
        X = self.bin_of[S]
        LS, fS = L[S][:, :, None], f[S][:, :, None]
        own = heavy[:, None, None]
        # moves: into the fullest micro-batch with room of any other rank
        room = (cap - tok[self.RB]).max(axis=1)
        mval = np.maximum(np.maximum(FR - fS, load + fS), thr)
        mok = (s_real & (cnt[X] >= 2))[:, :, None] & (LS <= room) & (np.arange(dp) != own)
        mval[~mok] = np.inf
        # swaps: against every lighter sample of another rank, both micro-batches under the cap
        Y = self.bin_of
        d = fS - f
        ok = s_real[:, :, None] & (self.smp_rank != own) & (d > 0)
        ok &= (cnt[X] == 1)[:, :, None] | (tok[X][:, :, None] - LS + L <= cap)
        ok &= (cnt[Y] == 1) | (tok[Y] - L + LS <= cap)
        sval = np.maximum(np.maximum(FR - d, load[self.smp_rank] + d), thr)
        sval[~ok] = np.inf
        mval, sval = mval.reshape(H, -1), sval.reshape(H, -1)
        bm, bs = mval.argmin(axis=1), sval.argmin(axis=1)
        vm, vs = mval[np.arange(H), bm], sval[np.arange(H), bs]
        touched = np.zeros(dp, dtype=bool)
        moves = swaps = 0
        for h in range(H):  # busiest first; each rank takes part in one operation
            R = int(heavy[h])
            limit = float(load[R]) * (1.0 - 1e-12)  # lower it beyond rounding
            if vs[h] < vm[h] and vs[h] < limit:
                si, t = divmod(int(bs[h]), n)
                r = int(self.smp_rank[t])
                if not (touched[R] or touched[r]):
                    self.apply_swap(int(S[h, si]), t)
                    swaps += 1
            elif vm[h] < limit:
                si, r = divmod(int(bm[h]), dp)
                if not (touched[R] or touched[r]):
                    self.apply_move(int(S[h, si]), r)
                    moves += 1
            else:
                if h == 0:
                    return 0, 0
                continue
            touched[R] = touched[r] = True
        return moves, swaps

    def one_round(self, thr: float, width: int, neighbours: int, full_scan: int,
                  stuck: bool) -> tuple[tuple[int, int] | None, bool]:
        """The busiest rank's best move or swap, applied: ``((moves, swaps), stuck)``.
        ``(0, 0)`` when nothing helped with ``width`` partner ranks (``stuck`` is then True:
        the next round tries every rank), None when nothing helps at all."""
        R = int(np.argmax(self.load))
        S = np.flatnonzero(self.smp_rank == R)
        # an operation must lower R by more than rounding noise
        best = (float(self.load[R]) * (1.0 - 1e-12), None)
        best = self.best_move(R, S, thr, best)
        exhaustive = S.size * (self.L.size - S.size) <= full_scan
        best = self.best_swap(R, S, thr, best, None if exhaustive else
                              (self.dp - 1 if stuck else width), neighbours)
        op = best[1]
        if op is None:
            if stuck or exhaustive or width >= self.dp - 1:
                return None, stuck  # nothing lowers the busiest rank
            return (0, 0), True
        if op[0] == "move":
            self.apply_move(op[1], op[2])
            return (1, 0), False
        self.apply_swap(op[1], op[2])
        return (0, 1), False

    def best_move(self, R: int, S: np.ndarray, thr: float, best: tuple) -> tuple:
        """Best move of a sample of ``R`` (from a micro-batch keeping another) to another rank."""
        mov = S[self.cnt[self.bin_of[S]] >= 2]
        if mov.size == 0:
            return best
        maxroom = (self.cap - self.tok[self.RB]).max(axis=1)
        maxroom[R] = -1
        Lm, fm = self.L[mov], self.f[mov]
        ok = maxroom[None, :] >= Lm[:, None]
        if not ok.any():
            return best
        FR = float(self.load[R])
        val = np.maximum(FR - fm[:, None], self.load[None, :] + fm[:, None])
        np.maximum(val, thr, out=val)
        val[~ok] = np.inf
        j = int(np.argmin(val))
        if val.flat[j] < best[0]:
            si, r = divmod(j, self.dp)
            return float(val.flat[j]), ("move", int(mov[si]), r)
        return best

    def _pairs(self, R, S, t, inside, Fr, thr, best) -> tuple:
        """Best swap of ``S[i]`` with ``t[i, j]`` (rank load(s) ``Fr``) among valid pairs."""
        L, f, cnt, tok, cap = self.L, self.f, self.cnt, self.tok, self.cap
        X = self.bin_of[S]
        LS = L[S][:, None]
        Lt, ft = L[t], f[t]
        Y = self.bin_of[t]
        d = f[S][:, None] - ft
        ok = inside & (d > 0)
        ok &= (cnt[X][:, None] == 1) | (tok[X][:, None] - LS + Lt <= cap)
        ok &= (cnt[Y] == 1) | (tok[Y] - Lt + LS <= cap)
        FR = float(self.load[R])
        val = np.maximum(FR - d, Fr + d)
        np.maximum(val, thr, out=val)
        val[~ok] = np.inf
        j = int(np.argmin(val))
        if val.flat[j] < best[0]:
            si, c = divmod(j, val.shape[1])
            partner = int(np.broadcast_to(t, val.shape)[si, c])
            return float(val.flat[j]), ("swap", int(S[si]), partner)
        return best

    def best_swap(self, R: int, S: np.ndarray, thr: float, best: tuple, width: int | None,
                  neighbours: int) -> tuple:
        """Best swap of a sample of ``R`` with a lighter one elsewhere.

        ``width=None``: every pair. Otherwise the ``width`` least loaded
        ranks, with partners near the ideal one and lighter ones at growing
        distances, all ranks' candidates evaluated at once (ties go to the
        less loaded rank, then to the earlier sample of ``R``).
        """
        if width is None:
            T = np.flatnonzero(self.smp_rank != R)
            if T.size:
                best = self._pairs(R, S, T[None, :], True, self.load[self.smp_rank[T]][None, :],
                                   thr, best)
            return best
        order = np.argsort(self.load, kind="stable")
        ranks = order[order != R][:width]
        q = ranks.size
        # the samples of those ranks, rank by rank (in ``ranks`` order), lightest first
        slot = np.full(self.dp, -1, dtype=np.int64)
        slot[ranks] = np.arange(q)
        of = slot[self.smp_rank[self.by_f]]
        T = self.by_f[of >= 0]
        seg = of[of >= 0]
        keep = np.argsort(seg, kind="stable")
        T, seg = T[keep], seg[keep]
        counts = np.bincount(seg, minlength=q)
        end = np.cumsum(counts)
        start = end - counts
        # a value's place in its rank's segment: the segments hold (slot, place in the global
        # FLOPs order) increasing, so one search over that key finds every (sample, rank)
        n = self.f.size
        key = seg * (n + 1) + self.f_rank[T]
        fS = self.f[S]
        Fr = self.load[ranks]
        ideal_v = fS[:, None] - (float(self.load[R]) - Fr[None, :]) / 2.0  # (s, q)
        base = np.arange(q) * (n + 1)
        ideal = np.searchsorted(key, base[None, :] + np.searchsorted(self.f_sorted, ideal_v))
        below = np.searchsorted(key, base[None, :] + np.searchsorted(self.f_sorted, fS)[:, None])
        near = np.arange(-neighbours, neighbours)
        cand = np.concatenate((ideal[:, :, None] + near, below[:, :, None] - self.spread),
                              axis=2)  # (s, q, c)
        inside = (cand >= start[None, :, None]) & (cand < end[None, :, None])
        t = T[np.clip(cand, 0, max(T.size - 1, 0))] if T.size else cand
        # rank-major, so the first minimum is the sequential search's (ranks in load order)
        t = t.transpose(1, 0, 2).reshape(q * S.size, -1)
        inside = inside.transpose(1, 0, 2).reshape(q * S.size, -1)
        if not inside.any():
            return best
        SS = np.tile(S, q)
        return self._pairs(R, SS, t, inside, np.repeat(Fr, S.size)[:, None], thr, best)

    def apply_move(self, s: int, r: int) -> None:
        """Move sample ``s`` into the fullest micro-batch of rank ``r`` that has room for it."""
        room = self.cap - self.tok[self.RB[r]]
        y = int(self.RB[r, int(np.argmin(np.where(room >= self.L[s], room,
                                                  np.iinfo(np.int64).max)))])
        x = int(self.bin_of[s])
        R = int(self.smp_rank[s])
        self.bin_of[s] = y
        self.tok[x] -= self.L[s]
        self.tok[y] += self.L[s]
        self.cnt[x] -= 1
        self.cnt[y] += 1
        self.smp_rank[s] = r
        self.load[R] -= self.f[s]
        self.load[r] += self.f[s]

    def apply_swap(self, s: int, t: int) -> None:
        """Exchange samples ``s`` and ``t`` (micro-batches and ranks)."""
        x, y = int(self.bin_of[s]), int(self.bin_of[t])
        R, r = int(self.smp_rank[s]), int(self.smp_rank[t])
        L, f = self.L, self.f
        self.bin_of[s], self.bin_of[t] = y, x
        self.tok[x] += L[t] - L[s]
        self.tok[y] += L[s] - L[t]
        self.smp_rank[s], self.smp_rank[t] = r, R
        self.load[R] += f[t] - f[s]
        self.load[r] += f[s] - f[t]


# --------------------------------------------------------------------------- distribution
def balanced_distribution(weights: BinWeights, dp: int) -> list[list[int]]:
    """Equal-count Karmarkar-Karp on micro-batch FLOPs, then swaps of whole micro-batches."""
    w = np.asarray(weights.flops, dtype=np.float64)
    k = w.size
    init = np.asarray(karmarkar_karp(w, dp, equal_size=True), dtype=np.int64)
    if dp < 2 or k == dp:
        return [sorted(p) for p in init.tolist()]
    # micro-batches play the samples, each alone in a slot that never overflows
    slot_of = local_search(np.ones(k, dtype=np.int64), w, 1, np.arange(k), init)
    owner = np.empty(k, dtype=np.int64)
    owner[init] = np.arange(dp)[:, None]
    rank_of_bin = owner[slot_of]
    return [np.flatnonzero(rank_of_bin == r).tolist() for r in range(dp)]


# --------------------------------------------------------------------------- refinement
def _rank_first_fill(lengths: np.ndarray, weights: np.ndarray, cap: int, dp: int,
                     m: int) -> np.ndarray | None:
    """Samples, heaviest first, to the least loaded rank that has room; returns ``bin_of``.

    Rank ``r`` owns micro-batches ``r*m .. r*m+m-1``; within a rank a sample
    goes to the micro-batch with the most room (an over-cap sample needs an
    empty one). Ranks without room for the current sample wait in a heap by
    their largest room, as in :func:`_flops_balanced_fill`. Micro-batches
    left empty take the lightest sample of a multi-sample micro-batch (of
    their own rank if possible). Returns None when a sample fits nowhere.
    """
    n = lengths.size
    lens, w = lengths.tolist(), weights.tolist()
    k = dp * m
    bin_of = np.empty(n, dtype=np.int64)
    rank_heap = [(0.0, r) for r in range(dp)]
    waiting: list[tuple[int, int]] = []  # (-largest room, rank)
    load = [0.0] * dp
    inner = [[(-cap, r * m + j) for j in range(m)] for r in range(dp)]  # (-room, bin)
    order = np.lexsort((np.arange(n), -weights)).tolist()
    for i in order:
        need = min(lens[i], cap) if lens[i] <= cap else cap
        while waiting and -waiting[0][0] >= need:
            r = heapq.heappop(waiting)[1]
            heapq.heappush(rank_heap, (load[r], r))
        while rank_heap:
            _, r = heapq.heappop(rank_heap)
            if -inner[r][0][0] >= need:
                break
            heapq.heappush(waiting, (inner[r][0][0], r))
        else:
            return None
        neg_room, b = heapq.heappop(inner[r])
        heapq.heappush(inner[r], (neg_room + lens[i], b))
        bin_of[i] = b
        load[r] += w[i]
        heapq.heappush(rank_heap, (load[r], r))
    cnt = np.bincount(bin_of, minlength=k)
    for b in np.flatnonzero(cnt == 0).tolist():
        r = b // m
        movable = np.flatnonzero(cnt[bin_of] >= 2)
        if movable.size == 0:
            return None
        own = movable[bin_of[movable] // m == r]
        pool = own if own.size else movable
        s = int(pool[np.argmin(weights[pool])])
        cnt[bin_of[s]] -= 1
        bin_of[s] = b
        cnt[b] += 1
    return bin_of


def _rank_of_bin(rank_bins: np.ndarray) -> np.ndarray:
    """The rank of each micro-batch of a ``(dp, m)`` array of micro-batches per rank."""
    out = np.empty(rank_bins.size, dtype=np.int64)
    out[rank_bins] = np.arange(rank_bins.shape[0])[:, None]
    return out


def _grouping(bin_of: np.ndarray, rank_bins: np.ndarray) -> np.ndarray:
    """Per sample, the smallest sample index of its micro-batch and of its rank: equal for two
    starts that group the samples alike (rank and micro-batch numbers aside)."""
    n = bin_of.size
    k = rank_bins.size
    rank = _rank_of_bin(rank_bins)[bin_of]
    first_of_bin = np.full(k, n, dtype=np.int64)
    np.minimum.at(first_of_bin, bin_of, np.arange(n))
    first_of_rank = np.full(int(rank.max()) + 1 if n else 0, n, dtype=np.int64)
    np.minimum.at(first_of_rank, rank, np.arange(n))
    return np.stack((first_of_bin[bin_of], first_of_rank[rank]))


def _group(bin_of: np.ndarray, k: int) -> Bins:
    n = bin_of.size
    order = np.lexsort((np.arange(n), bin_of))
    counts = np.bincount(bin_of, minlength=k)
    return [chunk.tolist() for chunk in np.split(order, np.cumsum(counts)[:-1])]


def refine_balanced(inp: PackInput, bins: Bins, rank_bins: list[list[int]],
                    stats: SearchStats | None = None, *,
                    retry_above: float = 1e-3) -> tuple[Bins, list[list[int]]]:
    """Stage 3: sample moves and swaps between ranks (see :func:`local_search`).

    Micro-batches keep their positions and ranks; only their contents change.
    When the search stops more than ``retry_above`` (relative) above the
    lower bound ``max(total / dp, largest sample)``, a second start is made:
    samples placed rank by rank (:func:`_rank_first_fill`, which lets a rank
    holding a very long sample take light micro-batches). Unless it groups the
    samples as the first start did, it is searched the same way; the better
    result is kept (the first on ties).
    """
    dp = len(rank_bins)
    if dp < 2:
        return bins, rank_bins
    lengths = np.asarray(inp.lengths, dtype=np.int64)
    weights = _weights(inp)
    cap = int(inp.cap)
    n, k = lengths.size, len(bins)
    m = k // dp
    bin_of = np.empty(n, dtype=np.int64)
    for b, members in enumerate(bins):
        bin_of[members] = b
    rb = np.asarray(rank_bins, dtype=np.int64)
    stats = stats if stats is not None else SearchStats()
    new_of = local_search(lengths, weights, cap, bin_of, rb, stats=stats)
    if stats.after <= stats.bound * (1.0 + retry_above):
        return _group(new_of, k), rank_bins
    alt = _rank_first_fill(lengths, weights, cap, dp, m)
    rb2 = np.arange(k, dtype=np.int64).reshape(dp, m)
    if alt is not None and not np.array_equal(_grouping(bin_of, rb), _grouping(alt, rb2)):
        st2 = SearchStats()
        alt = local_search(lengths, weights, cap, alt, rb2, stats=st2)
        if st2.after < stats.after:
            for name in SearchStats.__slots__:
                setattr(stats, name, getattr(st2, name))
            return _group(alt, k), rb2.tolist()
    return _group(new_of, k), rank_bins

