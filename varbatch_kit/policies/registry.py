"""The packings and distributions users choose by name, assembled in one place.

A *packer* turns one step's samples into micro-batches (bins); a
*distribution* gives each DP rank its bins. Both tables are built here,
explicitly, from the functions in :mod:`~varbatch_kit.policies.packers`,
:mod:`~varbatch_kit.policies.distributions` and
:mod:`~varbatch_kit.policies.balance`; nothing registers itself on import.
:func:`register_packer` / :func:`register_distribution` add a user's own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from varbatch_kit.policies import balance, distributions, packers
from varbatch_kit.policies.distributions import Assignment, BinWeights
from varbatch_kit.policies.packers import Bins, PackInput, Refiner

__all__ = [
    "DISTRIBUTIONS",
    "PACKERS",
    "DistributionSpec",
    "PackerSpec",
    "get_distribution",
    "get_packer",
    "register_distribution",
    "register_packer",
]


@dataclass(frozen=True)
class PackerSpec:
    """A named packer and what it needs.

    ``dynamic``: needs a token cap (``max_tokens_per_gpu``), not
    ``micro_batch_size``; ``needs_flops``: needs a model shape;
    ``respects_cap``: only a single over-cap sample may exceed the cap;
    ``requires_distribution``: the only distribution it works with (None:
    any); ``refine``: an optional stage run after the distribution that may
    move samples between micro-batches and ranks.
    """

    name: str
    fn: Callable[[PackInput], Bins]
    dynamic: bool
    needs_flops: bool
    respects_cap: bool
    doc: str = ""
    requires_distribution: str | None = None
    refine: Refiner | None = None


@dataclass(frozen=True)
class DistributionSpec:
    """A named distribution: ``fn(BinWeights, dp) -> bin positions per rank`` (ascending)."""

    name: str
    fn: Callable[[BinWeights, int], Assignment]
    needs_flops: bool
    doc: str = ""


def _doc(fn: Callable) -> str:
    return (fn.__doc__ or "").strip().splitlines()[0]


PACKERS: dict[str, PackerSpec] = {}
DISTRIBUTIONS: dict[str, DistributionSpec] = {}


def register_packer(spec: PackerSpec) -> PackerSpec:
    """Add (or replace) a packer under ``spec.name``; returns the spec."""
    if not isinstance(spec, PackerSpec):
        raise ValueError(f"register_packer takes a PackerSpec, got {type(spec).__name__}")
    PACKERS[spec.name] = spec
    return spec


def register_distribution(spec: DistributionSpec) -> DistributionSpec:
    """Add (or replace) a distribution under ``spec.name``; returns the spec."""
    if not isinstance(spec, DistributionSpec):
        raise ValueError(
            f"register_distribution takes a DistributionSpec, got {type(spec).__name__}")
    DISTRIBUTIONS[spec.name] = spec
    return spec


def get_packer(name: str) -> PackerSpec:
    """The packer called ``name`` (``ValueError`` listing the choices otherwise)."""
    if name not in PACKERS:
        raise ValueError(f"unknown packing {name!r}; choose one of {sorted(PACKERS)}")
    return PACKERS[name]


def get_distribution(name: str) -> DistributionSpec:
    """The distribution called ``name`` (``ValueError`` listing the choices otherwise)."""
    if name not in DISTRIBUTIONS:
        raise ValueError(f"unknown distribution {name!r}; choose one of {sorted(DISTRIBUTIONS)}")
    return DISTRIBUTIONS[name]


for _fn, _name, _dynamic, _flops, _cap in (
    (packers.static_chunks, "static", False, False, False),
    (packers.first_fit, "first_fit", True, False, True),
    (packers.first_fit_decreasing, "ffd", True, False, True),
    (packers.best_fit_decreasing, "bfd", True, False, True),
    (packers.flops_kk, "flops_kk", True, True, False),
):
    register_packer(PackerSpec(_name, _fn, _dynamic, _flops, _cap, _doc(_fn)))
register_packer(PackerSpec(
    "balanced", balance.balanced_pack, dynamic=True, needs_flops=True, respects_cap=True,
    doc="FLOPs-balanced micro-batches under the cap, no more than first-fit's, plus a local "
        "search over micro-batches and ranks",
    requires_distribution="balanced", refine=balance.refine_balanced))

for _fn, _name, _flops in (
    (distributions.strided, "strided", False),
    (distributions.flops_kk_distribution, "flops_kk", True),
    (balance.balanced_distribution, "balanced", True),
):
    register_distribution(DistributionSpec(_name, _fn, _flops, _doc(_fn)))
