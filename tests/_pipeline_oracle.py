"""A slow, independent 1F1B simulator for the tests (not collected by pytest).

One rank, plain floats, written as the recurrence of the schedule rather than
as the package's operation sweep (:mod:`varbatch_kit.policies.pipeline`): an
operation ends ``duration`` after the later of the end of the operation
before it on its stage and the end of the operation it depends on.
"""

from __future__ import annotations

from functools import cache


def reference_1f1b(fwd, bwd, pp: int) -> tuple[list[float], list[float], float]:
    """``(first-stage forward starts, first-stage backward ends, makespan)`` of one rank."""
    fwd, bwd = [float(x) for x in fwd], [float(x) for x in bwd]
    m = len(fwd)
    if m == 0:
        return [], [], 0.0
    # per stage: its operations in order, ("F" | "B", micro-batch)
    seqs = []
    for s in range(pp):
        warm = min(pp - s - 1, m)
        seq = [("F", j) for j in range(warm)]
        for i in range(m - warm):
            seq += [("F", warm + i), ("B", i)]
        seq += [("B", j) for j in range(m - warm, m)]
        seqs.append(seq)
    position = {(s, op): k for s in range(pp) for k, op in enumerate(seqs[s])}

    @cache
    def start(s: int, op: tuple[str, int]) -> float:
        kind, j = op
        k = position[(s, op)]
        t = end(s, seqs[s][k - 1]) if k else 0.0
        if kind == "F" and s > 0:
            t = max(t, end(s - 1, ("F", j)))
        elif kind == "B":
            t = max(t, end(s, ("F", j)) if s == pp - 1 else end(s + 1, ("B", j)))
        return t

    @cache
    def end(s: int, op: tuple[str, int]) -> float:
        kind, j = op
        return start(s, op) + (fwd[j] if kind == "F" else bwd[j])

    starts = [start(0, ("F", j)) for j in range(m)]
    ends = [end(0, ("B", j)) for j in range(m)]
    return starts, ends, max(end(s, seqs[s][-1]) for s in range(pp))
