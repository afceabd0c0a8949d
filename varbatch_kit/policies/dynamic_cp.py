"""Dynamic context parallelism: a CP degree and a CP group for every micro-batch.

With a fixed CP degree every micro-batch is cut over the same ``cp`` ranks:
short samples pay the ring communication of context parallelism although
they would fit one GPU, and the long ones still dominate. Here a step's
``dp * cp`` ranks form one *pool*; every micro-batch gets its own degree
``c`` (from ``degrees``, e.g. 1, 2, 4, ... ``cp``) and a group of ``c`` ranks,
so that each rank holds at most ``cap`` tokens of it (``sum(L) / c``).

The cost model (:class:`CPCostModel`) gives the time a micro-batch keeps each
of its ``c`` ranks busy::

    t = overhead + linear * S / c + attention * Q / c
        + max(0, comm * (c - 1) * S / c - overlap * attention * Q / c)
        + latency * (c - 1)

with ``S = sum(L)`` and ``Q = sum(L**2)`` over its samples: the linear layers
and the causal attention are split evenly (zigzag), the ring passes each
rank's KV chunk ``c - 1`` times and hides behind the attention compute
(``overlap``), and every ring step pays a fixed latency. A group starts when
all its ranks are free (its collectives need every member); the step ends
when the last rank does (:func:`group_timeline`).

The planner (:func:`plan_dynamic_cp`), a heuristic:

1. give each sample the smallest degree whose ``c * cap`` holds it, raised
   for long samples while their time alone exceeds a target ``tau`` (several
   targets around the perfectly balanced load are tried);
2. pack the samples of each degree ``c > 1`` first-fit decreasing under
   ``c * cap`` tokens (and ``tau`` seconds), and list-schedule these
   micro-batches longest first, each on the window of ``c`` consecutive
   ranks of one CP replica (``cp`` consecutive pool ranks) that frees first;
3. deal the degree-1 samples longest first to the rank that finishes first,
   each rank packing them next-fit under ``cap`` tokens;
4. number the rounds so that every rank runs its micro-batches in the order
   planned (a group's round is the first round free on all its ranks; the
   other ranks idle in the rounds they skip) and pad every rank to the same
   number of rounds.

Of the candidate plans the one with the shortest makespan under the cost
model is kept, and a given fixed-CP plan (every micro-batch at degree ``cp``
on its DP replica) is kept instead where it is not slower: a dynamic plan is
never slower than the fixed one under the model it was planned with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["CPCostModel", "DynamicCPPlan", "group_timeline", "plan_dynamic_cp"]


@dataclass(frozen=True)
class CPCostModel:
    """Seconds a micro-batch keeps each rank of its CP group busy (forward + backward).

    :func:`varbatch_kit.core.hardware.cp_cost_model` builds it from a model
    shape and a hardware profile.

    Attributes
    ----------
    linear_s:
        Seconds per token of the linear work (projections, MLP, LM head) on one GPU.
    attention_s:
        Seconds per squared token of the causal attention on one GPU.
    comm_s:
        Seconds per token of a rank's KV chunk, per ring step (forward and
        backward, all layers).
    latency_s:
        Fixed seconds per ring step (forward and backward, all layers).
    microbatch_overhead_s:
        Fixed seconds per micro-batch on each rank.
    overlap:
        Share of the attention time that hides the ring communication, in [0, 1].
    """

    linear_s: float
    attention_s: float
    comm_s: float = 0.0
    latency_s: float = 0.0
    microbatch_overhead_s: float = 0.0
    overlap: float = 1.0

    def __post_init__(self) -> None:
        for name in ("linear_s", "attention_s", "comm_s", "latency_s", "microbatch_overhead_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"CPCostModel.{name} must be a finite number >= 0, got {v!r}")
        if not (isinstance(self.overlap, (int, float)) and 0 <= self.overlap <= 1):
            raise ValueError(f"CPCostModel.overlap must be in [0, 1], got {self.overlap!r}")

    def compute(self, tokens, sq_tokens, c):
        """Linear plus attention seconds per rank (no overhead, no communication)."""
        c = np.asarray(c, dtype=np.float64)
        return (self.linear_s * np.asarray(tokens, dtype=np.float64)
                + self.attention_s * np.asarray(sq_tokens, dtype=np.float64)) / c

    def exposed_comm(self, tokens, sq_tokens, c):
        """Ring seconds per rank not hidden by the attention, latency included (0 at c=1)."""
        c = np.asarray(c, dtype=np.float64)
        s = np.asarray(tokens, dtype=np.float64)
        att = self.attention_s * np.asarray(sq_tokens, dtype=np.float64) / c
        ring = self.comm_s * (c - 1) * s / c
        return np.maximum(0.0, ring - self.overlap * att) + self.latency_s * (c - 1)

    def time1(self, tokens: float, sq_tokens: float, c: int) -> float:
        """:meth:`time` of one micro-batch, in plain floats (fast in loops)."""
        att = self.attention_s * sq_tokens / c
        ring = self.comm_s * (c - 1) * tokens / c
        return (self.microbatch_overhead_s + self.linear_s * tokens / c + att
                + max(0.0, ring - self.overlap * att) + self.latency_s * (c - 1))

    def time(self, tokens, sq_tokens, c):
        """Seconds the micro-batch keeps each of its ``c`` ranks busy (vectorised)."""
        return (self.microbatch_overhead_s + self.compute(tokens, sq_tokens, c)
                + self.exposed_comm(tokens, sq_tokens, c))


@dataclass(frozen=True, eq=False)
class DynamicCPPlan:
    """A dynamic-CP plan of one step.

    ``bins[b]``: step-local sample positions of micro-batch b; ``rounds[b]``
    and ``groups[b]`` (pool ranks, CP-rank order): where it runs;
    ``makespan_s``: its time under the cost model it was planned with;
    ``fixed_makespan_s``: that of the fixed plan it was compared with (NaN
    without one); ``source``: ``"dynamic"`` or ``"fixed"`` (the fixed plan
    was not slower and is kept).
    """

    bins: list[list[int]]
    rounds: list[int]
    groups: list[tuple[int, ...]]
    makespan_s: float
    fixed_makespan_s: float
    source: str

    @property
    def degrees(self) -> list[int]:
        return [len(g) for g in self.groups]


def group_timeline(durations, rounds, groups, pool: int):
    """Start and end of every micro-batch when a group starts once all its ranks are free.

    Parameters
    ----------
    durations, rounds, groups:
        Per micro-batch: seconds on each rank of its group, round, group (pool ranks).
    pool:
        Ranks in the pool.

    Returns
    -------
    ``(start, end, finish, busy)``: per micro-batch start and end; per rank
    the end of its last micro-batch and its busy seconds.
    """
    durations = np.asarray(durations, dtype=np.float64)
    k = durations.size
    start, end = np.zeros(k), np.zeros(k)
    free, busy = np.zeros(pool), np.zeros(pool)
    for b in sorted(range(k), key=lambda b: rounds[b]):
        g = list(groups[b])
        start[b] = free[g].max()
        end[b] = start[b] + durations[b]
        free[g] = end[b]
        busy[g] += durations[b]
    return start, end, free, busy


def _windows(pool: int, cp: int, c: int) -> np.ndarray:
    """Windows of ``c`` consecutive ranks inside each CP replica of ``cp`` ranks."""
    step = c if cp % c == 0 else 1
    offsets = range(0, cp - c + 1, step)
    return np.array([[d * cp + o + i for i in range(c)]
                     for d in range(pool // cp) for o in offsets], dtype=np.int64)


def _ffd(pos: np.ndarray, lengths: np.ndarray, cap_tokens: int, cost: CPCostModel, c: int,
         tau: float) -> list[list[int]]:
    """First-fit decreasing of samples ``pos`` into bins of <= cap_tokens and <= tau seconds."""
    order = pos[np.argsort(-lengths[pos], kind="stable")]
    bins: list[list[int]] = []
    tok: list[int] = []
    sq: list[float] = []
    for i in order.tolist():
        L = int(lengths[i])
        for j in range(len(bins)):
            if tok[j] + L <= cap_tokens and cost.time1(tok[j] + L, sq[j] + L * L, c) <= tau:
                bins[j].append(i)
                tok[j] += L
                sq[j] += float(L) * L
                break
        else:
            bins.append([i])
            tok.append(L)
            sq.append(float(L) * L)
    return bins


def _candidate(lengths: np.ndarray, deg: np.ndarray, pool: int, cp: int, cap: int,
               cost: CPCostModel, tau: float):
    """One plan for given sample degrees: (bins, rounds, groups, makespan)."""
    bins: list[list[int]] = []
    bdeg: list[int] = []
    for c in sorted(set(deg.tolist()) - {1}, reverse=True):
        pos = np.flatnonzero(deg == c)
        for b in _ffd(pos, lengths, cap * c, cost, c, tau):
            bins.append(b)
            bdeg.append(c)
    tok = np.array([lengths[b].sum() for b in bins], dtype=np.float64)
    sq = np.array([(lengths[b].astype(np.float64) ** 2).sum() for b in bins])
    dur = cost.time(tok, sq, np.array(bdeg)) if bins else np.zeros(0)
    free = np.zeros(pool)
    nxt = np.zeros(pool, dtype=np.int64)
    groups: list[tuple[int, ...]] = [()] * len(bins)
    rounds = [0] * len(bins)
    win = {c: _windows(pool, cp, c) for c in set(bdeg)}
    for b in np.argsort(-dur, kind="stable").tolist():
        w = win[bdeg[b]]
        fm = free[w]
        st = fm.max(axis=1)
        idle = (st[:, None] - fm).sum(axis=1)
        best = int(np.lexsort((idle, st))[0])
        g = w[best]
        free[g] = st[best] + dur[b]
        r = int(nxt[g].max())
        nxt[g] = r + 1
        groups[b] = tuple(int(x) for x in g)
        rounds[b] = r
    # degree-1 samples: longest first to the rank that finishes first, next-fit per rank
    short = np.flatnonzero(deg == 1)
    per_rank = _deal_short(short, lengths, free, cap, cost)
    fin = _refine_short(per_rank, lengths, free, cap, cost)
    for r in range(pool):
        for mb in per_rank[r]:
            bins.append(mb)
            groups.append((r,))
            rounds.append(int(nxt[r]))
            nxt[r] += 1
    return bins, rounds, groups, float(fin.max()) if pool else 0.0


def _deal_short(short: np.ndarray, lengths: np.ndarray, free: np.ndarray, cap: int,
                cost: CPCostModel) -> list[list[list[int]]]:
    """Degree-1 samples, longest first, each to the rank that finishes first (next-fit)."""
    pool = free.size
    fin = free.copy()
    short = short[np.argsort(-lengths[short], kind="stable")]
    open_tok = np.full(pool, np.inf)  # tokens of each rank's open micro-batch (inf: none)
    per_rank: list[list[list[int]]] = [[] for _ in range(pool)]
    oh = cost.microbatch_overhead_s
    Ls = lengths[short].astype(np.float64)
    works = cost.compute(Ls, Ls * Ls, 1)
    for i, L, work in zip(short.tolist(), Ls.tolist(), works.tolist()):
        new = open_tok + L > cap
        r = int((fin + oh * new).argmin())
        if new[r]:
            per_rank[r].append([])
            open_tok[r] = 0.0
            fin[r] += oh
        per_rank[r][-1].append(i)
        open_tok[r] += L
        fin[r] += work
    return per_rank


def _refine_short(per_rank: list[list[list[int]]], lengths: np.ndarray, free: np.ndarray,
                  cap: int, cost: CPCostModel, max_moves: int = 4000) -> np.ndarray:
    """Local search on the degree-1 micro-batches (they run last on each rank, so a
    rank's finish is its time after the groups plus their sum): move a sample off
    the rank that finishes last, or swap it for a shorter one, while that lowers
    the pair's later finish. Returns every rank's finish; edits ``per_rank``."""
    oh = cost.microbatch_overhead_s
    L = lengths.astype(np.float64)
    w = cost.compute(L, L * L, 1)
    mb_rank: list[int] = []
    mb_tok: list[float] = []
    mb_of: dict[int, int] = {}
    members: list[list[int]] = []
    for r, mbs in enumerate(per_rank):
        for mb in mbs:
            for i in mb:
                mb_of[i] = len(members)
            members.append(list(mb))
            mb_rank.append(r)
            mb_tok.append(float(L[mb].sum()))
    on_rank: list[list[int]] = [[i for mb in mbs for i in mb] for mbs in per_rank]
    rank_mbs: list[list[int]] = [[] for _ in per_rank]
    for m, r in enumerate(mb_rank):
        rank_mbs[r].append(m)
    fin = free + np.array([sum(oh + float(w[mb].sum()) for mb in mbs) for mbs in per_rank])
    eps = 1e-12

    def put(i: int, m: int) -> None:
        members[m].append(i)
        mb_of[i] = m
        mb_tok[m] += L[i]

    def take(i: int) -> None:
        m = mb_of[i]
        members[m].remove(i)
        mb_tok[m] -= L[i]

    for _ in range(max_moves):
        r = int(np.argmax(fin))
        top = fin[r]
        if not on_rank[r]:
            break
        si = np.array(on_rank[r], dtype=np.int64)
        wi, li = w[si], L[si]
        ti = np.array([mb_tok[mb_of[i]] for i in on_rank[r]])
        alone = np.array([len(members[mb_of[i]]) == 1 for i in on_rank[r]])
        gain = wi + oh * alone
        moved = False
        for t in np.argsort(fin, kind="stable").tolist():
            if t == r or fin[t] >= top - eps:
                continue
            open_t = [m for m in rank_mbs[t] if members[m]]
            low = min(open_t, key=lambda m: mb_tok[m]) if open_t else -1
            room = (mb_tok[low] + li <= cap) if low >= 0 else np.zeros(si.size, dtype=bool)
            add = wi + oh * ~room
            ok = (fin[t] + add < top - eps) & (gain > eps)
            if ok.any():  # move the heaviest sample that fits
                x = int(np.flatnonzero(ok)[np.argmax(wi[ok])])
                i = int(si[x])
                take(i)
                on_rank[r].remove(i)
                if room[x]:
                    put(i, low)
                else:
                    members.append([])
                    mb_tok.append(0.0)
                    mb_rank.append(t)
                    rank_mbs[t].append(len(members) - 1)
                    put(i, len(members) - 1)
                on_rank[t].append(i)
                fin[r] -= gain[x]
                fin[t] += add[x]
                moved = True
                break
            if not on_rank[t]:
                continue
            sk = np.array(on_rank[t], dtype=np.int64)
            wk, lk = w[sk], L[sk]
            tk = np.array([mb_tok[mb_of[k]] for k in on_rank[t]])
            d = wi[:, None] - wk[None, :]
            ok = ((d > eps) & (fin[t] + d < top - eps)
                  & (ti[:, None] - li[:, None] + lk[None, :] <= cap)
                  & (tk[None, :] - lk[None, :] + li[:, None] <= cap))
            if ok.any():  # the swap that leaves the pair's later finish lowest
                after = np.where(ok, np.maximum(top - d, fin[t] + d), np.inf)
                x, y = np.unravel_index(int(np.argmin(after)), after.shape)
                i, k = int(si[x]), int(sk[y])
                mi, mk = mb_of[i], mb_of[k]
                take(i)
                take(k)
                put(k, mi)
                put(i, mk)
                on_rank[r][on_rank[r].index(i)] = k
                on_rank[t][on_rank[t].index(k)] = i
                fin[r] -= d[x, y]
                fin[t] += d[x, y]
                moved = True
                break
        if not moved:
            break
    for r in range(len(per_rank)):
        per_rank[r] = [sorted(members[m]) for m in rank_mbs[r] if members[m]]
    return fin


def _validate(lengths, dp, cp, cap, degrees, cost):
    for name, v in (("dp", dp), ("cp", cp), ("cap", cap)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    degrees = sorted({int(c) for c in degrees})
    if not degrees or degrees[0] < 1 or degrees[-1] > cp:
        raise ValueError(f"degrees must be CP degrees in 1..cp={cp}, got {degrees}")
    if degrees[-1] != cp:
        raise ValueError(f"degrees must include cp={cp} (for the longest samples), got {degrees}")
    if not isinstance(cost, CPCostModel):
        raise ValueError(f"cost must be a CPCostModel, got {type(cost).__name__}")
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 1 or (lengths < 0).any():
        raise ValueError("lengths must be a 1-D array of non-negative token counts")
    return lengths, degrees


def plan_dynamic_cp(lengths, *, dp: int, cp: int, cap: int, degrees, cost: CPCostModel,
                    fixed: tuple[list[list[int]], list[list[int]]] | None = None,
                    ) -> DynamicCPPlan:
    """Plan one step's micro-batches over a pool of ``dp * cp`` ranks (see module doc).

    Parameters
    ----------
    lengths:
        Token counts of the step's samples (step-local positions).
    dp, cp:
        The pool is ``dp`` CP replicas of ``cp`` consecutive ranks; groups lie
        inside one replica.
    cap:
        Tokens per rank (``max_tokens_per_gpu``): a micro-batch of degree ``c``
        holds at most ``c * cap`` tokens (a single longer sample goes alone
        at the largest degree).
    degrees:
        Allowed CP degrees (must include ``cp``).
    cost:
        The cost model.
    fixed:
        ``(bins, rank_bins)`` of a fixed-CP plan of the same samples (DP rank
        ``d`` trains ``rank_bins[d]`` on ranks ``d*cp .. d*cp+cp-1``); kept
        when the dynamic candidates are not faster.
    """
    lengths, degrees = _validate(lengths, dp, cp, cap, degrees, cost)
    pool = dp * cp
    L = lengths.astype(np.float64)
    # smallest degree holding each sample within the cap (the largest for oversize samples)
    need = np.full(lengths.size, degrees[-1], dtype=np.int64)
    for c in reversed(degrees):
        need[lengths <= c * cap] = c
    work = cost.compute(L, L * L, 1)
    balanced = float(work.sum()) / pool if pool else 0.0
    best = None
    for f in (math.inf, 4.0, 2.0, 1.0, 0.5, 0.25):
        tau = balanced * f
        deg = need.copy()
        if math.isfinite(tau):
            for c in degrees:
                raise_ = (deg < c) & (cost.time(L, L * L, deg) > tau)
                deg[raise_] = c
        cand = _candidate(lengths, deg, pool, cp, cap, cost, tau)
        if best is None or cand[3] < best[3] - 1e-12:
            best = cand
    bins, rounds, groups, span = best
    fixed_span = math.nan
    if fixed is not None:
        fb, frb = fixed
        tok = np.array([lengths[b].sum() for b in fb], dtype=np.float64)
        sq = np.array([(L[b] ** 2).sum() for b in fb])
        dur = cost.time(tok, sq, cp)
        fixed_span = max(float(dur[rb].sum()) for rb in frb) if fb else 0.0
        if fixed_span <= span:
            rounds = [0] * len(fb)
            groups = [()] * len(fb)
            for d, rb in enumerate(frb):
                for j, b in enumerate(rb):
                    rounds[b] = j
                    groups[b] = tuple(range(d * cp, (d + 1) * cp))
            return DynamicCPPlan([list(b) for b in fb], rounds, groups, fixed_span, fixed_span,
                                 "fixed")
    return DynamicCPPlan(bins, rounds, groups, span, fixed_span, "dynamic")
