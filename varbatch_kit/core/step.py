"""`Step`: one training step of a schedule, in the one shape both CP modes share.

A step's ``dp * cp`` world ranks form one pool. Every micro-batch has a
:class:`~varbatch_kit.core.placement.Placement`: the round it runs in and the
world ranks of its CP group. Fixed CP is the special case where every
micro-batch has degree ``cp`` and the whole CP replica of its DP rank as its
group (world ranks ``d*cp .. d*cp+cp-1`` for DP rank ``d``; round = its
position in that DP rank's training order); dynamic CP gives each micro-batch
its own degree and group. Everything else (:attr:`Step.rank_bins`,
:meth:`Step.rank_program`, :attr:`Step.num_rounds`,
:meth:`Step.sample_cp_sizes`) is read from the placements the same way for
both; :attr:`Step.dp_rank_bins` is the per-DP-rank view that exists only for a
step of the fixed shape (slime's rank layout, the per-DP-rank quality tables).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from varbatch_kit.checks import int_in_range, positive_int
from varbatch_kit.core.placement import Placement, RankWork

__all__ = ["Step"]


@dataclass(frozen=True, eq=False)
class Step:
    """One training step of a schedule.

    Build one with :meth:`from_dp_ranks` (the fixed-CP shape) or
    :meth:`from_placements` (any plan).

    Attributes
    ----------
    index:
        Step number (0-based).
    rollout_ids:
        The step's rollout ids, in order of first appearance.
    sample_indices:
        Global sample indices of the step, in step-local order (rollout after
        rollout, each rollout's samples in their original order).
    micro_batches:
        The step's micro-batches (global sample indices) in bin order.
    placements:
        One :class:`~varbatch_kit.core.placement.Placement` per micro-batch,
        in bin order (``placements[b].bin == b``): its round and CP group.
    dp, cp:
        The pool: world ranks ``0 .. dp*cp - 1`` (the schedule's ``config.dp``
        and ``config.cp``).
    """

    index: int
    rollout_ids: np.ndarray
    sample_indices: np.ndarray
    micro_batches: list[np.ndarray]
    placements: tuple[Placement, ...]
    dp: int
    cp: int

    # ------------------------------------------------------------ constructors
    @classmethod
    def from_placements(cls, index: int, rollout_ids: np.ndarray, sample_indices: np.ndarray,
                        micro_batches: list[np.ndarray], placements, *, dp: int,
                        cp: int) -> Step:
        """A step from its micro-batches and their placements.

        ``placements``: one :class:`Placement` or ``(round, ranks)`` pair per
        micro-batch, in bin order. Raises ``ValueError`` when their number is
        not the micro-batch count or a rank is outside the pool ``0 .. dp*cp-1``.
        """
        dp, cp = positive_int("dp", dp), positive_int("cp", cp)
        pl = tuple(p if isinstance(p, Placement) else
                   Placement(b, int(p[0]), tuple(int(r) for r in p[1]))
                   for b, p in enumerate(placements))
        if len(pl) != len(micro_batches):
            raise ValueError(f"placements: {len(pl)} for {len(micro_batches)} micro-batches; "
                             "give one per micro-batch, in bin order")
        world = dp * cp
        for p in pl:
            for r in p.ranks:
                if not 0 <= r < world:
                    raise ValueError(f"placements: micro-batch {p.bin}: rank {r} is outside the "
                                     f"pool 0..{world - 1} (dp={dp}, cp={cp})")
        return cls(index, rollout_ids, sample_indices, list(micro_batches), pl, dp, cp)

    @classmethod
    def from_dp_ranks(cls, index: int, rollout_ids: np.ndarray, sample_indices: np.ndarray,
                      micro_batches: list[np.ndarray], dp_rank_bins: list[list[int]], *,
                      cp: int) -> Step:
        """The fixed-CP step: DP rank ``d`` trains ``dp_rank_bins[d]`` in that order.

        Its ``j``-th micro-batch runs in round ``j`` on world ranks
        ``d*cp .. d*cp+cp-1`` (degree ``cp``).
        """
        cp = positive_int("cp", cp)
        out: list = [None] * len(micro_batches)
        for d, bins in enumerate(dp_rank_bins):
            for j, b in enumerate(bins):
                if not 0 <= b < len(out) or out[b] is not None:
                    raise ValueError(f"dp_rank_bins: bin {b} is not a micro-batch used once "
                                     f"(0..{len(out) - 1})")
                out[b] = (j, tuple(range(d * cp, (d + 1) * cp)))
        if any(p is None for p in out):
            raise ValueError("dp_rank_bins: every micro-batch must be on one DP rank")
        return cls.from_placements(index, rollout_ids, sample_indices, micro_batches, out,
                                   dp=len(dp_rank_bins), cp=cp)

    # ------------------------------------------------------------ sizes
    @property
    def world_size(self) -> int:
        """Ranks of the pool: ``dp * cp``."""
        return self.dp * self.cp

    @property
    def num_rollouts(self) -> int:
        return int(self.rollout_ids.size)

    @property
    def num_samples(self) -> int:
        return int(self.sample_indices.size)

    @property
    def num_rounds(self) -> int:
        """Rounds of the step: every rank runs one micro-batch (or idles) per round.

        Fixed CP: the micro-batches per DP rank.
        """
        return 1 + max(p.round for p in self.placements) if self.placements else 0

    @property
    def num_microbatches(self) -> int:
        """Rounds of the step (micro-batches per rank under fixed CP)."""
        return self.num_rounds

    # ------------------------------------------------------------ per world rank
    @cached_property
    def rank_bins(self) -> list[list[int]]:
        """Per world rank (``dp * cp`` lists): the micro-batches it takes part in, in round
        order, idle rounds left out. A micro-batch of degree ``c`` is in ``c`` lists; under
        fixed CP the ``cp`` ranks of DP rank ``d`` all list ``dp_rank_bins[d]``."""
        per_rank: list[list[tuple[int, int]]] = [[] for _ in range(self.world_size)]
        for p in self.placements:
            for r in p.ranks:
                per_rank[r].append((p.round, p.bin))
        return [[b for _, b in sorted(x)] for x in per_rank]

    @property
    def ranks(self) -> list[list[np.ndarray]]:
        """``ranks[w]`` = world rank w's micro-batches (:attr:`rank_bins`) as sample arrays."""
        return [[self.micro_batches[b] for b in bins] for bins in self.rank_bins]

    def rank_program(self, world_rank: int) -> list[RankWork]:
        """What world rank ``world_rank`` trains, round by round (one entry per round).

        In each round the micro-batch whose group holds the rank (its degree
        and the rank's position in the group), or an idle entry (empty
        samples, ``cp_size=1, cp_rank=0``). Every rank's list has
        :attr:`num_rounds` entries. Fixed CP: DP rank ``world_rank // cp``'s
        micro-batches in training order, each with ``cp_size=cp, cp_rank=world_rank % cp``.
        """
        world = self.world_size
        world_rank = int_in_range("world_rank", world_rank, 0, world,
                                  what=f"this step has ranks 0..{world - 1}")
        idle = np.zeros(0, dtype=np.int64)
        out = [RankWork(idle, 1, 0) for _ in range(self.num_rounds)]
        for b in self.rank_bins[world_rank]:
            p = self.placements[b]
            out[p.round] = RankWork(self.micro_batches[b], p.degree,
                                    p.ranks.index(int(world_rank)))
        return out

    def sample_cp_sizes(self) -> np.ndarray:
        """The CP degree each sample of :attr:`sample_indices` is cut by (int64, same order):
        its micro-batch's degree (``cp`` for every sample under fixed CP)."""
        by_sample = {}
        for mb, p in zip(self.micro_batches, self.placements):
            for i in mb.tolist():
                by_sample[i] = p.degree
        return np.array([by_sample[i] for i in self.sample_indices.tolist()], dtype=np.int64)

    # ------------------------------------------------------------ per DP rank (fixed shape)
    @cached_property
    def _dp_view(self) -> list[list[int]] | None:
        cp, m = self.cp, self.num_rounds
        out: list[list[int | None]] = [[None] * m for _ in range(self.dp)]
        for p in self.placements:
            d, rest = divmod(p.ranks[0], cp) if p.ranks else (0, 1)
            if rest or p.ranks != tuple(range(d * cp, (d + 1) * cp)) or out[d][p.round] is not None:
                return None
            out[d][p.round] = p.bin
        if any(b is None for bins in out for b in bins):
            return None
        return out

    @property
    def is_fixed_shape(self) -> bool:
        """True when the step is a fixed-CP plan: every micro-batch on the whole CP replica
        of one DP rank, every DP rank busy in every round (see :attr:`dp_rank_bins`)."""
        return self._dp_view is not None

    @property
    def dp_rank_bins(self) -> list[list[int]]:
        """``dp_rank_bins[d]`` = the micro-batches DP rank ``d`` trains, in training order.

        Only a step of the fixed shape (:attr:`is_fixed_shape`) has DP ranks;
        any other plan raises ``ValueError``: use :meth:`rank_program`,
        :attr:`rank_bins` or :attr:`placements`.
        """
        view = self._dp_view
        if view is None:
            raise ValueError(
                f"step {self.index} has no DP ranks: its placements are not the fixed-CP shape "
                f"(every micro-batch of degree cp={self.cp} on the CP replica of one DP rank, "
                "every DP rank busy each round), as a dynamic-CP plan (cp_mode='dynamic') is "
                "not; use step.rank_program(world_rank), step.rank_bins or step.placements")
        return [list(bins) for bins in view]

    @property
    def dp_ranks(self) -> list[list[np.ndarray]]:
        """``dp_ranks[d]`` = DP rank d's micro-batches as sample arrays (fixed shape only)."""
        return [[self.micro_batches[b] for b in bins] for bins in self.dp_rank_bins]
