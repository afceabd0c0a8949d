"""`build_schedule`: rollouts → steps → DP ranks → micro-batches.

"Pack first, distribute second" (docs/reference_semantics.md §2): each step holds
exactly ``global_batch_size`` rollouts (so a variable number of samples); the
step's samples are packed into micro-batches by the configured packer, the
bin count is aligned to a multiple of ``dp`` (times ``mb_group`` under
virtual pipelining), and the micro-batches are distributed over DP ranks.
Every rank gets the same number of micro-batches per step, trained in the
configured ``microbatch_order``. With ``alignment_fallback="drop_rollouts"``
a step that cannot be aligned trains fewer rollouts and moves its trailing
ones to the next step; :func:`build_log_prob_schedule` gives the
micro-batches of the forward-only log-prob pass under its own token cap.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import NamedTuple

import numpy as np

from varbatch_kit.core.config import ScheduleConfig
from varbatch_kit.core.flops import ModelShape
from varbatch_kit.core.hardware import cp_cost_model
from varbatch_kit.core.placement import Placement, RankWork
from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.policies.distributions import BinWeights
from varbatch_kit.policies.dynamic_cp import CPCostModel, plan_dynamic_cp
from varbatch_kit.policies.order import apply_order
from varbatch_kit.policies.packers import AlignmentError, PackInput, aligned_count, split_to_target
from varbatch_kit.policies.registry import get_distribution, get_packer

__all__ = ["RankLayout", "Schedule", "ScheduleInvariantError", "Step", "build_log_prob_schedule",
           "build_schedule", "dynamic_step", "fixed_as_placements", "step_rollout_groups"]

log = logging.getLogger("varbatch_kit")


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
    """A schedule broke one of its invariants (a bug in a packer or distribution)."""


@dataclass(frozen=True, eq=False)
class Step:
    """One training step of a schedule.

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
        The step's micro-batches (global sample indices) in bin order, before
        distribution.
    rank_bins:
        Fixed CP: ``rank_bins[r]`` = positions in ``micro_batches`` that DP
        rank r trains, in training order (``dp`` lists, disjoint).
        Dynamic CP: one list per *world* rank ``w`` (``dp * cp`` lists):
        the micro-batches ``w`` takes part in, in round order, idle rounds
        left out; a micro-batch of degree ``c`` is in ``c`` lists. There is
        no DP rank in a dynamic plan: consumers that need one (the slime
        rank layout, ``dp_rank_of_sample``, the per-DP-rank quality and
        simulation tables) raise a ``ValueError`` for it or use
        :meth:`rank_program` / :attr:`placements`.
    placements:
        ``None`` for a fixed-CP step. Dynamic CP: one
        :class:`~varbatch_kit.core.placement.Placement` per micro-batch, in
        bin order (``placements[b].bin == b``): its round and CP group.
    """

    index: int
    rollout_ids: np.ndarray
    sample_indices: np.ndarray
    micro_batches: list[np.ndarray]
    rank_bins: list[list[int]]
    placements: tuple[Placement, ...] | None = None

    @property
    def is_dynamic_cp(self) -> bool:
        """True for a dynamic-CP step (it has placements)."""
        return self.placements is not None

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per rank (the same on every rank); rounds under dynamic CP."""
        if self.placements is not None:
            return self.num_rounds
        return len(self.rank_bins[0])

    @property
    def num_rounds(self) -> int:
        """Rounds of the step: every rank runs one micro-batch (or idles) per round.

        Fixed CP: the micro-batches per DP rank.
        """
        if self.placements is None:
            return len(self.rank_bins[0])
        return 1 + max(p.round for p in self.placements) if self.placements else 0

    def rank_program(self, world_rank: int, cp: int) -> list[RankWork]:
        """What world rank ``world_rank`` trains, round by round (one entry per round).

        ``cp`` is the schedule's ``config.cp``. Fixed CP: DP rank
        ``world_rank // cp``'s micro-batches in training order, each with
        ``cp_size=cp, cp_rank=world_rank % cp``. Dynamic CP: in each round the
        micro-batch whose group holds the rank (its degree and the rank's
        position in the group), or an idle entry (empty samples,
        ``cp_size=1, cp_rank=0``). Every rank's list has :attr:`num_rounds`
        entries.
        """
        if isinstance(cp, bool) or not isinstance(cp, (int, np.integer)) or cp < 1:
            raise ValueError(f"cp must be a positive integer (config.cp), got {cp!r}")
        world = len(self.rank_bins) * (1 if self.placements is not None else int(cp))
        if (isinstance(world_rank, bool) or not isinstance(world_rank, (int, np.integer))
                or not 0 <= world_rank < world):
            raise ValueError(
                f"world_rank must be an integer in [0, {world}) for this step, got {world_rank!r}")
        if self.placements is None:
            d, c = divmod(int(world_rank), int(cp))
            return [RankWork(self.micro_batches[b], int(cp), c) for b in self.rank_bins[d]]
        idle = np.zeros(0, dtype=np.int64)
        out = [RankWork(idle, 1, 0) for _ in range(self.num_rounds)]
        for b in self.rank_bins[world_rank]:
            p = self.placements[b]
            out[p.round] = RankWork(self.micro_batches[b], p.degree,
                                    p.ranks.index(int(world_rank)))
        return out

    def sample_cp_sizes(self, cp: int) -> np.ndarray:
        """The CP degree each sample of :attr:`sample_indices` is cut by (int64, same order).

        ``cp`` (the schedule's ``config.cp``) for every sample in fixed mode;
        its micro-batch's degree in dynamic mode.
        """
        if isinstance(cp, bool) or not isinstance(cp, (int, np.integer)) or cp < 1:
            raise ValueError(f"cp must be a positive integer (config.cp), got {cp!r}")
        if self.placements is None:
            return np.full(self.sample_indices.size, int(cp), dtype=np.int64)
        by_sample = {}
        for mb, p in zip(self.micro_batches, self.placements):
            for i in mb.tolist():
                by_sample[i] = p.degree
        return np.array([by_sample[i] for i in self.sample_indices.tolist()], dtype=np.int64)

    @property
    def num_rollouts(self) -> int:
        return int(self.rollout_ids.size)

    @property
    def num_samples(self) -> int:
        return int(self.sample_indices.size)

    @property
    def ranks(self) -> list[list[np.ndarray]]:
        """``ranks[r]`` = rank r's micro-batches as arrays of global sample indices."""
        return [[self.micro_batches[b] for b in bins] for bins in self.rank_bins]


