"""`ParallelLayout`: the whole parallel layout of a training run, as one value object.

A run has ``world_size = dp * cp * pp * tp`` worker processes. The schedule
(:class:`~varbatch_kit.ScheduleConfig`) places micro-batches on the *pool* of
``dp * cp`` data/context-parallel ranks; tensor and pipeline parallelism
replicate that pool: every ``(tp_rank, pp_rank)`` coordinate holds one copy of
it, training the same micro-batches on its own shard (``tp``) or stage (``pp``)
of the model.

World ranks follow megatron-core's default order (``tp-cp-ep-dp-pp``, tensor
fastest). megatron-core is initialised with context-parallel size 1 (the
engine runs its own CP groups inside the pool, fixed or dynamic), so its
data-parallel group at a ``(tp, pp)`` coordinate *is* the pool::

    world_rank = tp_rank + tp * (pool_rank + dp * cp * pp_rank)
    pool_rank  = dp_rank * cp + cp_rank          (fixed CP)

:meth:`ParallelLayout.coords` and :meth:`ParallelLayout.world_rank` convert;
:meth:`ParallelLayout.check` refuses, before any worker starts, a layout the
engine cannot run (a ValueError that names it); :meth:`describe` is the text
``summary()`` and every step line give.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CP_IMPLS", "ParallelLayout", "RankCoords"]

#: how context parallelism runs (``cp > 1``): ``allgather`` (each CP rank runs the model on its
#: zigzag share, K/V all-gathered over the micro-batch's CP group) or ``emulated`` (every CP rank
#: runs the full forward and keeps only its slice of the loss: the reference)
CP_IMPLS = ("allgather", "emulated")
#: the layout's sizes and what each counts (the error of a size that is not a positive integer)
_COUNTS = {"dp": "data-parallel replicas", "cp": "context-parallel ranks",
           "pp": "pipeline stages", "vpp": "model chunks per pipeline stage",
           "tp": "tensor-parallel ranks", "mb_group": "micro-batches per virtual-stage group",
           "ep": "expert-parallel ranks"}


@dataclass(frozen=True)
class RankCoords:
    """Where one world rank sits: its pool rank (``dp_rank * cp + cp_rank`` under fixed CP),
    tensor-parallel rank and pipeline stage."""

    pool_rank: int
    tp_rank: int
    pp_rank: int


@dataclass(frozen=True)
class ParallelLayout:
    """The parallel layout of a run (see the module docstring).

    ``dp``, ``cp``, ``pp``, ``vpp``, ``mb_group`` come from the schedule, ``tp`` and
    ``cp_impl`` from the :class:`~varbatch_kit.train.config.train_config.TrainConfig`;
    ``cp_mode`` is the schedule's (``"fixed"`` or ``"dynamic"``); ``sp``: megatron's sequence
    parallelism over the ``tp`` ranks (the activations outside attention and the MLP split
    along the sequence; packed rows padded to a multiple of ``tp``). A run builds it once
    (``TrainConfig.layout``) and hands it to the model builders, the step and the log-prob
    pass: the tensor-parallel size and rank they use are this object's, never read back from
    megatron's parallel state. ``ep``: expert parallelism (a mixture of experts), carved out of
    the dp * cp pool as megatron carves it out of its data- and context-parallel ranks (no
    extra ranks): each group of ``ep`` consecutive pool ranks holds every expert once,
    ``1/ep`` of them per rank.
    """

    dp: int = 1
    cp: int = 1
    pp: int = 1
    vpp: int = 1
    tp: int = 1
    cp_impl: str = "allgather"
    cp_mode: str = "fixed"
    mb_group: int = 1
    sp: bool = False
    ep: int = 1

    def __post_init__(self) -> None:
        from varbatch_kit.checks import positive_int

        for name, what in _COUNTS.items():
            positive_int(name, getattr(self, name), note=f" ({what})", numpy=False)
        if not isinstance(self.sp, bool):
            raise ValueError(f"sp={self.sp!r}: give True or False (sequence parallelism)")
        if self.cp_impl not in CP_IMPLS:
            raise ValueError(f"cp_impl={self.cp_impl!r}: use one of {', '.join(CP_IMPLS)}")

    # ----------------------------------------------------------------- sizes
    @property
    def pool_size(self) -> int:
        """The ``dp * cp`` ranks the schedule places micro-batches on."""
        return self.dp * self.cp

    @property
    def world_size(self) -> int:
        """Worker processes: ``dp * cp * pp * tp``."""
        return self.dp * self.cp * self.pp * self.tp

    # ----------------------------------------------------------------- ranks
    def coords(self, world_rank: int) -> RankCoords:
        """The pool rank, TP rank and PP stage of ``world_rank`` (megatron-core's order)."""
        if not 0 <= int(world_rank) < self.world_size:
            raise ValueError(f"world_rank={world_rank}: give a rank in [0, {self.world_size})")
        w = int(world_rank)
        tp_rank, rest = w % self.tp, w // self.tp
        return RankCoords(pool_rank=rest % self.pool_size, tp_rank=tp_rank,
                          pp_rank=rest // self.pool_size)

    def world_rank(self, pool_rank: int, tp_rank: int = 0, pp_rank: int = 0) -> int:
        """The world rank at ``(pool_rank, tp_rank, pp_rank)``."""
        return int(tp_rank) + self.tp * (int(pool_rank) + self.pool_size * int(pp_rank))

    def ep_rank(self, world_rank: int) -> int:
        """The expert-parallel rank of ``world_rank``: its place in its group of ``ep``
        consecutive pool ranks (megatron's order, tensor-parallel size 1)."""
        return self.coords(world_rank).pool_rank % self.ep

    @property
    def last_stage_world_rank(self) -> int:
        """The world rank of pool rank 0, TP rank 0 on the last pipeline stage (its losses)."""
        return self.world_rank(0, 0, self.pp - 1)

    # ----------------------------------------------------------------- text
    def describe(self) -> str:
        """``dp2 cp2(allgather) pp1 tp1``; ``vpp``, the CP mode and ``sp`` only when they
        matter."""
        cp = f"cp{self.cp}"
        if self.cp > 1:
            cp += f"({self.cp_impl}{', dynamic' if self.cp_mode == 'dynamic' else ''})"
        pp = f"pp{self.pp}" + (f" vpp{self.vpp}" if self.vpp > 1 else "")
        return (f"dp{self.dp} {cp} {pp} tp{self.tp}" + (" sp" if self.sp else "")
                + (f" ep{self.ep}" if self.ep > 1 else ""))

    def as_dict(self) -> dict:
        """The layout's fields plus ``world_size``, for step lines and summaries."""
        return {"dp": self.dp, "cp": self.cp, "pp": self.pp, "vpp": self.vpp, "tp": self.tp,
                "sp": self.sp, "ep": self.ep, "cp_impl": self.cp_impl if self.cp > 1 else None,
                "world_size": self.world_size}

    # ----------------------------------------------------------------- what runs
    def check(self, *, engine: str = "the training engine") -> None:
        """Raise a ValueError naming the first part of this layout ``engine`` cannot run.

        Called by :class:`~varbatch_kit.train.config.train_config.TrainConfig` (so before any worker
        starts). The combinations refused here are the ones not built.
        """
        for problem in self.unsupported():
            raise ValueError(f"{problem} ({engine}: {self.describe()})")

    def unsupported(self) -> list[str]:
        """Why this layout cannot run, one line per reason (empty: it runs)."""
        out = []
        if self.vpp > 1 and self.pp == 1:
            out.append(f"vpp={self.vpp} needs pipeline parallelism: set pp > 1 or vpp=1")
        if self.pp > 1 and self.vpp > 1 and self.mb_group < self.pp:
            out.append(f"mb_group={self.mb_group} with pp={self.pp}, vpp={self.vpp}: megatron's "
                       "interleaved schedule runs micro-batches in groups of mb_group per "
                       f"virtual stage, at least pp; set mb_group >= {self.pp} (e.g. "
                       f"mb_group={self.pp})")
        if self.sp and self.tp == 1:
            out.append("sequence_parallel=True needs tp > 1 (it splits the sequence over the "
                       "tensor-parallel ranks); set tp >= 2 or sequence_parallel=False")
        if self.ep > 1 and self.pool_size % self.ep:
            out.append(f"ep={self.ep} does not divide dp*cp={self.pool_size}: expert "
                       "parallelism splits the experts over groups of ep consecutive ranks of "
                       "the data- and context-parallel pool; choose an ep that divides it")
        if self.ep > 1 and self.cp_mode == "dynamic":
            out.append(f"ep={self.ep} runs with fixed CP only (under dynamic CP the ranks of "
                       "an expert-parallel group run different micro-batch counts, and each "
                       "all-to-all needs all of them)")
        # parts being built: each line goes when its engine path lands
        return out
