"""What every peer scheduler shares: the plan it returns, its refusal, its input check.

:class:`PeerPlan` is one step as a peer schedules it; :class:`PeerRefusal` is
raised where the peer itself would refuse the input. :func:`validate` checks
``(lengths, dp, cap, workload)`` the same way for every peer, :func:`make_plan`
builds a plan from index lists, and :func:`lpt_split` is the bin split that
prime-rl and NeMo-RL both use to reach a multiple of ``dp`` bins.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from varbatch_kit.checks import positive_int

__all__ = ["PeerPlan", "PeerRefusal", "lpt_split", "make_plan", "refuse_oversize", "validate"]


class PeerRefusal(ValueError):
    """The peer itself would refuse this input (e.g. a sample longer than its cap)."""


@dataclass(frozen=True)
class PeerPlan:
    """One step as a peer schedules it.

    ``rank_micro_batches[r][j]``: sample indices (into the step's arrays) of
    rank r's j-th micro-batch, in training order. Ranks may hold different
    micro-batch counts when the peer allows it (torchtitan). ``notes`` says
    what the peer did that the numbers alone do not show (e.g. a fallback).
    """

    rank_micro_batches: list[list[np.ndarray]]
    notes: tuple[str, ...] = field(default=())

    @property
    def dp(self) -> int:
        return len(self.rank_micro_batches)

    @property
    def micro_batches(self) -> list[np.ndarray]:
        """All micro-batches, rank after rank."""
        return [mb for rank in self.rank_micro_batches for mb in rank]

    def check(self, n: int) -> PeerPlan:
        """Raise ``AssertionError`` unless every sample ``0..n-1`` appears exactly once."""
        flat = (np.concatenate(self.micro_batches) if self.micro_batches
                else np.zeros(0, dtype=np.int64))
        counts = np.bincount(flat.astype(np.int64), minlength=n) if flat.size else np.zeros(n)
        assert flat.size == n and counts.size == n and bool(np.all(counts == 1)), \
            "a peer plan must hold every sample exactly once"
        return self


def make_plan(rank_lists, index=None, notes=()) -> PeerPlan:
    """Build a plan from per-rank lists of index lists, mapped through ``index``."""
    out = []
    for rank in rank_lists:
        mbs = []
        for mb in rank:
            a = np.asarray(mb, dtype=np.int64)
            mbs.append(a if index is None else index[a])
        out.append(mbs)
    return PeerPlan(out, tuple(notes))


def validate(lengths, dp, cap, workload=None):
    """Check a peer's inputs; returns ``(lengths as int64, dp, cap, workload or None)``.

    Raises ``ValueError`` naming the parameter for lengths that are not whole
    token counts >= 1, a ``dp`` or ``cap`` that is not a positive integer, or
    a ``workload`` that is not one finite, non-negative cost per sample.
    """
    lens = np.asarray(lengths)
    if lens.ndim != 1 or lens.size == 0:
        raise ValueError(f"lengths must be a non-empty 1-D array of token counts, got shape "
                         f"{lens.shape}")
    if not np.issubdtype(lens.dtype, np.integer):
        if not np.all(lens == np.floor(lens)):
            raise ValueError("lengths must be whole token counts")
        lens = lens.astype(np.int64)
    lens = lens.astype(np.int64)
    if np.any(lens < 1):
        raise ValueError("lengths must be >= 1 token each")
    positive_int("dp", dp, whole_floats=True)
    positive_int("cap", cap, note=" token count", whole_floats=True)
    w = None
    if workload is not None:
        w = np.asarray(workload, dtype=np.float64)
        if w.shape != lens.shape or np.any(~np.isfinite(w)) or np.any(w < 0):
            raise ValueError("workload must be finite, non-negative and one per sample")
    return lens, int(dp), int(cap), w


def refuse_oversize(peer: str, lens: np.ndarray, cap: int) -> None:
    """Raise :class:`PeerRefusal` when ``peer`` (which cannot split a sample) meets one > cap."""
    if int(lens.max()) > cap:
        raise PeerRefusal(f"{peer} refuses a sample of {int(lens.max())} tokens > cap {cap} "
                          "(it cannot split a sample); raise the cap or drop the sample")


def lpt_split(items: list[int], w: np.ndarray) -> tuple[list[int], list[int]]:
    """Split a bin's items in two by workload: heaviest first, each to the lighter half."""
    a, b, wa, wb = [], [], 0.0, 0.0
    for i in sorted(items, key=lambda i: (-w[i], i)):
        if wa <= wb:
            a.append(i)
            wa += w[i]
        else:
            b.append(i)
            wb += w[i]
    return sorted(a), sorted(b)
