"""95 % intervals over rounds, and which rankings they resolve (``benchmarks.measured``).

A measured figure (a policy's mean step time, its straggler wait) is taken
once per round; :func:`interval` gives the mean of those per-round values
and its two-sided 95 % Student-t interval. Two figures are told apart only
where their intervals do not overlap (:func:`separated`): :func:`ranking`
orders policies by their mean and joins neighbours with ``<`` where the
intervals separate and ``≈`` where they do not; :func:`order_agrees` checks
the predicted order on the resolved pairs only; :func:`gain_verdict` says
whether a measured gain reaches a share of the predicted one and is resolved.

Pure (math only), unit-tested in ``tests/unit/test_bench_intervals.py``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Interval", "gain_verdict", "interval", "order_agrees", "ranking", "separated",
           "t_975"]

#: two-sided 95 % quantiles of Student's t (0.975 one-sided), degrees of freedom 1..30
_T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
         2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
         2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423)


def t_975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (``df >= 1``).

    Tabulated up to 30; beyond, the Cornish-Fisher expansion around the normal
    quantile 1.959964 (error below 1e-4 there).
    """
    if not isinstance(df, int) or df < 1:
        raise ValueError(f"df must be an integer >= 1, got {df!r}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959963984540054
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


@dataclass(frozen=True)
class Interval:
    """A mean over ``n`` rounds and its 95 % interval ``[lo, hi]`` (NaN ends when ``n < 2``)."""

    mean: float
    lo: float
    hi: float
    n: int

    @property
    def half_width(self) -> float:
        return (self.hi - self.lo) / 2.0

    def text(self, spec: str = ".3f") -> str:
        """``"2.659 ±0.031"`` (``"2.659 ±?"`` with one round)."""
        hw = "?" if math.isnan(self.half_width) else format(self.half_width, spec)
        return f"{format(self.mean, spec)} ±{hw}"

    def as_dict(self) -> dict:
        return {"mean": self.mean, "lo": self.lo, "hi": self.hi, "n": self.n}


def interval(values: Sequence[float]) -> Interval:
    """Mean of the per-round ``values`` and its two-sided 95 % Student-t interval."""
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("interval needs at least one value (one per round)")
    if any(not math.isfinite(v) for v in xs):
        raise ValueError(f"interval needs finite values, got {xs}")
    n = len(xs)
    mean = sum(xs) / n
    if n < 2:
        return Interval(mean, math.nan, math.nan, n)
    sd = math.sqrt(sum((v - mean) ** 2 for v in xs) / (n - 1))
    hw = t_975(n - 1) * sd / math.sqrt(n)
    return Interval(mean, mean - hw, mean + hw, n)


def separated(a: Interval, b: Interval) -> bool:
    """True when the two intervals do not overlap (a NaN end never separates)."""
    if any(math.isnan(x) for x in (a.lo, a.hi, b.lo, b.hi)):
        return False
    return a.hi < b.lo or b.hi < a.lo


def ranking(items: Mapping[str, Interval]) -> tuple[str, bool]:
    """Names by ascending mean joined by ``<`` (intervals separate) or ``≈`` (they overlap),
    and whether every neighbouring pair is resolved."""
    order = sorted(items, key=lambda k: items[k].mean)
    if not order:
        return "", True
    text, resolved = order[0], True
    for a, b in zip(order, order[1:]):
        sep = separated(items[a], items[b])
        resolved &= sep
        text += f" {'<' if sep else '≈'} {b}"
    return text, resolved


def order_agrees(measured: Mapping[str, Interval], predicted: Mapping[str, float]) -> bool:
    """The predicted order holds on every pair the measured intervals resolve."""
    names = list(measured)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if separated(measured[a], measured[b]):
                faster_measured = measured[a].mean < measured[b].mean
                if faster_measured != (predicted[a] < predicted[b]):
                    return False
    return True


def gain_verdict(baseline: Interval, ours: Interval, predicted_baseline: float,
                 predicted_ours: float, *, share: float = 0.5) -> dict:
    """Does the measured gain ``baseline / ours - 1`` reach ``share`` of the predicted one,
    with ``ours`` resolved faster (its interval below the baseline's)?"""
    predicted = predicted_baseline / predicted_ours - 1.0
    measured = baseline.mean / ours.mean - 1.0
    resolved = separated(ours, baseline) and ours.mean < baseline.mean
    return {"predicted_gain": predicted, "measured_gain": measured,
            "measured_gain_lo": baseline.lo / ours.hi - 1.0 if resolved else math.nan,
            "share_of_predicted": measured / predicted if predicted > 0 else math.nan,
            "resolved": resolved,
            "ok": bool(resolved and predicted > 0 and measured >= share * predicted)}
