"""Distributions: how a step's micro-batches go to data-parallel ranks.

A distributor takes per-bin weights and the DP size and returns, for each
rank, the bin positions it trains (ascending). Named in
:mod:`varbatch_kit.policies.registry`. slime's two behaviours (docs/reference_semantics.md §2.6):
``strided`` (rank r gets bins r, r+dp, ...) and ``flops_kk`` (equal-count
Karmarkar-Karp on bin FLOPs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from varbatch_kit.policies.partition import karmarkar_karp

__all__ = ["Assignment", "BinWeights", "strided", "flops_kk_distribution"]


@dataclass(frozen=True)
class BinWeights:
    """Per-bin totals of a step: tokens, and FLOPs (None without a model shape).

    With a configured workload ``flops`` holds each bin's measured cost
    instead (``c0`` plus its samples' ``c1 L + c2 L^2``).
    """

    tokens: np.ndarray
    flops: np.ndarray | None


Assignment = list[list[int]]


def strided(weights: BinWeights, dp: int) -> Assignment:
    """Rank r gets bins r, r+dp, r+2dp, ... (slime's default)."""
    k = len(weights.tokens)
    return [list(range(r, k, dp)) for r in range(dp)]


def flops_kk_distribution(weights: BinWeights, dp: int) -> Assignment:
    """Equal-count Karmarkar-Karp on bin FLOPs (slime --balance-data)."""
    return karmarkar_karp(list(np.asarray(weights.flops, dtype=np.float64)), dp, equal_size=True)
