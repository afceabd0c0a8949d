"""`Schedule`: the steps of a rollout batch, their invariants, tables and rank layout.

Built by :func:`varbatch_kit.core.build.build_schedule` (rollouts → steps →
ranks → micro-batches; docs/reference_semantics.md §2). Every step has the one
shape of :class:`~varbatch_kit.core.step.Step` (placements of its
micro-batches on the ``dp * cp`` pool), whatever the CP mode;
:meth:`Schedule.check` verifies the placements the same way for both and, when
the config allows only degree ``cp`` (fixed CP), that they are the fixed shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import numpy as np

from varbatch_kit.checks import int_in_range, positive_int
from varbatch_kit.core.config import ScheduleConfig
from varbatch_kit.core.flops import ModelShape
from varbatch_kit.core.placement import Placement
from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.core.step import Step
from varbatch_kit.policies.registry import get_packer

__all__ = ["RankLayout", "Schedule", "ScheduleInvariantError", "check_placements",
           "step_rollout_groups"]


class RankLayout(NamedTuple):
    """What each DP rank trains over all steps of a schedule.

    ``partitions[r]``: rank r's global sample indices, micro-batch after
    micro-batch, step after step; ``micro_batch_indices[r]``: each of its
    micro-batches as the list of its positions in ``partitions[r]``;
    ``num_microbatches[s]``: micro-batches per rank in step s (the same on
    every rank); ``global_batch_sizes[s]``: rollouts in step s (``global_batch_size``,
    fewer in a step that moved rollouts on under ``alignment_fallback="drop_rollouts"``).
    """

    partitions: list[list[int]]
    micro_batch_indices: list[list[list[int]]]
    num_microbatches: list[int]
    global_batch_sizes: list[int]


class ScheduleInvariantError(AssertionError):
    """A schedule broke one of its invariants (a bug in a packer, distribution or planner)."""


def step_rollout_groups(rollouts: Rollouts, global_batch_size: int):
    """Cut rollouts (first-appearance order) into steps of ``global_batch_size``.

    Returns ``(steps, dropped_rollout_ids, dropped_samples)`` where each step
    is ``(rollout_ids, sample_indices)``.
    """
    positive_int("global_batch_size", global_batch_size)
    ids, positions, offsets = rollouts.rollout_order_flat()
    n_roll = ids.size
    num_steps = n_roll // global_batch_size
    if num_steps < 1:
        raise ValueError(
            f"global_batch_size={global_batch_size} rollouts per step, but the batch holds only "
            f"{n_roll} rollouts: use global_batch_size <= {n_roll}"
        )
    steps = []
    for s in range(num_steps):
        lo, hi = s * global_batch_size, (s + 1) * global_batch_size
        steps.append((ids[lo:hi], positions[offsets[lo]:offsets[hi]].astype(np.int64)))
    kept = num_steps * global_batch_size
    dropped_ids = ids[kept:]
    dropped = np.sort(positions[offsets[kept]:]).astype(np.int64)
    return steps, dropped_ids, dropped


@dataclass(frozen=True, eq=False)
class Schedule:
    """Steps → DP ranks → micro-batches of global sample indices.

    Built by :func:`build_schedule`. ``dropped_samples`` are the samples of
    trailing rollouts that did not fill a step. ``deferred_rollouts[s]``:
    the rollout ids step s moved to the next step because its micro-batch
    count could not be aligned (``alignment_fallback="drop_rollouts"``;
    empty otherwise); the ones the last step moves on are also in
    ``dropped_rollout_ids``.
    """

    config: ScheduleConfig
    rollouts: Rollouts
    steps: list[Step]
    dropped_rollout_ids: np.ndarray
    dropped_samples: np.ndarray
    model: ModelShape | None = None
    sample_flops: np.ndarray | None = field(default=None, repr=False)
    deferred_rollouts: dict[int, np.ndarray] = field(default_factory=dict, repr=False)

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def num_microbatches(self) -> list[int]:
        """Micro-batches per rank for each step."""
        return [s.num_microbatches for s in self.steps]

    def __repr__(self) -> str:
        c = self.config
        return (
            f"Schedule({self.num_steps} steps, dp={c.dp}, cp={c.cp}"
            f"{', cp_mode=' + repr(c.cp_mode) if len(c.cp_degrees) > 1 else ''}, "
            f"packing={c.packing!r}, "
            f"distribution={c.distribution!r}, micro-batches/rank={self.num_microbatches}, "
            f"dropped {self.dropped_samples.size} samples)"
        )

    def step(self, i: int) -> Step:
        """Step ``i`` (0-based); ``ValueError`` naming ``i`` and the valid range otherwise."""
        i = int_in_range("step", i, 0, self.num_steps,
                         what=f"the schedule has steps 0..{self.num_steps - 1}")
        return self.steps[i]

    # ----------------------------------------------------------- per rank
    def rank_layout(self) -> RankLayout:
        """What each DP rank trains, over all steps: see :class:`RankLayout`.

        The tuple is slime's ``build_dp_schedule`` result
        (:func:`varbatch_kit.compat.slime.to_slime` gives it by slime's name).
        It needs DP ranks: a step whose placements are not the fixed-CP shape
        (a dynamic-CP plan) raises ``ValueError``
        (:attr:`~varbatch_kit.core.step.Step.dp_rank_bins`).
        """
        dp = self.config.dp
        partitions: list[list[int]] = [[] for _ in range(dp)]
        mb_indices: list[list[list[int]]] = [[] for _ in range(dp)]
        for step in self.steps:
            if not step.is_fixed_shape:
                raise ValueError(
                    "rank_layout() is slime's per-DP-rank layout, and a dynamic-CP plan has no "
                    f"DP ranks (step {step.index}): use step.rank_program(world_rank) or "
                    "step.placements")
            for r, bins in enumerate(step.dp_rank_bins):
                for b in bins:
                    members = step.micro_batches[b].tolist()
                    start = len(partitions[r])
                    partitions[r].extend(members)
                    mb_indices[r].append(list(range(start, start + len(members))))
        return RankLayout(
            partitions,
            mb_indices,
            list(self.num_microbatches),
            [s.num_rollouts for s in self.steps],
        )

    # --------------------------------------------------------------- tables
    @cached_property
    def _mb_frame(self):
        import pandas as pd

        tokens = self.rollouts.total_len
        flops = self.sample_flops
        per_gpu = self.config.max_tokens_per_gpu if self.config.cap is not None else None
        rows = {k: [] for k in ("step", "rank", "micro_batch", "bin", "samples", "tokens",
                                "flops", "over_cap")}
        for step in self.steps:
            for r, bins in enumerate(step.rank_bins):  # world rank r, in round order
                for b in bins:
                    mb = step.micro_batches[b]
                    p = step.placements[b]
                    t = int(tokens[mb].sum())
                    rows["step"].append(step.index)
                    rows["rank"].append(r)
                    rows["micro_batch"].append(p.round)
                    rows["bin"].append(b)
                    rows["samples"].append(int(mb.size))
                    rows["tokens"].append(t)
                    rows["flops"].append(float(flops[mb].sum()) if flops is not None else np.nan)
                    rows["over_cap"].append(bool(per_gpu is not None and t > per_gpu * p.degree))
        return pd.DataFrame(rows)

    def micro_batch_table(self):
        """A pandas table with one row per (step, world rank, round it is busy in).

        Columns ``step, rank`` (world rank), ``micro_batch`` (the round),
        ``bin, samples, tokens, flops, over_cap``. A micro-batch of degree
        ``c`` has ``c`` rows (under fixed CP every micro-batch has ``cp``: one
        row on each rank of its DP rank's CP replica), and ``over_cap``
        compares its tokens with ``max_tokens_per_gpu * c``.
        """
        return self._mb_frame.copy()

    def stats(self, memory=None, *, hardware_memory_gib: float | None = None):
        """A pandas table per step × world rank (see :meth:`micro_batch_table`).

        Columns: ``step, rank, samples, tokens, flops, micro_batches,
        max_mb_tokens, cap_violations`` (micro-batches over the token cap that
        hold two or more samples: packing could have avoided them) and
        ``oversize_alone`` (a single sample longer than the cap, alone in its
        micro-batch: unavoidable). Both are 0 on the static path, which has
        no cap. :mod:`varbatch_kit.analysis.quality` and the explorers count the same way.

        ``memory`` (a :class:`~varbatch_kit.core.memory.MemoryLayout`; the schedule must have a
        model shape) adds ``peak_bytes``: the rank's predicted peak memory
        (:func:`~varbatch_kit.core.memory.predict_memory`; the busiest of its tensor- and
        pipeline-parallel GPUs) and, with ``hardware_memory_gib``, ``over_memory``.
        """
        mb = self._mb_frame.assign(
            violation=lambda f: f["over_cap"] & (f["samples"] > 1),
            alone=lambda f: f["over_cap"] & (f["samples"] == 1),
        )
        g = mb.groupby(["step", "rank"], sort=True)
        out = g.agg(
            samples=("samples", "sum"),
            tokens=("tokens", "sum"),
            flops=("flops", "sum"),
            micro_batches=("micro_batch", "size"),
            max_mb_tokens=("tokens", "max"),
            cap_violations=("violation", "sum"),
            oversize_alone=("alone", "sum"),
        ).reset_index()
        if self.sample_flops is None:
            out["flops"] = np.nan
        if memory is not None:
            from varbatch_kit.core.memory import predict_memory

            if self.model is None:
                raise ValueError("stats(memory=...) needs a schedule built with a model shape")
            pred = predict_memory(self, self.model, memory)
            peak = pred.groupby(["step", "pool_rank"])["peak_bytes"].max().rename("peak_bytes")
            out = out.merge(peak, left_on=["step", "rank"], right_index=True, how="left")
            if hardware_memory_gib is not None:
                out["over_memory"] = out["peak_bytes"] > hardware_memory_gib * 2**30
        return out

    # --------------------------------------------------------------- check
    def _expected_steps(self, fail):
        """The steps' rollout groups, as :func:`step_rollout_groups`, replaying the deferrals."""
        gbs = self.config.global_batch_size
        if not self.deferred_rollouts:
            return step_rollout_groups(self.rollouts, gbs)
        ids, groups = self.rollouts.rollout_order()
        steps, p, s = [], 0, 0
        while ids.size - p >= gbs:
            moved = np.asarray(self.deferred_rollouts.get(s, ()), dtype=ids.dtype)
            size = gbs - moved.size
            if size < 1 or not np.array_equal(moved, ids[p + size:p + gbs]):
                fail(f"step {s}: deferred rollouts {moved[:5]}... are not the trailing "
                     f"rollouts of its {gbs}")
            steps.append((ids[p:p + size], np.concatenate(groups[p:p + size]).astype(np.int64)))
            p, s = p + size, s + 1
        if any(k >= s for k in self.deferred_rollouts):
            fail(f"deferred_rollouts names steps {sorted(self.deferred_rollouts)} of {s}")
        dropped = (np.sort(np.concatenate(groups[p:])).astype(np.int64) if p < ids.size
                   else np.zeros(0, dtype=np.int64))
        return steps, ids[p:], dropped

    def check(self) -> Schedule:
        """Verify every invariant; raise :class:`ScheduleInvariantError` naming the broken one.

        Every step holds its rollouts' samples, each kept sample exactly once,
        and one placement per micro-batch (:func:`check_placements`): an
        allowed degree ``c``, ``c`` distinct pool ranks, rounds ``0..R-1``
        without gaps, the groups of a round disjoint, each rank holding at
        most ``max_tokens_per_gpu`` tokens of a capped micro-batch
        (``sum(L) / c``; a single over-cap sample alone is allowed). When the
        config allows only degree ``cp`` (fixed CP) the placements must be the
        fixed shape: every DP rank's replica busy in every round, and the
        micro-batch count a multiple of ``align``.

        Returns ``self`` so calls chain.
        """
        cfg, roll = self.config, self.rollouts

        def fail(msg: str) -> None:
            raise ScheduleInvariantError(msg)

        expected, dropped_ids, dropped = self._expected_steps(fail)
        if len(expected) != self.num_steps:
            fail(f"{self.num_steps} steps, expected {len(expected)}")
        if not np.array_equal(dropped, self.dropped_samples):
            fail("dropped samples are not exactly the trailing rollouts' samples")
        seen = np.zeros(len(roll), dtype=bool)
        for s, (step, (ids, samples)) in enumerate(zip(self.steps, expected)):
            where = f"step {s}"
            if step.index != s:
                fail(f"{where}: has index {step.index}")
            if not np.array_equal(step.rollout_ids, ids):
                fail(f"{where}: holds rollouts {step.rollout_ids[:5]}..., expected {ids[:5]}...")
            if not np.array_equal(step.sample_indices, samples):
                fail(f"{where}: sample_indices are not its rollouts' samples in order")
            if any(mb.size == 0 for mb in step.micro_batches):
                fail(f"{where}: an empty micro-batch")
            flat = np.concatenate(step.micro_batches)
            if flat.size != samples.size or not np.array_equal(np.sort(flat), np.sort(samples)):
                fail(f"{where}: micro-batches do not hold each step sample exactly once")
            if seen[flat].any():
                fail(f"{where}: a sample already used by an earlier step")
            seen[flat] = True
            check_placements(step, cfg, roll.total_len, fail)
        return self


def _respects_cap(cfg: ScheduleConfig) -> bool:
    """Whether every micro-batch of two or more samples must fit ``max_tokens_per_gpu * c``:
    capped packers, and the CP planner (a config with several degrees) always."""
    if cfg.cap is None:
        return False
    return len(cfg.cp_degrees) > 1 or get_packer(cfg.packing).respects_cap


def check_placements(step: Step, cfg: ScheduleConfig, lengths: np.ndarray, fail) -> None:
    """The placement invariants of one step (see :meth:`Schedule.check`); ``fail(msg)`` raises."""
    where = f"step {step.index}"
    world, k = cfg.world_size, len(step.micro_batches)
    pl = step.placements
    if (step.dp, step.cp) != (cfg.dp, cfg.cp):
        fail(f"{where}: pool dp={step.dp}, cp={step.cp}, expected dp={cfg.dp}, cp={cfg.cp}")
    if len(pl) != k:
        fail(f"{where}: {len(pl)} placements for {k} micro-batches")
    allowed = set(cfg.cp_degrees)
    capped = _respects_cap(cfg)
    rounds = step.num_rounds
    used: dict[tuple[int, int], int] = {}
    per_rank: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    for b, p in enumerate(pl):
        if not isinstance(p, Placement) or p.bin != b:
            fail(f"{where}: placement {b} is not a Placement of bin {b}: {p!r}")
        if p.degree not in allowed:
            fail(f"{where}: micro-batch {b} has CP degree {p.degree}, allowed "
                 f"{sorted(allowed)} (cp={cfg.cp}, cp_mode={cfg.cp_mode!r}, "
                 f"cp_sizes={cfg.cp_sizes!r})")
        if len(set(p.ranks)) != p.degree or not all(0 <= r < world for r in p.ranks):
            fail(f"{where}: micro-batch {b}'s group {p.ranks} is not {p.degree} distinct "
                 f"ranks of the pool 0..{world - 1}")
        if not 0 <= p.round < rounds:
            fail(f"{where}: micro-batch {b} in round {p.round}, outside 0..{rounds - 1}")
        for r in p.ranks:
            if (p.round, r) in used:
                fail(f"{where}: rank {r} is in the groups of micro-batches {used[p.round, r]} "
                     f"and {b} in round {p.round}: groups of a round must be disjoint")
            used[p.round, r] = b
            per_rank[r].append((p.round, b))
        mb = step.micro_batches[b]
        tokens = int(lengths[mb].sum())
        if capped and mb.size > 1 and tokens > cfg.max_tokens_per_gpu * p.degree:
            fail(f"{where}: micro-batch {b} holds {mb.size} samples and {tokens} tokens > cap "
                 f"{cfg.max_tokens_per_gpu * p.degree} over its c={p.degree} ranks: "
                 f"{tokens / p.degree:.1f} > max_tokens_per_gpu {cfg.max_tokens_per_gpu} "
                 "per rank")
    if len({p.round for p in pl}) != rounds:
        fail(f"{where}: rounds are not 0..{rounds - 1} without gaps")
    if len(step.rank_bins) != world:
        fail(f"{where}: {len(step.rank_bins)} rank lists, expected dp*cp={world}")
    for r in range(world):
        expect = [b for _, b in sorted(per_rank[r])]
        if list(step.rank_bins[r]) != expect:
            fail(f"{where}: rank_bins[{r}]={list(step.rank_bins[r])} does not list its groups' "
                 f"micro-batches in round order {expect}")
    if allowed == {cfg.cp}:  # one degree: the fixed-CP shape, every replica busy every round
        if not step.is_fixed_shape:
            fail(f"{where}: placements are not the fixed-CP shape (every micro-batch on the "
                 f"CP replica d*cp..d*cp+cp-1 of one DP rank d, every DP rank busy in each of "
                 f"its {rounds} rounds)")
        if k % cfg.align:
            fail(f"{where}: {k} micro-batches, not a multiple of align={cfg.align}")
