"""Exact reference for small steps: minimum busiest-rank FLOPs by CP-SAT.

:func:`solve_min_max_rank_flops` finds, for one step of at most
:data:`MAX_SAMPLES` samples, the assignment of samples to ``dp * m``
micro-batches (``m`` per rank) that minimises the largest rank FLOPs, such
that every micro-batch is non-empty and holds at most ``cap`` tokens unless
it is a single over-cap sample. It is the yardstick for the heuristics
(tests and benchmarks report their gap to it); it is not meant for
production steps.

FLOPs are scaled to integers (``resolution`` steps of the largest sample)
for the solver; the returned ``max_rank_flops`` is recomputed in float64
from the solution. Symmetries are broken (rank loads descending, micro-batch
tokens descending within a rank). Requires OR-Tools (``pip install ortools``;
a dev dependency).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from varbatch_kit._extras import require
from varbatch_kit.checks import positive_int

__all__ = [
    "MAX_SAMPLES",
    "OptimalResult",
    "solve_min_max_rank_flops",
]

#: Largest instance the exact solver accepts.
MAX_SAMPLES = 40


@dataclass(frozen=True)
class OptimalResult:
    """A CP-SAT solution.

    ``bins``: micro-batches (sample positions, ascending); ``rank_bins``:
    the micro-batch positions of each rank; ``max_rank_flops``: the busiest
    rank's FLOPs (float64, recomputed); ``proven_optimal``: the solver
    proved optimality (otherwise the time limit cut it short and the value is
    an upper bound); ``lower_bound``: the solver's proven bound, in FLOPs;
    ``status`` and ``wall_s`` as reported.
    """

    bins: list[list[int]]
    rank_bins: list[list[int]]
    max_rank_flops: float
    proven_optimal: bool
    lower_bound: float
    status: str
    wall_s: float


def _check(lengths, flops, cap, dp, m):
    L = np.asarray(lengths)
    F = np.asarray(flops, dtype=np.float64)
    if L.ndim != 1 or L.size == 0 or not np.issubdtype(L.dtype, np.integer) or (L < 1).any():
        raise ValueError(f"lengths must be a non-empty 1-D array of positive integers, got {L!r}")
    if F.shape != L.shape or not np.isfinite(F).all() or (F < 0).any():
        raise ValueError("flops must be finite, non-negative and match lengths one to one "
                         f"(got shape {F.shape} for {L.size} lengths)")
    if L.size > MAX_SAMPLES:
        raise ValueError(f"the exact solver is for small steps: {L.size} samples > MAX_SAMPLES="
                         f"{MAX_SAMPLES}; use a heuristic packing for larger ones")
    for name, v in (("cap", cap), ("dp", dp), ("micro_batches_per_rank", m)):
        positive_int(name, v)
    if dp * m > L.size:
        raise ValueError(f"dp * micro_batches_per_rank = {dp * m} micro-batches need at least as "
                         f"many samples, got {L.size}")
    return L.astype(np.int64), F


def _canonical(hint, lens, w, dp, m) -> list[set[int]]:
    """A hinted schedule reordered to satisfy the symmetry breaking of the model."""
    bins, rank_bins = hint
    if len(rank_bins) != dp or any(len(rb) != m for rb in rank_bins):
        raise ValueError(f"hint must have dp={dp} ranks of {m} micro-batches each")
    ranks = []
    for rb in rank_bins:
        mbs = sorted((list(bins[b]) for b in rb), key=lambda mb: -sum(lens[i] for i in mb))
        ranks.append((sum(w[i] for mb in mbs for i in mb), mbs))
    ranks.sort(key=lambda t: -t[0])
    return [set(mb) for _, mbs in ranks for mb in mbs]


def solve_min_max_rank_flops(
    lengths,
    flops,
    cap: int,
    dp: int,
    micro_batches_per_rank: int,
    *,
    time_limit_s: float = 10.0,
    num_workers: int = 1,
    resolution: int = 1_000_000,
    relative_gap: float = 1e-5,
    hint: tuple[list[list[int]], list[list[int]]] | None = None,
    seed: int = 0,
) -> OptimalResult:
    """Minimum busiest-rank FLOPs with ``micro_batches_per_rank`` non-empty micro-batches per rank.

    Parameters
    ----------
    lengths, flops:
        Per-sample tokens and forward FLOPs (at most :data:`MAX_SAMPLES`).
    cap:
        Token cap of a micro-batch of two or more samples.
    dp, micro_batches_per_rank:
        Ranks and micro-batches per rank.
    time_limit_s, num_workers, seed:
        CP-SAT search parameters (one worker and a fixed seed are
        deterministic).
    resolution:
        The largest sample's FLOPs in integer units.
    relative_gap:
        Stop once the solution is proven within this relative distance of
        the optimum (``proven_optimal`` is then True); 0 asks for a full
        proof, which can take long when the optimum sits just above
        ``total / dp``.
    hint:
        ``(bins, rank_bins)`` of a known schedule (e.g. a heuristic's) to
        start the search from; it only speeds the search up.

    Raises
    ------
    ValueError
        For bad input or an infeasible instance (e.g. too few samples).
    """
    require("the exact solver (solve_min_max_rank_flops)", "dev", ("ortools",))
    from ortools.sat.python import cp_model

    L, F = _check(lengths, flops, cap, dp, micro_batches_per_rank)
    n, m = L.size, int(micro_batches_per_rank)
    k = dp * m
    unit = max(float(F.max()), 1e-300) / resolution
    w = np.rint(F / unit).astype(np.int64).tolist()
    lens = L.tolist()
    over = [i for i in range(n) if lens[i] > cap]

    model = cp_model.CpModel()
    x = [[model.NewBoolVar(f"x{i}_{b}") for b in range(k)] for i in range(n)]
    for i in range(n):
        model.AddExactlyOne(x[i])
    tok = []
    for b in range(k):
        col = [x[i][b] for i in range(n)]
        model.Add(sum(col) >= 1)
        t = model.NewIntVar(0, int(L.sum()), f"tok{b}")
        model.Add(t == sum(lens[i] * x[i][b] for i in range(n)))
        tok.append(t)
        model.Add(sum(lens[i] * x[i][b] for i in range(n) if lens[i] <= cap) <= cap)
        for o in over:
            model.Add(sum(col) == 1).OnlyEnforceIf(x[o][b])
    total = int(sum(w))
    load = []
    for r in range(dp):
        v = model.NewIntVar(0, total, f"load{r}")
        model.Add(v == sum(w[i] * x[i][b] for i in range(n) for b in range(r * m, (r + 1) * m)))
        load.append(v)
        for b in range(r * m, (r + 1) * m - 1):
            model.Add(tok[b] >= tok[b + 1])
    for r in range(dp - 1):
        model.Add(load[r] >= load[r + 1])
    # redundant: a rank's short samples fill at most its micro-batches not taken by long ones
    for r in range(dp):
        cells = range(r * m, (r + 1) * m)
        n_over = sum(x[o][b] for o in over for b in cells)
        model.Add(sum(lens[i] * x[i][b] for i in range(n) if lens[i] <= cap for b in cells)
                  <= cap * (m - n_over))
    lower = max(-(-total // dp), max(w))
    z = model.NewIntVar(lower, total, "z")
    model.AddMaxEquality(z, load)
    model.Minimize(z)
    if hint is not None:
        for b, members in enumerate(_canonical(hint, lens, w, dp, m)):
            for i in range(n):
                model.AddHint(x[i][b], i in members)

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    solver.parameters.num_workers = int(num_workers)
    solver.parameters.random_seed = int(seed)
    solver.parameters.relative_gap_limit = float(relative_gap)
    t0 = time.perf_counter()
    status = solver.Solve(model)
    wall = time.perf_counter() - t0
    name = solver.StatusName(status)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise ValueError(f"no schedule found ({name}) for {n} samples, cap {cap}, dp {dp}, "
                         f"{m} micro-batches per rank within {time_limit_s} s")
    bins: list[list[int]] = [[] for _ in range(k)]
    for i in range(n):
        for b in range(k):
            if solver.Value(x[i][b]):
                bins[b].append(i)
                break
    rank_bins = [list(range(r * m, (r + 1) * m)) for r in range(dp)]
    loads = [float(sum(F[i] for b in rb for i in bins[b])) for rb in rank_bins]
    return OptimalResult(
        bins=bins,
        rank_bins=rank_bins,
        max_rank_flops=max(loads),
        proven_optimal=status == cp_model.OPTIMAL,  # within relative_gap
        lower_bound=float(solver.BestObjectiveBound()) * unit,
        status=name,
        wall_s=wall,
    )


# --------------------------------------------------------------------------- gap studies
