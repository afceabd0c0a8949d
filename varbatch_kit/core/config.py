"""`ScheduleConfig`: the parallel layout and the two scheduling knobs.

``packing`` says how a step becomes micro-batches, ``distribution`` how
micro-batches go to DP ranks (see :mod:`varbatch_kit.policies.packers` and
:mod:`varbatch_kit.policies.distributions` for the registered names). slime's flags map
onto these two knobs in :mod:`varbatch_kit.compat.slime.flags`.

Which batching path is in force, ``"static"`` (``micro_batch_size`` samples
per micro-batch) or ``"dynamic"`` (micro-batches under the token cap
``max_tokens_per_gpu``), is decided in one place, :func:`decide_batching`;
:func:`batching_fields` gives the two size fields for a fresh config,
:meth:`ScheduleConfig.with_batching` switches an existing one, and
:attr:`ScheduleConfig.batching` says which path a config is on. The
front ends (``varbatch-kit schedule``/``train``, the explorers) call these
instead of deciding for themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from varbatch_kit.checks import positive_int
from varbatch_kit.core.workload import Workload, as_workload

__all__ = ["ALIGNMENT_FALLBACKS", "BATCHINGS", "CP_MODES", "CP_SIZES", "ScheduleConfig",
           "batching_fields", "decide_batching", "packing_batching"]

#: the two batching paths, the values of ``ScheduleConfig.batching``
BATCHINGS = ("static", "dynamic")

#: the values of ``ScheduleConfig.alignment_fallback``
ALIGNMENT_FALLBACKS = ("error", "drop_rollouts")

#: accepted values of ``ScheduleConfig.cp_mode`` and ``ScheduleConfig.cp_sizes``
CP_MODES = ("fixed", "dynamic")
CP_SIZES = ("pow2", "divisors")


def packing_batching(packing: str) -> str:
    """The batching path the registered packing ``packing`` runs on: ``"static"`` or ``"dynamic"``.

    An unknown name is a ``ValueError`` listing the registered ones.
    """
    from varbatch_kit.policies.registry import get_packer

    return "dynamic" if get_packer(packing).dynamic else "static"


#: how :func:`decide_batching`'s errors name the settings; a caller that spells them otherwise
#: (the CLI's flags) passes its own ``words`` (any of these keys), never rewriting the text
BATCHING_WORDS = {"micro_batch_size": "micro_batch_size",
                  "max_tokens_per_gpu": "max_tokens_per_gpu", "packing": "packing",
                  "let_packing_pick": "pass both with packing= to batching_fields"}


def decide_batching(*, micro_batch_size: int | None = None,
                    max_tokens_per_gpu: int | None = None, packing: str | None = None,
                    words: dict[str, str] | None = None) -> str:
    """Which batching path these settings ask for: ``"static"`` or ``"dynamic"``.

    The one place that decides it (``None`` = not given):

    - no ``packing``: ``micro_batch_size`` alone -> ``"static"``,
      ``max_tokens_per_gpu`` alone -> ``"dynamic"``, both or neither -> ``ValueError``;
    - a ``packing`` (a registered name): its own path (:func:`packing_batching`),
      the other path's size is ignored; its own size missing -> ``ValueError``.

    A named packing decides on its own, so a caller holding both sizes (an
    explorer's two sliders) passes both with the packing. ``words``: how the errors name
    the settings (:data:`BATCHING_WORDS`' keys; e.g. the CLI's ``--micro-batch-size``).
    """
    w = {**BATCHING_WORDS, **(words or {})}
    mbs, cap, pack = w["micro_batch_size"], w["max_tokens_per_gpu"], w["packing"]
    if packing is None:
        if (micro_batch_size is None) == (max_tokens_per_gpu is None):
            raise ValueError(
                f"set exactly one of {mbs} (static batching) and {cap} (dynamic batching); "
                f"got {mbs}={micro_batch_size!r}, {cap}={max_tokens_per_gpu!r}"
                + (f"; to let a packing pick, {w['let_packing_pick']}"
                   if micro_batch_size is not None else ""))
        return "static" if micro_batch_size is not None else "dynamic"
    batching = packing_batching(packing)
    if batching == "dynamic" and max_tokens_per_gpu is None:
        raise ValueError(
            f"{pack}={packing!r} packs under a token cap: set {cap} (dynamic batching)"
            + ("" if micro_batch_size is None else
               f" instead of {mbs}, or use {pack}='static'"))
    if batching == "static" and micro_batch_size is None:
        raise ValueError(
            f"{pack}={packing!r} needs {mbs} (static batching)"
            + ("" if max_tokens_per_gpu is None else
               f"; with {cap} use a dynamic packing such as 'first_fit'"))
    return batching


def batching_fields(*, micro_batch_size: int | None = None,
                    max_tokens_per_gpu: int | None = None, packing: str | None = None,
                    words: dict[str, str] | None = None) -> dict[str, int | None]:
    """The two size fields of a config on the path :func:`decide_batching` picks.

    ``{"micro_batch_size": ..., "max_tokens_per_gpu": ...}`` with the other
    path's field ``None``; pass it to :class:`ScheduleConfig` (``**fields``)::

        ScheduleConfig(dp=8, packing=p, **batching_fields(micro_batch_size=mbs,
                                                          max_tokens_per_gpu=cap, packing=p))

    ``words``: how the errors name the settings (see :func:`decide_batching`).
    """
    batching = decide_batching(micro_batch_size=micro_batch_size,
                               max_tokens_per_gpu=max_tokens_per_gpu, packing=packing,
                               words=words)
    if batching == "static":
        return {"micro_batch_size": micro_batch_size, "max_tokens_per_gpu": None}
    return {"micro_batch_size": None, "max_tokens_per_gpu": max_tokens_per_gpu}


@dataclass(frozen=True)
class ScheduleConfig:
    """How rollout steps are cut into micro-batches and spread over ranks.

    Parameters
    ----------
    dp, cp, vpp, mb_group:
        Data-parallel size, context-parallel size, virtual-pipeline size and
        micro-batches grouped per virtual-pipeline stage (only used when
        ``vpp > 1``: the micro-batch count per rank is then a multiple of it).
    global_batch_size:
        Rollouts per training step (not samples).
    micro_batch_size:
        Static path: samples per micro-batch. Exactly one of this and
        ``max_tokens_per_gpu`` is set (:func:`decide_batching`).
    max_tokens_per_gpu:
        Dynamic path: token cap per GPU; a micro-batch holds up to
        ``max_tokens_per_gpu * cp`` tokens (it is split over CP ranks).
    packing:
        Name of a registered packer (``static``, ``first_fit``, ``flops_kk``,
        and more; see :data:`varbatch_kit.policies.packers.PACKERS`). Defaults to
        ``static`` or ``first_fit`` from the path.
    distribution:
        Name of a registered distribution (``strided``, ``flops_kk``,
        ``balanced``, ...). Defaults to ``strided``, or to the distribution a
        packing requires: ``packing="balanced"`` places samples on ranks
        itself and needs ``distribution="balanced"`` (the default for it);
        any other distribution with it is a ``ValueError``.
    pp:
        Pipeline stages of one DP replica (non-interleaved 1F1B). It does not
        change which samples a rank trains; it is what ``microbatch_order``
        optimises for and the default ``pp`` of
        :func:`varbatch_kit.analysis.simulate.simulate`.
    microbatch_order:
        The order in which each rank trains its micro-batches of a step, a
        name of :data:`varbatch_kit.policies.order.ORDERS`: ``"arrival"``
        (default: the order the distribution gives), ``"small_ends"`` (small
        micro-batches first and last) or ``"min_bubble"`` (shortest 1F1B
        pipeline on ``pp`` stages, exact up to 8 micro-batches per rank). The
        cost of a micro-batch is its forward FLOPs when the schedule is
        built with a model shape, else its tokens; backward = 2 x forward.
    log_probs_max_tokens_per_gpu:
        Dynamic path only: the token cap per GPU of the forward-only
        log-prob pass (slime's ``--log-probs-max-tokens-per-gpu``); None =
        the training cap. See :func:`varbatch_kit.core.schedule.build_log_prob_schedule`.
    alignment_fallback:
        What :func:`~varbatch_kit.build_schedule` does with a step whose
        micro-batch count cannot be brought to a multiple of ``dp`` (times
        ``mb_group``): ``"error"`` (default) raises; ``"drop_rollouts"``
        moves the fewest trailing rollouts of that step to the next step
        (the step trains fewer rollouts; at the end of the batch they are
        dropped with the other trailing rollouts), reported in
        ``Schedule.deferred_rollouts`` and with a warning.
    cp_mode:
        ``"fixed"`` (default, today's behaviour): every micro-batch is cut
        over the same ``cp`` ranks of its DP replica. ``"dynamic"``: each
        step's ``dp * cp`` ranks form one pool and every micro-batch gets its
        own CP degree ``c`` and a group of ``c`` ranks
        (:mod:`varbatch_kit.policies.dynamic_cp`; see ``Step.placements``).
        Dynamic CP needs the token cap (``max_tokens_per_gpu``: a rank holds
        at most that many tokens of a micro-batch, ``sum(L) / c``), ``cp > 1``
        (with ``cp=1`` there is no degree to choose) and ``vpp == 1``.
        ``packing`` and ``distribution`` then give the fixed-CP plan the
        planner compares against (it keeps that plan where it is faster).
    cp_sizes:
        The CP degrees a dynamic plan may use: ``"pow2"`` (default: 1, 2, 4,
        ... up to ``cp``; ``cp`` itself is allowed even when it is not a
        power of two) or ``"divisors"`` (every divisor of ``cp``). Only read
        with ``cp_mode="dynamic"``.
    workload:
        What the FLOPs-aware packings, distributions and micro-batch orders
        balance: None (default) = the forward FLOPs of the model shape; a
        :class:`~varbatch_kit.core.workload.Workload` ``(c0, c1, c2)`` or a
        calibrated :class:`~varbatch_kit.analysis.cost_model.MicroBatchCostModel`
        (stored as its ``workload()``) = the measured micro-batch cost
        ``c0 + c1 sum L + c2 sum L^2``, so a schedule balances what the
        hardware measured. The schedule builder then needs no model shape for
        balancing (``cp_mode="dynamic"`` still does).

    The config is frozen, hashable and equal by value (``defaulted`` is not
    compared): the explorers key their caches on it.
    """

    dp: int = 1
    global_batch_size: int = 1
    micro_batch_size: int | None = None
    max_tokens_per_gpu: int | None = None
    cp: int = 1
    vpp: int = 1
    mb_group: int = 1
    packing: str | None = None
    distribution: str | None = None
    pp: int = 1
    microbatch_order: str = "arrival"
    log_probs_max_tokens_per_gpu: int | None = None
    alignment_fallback: str = "error"
    cp_mode: str = "fixed"
    cp_sizes: str = "pow2"
    workload: Workload | None = None
    #: the fields left unset (None) and filled with their default; ``with_`` re-derives them
    defaulted: frozenset[str] = field(default=frozenset(), init=False, repr=False,
                                      compare=False)

    def __post_init__(self) -> None:
        from varbatch_kit.policies.registry import get_distribution, get_packer

        for name in ("dp", "cp", "vpp", "mb_group", "global_batch_size", "pp"):
            positive_int(name, getattr(self, name), numpy=False)
        object.__setattr__(self, "workload", as_workload(self.workload))
        sizes = {"micro_batch_size": self.micro_batch_size,
                 "max_tokens_per_gpu": self.max_tokens_per_gpu}
        batching = decide_batching(**sizes)  # exactly one of the two
        if batching == "static":
            positive_int("micro_batch_size", self.micro_batch_size, numpy=False)
        else:
            positive_int("max_tokens_per_gpu", self.max_tokens_per_gpu, numpy=False)
        defaulted = {f for f in ("packing", "distribution") if getattr(self, f) is None}
        object.__setattr__(self, "defaulted", frozenset(defaulted))
        if self.packing is None:
            object.__setattr__(self, "packing", "first_fit" if self.dynamic else "static")
        spec = get_packer(self.packing)
        decide_batching(**sizes, packing=self.packing)  # the packing runs on this path
        self._check_cp_mode()
        if self.distribution is None:
            object.__setattr__(self, "distribution", spec.requires_distribution or "strided")
        get_distribution(self.distribution)
        self._check_order_and_fallback()
        if spec.requires_distribution and self.distribution != spec.requires_distribution:
            raise ValueError(
                f"packing={self.packing!r} decides which rank trains each sample, so it needs "
                f"distribution={spec.requires_distribution!r} (or leave distribution unset); got "
                f"distribution={self.distribution!r}. To keep distribution="
                f"{self.distribution!r}, pick another packing such as 'ffd' or 'first_fit'"
            )

    def _check_order_and_fallback(self) -> None:
        from varbatch_kit.policies.order import get_order

        if not isinstance(self.microbatch_order, str):
            raise ValueError(f"microbatch_order must be a name, got {self.microbatch_order!r}")
        get_order(self.microbatch_order)
        if self.alignment_fallback not in ALIGNMENT_FALLBACKS:
            raise ValueError(f"alignment_fallback must be one of {list(ALIGNMENT_FALLBACKS)}, "
                             f"got {self.alignment_fallback!r}")
        if self.log_probs_max_tokens_per_gpu is not None:
            positive_int("log_probs_max_tokens_per_gpu", self.log_probs_max_tokens_per_gpu,
                         numpy=False)
            if not self.dynamic:
                raise ValueError(
                    f"log_probs_max_tokens_per_gpu={self.log_probs_max_tokens_per_gpu} is a "
                    "token cap of dynamic batching: set max_tokens_per_gpu (and a dynamic "
                    "packing) instead of micro_batch_size, or leave log_probs_max_tokens_per_gpu "
                    "unset (the log-prob pass then reuses the training micro-batches)")

    @property
    def log_probs_cap(self) -> int | None:
        """Token cap per micro-batch of the log-prob pass (``* cp``); the training cap if unset."""
        if self.log_probs_max_tokens_per_gpu is None:
            return self.cap
        return self.log_probs_max_tokens_per_gpu * self.cp
    def _check_cp_mode(self) -> None:
        if self.cp_mode not in CP_MODES:
            raise ValueError(f"cp_mode must be one of {CP_MODES}, got {self.cp_mode!r}")
        if self.cp_sizes not in CP_SIZES:
            raise ValueError(f"cp_sizes must be one of {CP_SIZES}, got {self.cp_sizes!r}")
        if self.cp_mode == "dynamic":
            if not self.dynamic:
                raise ValueError(
                    "cp_mode='dynamic' sizes each micro-batch's CP group by the token cap: set "
                    "max_tokens_per_gpu (dynamic batching) instead of micro_batch_size")
            if self.cp < 2:
                raise ValueError(
                    f"cp_mode='dynamic' chooses a CP degree per micro-batch up to cp, but "
                    f"cp={self.cp}: use cp >= 2, or cp_mode='fixed'")
            if self.vpp > 1:
                raise ValueError(
                    f"cp_mode='dynamic' does not support virtual pipelining yet (vpp={self.vpp}):"
                    " use vpp=1, or cp_mode='fixed'")

    @property
    def cp_degrees(self) -> tuple[int, ...]:
        """The CP degrees a micro-batch may get, ascending (``(cp,)`` in fixed mode)."""
        if self.cp_mode == "fixed":
            return (self.cp,)
        if self.cp_sizes == "divisors":
            return tuple(c for c in range(1, self.cp + 1) if self.cp % c == 0)
        out, c = [], 1
        while c < self.cp:
            out.append(c)
            c *= 2
        return (*out, self.cp)

    # ------------------------------------------------------------- derived
    @property
    def batching(self) -> str:
        """The batching path in force, ``"static"`` or ``"dynamic"`` (:func:`decide_batching`)."""
        return "dynamic" if self.max_tokens_per_gpu is not None else "static"

    @property
    def dynamic(self) -> bool:
        """True on the dynamic (token-capped) path: ``batching == "dynamic"``."""
        return self.batching == "dynamic"

    @property
    def cap(self) -> int | None:
        """Token cap per micro-batch: ``max_tokens_per_gpu * cp`` (None when static)."""
        return None if self.max_tokens_per_gpu is None else self.max_tokens_per_gpu * self.cp

    @property
    def align(self) -> int:
        """The bin count of a step is a multiple of this: dp (times mb_group under VPP)."""
        return self.dp * (self.mb_group if self.vpp > 1 else 1)

    @property
    def world_size(self) -> int:
        return self.dp * self.cp

    def with_(self, **changes: Any) -> ScheduleConfig:
        """A copy with some fields changed (re-validated).

        Fields left at their default follow the change: switching between
        ``micro_batch_size`` and ``max_tokens_per_gpu`` picks the new path's
        default packing (and switching to static clears
        ``log_probs_max_tokens_per_gpu``, a dynamic-only cap), and a defaulted
        distribution follows a new packing (``with_(packing="balanced")`` gets
        ``distribution="balanced"``). Every other field is kept. To let a
        packing choose the path, use :meth:`with_batching`.
        """
        if changes.get("micro_batch_size") is not None:
            changes.setdefault("max_tokens_per_gpu", None)
            changes.setdefault("log_probs_max_tokens_per_gpu", None)
        if changes.get("max_tokens_per_gpu") is not None:
            changes.setdefault("micro_batch_size", None)
        path_change = "micro_batch_size" in changes or "max_tokens_per_gpu" in changes
        if path_change and "packing" not in changes:
            new_dynamic = changes.get("max_tokens_per_gpu", self.max_tokens_per_gpu) is not None
            if "packing" in self.defaulted or (
                    packing_batching(self.packing) == "dynamic") != new_dynamic:
                changes["packing"] = None
        if "distribution" not in changes and "distribution" in self.defaulted and (
                "packing" in changes):
            changes["distribution"] = None
        if "packing" not in changes and "packing" in self.defaulted:
            changes["packing"] = None
        return replace(self, **changes)

    def with_batching(self, *, micro_batch_size: int | None = None,
                      max_tokens_per_gpu: int | None = None, packing: str | None = None,
                      **changes: Any) -> ScheduleConfig:
        """A copy on the path :func:`decide_batching` picks; other changes as in :meth:`with_`.

        With ``packing`` the packing decides the path: its size is the one
        given here, else this config's own (``with_batching(packing="static")``
        on a dynamic config is a ``ValueError`` naming ``micro_batch_size``);
        the other path's size is cleared. Without it exactly one size may be
        given and picks the path (``micro_batch_size`` -> static, the cap ->
        dynamic), the packing follows as in :meth:`with_`; with neither only
        ``changes`` apply. Every field not named (``pp``,
        ``microbatch_order``, ``alignment_fallback``, ``cp_sizes``, ...) is
        kept; switching to static clears ``log_probs_max_tokens_per_gpu``.
        """
        if packing is not None:
            if micro_batch_size is None:
                micro_batch_size = self.micro_batch_size
            if max_tokens_per_gpu is None:
                max_tokens_per_gpu = self.max_tokens_per_gpu
            changes["packing"] = packing
        elif micro_batch_size is None and max_tokens_per_gpu is None:
            return self.with_(**changes)
        changes.update(batching_fields(micro_batch_size=micro_batch_size,
                                       max_tokens_per_gpu=max_tokens_per_gpu, packing=packing))
        return self.with_(**changes)
