"""The non-interleaved 1F1B pipeline schedule, simulated operation by operation.

One DP rank runs its ``m`` micro-batches through ``pp`` stages, every stage
holding an equal share of the layers. Stage ``s`` runs ``min(pp - s - 1, m)``
warm-up forwards, then pairs one forward with one backward (the forward of
micro-batch ``j + pp - 1 - s`` with the backward of ``j``), then the
cool-down backwards. A forward on stage ``s`` waits for the same
micro-batch's forward on stage ``s - 1``; a backward on stage ``s`` waits for
its backward on stage ``s + 1`` (on the last stage: its own forward there).
Communication is free. Each operation starts when its stage is free and its
dependency has ended.

:func:`one_f_one_b` is the one simulator of the package: the step-time model
(:mod:`varbatch_kit.analysis.simulate`) reads its timelines, the micro-batch
orders (:mod:`varbatch_kit.policies.order`) its makespan
(:func:`pipeline_makespan`), vectorised over many ranks or candidate orders.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from varbatch_kit.checks import positive_int

__all__ = ["one_f_one_b", "pipeline_makespan"]


@lru_cache(maxsize=256)
def _ops(pp: int, m: int) -> tuple[tuple[tuple[int, int, int, int, int], ...], tuple[int, ...]]:
    """The 1F1B operations in a dependency-respecting order, and each stage's last one.

    Each operation is ``(stage, kind, mb, same_stage_pred, cross_pred)``:
    ``kind`` 0 = forward, 1 = backward; the predecessors are indices into
    the list (-1: none). Built once per ``(pp, m)``: the graph does not
    depend on the durations.
    """
    seqs = []
    for s in range(pp):
        warm = min(pp - s - 1, m)
        seq = [(0, j) for j in range(warm)]
        for i in range(m - warm):
            seq += [(0, warm + i), (1, i)]
        seq += [(1, j) for j in range(m - warm, m)]
        seqs.append(seq)
    index: dict[tuple[int, int, int], int] = {}
    out: list[tuple[int, int, int, int, int]] = []
    ptr = [0] * pp
    total = sum(len(q) for q in seqs)
    while len(out) < total:
        moved = False
        for s in range(pp):
            while ptr[s] < len(seqs[s]):
                kind, j = seqs[s][ptr[s]]
                if kind == 0:
                    dep = None if s == 0 else (s - 1, 0, j)
                else:
                    dep = (s, 0, j) if s == pp - 1 else (s + 1, 1, j)
                if dep is not None and dep not in index:
                    break
                prev = index[(s, *seqs[s][ptr[s] - 1])] if ptr[s] else -1
                index[(s, kind, j)] = len(out)
                out.append((s, kind, j, prev, -1 if dep is None else index[dep]))
                ptr[s] += 1
                moved = True
        if not moved:  # pragma: no cover - the 1F1B graph is acyclic
            raise AssertionError("1F1B graph has a cycle")
    finals = tuple(index[(s, *seqs[s][-1])] for s in range(pp))
    return tuple(out), finals


def _check(fwd, bwd, pp) -> tuple[np.ndarray, np.ndarray, int]:
    fwd = np.asarray(fwd, dtype=np.float64)
    bwd = np.asarray(bwd, dtype=np.float64)
    if fwd.shape != bwd.shape or fwd.ndim < 1:
        raise ValueError(f"fwd and bwd must have the same shape (..., m); got {fwd.shape} "
                         f"and {bwd.shape}")
    return fwd, bwd, positive_int("pp", pp, note=" (pipeline stages)")


def one_f_one_b(fwd, bwd, pp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Simulate non-interleaved 1F1B on ``pp`` stages, for many ranks (or orders) at once.

    Parameters
    ----------
    fwd, bwd:
        ``(..., m)`` per-stage forward and backward times (>= 0, any unit) of
        the micro-batches in training order; each leading index is one rank
        or one candidate order.
    pp:
        Pipeline stages (a positive integer).

    Returns
    -------
    ``(start, end, finish)``: ``(..., m)`` the start of each micro-batch's
    first-stage forward and the end of its first-stage backward, and
    ``(...)`` the time the last operation ends (the makespan). With
    ``pp = 1`` the micro-batches run back to back.
    """
    fwd, bwd, pp = _check(fwd, bwd, pp)
    m = fwd.shape[-1]
    if pp == 1 or m == 0:
        ends = np.cumsum(fwd + bwd, axis=-1)
        starts = ends - (fwd + bwd)
        finish = ends[..., -1] if m else np.zeros(fwd.shape[:-1])
        return starts, ends, finish
    dur = (np.moveaxis(fwd, -1, 0), np.moveaxis(bwd, -1, 0))
    ops, finals = _ops(pp, m)
    zero = np.zeros(fwd.shape[:-1])
    start0 = [zero] * m  # stage 0's forwards have no dependency: they start when it is free
    end0 = [zero] * m
    ends: list[np.ndarray] = []
    for s, kind, j, prev, dep in ops:
        if prev < 0:
            start = zero if dep < 0 else ends[dep]
        else:
            start = ends[prev] if dep < 0 else np.maximum(ends[prev], ends[dep])
        ends.append(start + dur[kind][j])
        if s == 0:
            if kind == 0:
                start0[j] = start
            else:
                end0[j] = ends[-1]
    finish = np.max(np.stack([ends[i] for i in finals]), axis=0)
    return np.stack(start0, axis=-1), np.stack(end0, axis=-1), finish


def pipeline_makespan(fwd, bwd, pp: int) -> np.ndarray:
    """The makespan of :func:`one_f_one_b`: ``(...)`` times at which the last operation ends.

    ``fwd``, ``bwd``: ``(..., m)`` per-stage forward and backward times of the
    micro-batches *in training order* (each row one candidate). With
    ``pp = 1`` this is the plain sum.
    """
    return one_f_one_b(fwd, bwd, pp)[2]
