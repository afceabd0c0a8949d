"""`ScheduleConfig`: the parallel layout and the two scheduling knobs.

``packing`` says how a step becomes micro-batches, ``distribution`` how
micro-batches go to DP ranks (see :mod:`varbatch_kit.policies.packers` and
:mod:`varbatch_kit.policies.distributions` for the registered names). slime's flags map
onto these two knobs in :mod:`varbatch_kit.compat.slime.flags`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

__all__ = ["CP_MODES", "CP_SIZES", "ScheduleConfig"]

#: accepted values of ``ScheduleConfig.cp_mode`` and ``ScheduleConfig.cp_sizes``
CP_MODES = ("fixed", "dynamic")
CP_SIZES = ("pow2", "divisors")


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


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
        ``max_tokens_per_gpu`` is set.
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
    cp_mode: str = "fixed"
    cp_sizes: str = "pow2"
    #: the fields left unset (None) and filled with their default; ``with_`` re-derives them
    defaulted: frozenset[str] = field(default=frozenset(), init=False, repr=False,
                                      compare=False)

    def __post_init__(self) -> None:
        from varbatch_kit.policies.registry import get_distribution, get_packer

        for name in ("dp", "cp", "vpp", "mb_group", "global_batch_size"):
            _positive_int(name, getattr(self, name))
        if (self.micro_batch_size is None) == (self.max_tokens_per_gpu is None):
            raise ValueError(
                "set exactly one of micro_batch_size (static batching) and max_tokens_per_gpu "
                f"(dynamic batching); got micro_batch_size={self.micro_batch_size!r}, "
                f"max_tokens_per_gpu={self.max_tokens_per_gpu!r}"
            )
        if self.micro_batch_size is not None:
            _positive_int("micro_batch_size", self.micro_batch_size)
        else:
            _positive_int("max_tokens_per_gpu", self.max_tokens_per_gpu)
        defaulted = {f for f in ("packing", "distribution") if getattr(self, f) is None}
        object.__setattr__(self, "defaulted", frozenset(defaulted))
        if self.packing is None:
            object.__setattr__(self, "packing", "first_fit" if self.dynamic else "static")
        spec = get_packer(self.packing)
        if spec.dynamic and not self.dynamic:
            raise ValueError(
                f"packing={self.packing!r} packs under a token cap: set max_tokens_per_gpu "
                "(dynamic batching) instead of micro_batch_size"
            )
        if not spec.dynamic and self.dynamic:
            raise ValueError(
                f"packing={self.packing!r} needs micro_batch_size (static batching); with "
                "max_tokens_per_gpu use a dynamic packing such as 'first_fit'"
            )
        self._check_cp_mode()
        if self.distribution is None:
            object.__setattr__(self, "distribution", spec.requires_distribution or "strided")
        get_distribution(self.distribution)
        if spec.requires_distribution and self.distribution != spec.requires_distribution:
            raise ValueError(
                f"packing={self.packing!r} decides which rank trains each sample, so it needs "
                f"distribution={spec.requires_distribution!r} (or leave distribution unset); got "
                f"distribution={self.distribution!r}. To keep distribution="
                f"{self.distribution!r}, pick another packing such as 'ffd' or 'first_fit'"
            )

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
    def dynamic(self) -> bool:
        """True on the dynamic (token-capped) path."""
        return self.max_tokens_per_gpu is not None

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
        default packing, and a defaulted distribution follows a new packing
        (``with_(packing="balanced")`` gets ``distribution="balanced"``).
        """
        if changes.get("micro_batch_size") is not None:
            changes.setdefault("max_tokens_per_gpu", None)
        if changes.get("max_tokens_per_gpu") is not None:
            changes.setdefault("micro_batch_size", None)
        path_change = "micro_batch_size" in changes or "max_tokens_per_gpu" in changes
        if path_change and "packing" not in changes:
            new_dynamic = changes.get("max_tokens_per_gpu", self.max_tokens_per_gpu) is not None
            if "packing" in self.defaulted or _packer_is_dynamic(self.packing) != new_dynamic:
                changes["packing"] = None
        if "distribution" not in changes and "distribution" in self.defaulted and (
                "packing" in changes):
            changes["distribution"] = None
        if "packing" not in changes and "packing" in self.defaulted:
            changes["packing"] = None
        return replace(self, **changes)


def _packer_is_dynamic(name: str) -> bool:
    from varbatch_kit.policies.registry import get_packer

    return get_packer(name).dynamic
