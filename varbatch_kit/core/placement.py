"""Where the micro-batches of a step run, and what each rank does per round.

A step's ``dp * cp`` ranks form one *pool* (world ranks ``0 .. dp*cp - 1``).
The step runs in *rounds*: in each round the pool is split into disjoint CP
groups, each running one micro-batch over its ``c`` ranks (ranks in no group
are idle that round). Every rank runs the same number of rounds, so gradient
synchronisation and pipeline schedules still line up. Under fixed CP every
micro-batch has degree ``cp`` and the CP replica of its DP rank as its group;
under ``ScheduleConfig(cp_mode="dynamic")`` each has its own.

:class:`Placement` says where one micro-batch runs; :class:`RankWork` is one
entry of a rank's program (:meth:`varbatch_kit.core.step.Step.rank_program`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Placement", "RankWork"]


@dataclass(frozen=True)
class Placement:
    """Where one micro-batch of a step runs (its round and CP group).

    Attributes
    ----------
    bin:
        Position of the micro-batch in ``step.micro_batches``.
    round:
        0-based round of the step in which it runs.
    ranks:
        Pool ranks (world ranks ``0 .. dp*cp - 1``) of its CP group, in CP-rank
        order: ``ranks[i]`` holds the ``i``-th zigzag share of every sample;
        ``len(ranks)`` is its CP degree.
    """

    bin: int
    round: int
    ranks: tuple[int, ...]

    @property
    def degree(self) -> int:
        """The micro-batch's CP degree ``c`` (size of its group)."""
        return len(self.ranks)


@dataclass(frozen=True, eq=False)
class RankWork:
    """What one world rank does in one round.

    Attributes
    ----------
    samples:
        Global sample indices of the micro-batch it takes part in (empty:
        the rank is idle this round).
    cp_size:
        The micro-batch's CP degree ``c`` (1 when idle).
    cp_rank:
        This rank's position in the CP group (``0 .. c-1``); it holds the
        ``cp_rank``-th zigzag share of each sample.
    """

    samples: np.ndarray
    cp_size: int
    cp_rank: int

    @property
    def idle(self) -> bool:
        """True when the rank has nothing to train this round."""
        return self.samples.size == 0