def step_rollout_groups(rollouts: Rollouts, global_batch_size: int):
    """Cut rollouts (first-appearance order) into steps of ``global_batch_size``.

    Returns ``(steps, dropped_rollout_ids, dropped_samples)`` where each step
    is ``(rollout_ids, sample_indices)``.
    """
    if isinstance(global_batch_size, bool) or not isinstance(
            global_batch_size, (int, np.integer)) or global_batch_size < 1:
        raise ValueError(f"global_batch_size must be a positive integer, got {global_batch_size!r}")
    ids, groups = rollouts.rollout_order()
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
        steps.append((ids[lo:hi], np.concatenate(groups[lo:hi]).astype(np.int64)))
    kept = num_steps * global_batch_size
    dropped_ids = ids[kept:]
    dropped = (np.sort(np.concatenate(groups[kept:])).astype(np.int64) if kept < n_roll
               else np.zeros(0, dtype=np.int64))
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
            f"{', cp_mode=' + repr(c.cp_mode) if c.cp_mode != 'fixed' else ''}, "
            f"packing={c.packing!r}, "
            f"distribution={c.distribution!r}, micro-batches/rank={self.num_microbatches}, "
            f"dropped {self.dropped_samples.size} samples)"
        )

    # ----------------------------------------------------------- per rank
    def rank_layout(self) -> RankLayout:
        """What each rank trains, over all steps: see :class:`RankLayout`.

        The tuple is slime's ``build_dp_schedule`` result
        (:func:`varbatch_kit.compat.slime.to_slime` gives it by slime's name).
        """
        if self.config.cp_mode == "dynamic":
            raise ValueError(
                "rank_layout() is slime's per-DP-rank layout, and a dynamic-CP plan has no DP "
                "ranks: use step.rank_program(world_rank, cp) or step.placements")
        dp = self.config.dp
        partitions: list[list[int]] = [[] for _ in range(dp)]
        mb_indices: list[list[list[int]]] = [[] for _ in range(dp)]
        for step in self.steps:
            for r, bins in enumerate(step.rank_bins):
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
        cap = self.config.cap
        rows = {k: [] for k in ("step", "rank", "micro_batch", "bin", "samples", "tokens",
                                "flops", "over_cap")}
        for step in self.steps:
            for r, bins in enumerate(step.rank_bins):
                for j, b in enumerate(bins):
                    mb = step.micro_batches[b]
                    t = int(tokens[mb].sum())
                    if step.placements is not None:  # world rank r, round j; cap of its degree
                        j = step.placements[b].round
                        cap = self.config.max_tokens_per_gpu * step.placements[b].degree
                    rows["step"].append(step.index)
                    rows["rank"].append(r)
                    rows["micro_batch"].append(j)
                    rows["bin"].append(b)
                    rows["samples"].append(int(mb.size))
                    rows["tokens"].append(t)
                    rows["flops"].append(float(flops[mb].sum()) if flops is not None else np.nan)
                    rows["over_cap"].append(bool(cap is not None and t > cap))
        return pd.DataFrame(rows)

    def micro_batch_table(self):
        """A pandas table with one row per (step, rank, micro-batch).

        Dynamic CP: one row per (step, world rank, round it is busy in); a
        micro-batch of degree ``c`` has ``c`` rows, and ``over_cap`` compares
        its tokens with ``max_tokens_per_gpu * c``.
        """
        return self._mb_frame.copy()

    def stats(self):
        """A pandas table per step × rank.

        Columns: ``step, rank, samples, tokens, flops, micro_batches,
        max_mb_tokens, cap_violations`` (micro-batches over the token cap that
        hold two or more samples: packing could have avoided them) and
        ``oversize_alone`` (a single sample longer than the cap, alone in its
        micro-batch: unavoidable). Both are 0 on the static path, which has
        no cap. :mod:`varbatch_kit.analysis.quality` and the explorers count the same way.
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

        Every step holds its rollouts' samples, each kept sample exactly once.
        Fixed CP: the micro-batch count is a multiple of ``align``, every DP
        rank trains the same number, and capped packers respect
        ``max_tokens_per_gpu * cp``. Dynamic CP: one placement per
        micro-batch with an allowed degree ``c``; each rank holds at most
        ``max_tokens_per_gpu`` tokens of its micro-batch (``sum(L) / c``; a
        single over-cap sample alone is allowed); rounds ``0..R-1`` without
        gaps, every rank's program ``R`` rounds long; the groups of a round
        are disjoint, each of ``c`` distinct pool ranks; ``rank_bins`` lists
        each world rank's micro-batches in round order.

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
        cap = cfg.cap
        respects_cap = cfg.dynamic and get_packer(cfg.packing).respects_cap
        seen = np.zeros(len(roll), dtype=bool)
        for s, (step, (ids, samples)) in enumerate(zip(self.steps, expected)):
            where = f"step {s}"
            if not np.array_equal(step.rollout_ids, ids):
                fail(f"{where}: holds rollouts {step.rollout_ids[:5]}..., expected {ids[:5]}...")
            if not np.array_equal(step.sample_indices, samples):
                fail(f"{where}: sample_indices are not its rollouts' samples in order")
            k = len(step.micro_batches)
            if any(mb.size == 0 for mb in step.micro_batches):
                fail(f"{where}: an empty micro-batch")
            flat = np.concatenate(step.micro_batches)
            if flat.size != samples.size or not np.array_equal(np.sort(flat), np.sort(samples)):
                fail(f"{where}: micro-batches do not hold each step sample exactly once")
            if seen[flat].any():
                fail(f"{where}: a sample already used by an earlier step")
            seen[flat] = True
            if cfg.cp_mode == "dynamic":
                _check_dynamic_step(step, cfg, roll.total_len, fail)
                continue
            if step.placements is not None:
                fail(f"{where}: has CP placements but cp_mode={cfg.cp_mode!r}")
            if k % cfg.align:
                fail(f"{where}: {k} micro-batches, not a multiple of align={cfg.align}")
            if len(step.rank_bins) != cfg.dp:
                fail(f"{where}: {len(step.rank_bins)} ranks, expected dp={cfg.dp}")
            counts = {len(b) for b in step.rank_bins}
            if counts != {k // cfg.dp}:
                fail(f"{where}: micro-batches per rank {sorted(counts)}, expected {k // cfg.dp}")
            all_bins = sorted(b for bins in step.rank_bins for b in bins)
            if all_bins != list(range(k)):
                fail(f"{where}: ranks do not split the micro-batches disjointly and completely")
            if respects_cap:
                for j, mb in enumerate(step.micro_batches):
                    if mb.size > 1 and int(roll.total_len[mb].sum()) > cap:
                        fail(f"{where}: micro-batch {j} holds {mb.size} samples and "
                             f"{int(roll.total_len[mb].sum())} tokens > cap {cap}")
        if cfg.cp_mode == "dynamic":
            return self
        parts, mbi, nmb, gbs = self.rank_layout()
        for r in range(cfg.dp):
            if len(mbi[r]) != sum(nmb):
                fail(f"rank {r}: {len(mbi[r])} micro-batches, expected {sum(nmb)}")
            flat = [i for m in mbi[r] for i in m]
            if flat != list(range(len(parts[r]))):
                fail(f"rank {r}: micro_batch_indices do not enumerate its partition")
        return self


def _check_dynamic_step(step: Step, cfg: ScheduleConfig, lengths: np.ndarray, fail) -> None:
    """The invariants of a dynamic-CP step (see :meth:`Schedule.check`)."""
    where = f"step {step.index}"
    world, k = cfg.world_size, len(step.micro_batches)
    pl = step.placements
    if pl is None:
        fail(f"{where}: cp_mode='dynamic' but the step has no CP placements")
    if len(pl) != k:
        fail(f"{where}: {len(pl)} placements for {k} micro-batches")
    allowed = set(cfg.cp_degrees)
    rounds = step.num_rounds
    used: dict[tuple[int, int], int] = {}
    per_rank: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    for b, p in enumerate(pl):
        if not isinstance(p, Placement) or p.bin != b:
            fail(f"{where}: placement {b} is not a Placement of bin {b}: {p!r}")
        if p.degree not in allowed:
            fail(f"{where}: micro-batch {b} has CP degree {p.degree}, allowed "
                 f"{sorted(allowed)} (cp={cfg.cp}, cp_sizes={cfg.cp_sizes!r})")
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
        if mb.size > 1 and tokens > cfg.max_tokens_per_gpu * p.degree:
            fail(f"{where}: micro-batch {b} holds {mb.size} samples and {tokens} tokens over "
                 f"c={p.degree} ranks: {tokens / p.degree:.1f} > max_tokens_per_gpu "
                 f"{cfg.max_tokens_per_gpu} per rank")
    if len({p.round for p in pl}) != rounds:
        fail(f"{where}: rounds are not 0..{rounds - 1} without gaps")
    if len(step.rank_bins) != world:
        fail(f"{where}: {len(step.rank_bins)} rank lists, expected dp*cp={world}")
    for r in range(world):
        expect = [b for _, b in sorted(per_rank[r])]
        if list(step.rank_bins[r]) != expect:
            fail(f"{where}: rank_bins[{r}]={list(step.rank_bins[r])} does not list its groups' "
                 f"micro-batches in round order {expect}")
        if len(step.rank_program(r, cfg.cp)) != rounds:
            fail(f"{where}: rank {r} runs {len(step.rank_program(r, cfg.cp))} rounds, "
                 f"expected {rounds}")


def dynamic_step(index: int, rollout_ids: np.ndarray, sample_indices: np.ndarray,
                 micro_batches: list[np.ndarray], placements, world: int) -> Step:
    """A dynamic-CP :class:`Step` from its micro-batches and their placements.

    ``placements``: one ``(round, ranks)`` pair or :class:`Placement` per
    micro-batch, in bin order; ``rank_bins`` is derived (see :class:`Step`).
    """
    pl = tuple(p if isinstance(p, Placement) else Placement(b, int(p[0]),
                                                            tuple(int(r) for r in p[1]))
               for b, p in enumerate(placements))
    per_rank: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    for p in pl:
        for r in p.ranks:
            if not 0 <= r < world:
                raise ValueError(f"micro-batch {p.bin}: rank {r} is outside the pool "
                                 f"0..{world - 1}")
            per_rank[r].append((p.round, p.bin))
    rank_bins = [[b for _, b in sorted(x)] for x in per_rank]
    return Step(index, rollout_ids, sample_indices, micro_batches, rank_bins, pl)


def fixed_as_placements(rank_bins: list[list[int]], cp: int) -> list[tuple[int, tuple[int, ...]]]:
    """The placements of a fixed-CP plan: DP rank d's j-th micro-batch in round j on
    world ranks ``d*cp .. d*cp+cp-1``, in bin order."""
    k = sum(len(b) for b in rank_bins)
    out: list = [None] * k
    for d, bins in enumerate(rank_bins):
        for j, b in enumerate(bins):
            out[b] = (j, tuple(range(d * cp, (d + 1) * cp)))
    return out


def _plan_dynamic_step(s: int, ids: np.ndarray, samples: np.ndarray, step_len: np.ndarray,
                       bins, rank_bins: list[list[int]], config: ScheduleConfig,
                       cost: CPCostModel) -> Step:
    """The dynamic-CP plan of one step (:func:`~varbatch_kit.policies.dynamic_cp.plan_dynamic_cp`),
    compared with the fixed plan of the configured packing and distribution."""
    plan = plan_dynamic_cp(step_len, dp=config.dp, cp=config.cp,
                           cap=config.max_tokens_per_gpu, degrees=config.cp_degrees, cost=cost,
                           fixed=([list(b) for b in bins], rank_bins))
    micro_batches = [samples[np.asarray(b, dtype=np.int64)] for b in plan.bins]
    return dynamic_step(s, ids, samples, micro_batches, list(zip(plan.rounds, plan.groups)),
                        config.world_size)


def _static_alignment_error(step: int, n: int, k: int, cfg: ScheduleConfig) -> AlignmentError:
    align, m = cfg.align, cfg.micro_batch_size
    good_m = [c for c in range(1, n + 1) if math.ceil(n / c) % align == 0]
    hint = (f"micro_batch_size in {good_m[:8]}" if good_m else
            f"a step with at least {align} samples")
    return AlignmentError(
        f"static path: num_mbs ({k}) is not a multiple of dp_size * mb_group ({align}); "
        f"step {step}: {n} samples in micro-batches of micro_batch_size={m} give {k} "
        f"micro-batches, not a multiple of dp*mb_group={align} (static batching cannot split "
        f"micro-batches). Use {hint} for this step, or a global_batch_size whose steps hold a "
        f"multiple of micro_batch_size*dp*mb_group={m * align} samples (for one-sample "
        f"rollouts: global_batch_size={m * align}, {2 * m * align}, ...)"
    )


def build_schedule(
    rollouts: Rollouts,
    config: ScheduleConfig,
    model: ModelShape | None = None,
    *,
    progress: bool = False,
    cp_cost: CPCostModel | None = None,
) -> Schedule:
    """Turn a rollout batch into training steps → DP ranks → micro-batches.

    Parameters
    ----------
    rollouts:
        The batch (samples with their rollout ids).
    config:
        Layout and policy; see :class:`ScheduleConfig`.
    model:
        Model shape for FLOPs weights; required by FLOPs-based packings and
        distributions, optional otherwise (then ``stats()`` has no FLOPs).
    progress:
        Show a tqdm progress bar over steps.
    cp_cost:
        ``cp_mode="dynamic"`` only: the cost model the plans minimise the
        step's makespan under; defaults to
        :func:`~varbatch_kit.core.hardware.cp_cost_model` of ``model`` (the
        simulator's defaults: the H100 profile). Pass
        ``cp_cost_model(model, hardware, efficiency, ...)`` to plan for other
        simulator settings.

    Raises
    ------
    ValueError
        For impossible layouts (too few rollouts, a step with fewer samples
        than dp, a bin count that cannot be aligned), naming the step and
        what would work. The alignment ones are
        :class:`~varbatch_kit.policies.packers.AlignmentError` (a
        ``ValueError``); ``config.alignment_fallback="drop_rollouts"`` turns
        them into deferred rollouts where a shorter step aligns.
    """
    if not isinstance(rollouts, Rollouts):
        raise ValueError(f"rollouts must be a varbatch_kit.Rollouts, got {type(rollouts).__name__}")
    if not isinstance(config, ScheduleConfig):
        raise ValueError(f"config must be a ScheduleConfig, got {type(config).__name__}")
    packer = get_packer(config.packing)
    distribution = get_distribution(config.distribution)
    if model is None and (packer.needs_flops or distribution.needs_flops):
        need = config.packing if packer.needs_flops else config.distribution
        raise ValueError(
            f"{need!r} balances FLOPs and needs a model shape: pass "
            "model=ModelShape.preset('qwen3-8b') (or another preset / from_hf_config)"
        )
    if model is not None and not isinstance(model, ModelShape):
        raise ValueError(f"model must be a ModelShape or None, got {type(model).__name__}")
    if model is None and config.cp_mode == "dynamic":
        raise ValueError(
            "cp_mode='dynamic' plans CP degrees with a cost model of the model's linear and "
            "attention FLOPs and needs a model shape: pass model=ModelShape.preset('qwen3-8b') "
            "(or another preset / from_hf_config)")
    if config.cp_mode == "dynamic":
        if cp_cost is None:
            cp_cost = cp_cost_model(model)
        elif not isinstance(cp_cost, CPCostModel):
            raise ValueError(f"cp_cost must be a CPCostModel or None, got {type(cp_cost).__name__}")
    if config.alignment_fallback == "drop_rollouts":
        return _build_deferring(rollouts, config, model, progress=progress, cp_cost=cp_cost)
    groups, dropped_ids, dropped = step_rollout_groups(rollouts, config.global_batch_size)
    if dropped.size:
        log.warning(
            "dropping %d trailing rollouts (%d samples) that do not fill a step of "
            "global_batch_size=%d", dropped_ids.size, dropped.size, config.global_batch_size)
    lengths = rollouts.total_len
    flops = model.forward_flops(lengths) if model is not None else None
    dp, align = config.dp, config.align

    steps: list[Step] = []
    iterator = groups
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(groups, desc="scheduling steps", unit="step")
    for s, (ids, samples) in enumerate(iterator):
        n = samples.size
        if n < dp:
            raise AlignmentError(
                f"step {s}: {n} samples < dp_size {dp}; step {s} holds {n} samples but dp={dp}: "
                f"every rank needs at least one sample. Use dp <= {n} or a larger "
                "global_batch_size"
            )
        step_len = lengths[samples]
        inp = PackInput(
            lengths=step_len,
            flops=None if flops is None else flops[samples],
            cap=config.cap,
            micro_batch_size=config.micro_batch_size,
            align=align,
        )
        bins = packer.fn(inp)
        k = len(bins)
        target = max(math.ceil(k / align) * align, align)
        if config.dynamic:
            if target > n:
                raise AlignmentError(
                    f"dynamic path: could only produce {n} mbs after maximal splitting; need "
                    f"{target}. step {s} holds {n} samples but the layout needs {target} "
                    "micro-batches "
                    f"(a multiple of dp*mb_group={align}, at least one sample each); slime stalls "
                    "here (its issue #2065). Use a smaller dp or mb_group, or a larger "
                    "global_batch_size"
                )
            bins = split_to_target(bins, step_len, target, step=s)
        elif k != target:
            raise _static_alignment_error(s, n, k, config)
        step_flops = None if flops is None else flops[samples].tolist()
        weights = BinWeights(
            tokens=np.array([int(step_len[b].sum()) for b in bins], dtype=np.int64),
            # summed in bin order, as slime does, so ties break identically
            flops=None if step_flops is None else np.array(
                [sum(step_flops[i] for i in b) for b in bins], dtype=np.float64),
        )
        rank_bins = distribution.fn(weights, dp)
        if packer.refine is not None:  # e.g. 'balanced': moves samples between ranks
            bins, rank_bins = packer.refine(inp, bins, [list(b) for b in rank_bins])
        micro_batches = [samples[np.asarray(b, dtype=np.int64)] for b in bins]
        rank_bins = _order_rank_bins(config, rank_bins, micro_batches, lengths, flops)
        if config.cp_mode == "dynamic":
            steps.append(_plan_dynamic_step(s, ids, samples, step_len, bins,
                                            [list(b) for b in rank_bins], config, cp_cost))
            continue
        steps.append(Step(s, ids, samples, micro_batches, [list(b) for b in rank_bins]))
    return Schedule(config, rollouts, steps, dropped_ids, dropped, model, flops)


# ------------------------------------------------------------------ micro-batch order
def _order_rank_bins(config: ScheduleConfig, rank_bins, micro_batches, lengths, flops):
    """Each rank's bins in ``config.microbatch_order`` (cost: FLOPs, else tokens; bwd = 2 fwd)."""
    if config.microbatch_order == "arrival":
        return rank_bins
    weights = lengths if flops is None else flops
    cost = np.array([float(weights[mb].sum()) for mb in micro_batches], dtype=np.float64)
    out = []
    for bins in rank_bins:
        bins = list(bins)
        c = cost[bins]
        perm = apply_order(config.microbatch_order, c, 2.0 * c, config.pp)
        out.append([bins[i] for i in perm])
    return out


# ------------------------------------------------------------------ alignment fallback
def _build_deferring(rollouts: Rollouts, config: ScheduleConfig, model: ModelShape | None, *,
                     progress: bool = False, cp_cost: CPCostModel | None = None) -> Schedule:
    """``alignment_fallback="drop_rollouts"``: steps that cannot be aligned move rollouts on.

    The rollouts (first-appearance order) are consumed as a stream: each
    step takes the next ``global_batch_size`` of them; when they cannot be
    split into a multiple of ``dp`` (times ``mb_group``) micro-batches, the
    step keeps the longest prefix that can (it drops the fewest trailing
    rollouts) and the dropped ones head the next step. When fewer than
    ``global_batch_size`` rollouts remain, they are dropped, as always. A
    step no prefix of which aligns raises the error of its full set.
    """
    ids, groups = rollouts.rollout_order()
    gbs = config.global_batch_size
    if ids.size < gbs:
        step_rollout_groups(rollouts, gbs)  # raises the usual message
    strict = replace(config, alignment_fallback="error")
    flops = model.forward_flops(rollouts.total_len) if model is not None else None
    steps: list[Step] = []
    deferred: dict[int, np.ndarray] = {}
    p = 0
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(desc="scheduling steps", unit="step")
    while ids.size - p >= gbs:
        s = len(steps)
        first_error = None
        for size in range(gbs, 0, -1):
            samples = np.concatenate(groups[p:p + size]).astype(np.int64)
            try:
                one = build_schedule(rollouts.subset(samples),
                                     replace(strict, global_batch_size=size), model,
                                     cp_cost=cp_cost)
            except AlignmentError as err:  # the one-step build calls its step "step 0"
                first_error = first_error or AlignmentError(str(err).replace("step 0", f"step {s}"))
                continue
            st = one.steps[0]
            steps.append(replace(st, index=s, rollout_ids=ids[p:p + size], sample_indices=samples,
                                 micro_batches=[samples[mb] for mb in st.micro_batches]))
            if size < gbs:
                deferred[s] = ids[p + size:p + gbs]
                log.warning(
                    "alignment_fallback='drop_rollouts': step %d trains %d of %d rollouts; "
                    "rollouts %s move to the next step (%s)", s, size, gbs,
                    ids[p + size:p + gbs].tolist(), str(first_error).split(";")[0])
            p += size
            break
        else:
            raise AlignmentError(
                f"{first_error} (alignment_fallback='drop_rollouts' cannot help: no prefix of "
                f"step {s}'s {gbs} rollouts can be aligned either)") from first_error
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    dropped_ids = ids[p:]
    dropped = (np.sort(np.concatenate(groups[p:])).astype(np.int64) if p < ids.size
               else np.zeros(0, dtype=np.int64))
    if dropped.size:
        log.warning(
            "dropping %d trailing rollouts (%d samples) that do not fill a step of "
            "global_batch_size=%d", dropped_ids.size, dropped.size, gbs)
    return Schedule(config, rollouts, steps, dropped_ids, dropped, model, flops,
                    deferred_rollouts=deferred)


# ------------------------------------------------------------------ log-prob pass
def build_log_prob_schedule(
    rollouts: Rollouts,
    config: ScheduleConfig,
    model: ModelShape | None = None,
    *,
    schedule: Schedule | None = None,
) -> Schedule:
    """The micro-batches of the forward-only log-prob pass, under its own token cap.

    slime's ``--log-probs-max-tokens-per-gpu`` (its issue #1964): the pass
    that recomputes log-probs before training keeps no activations for a
    backward, so it can pack more tokens per micro-batch than training.

    Every sample's log-prob is computed on the DP rank that trains it (the
    rank holds the data; nothing moves between ranks): per step and rank,
    the rank's samples of the training schedule are packed again with the
    configured packer under ``log_probs_max_tokens_per_gpu * cp`` tokens,
    and every rank gets the same number of micro-batches (the largest
    count, rounded up to ``mb_group`` under virtual pipelining; the others
    split their largest micro-batches, as the training path does), then
    put in ``microbatch_order``. The steps (and any rollouts dropped or
    deferred) are the training schedule's.

    With ``log_probs_max_tokens_per_gpu`` unset or equal to the training
    cap this returns the training schedule itself (slime reuses the
    training micro-batches). Otherwise the result is a :class:`Schedule`
    whose ``config`` has ``max_tokens_per_gpu`` = the log-prob cap, so
    ``check()`` verifies that cap.

    Parameters
    ----------
    rollouts, config, model:
        As for :func:`build_schedule`.
    schedule:
        The training schedule, if already built from the same arguments.

    Raises
    ------
    ValueError
        When a rank holds fewer samples than the micro-batch count another
        rank needs under the log-prob cap (raise the cap), and as
        :func:`build_schedule`.
    """
    if schedule is None:
        schedule = build_schedule(rollouts, config, model)
    elif not isinstance(schedule, Schedule) or schedule.config != config or (
            schedule.rollouts is not rollouts):
        raise ValueError("schedule must be the training schedule of these rollouts and config "
                         "(build_schedule(rollouts, config, model))")
    if not config.dynamic or config.log_probs_cap == config.cap:
        return schedule
    lp_config = replace(config, max_tokens_per_gpu=config.log_probs_max_tokens_per_gpu,
                        log_probs_max_tokens_per_gpu=None)
    packer = get_packer(config.packing)
    cap = lp_config.cap
    lengths = rollouts.total_len
    flops = schedule.sample_flops
    per_rank_align = config.mb_group if config.vpp > 1 else 1
    steps: list[Step] = []
    for step in schedule.steps:
        rank_samples = [np.concatenate(mbs) for mbs in step.ranks]
        packed = []
        for samples in rank_samples:
            inp = PackInput(lengths=lengths[samples],
                            flops=None if flops is None else flops[samples],
                            cap=cap, align=per_rank_align)
            packed.append(packer.fn(inp))
        target = aligned_count(max(len(b) for b in packed), per_rank_align)
        micro_batches: list[np.ndarray] = []
        rank_bins: list[list[int]] = []
        for r, (samples, bins) in enumerate(zip(rank_samples, packed)):
            if samples.size < target:
                raise ValueError(
                    f"log-prob pass: step {step.index}: rank {r} holds {samples.size} samples "
                    f"but every rank needs {target} micro-batches (the most any rank packs under "
                    f"log_probs_max_tokens_per_gpu={config.log_probs_max_tokens_per_gpu}); use "
                    f"a larger log_probs_max_tokens_per_gpu (e.g. >= max_tokens_per_gpu="
                    f"{config.max_tokens_per_gpu})")
            bins = split_to_target(bins, lengths[samples], target, step=step.index)
            rank_bins.append(list(range(len(micro_batches), len(micro_batches) + target)))
            micro_batches += [samples[np.asarray(b, dtype=np.int64)] for b in bins]
        rank_bins = _order_rank_bins(lp_config, rank_bins, micro_batches, lengths, flops)
        steps.append(replace(step, micro_batches=micro_batches, rank_bins=rank_bins))
    return Schedule(lp_config, rollouts, steps, schedule.dropped_rollout_ids,
                    schedule.dropped_samples, schedule.model, flops,
                    deferred_rollouts=schedule.deferred_rollouts)
