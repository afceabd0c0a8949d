"""Distributions: how a step's micro-batches go to data-parallel ranks.

A distributor takes per-bin weights and the DP size and returns, for each
rank, the bin positions it trains (ascending). Registered by name in
:data:`DISTRIBUTIONS`. slime's two behaviours (SLIME_SEMANTICS §2.6):
``strided`` (rank r gets bins r, r+dp, ...) and ``flops_kk`` (equal-count
Karmarkar-Karp on bin FLOPs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from varbatch_kit.partition import karmarkar_karp

__all__ = ["BinWeights", "DistributionSpec", "DISTRIBUTIONS", "register_distribution",
           "get_distribution", "strided", "flops_kk_distribution"]


@dataclass(frozen=True)
class BinWeights:
    """Per-bin totals of a step: tokens, and FLOPs (None without a model shape)."""

    tokens: np.ndarray
    flops: np.ndarray | None


Assignment = list[list[int]]


@dataclass(frozen=True)
class DistributionSpec:
    name: str
    fn: Callable[[BinWeights, int], Assignment]
    needs_flops: bool
    doc: str = ""


DISTRIBUTIONS: dict[str, DistributionSpec] = {}


def register_distribution(name: str, *, needs_flops: bool, doc: str = ""):
    """Decorator registering ``fn(BinWeights, dp) -> bin ids per rank`` under ``name``."""

    def wrap(fn):
        DISTRIBUTIONS[name] = DistributionSpec(
            name, fn, needs_flops, doc or (fn.__doc__ or "").strip().splitlines()[0])
        return fn

    return wrap


def get_distribution(name: str) -> DistributionSpec:
    if name not in DISTRIBUTIONS:
        raise ValueError(f"unknown distribution {name!r}; choose one of {sorted(DISTRIBUTIONS)}")
    return DISTRIBUTIONS[name]


@register_distribution("strided", needs_flops=False)
def strided(weights: BinWeights, dp: int) -> Assignment:
    """Rank r gets bins r, r+dp, r+2dp, ... (slime's default)."""
    k = len(weights.tokens)
    return [list(range(r, k, dp)) for r in range(dp)]


@register_distribution("flops_kk", needs_flops=True)
def flops_kk_distribution(weights: BinWeights, dp: int) -> Assignment:
    """Equal-count Karmarkar-Karp on bin FLOPs (slime --balance-data)."""
    return karmarkar_karp(list(np.asarray(weights.flops, dtype=np.float64)), dp, equal_size=True)
