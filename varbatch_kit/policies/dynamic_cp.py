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
   each rank packing them next-fit under ``cap`` tokens, then move or swap
   them off the rank that finishes last while that helps
   (:mod:`varbatch_kit.policies.dynamic_cp_short`);
4. number the rounds so that every rank runs its micro-batches in the order
   planned (a group's round is the first round free on all its ranks; the
   other ranks idle in the rounds they skip) and pad every rank to the same
   number of rounds.

Of the candidate plans the one with the shortest makespan under the cost
model is kept, and a given fixed-CP plan (every micro-batch at degree ``cp``
on its DP replica) is kept instead where it is not slower: a dynamic plan is
never slower than the fixed one under the model it was planned with.

Planning is fast enough for interactive use (a 3000-sample step at 16 x 8 in
a few fixed plans' time, ``benchmarks/dynamic_cp_speed.py``) because work that
cannot change the result is skipped: a target whose degrees and groups repeat
an earlier candidate's is not planned again, and step 3 is not run for a
candidate whose lower bound (no rank before it frees, the whole pool busy with
the degree-1 work and one overhead per ``cap`` tokens of it) already reaches
the best candidate's makespan or the fixed plan's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from varbatch_kit.checks import positive_int
from varbatch_kit.policies.dynamic_cp_short import deal_short, refine_short

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


def _long_bins(lengths: np.ndarray, deg: np.ndarray, cap: int, cost: CPCostModel,
               tau: float) -> tuple[list[list[int]], list[int]]:
    """The micro-batches of the samples of degree ``c > 1`` (largest degree first) and their
    degrees: first-fit decreasing per degree under ``c * cap`` tokens and ``tau`` seconds."""
    bins: list[list[int]] = []
    bdeg: list[int] = []
    for c in sorted(set(deg.tolist()) - {1}, reverse=True):
        pos = np.flatnonzero(deg == c)
        for b in _ffd(pos, lengths, cap * c, cost, c, tau):
            bins.append(b)
            bdeg.append(c)
    return bins, bdeg


def _place_groups(lengths: np.ndarray, bins: list[list[int]], bdeg: list[int], pool: int,
                  cp: int, cost: CPCostModel):
    """List-schedule the micro-batches of degree > 1, longest first, each on the window
    of its degree that frees first (least idle on ties). Returns ``(rounds, groups, free,
    nxt)``: per micro-batch its round and ranks; per rank when it frees and its next round."""
    free = np.zeros(pool)
    nxt = np.zeros(pool, dtype=np.int64)
    groups: list[tuple[int, ...]] = [()] * len(bins)
    rounds = [0] * len(bins)
    if not bins:
        return rounds, groups, free, nxt
    tok, sq = _bin_sums(lengths, bins)
    dur = cost.time(tok, sq, np.array(bdeg))
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
    return rounds, groups, free, nxt


def _bin_sums(lengths: np.ndarray, bins: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """``S = sum(L)`` and ``Q = sum(L**2)`` of every bin, as floats (exact below 2**53)."""
    sizes = [len(b) for b in bins]
    if not bins or min(sizes) == 0:  # reduceat cannot sum empty bins
        return (np.array([float(lengths[b].sum()) for b in bins], dtype=np.float64),
                np.array([float((lengths[b].astype(np.float64) ** 2).sum()) for b in bins],
                         dtype=np.float64))
    flat = np.fromiter((i for b in bins for i in b), dtype=np.int64)
    starts = np.cumsum([0] + sizes[:-1])
    Lf = lengths[flat].astype(np.float64)
    return np.add.reduceat(Lf, starts), np.add.reduceat(Lf * Lf, starts)


def _short_lower_bound(free: np.ndarray, short_tokens: int, short_work: float, cap: int,
                       cost: CPCostModel, spread: bool = False) -> float:
    """A lower bound of the makespan once the degree-1 samples (``short_tokens`` tokens,
    ``short_work`` seconds) run after the groups: no rank finishes before it frees, and
    the pool holds all the work plus an overhead for each of at least
    ``ceil(short_tokens / cap)`` micro-batches. Shaved by 1e-9 (relative) for rounding.
    ``spread``: ``free`` only sums the groups' busy rank-seconds (placed or not), so
    only the mean counts."""
    mbs = -(-int(short_tokens) // cap)
    mean = (float(free.sum()) + short_work + cost.microbatch_overhead_s * mbs) / free.size
    return (mean if spread else max(float(free.max()), mean)) * (1 - 1e-9)


def _validate(lengths, dp, cp, cap, degrees, cost):
    for name, v in (("dp", dp), ("cp", cp), ("cap", cap)):
        positive_int(name, v)
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
    fixed_span = math.nan
    if fixed is not None:
        fb, frb = fixed
        tok, sq = _bin_sums(lengths, fb)
        dur = cost.time(tok, sq, cp)
        fixed_span = max(float(dur[rb].sum()) for rb in frb) if fb else 0.0
    best = None
    seen: set = set()
    # each sample's time alone at each degree, and at the degree it needs
    alone = {c: cost.time(L, L * L, c) for c in degrees}
    t_need = np.zeros(lengths.size)
    for c in degrees:
        t_need[need == c] = alone[c][need == c]
    for f in (math.inf, 4.0, 2.0, 1.0, 0.5, 0.25):
        tau = balanced * f
        deg = need.copy()
        if math.isfinite(tau):
            t_deg = t_need.copy()
            for c in degrees:
                raise_ = (deg < c) & (t_deg > tau)
                deg[raise_] = c
                t_deg[raise_] = alone[c][raise_]
        bins, bdeg = _long_bins(lengths, deg, cap, cost, tau)
        key = (deg.tobytes(), tuple(map(tuple, bins)))
        if key in seen:  # the same plan as an earlier candidate: it cannot win
            continue
        seen.add(key)
        # it cannot replace the best candidate, nor be kept over the fixed plan, when its
        # lower bound reaches theirs (the chain of 1e-12-better candidates may then end a
        # few 1e-12 s lower, no worse); first a bound without the groups' idle time
        limit = min(best[3] - 1e-12 if best is not None else math.inf,
                    fixed_span if fixed is not None else math.inf)
        short = np.flatnonzero(deg == 1)
        s_tok, s_work = int(lengths[short].sum()), float(work[short].sum())
        if bins:
            tok, sq = _bin_sums(lengths, bins)
            busy = cost.time(tok, sq, np.array(bdeg)) * np.array(bdeg)
            if _short_lower_bound(np.array([float(busy.sum())] + [0.0] * (pool - 1)), s_tok,
                                  s_work, cap, cost, spread=True) >= limit:
                continue
        rounds, groups, free, nxt = _place_groups(lengths, bins, bdeg, pool, cp, cost)
        if _short_lower_bound(free, s_tok, s_work, cap, cost) >= limit:
            continue
        # degree-1 samples: longest first to the rank that finishes first, next-fit per rank
        per_rank = deal_short(short, lengths, free, cap, cost)
        fin = refine_short(per_rank, lengths, free, cap, cost)
        for r in range(pool):
            for mb in per_rank[r]:
                bins.append(mb)
                groups.append((r,))
                rounds.append(int(nxt[r]))
                nxt[r] += 1
        span = float(fin.max())
        if best is None or span < best[3] - 1e-12:
            best = (bins, rounds, groups, span)
    if fixed is not None and (best is None or fixed_span <= best[3]):
        rounds = [0] * len(fb)
        groups = [()] * len(fb)
        for d, rb in enumerate(frb):
            for j, b in enumerate(rb):
                rounds[b] = j
                groups[b] = tuple(range(d * cp, (d + 1) * cp))
        return DynamicCPPlan([list(b) for b in fb], rounds, groups, fixed_span, fixed_span,
                             "fixed")
    bins, rounds, groups, span = best
    return DynamicCPPlan(bins, rounds, groups, span, fixed_span, "dynamic")
