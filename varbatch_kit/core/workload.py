"""`Workload`: what the balancing policies even out, when it is not the model's FLOPs.

By default the FLOPs-aware packings, distributions and micro-batch orders
balance the forward FLOPs of the model shape (:meth:`ModelShape.forward_flops`).
A machine's real cost weighs the quadratic (attention) term differently: a
calibrated micro-batch cost ``t = c0 + c1 * sum(L) + c2 * sum(L^2)``
(:class:`varbatch_kit.analysis.cost_model.MicroBatchCostModel`) is additive
per sample, ``c1 * L + c2 * L^2``, plus ``c0`` per micro-batch. A
:class:`Workload` holds those three coefficients; with
``ScheduleConfig(workload=...)`` the policies balance them instead:

- per sample: :meth:`Workload.sample_costs` (``c1 L + c2 L^2``) is what the
  packers and the ``balanced`` refinement weigh (``PackInput.flops``);
- per micro-batch: :meth:`Workload.bin_costs` (``c0`` plus its samples') is
  what the distributions and the micro-batch orders weigh
  (``BinWeights.flops``). Every registered distribution gives each rank the
  same number of micro-batches, so ``c0`` shifts every rank alike there.

``MicroBatchCostModel.workload()`` gives the workload of a calibrated model,
and :class:`ScheduleConfig` accepts either (:func:`as_workload`). The
coefficients are the workload's identity: two configs with the same ones are
equal and hash alike, and ``repr`` writes them at full precision (the
training checkpoint's fingerprint reads it).

Pure: numpy only; ``core`` never imports ``analysis``, so a cost model is
recognised by its ``workload()`` method, not by its class.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from varbatch_kit.checks import number_in

__all__ = ["Workload", "as_workload", "balancing_weights"]


@dataclass(frozen=True)
class Workload:
    """Per-micro-batch cost ``c0 + c1 * sum(L) + c2 * sum(L^2)`` the policies balance.

    Parameters
    ----------
    c0, c1, c2:
        Cost per micro-batch, per token and per squared token (any unit, e.g.
        seconds), finite and ``>= 0``; ``c1`` and ``c2`` not both 0 (the
        samples would all weigh nothing).
    """

    c0: float = 0.0
    c1: float = 0.0
    c2: float = 0.0

    def __post_init__(self) -> None:
        for name in ("c0", "c1", "c2"):
            object.__setattr__(self, name, number_in(
                f"workload.{name}", getattr(self, name), 0.0,
                note=" (a cost per micro-batch, per token, per squared token; a cost model "
                     "fitted with nonnegative=False can hold negative ones)"))
        if self.c1 == 0.0 and self.c2 == 0.0:
            raise ValueError(
                f"workload.c1 and workload.c2 are both 0 (c0={self.c0!r}): every sample would "
                "weigh nothing; give a per-token (c1) or per-squared-token (c2) cost > 0")

    def sample_costs(self, lengths) -> np.ndarray:
        """``c1 * L + c2 * L^2`` per sample of total length ``L`` (float64, same shape)."""
        L = np.asarray(lengths, dtype=np.float64)
        return self.c1 * L + self.c2 * (L * L)

    def bin_costs(self, sample_costs: np.ndarray, bins: Sequence[Sequence[int]]) -> np.ndarray:
        """``c0`` plus the summed ``sample_costs`` of each bin (summed in bin order)."""
        costs = np.asarray(sample_costs, dtype=np.float64).tolist()
        return np.array([self.c0 + sum(costs[i] for i in b) for b in bins], dtype=np.float64)

    def microbatch_cost(self, lengths) -> float:
        """The cost of one micro-batch holding samples of these total lengths."""
        return float(self.c0 + self.sample_costs(np.ravel(lengths)).sum())


def as_workload(value: Any, name: str = "workload") -> Workload | None:
    """``value`` as a :class:`Workload`: None, a Workload, or an object with ``workload()``.

    The last is how a ``MicroBatchCostModel`` is accepted without ``core``
    importing ``analysis``. Anything else is a ``ValueError`` naming ``name``.
    """
    if value is None or isinstance(value, Workload):
        return value
    method = getattr(value, "workload", None)
    if callable(method) and not isinstance(value, type):
        out = method()
        if isinstance(out, Workload):
            return out
    raise ValueError(
        f"{name} must be None (balance FLOPs), a varbatch_kit.core.workload.Workload(c0, c1, c2)"
        " or a calibrated varbatch_kit.analysis.cost_model.MicroBatchCostModel (e.g. "
        f"MicroBatchCostModel.load('build/bench/cost_model.json')), got {type(value).__name__}"
        f" {value!r}")


def balancing_weights(workload: Workload | None, lengths, flops) -> np.ndarray | None:
    """Per-sample weights the policies balance: the workload's costs, else ``flops`` (may be None).
    """
    if workload is None:
        return flops
    return workload.sample_costs(lengths)
