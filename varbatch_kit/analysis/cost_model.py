"""A measured cost model: seconds of one micro-batch from its composition.

The training time of one packed micro-batch (forward + backward) of samples
of total lengths ``L_1, ..., L_k`` is modelled as

    t = c0 + c1 * sum(L_i) + c2 * sum(L_i^2)

- ``c0``: fixed seconds per micro-batch (kernel launches, packing, the loss's
  host work);
- ``c1``: seconds per token (the projections, the MLP, the LM head: linear in
  the token count however the tokens are packed);
- ``c2``: seconds per squared token (per-sample causal attention: a sample of
  ``L`` tokens attends over ``L^2 / 2`` pairs; with per-sample packed
  attention a row costs ``sum(L_i^2)``, not ``(sum L_i)^2``).

:func:`fit_cost_model` finds the coefficients by least squares (non-negative
by default: an exact non-negative least squares over the three terms) from
measured ``(sum L, sum L^2, seconds)`` triples; :func:`fit_with_holdout`
also holds some micro-batches out and reports their R² (:class:`CostFit`).
The measurements come from a training run's step records
(``micro_batch_timing``, :func:`micro_batch_rows`, :func:`fit_from_run`) or
from a calibration sweep (:mod:`varbatch_kit.train.measure.calibration`).

:func:`varbatch_kit.analysis.simulate.simulate` takes a
:class:`MicroBatchCostModel` in place of a hardware profile. Pure: numpy only.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from varbatch_kit.checks import nonnegative_int, number_in
from varbatch_kit.core.workload import Workload

__all__ = [
    "CostFit",
    "MicroBatchCostModel",
    "fit_cost_model",
    "fit_from_run",
    "fit_with_holdout",
    "micro_batch_rows",
    "r_squared",
]

FORMAT = "varbatch_kit.cost_model/1"


@dataclass(frozen=True)
class MicroBatchCostModel:
    """``t = c0 + c1 * sum(L) + c2 * sum(L^2)`` seconds for one micro-batch (forward + backward).

    Attributes
    ----------
    c0, c1, c2:
        Seconds per micro-batch, per token, per squared token.
    r2, rmse_s, n_fit:
        Quality of the fit it came from (R² and root-mean-square error in
        seconds on the fitted micro-batches; their number).
    device, source:
        Where it was measured (e.g. ``"cpu"``, ``"cuda:NVIDIA H200"``) and
        from what (a run folder, ``"calibrate"``, ...).
    forward_share:
        The forward pass's share of ``t`` (used to split a micro-batch into
        forward and backward for the 1F1B pipeline simulation); 1/3 when the
        backward costs twice the forward.
    """

    c0: float
    c1: float
    c2: float
    r2: float = math.nan
    rmse_s: float = math.nan
    n_fit: int = 0
    device: str = ""
    source: str = ""
    forward_share: float = 1.0 / 3.0

    def __post_init__(self) -> None:
        for name in ("c0", "c1", "c2"):
            object.__setattr__(self, name, number_in(f"MicroBatchCostModel.{name}",
                                                     getattr(self, name), -math.inf))
        fs = self.forward_share
        if not (isinstance(fs, (int, float, np.floating)) and 0.0 <= float(fs) <= 1.0):
            raise ValueError(f"MicroBatchCostModel.forward_share must be in [0, 1], got {fs!r}")
        object.__setattr__(self, "forward_share", float(fs))
        object.__setattr__(self, "n_fit", nonnegative_int("MicroBatchCostModel.n_fit", self.n_fit))
        object.__setattr__(self, "r2", float(self.r2))
        object.__setattr__(self, "rmse_s", float(self.rmse_s))

    def workload(self) -> Workload:
        """The balancing workload ``(c0, c1, c2)`` of this model, for
        ``ScheduleConfig(workload=...)`` (which also takes the model itself).

        A ``ValueError`` when a coefficient is negative (a fit with
        ``nonnegative=False``) or ``c1 = c2 = 0``: no per-sample cost to balance.
        """
        return Workload(self.c0, self.c1, self.c2)

    @property
    def coefficients(self) -> np.ndarray:
        """``[c0, c1, c2]``."""
        return np.array([self.c0, self.c1, self.c2])

    def seconds(self, sum_len, sum_len_sq):
        """Predicted seconds of micro-batches with these ``sum L`` and ``sum L^2``
        (scalars give a float, arrays an array)."""
        s1 = np.asarray(sum_len, dtype=np.float64)
        s2 = np.asarray(sum_len_sq, dtype=np.float64)
        t = self.c0 + self.c1 * s1 + self.c2 * s2
        return float(t) if t.ndim == 0 else t

    def microbatch_seconds(self, lengths: Sequence[int]) -> float:
        """Predicted seconds of one micro-batch holding samples of these total lengths."""
        L = np.asarray(lengths, dtype=np.float64).ravel()
        if L.size == 0:
            raise ValueError("microbatch_seconds needs the lengths of at least one sample")
        if (L <= 0).any():
            raise ValueError(f"sample lengths must be positive, got {L[L <= 0][:5].tolist()}")
        return self.seconds(L.sum(), (L * L).sum())

    def to_dict(self) -> dict:
        """A JSON-ready dict (with a ``format`` tag)."""
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_dict(cls, d: Mapping) -> MicroBatchCostModel:
        """The inverse of :meth:`to_dict` (unknown keys are refused, missing optional ones
        take their defaults)."""
        if not isinstance(d, Mapping):
            raise ValueError(f"a cost model dict is needed, got {type(d).__name__}")
        d = dict(d)
        fmt = d.pop("format", FORMAT)
        if fmt != FORMAT:
            raise ValueError(f"cost model format {fmt!r}; this version reads {FORMAT!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown cost model keys {unknown}; allowed: {sorted(known)}")
        missing = [k for k in ("c0", "c1", "c2") if k not in d]
        if missing:
            raise ValueError(f"cost model dict lacks {missing}")
        for k in ("r2", "rmse_s"):  # JSON has no NaN in strict readers: null stands for it
            if k in d and d[k] is None:
                d[k] = math.nan
        return cls(**d)

    def save(self, path) -> Path:
        """Write the model as JSON (NaN written as ``null``); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        d = {k: (None if isinstance(v, float) and math.isnan(v) else v)
             for k, v in self.to_dict().items()}
        path.write_text(json.dumps(d, indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path) -> MicroBatchCostModel:
        """Read a model written by :meth:`save`."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"no cost model file at {str(path)!r}")
        return cls.from_dict(json.loads(path.read_text()))

    def describe(self) -> str:
        """One line: the coefficients and the fit's quality."""
        where = f", {self.device}" if self.device else ""
        return (f"t = {self.c0 * 1e3:.4g} ms + {self.c1 * 1e6:.4g} us * sum(L) + "
                f"{self.c2 * 1e9:.4g} ns * sum(L^2)  (R2 {self.r2:.4f}, rmse "
                f"{self.rmse_s * 1e3:.3g} ms, n={self.n_fit}{where})")


# ----------------------------------------------------------------------------- fitting
def r_squared(measured, predicted) -> float:
    """Coefficient of determination ``1 - SS_res / SS_tot`` (NaN for fewer than 2 points or
    constant measurements)."""
    y = np.asarray(measured, dtype=np.float64)
    p = np.asarray(predicted, dtype=np.float64)
    if y.size < 2:
        return math.nan
    ss_tot = float(((y - y.mean()) ** 2).sum())
    if ss_tot == 0.0:
        return math.nan
    return 1.0 - float(((y - p) ** 2).sum()) / ss_tot


def _arrays(sum_len, sum_len_sq, seconds):
    s1 = np.asarray(sum_len, dtype=np.float64).ravel()
    s2 = np.asarray(sum_len_sq, dtype=np.float64).ravel()
    y = np.asarray(seconds, dtype=np.float64).ravel()
    if not (s1.size == s2.size == y.size):
        raise ValueError(f"sum_len, sum_len_sq and seconds must have the same length, got "
                         f"{s1.size}, {s2.size}, {y.size}")
    for name, a in (("sum_len", s1), ("sum_len_sq", s2), ("seconds", y)):
        if not np.isfinite(a).all():
            raise ValueError(f"{name} holds non-finite values")
        if (a < 0).any():
            raise ValueError(f"{name} must be >= 0, got {a[a < 0][:3].tolist()}")
    if ((s1 > 0) & (s2 < s1)).any():
        raise ValueError("sum_len_sq < sum_len for some micro-batch: the lengths are integers "
                         ">= 1, so sum(L^2) >= sum(L); pass sum of squared lengths")
    return s1, s2, y


def _lstsq(X: np.ndarray, y: np.ndarray, nonnegative: bool) -> np.ndarray:
    """Least squares on column-scaled ``X``; non-negative by trying every active set (3 columns:
    8 sets; the best feasible one is the exact NNLS solution)."""
    scale = np.abs(X).max(axis=0)
    scale[scale == 0] = 1.0
    Xs = X / scale
    k = X.shape[1]

    def solve(cols):
        beta = np.zeros(k)
        if cols:
            sol, *_ = np.linalg.lstsq(Xs[:, cols], y, rcond=None)
            beta[list(cols)] = sol
        return beta

    full = solve(tuple(range(k)))
    if not nonnegative or (full >= 0).all():
        return full / scale
    best, best_res = None, math.inf
    for n in range(k, -1, -1):
        for cols in itertools.combinations(range(k), n):
            beta = solve(cols)
            if (beta < -1e-12 * max(1.0, float(np.abs(beta).max()))).any():
                continue  # infeasible (beyond rounding)
            beta = np.maximum(beta, 0.0)
            res = float(((Xs @ beta - y) ** 2).sum())
            if best is None or res < best_res:
                best, best_res = beta, res
    return best / scale


def fit_cost_model(sum_len, sum_len_sq, seconds, *, device: str = "", source: str = "",
                   nonnegative: bool = True, forward_share: float | None = None
                   ) -> MicroBatchCostModel:
    """Least-squares fit of ``seconds = c0 + c1 * sum_len + c2 * sum_len_sq``.

    Parameters
    ----------
    sum_len, sum_len_sq, seconds:
        One entry per measured micro-batch (at least 3, with at least 3
        distinct ``(sum_len, sum_len_sq)`` compositions so all three terms
        are identifiable: vary ``sum L^2`` at fixed ``sum L``, e.g. one long
        sample against several short ones).
    nonnegative:
        Constrain ``c0, c1, c2 >= 0`` (exact NNLS; default). A negative
        coefficient has no physical meaning and usually means noise or too
        narrow a sweep.
    forward_share:
        Stored on the model (the forward pass's share, for pipeline
        simulation); default 1/3.
    """
    s1, s2, y = _arrays(sum_len, sum_len_sq, seconds)
    if y.size < 3:
        raise ValueError(f"fit_cost_model needs at least 3 micro-batches, got {y.size}")
    X = np.column_stack([np.ones_like(s1), s1, s2])
    if np.unique(X[:, 1:], axis=0).shape[0] < 3 or np.linalg.matrix_rank(
            X / np.maximum(np.abs(X).max(axis=0), 1e-300)) < 3:
        raise ValueError("the micro-batches do not determine c0, c1 and c2: vary sum(L) and "
                         "sum(L^2) independently (at least 3 distinct compositions, not all "
                         "with sum(L^2) proportional to sum(L))")
    beta = _lstsq(X, y, nonnegative)
    pred = X @ beta
    rmse = float(np.sqrt(np.mean((pred - y) ** 2)))
    kw = {} if forward_share is None else {"forward_share": forward_share}
    return MicroBatchCostModel(float(beta[0]), float(beta[1]), float(beta[2]),
                               r2=r_squared(y, pred), rmse_s=rmse, n_fit=int(y.size),
                               device=device, source=source, **kw)


@dataclass(frozen=True, eq=False)
class CostFit:
    """A fitted model with its residuals and its quality on held-out micro-batches.

    Attributes
    ----------
    model:
        Fitted on the ``fit`` micro-batches only.
    fit_index, heldout_index:
        Positions (into the arrays given) of the fitted and held-out micro-batches.
    residuals_s:
        Measured minus predicted seconds of every micro-batch (all of them).
    predicted_s, measured_s:
        Per micro-batch.
    heldout_r2, heldout_rmse_s:
        R² and RMSE on the held-out micro-batches (NaN when none).
    """

    model: MicroBatchCostModel
    fit_index: np.ndarray
    heldout_index: np.ndarray
    measured_s: np.ndarray
    predicted_s: np.ndarray
    sum_len: np.ndarray = field(repr=False, default=None)
    sum_len_sq: np.ndarray = field(repr=False, default=None)

    @property
    def residuals_s(self) -> np.ndarray:
        return self.measured_s - self.predicted_s

    @property
    def heldout_r2(self) -> float:
        h = self.heldout_index
        return r_squared(self.measured_s[h], self.predicted_s[h]) if h.size else math.nan

    @property
    def heldout_rmse_s(self) -> float:
        h = self.heldout_index
        return float(np.sqrt(np.mean(self.residuals_s[h] ** 2))) if h.size else math.nan

    def summary(self) -> dict:
        """Coefficients, fit and held-out R² and RMSE, counts."""
        m = self.model
        return {"c0": m.c0, "c1": m.c1, "c2": m.c2, "r2_fit": m.r2, "rmse_fit_s": m.rmse_s,
                "r2_heldout": self.heldout_r2, "rmse_heldout_s": self.heldout_rmse_s,
                "n_fit": int(self.fit_index.size), "n_heldout": int(self.heldout_index.size),
                "device": m.device, "source": m.source}


def fit_with_holdout(sum_len, sum_len_sq, seconds, *, holdout: float = 0.25, seed: int = 0,
                     heldout_mask=None, device: str = "", source: str = "",
                     nonnegative: bool = True, forward_share: float | None = None) -> CostFit:
    """:func:`fit_cost_model` on a random ``1 - holdout`` share of the micro-batches, judged on
    the rest (or on ``heldout_mask``, a boolean array, when given)."""
    s1, s2, y = _arrays(sum_len, sum_len_sq, seconds)
    if heldout_mask is not None:
        mask = np.asarray(heldout_mask, dtype=bool).ravel()
        if mask.size != y.size:
            raise ValueError(f"heldout_mask has {mask.size} entries for {y.size} micro-batches")
    else:
        if not (isinstance(holdout, (int, float)) and 0.0 <= holdout < 1.0):
            raise ValueError(f"holdout must be a share in [0, 1), got {holdout!r}")
        n_out = int(round(holdout * y.size))
        mask = np.zeros(y.size, dtype=bool)
        mask[np.random.default_rng(seed).permutation(y.size)[:n_out]] = True
    fit_idx, out_idx = np.flatnonzero(~mask), np.flatnonzero(mask)
    model = fit_cost_model(s1[fit_idx], s2[fit_idx], y[fit_idx], device=device, source=source,
                           nonnegative=nonnegative, forward_share=forward_share)
    return CostFit(model, fit_idx, out_idx, y, model.seconds(s1, s2), s1, s2)


# ----------------------------------------------------------------------------- run records
ROW_KEYS = ("step", "rank", "position", "num_samples", "sum_len", "sum_len_sq", "fwd_s", "bwd_s",
            "time_s")


def micro_batch_rows(records: Iterable[Mapping]) -> list[dict]:
    """One row per (step, rank, micro-batch) from step records carrying ``micro_batch_timing``
    (the training engine's ``steps.jsonl`` lines): ``step, rank, position, num_samples,
    sum_len, sum_len_sq, fwd_s, bwd_s, time_s``. Records without timing give no rows."""
    rows = []
    for rec in records:
        timing = rec.get("micro_batch_timing")
        if not timing:
            continue
        for rank, mbs in enumerate(timing):
            for pos, mb in enumerate(mbs):
                L = np.asarray(mb["lengths"], dtype=np.int64)
                fwd, bwd = float(mb["fwd_s"]), float(mb["bwd_s"])
                rows.append({"step": int(rec.get("step", 0)), "rank": rank, "position": pos,
                             "num_samples": int(L.size), "sum_len": int(L.sum()),
                             "sum_len_sq": int((L * L).sum()), "fwd_s": fwd, "bwd_s": bwd,
                             "time_s": fwd + bwd})
    return rows


def _columns(table) -> dict[str, np.ndarray]:
    if isinstance(table, Mapping):
        return {k: np.asarray(table[k]) for k in ROW_KEYS if k in table}
    if hasattr(table, "columns"):  # a pandas DataFrame
        return {k: table[k].to_numpy() for k in ROW_KEYS if k in table.columns}
    rows = list(table)
    return {k: np.array([r[k] for r in rows]) for k in ROW_KEYS if rows and k in rows[0]}


def fit_from_run(run, *, holdout: float = 0.25, seed: int = 0, skip_first_steps: int = 1,
                 device: str | None = None, nonnegative: bool = True) -> CostFit:
    """Fit on the micro-batches a training run measured.

    ``run``: a :class:`varbatch_kit.train.Run` (its ``micro_batches``), a run
    folder or its ``steps.jsonl``, a table with the columns of
    :func:`micro_batch_rows`, or a list of several of these (pooled).
    ``skip_first_steps``: leave out the first steps of each run (warm-up:
    allocator, first-call overheads). The forward share is the measured one.
    """
    items = run if isinstance(run, (list, tuple)) else [run]
    cols: dict[str, list] = {k: [] for k in ROW_KEYS}
    sources, devices = [], []
    for item in items:
        table, src, dev = _run_table(item)
        c = _columns(table)
        if not c or "sum_len" not in c:
            raise ValueError(f"{src or type(item).__name__}: no micro-batch timing (records need "
                             "'micro_batch_timing'; train with a version that records it)")
        keep = c["step"] > skip_first_steps if "step" in c else np.ones(c["sum_len"].size, bool)
        for k in ROW_KEYS:
            if k in c:
                cols[k].append(c[k][keep])
        sources.append(src)
        devices.append(dev)
    arr = {k: np.concatenate(v) for k, v in cols.items() if v}
    if arr["sum_len"].size < 3:
        raise ValueError(f"only {arr['sum_len'].size} timed micro-batches after skipping "
                         f"{skip_first_steps} warm-up step(s); need at least 3")
    share = None
    if "fwd_s" in arr and "time_s" in arr and arr["time_s"].sum() > 0:
        share = float(np.clip(arr["fwd_s"].sum() / arr["time_s"].sum(), 0.0, 1.0))
    dev = device if device is not None else ",".join(sorted({d for d in devices if d}))
    return fit_with_holdout(arr["sum_len"], arr["sum_len_sq"], arr["time_s"], holdout=holdout,
                            seed=seed, device=dev, source=";".join(s for s in sources if s),
                            nonnegative=nonnegative, forward_share=share)


def _run_table(item):
    """(table, source, device) of one run-like item."""
    if isinstance(item, (str, Path)):
        path = Path(item)
        if path.is_dir():
            path = path / "steps.jsonl"
        if not path.is_file():
            raise ValueError(f"no steps.jsonl at {str(path)!r}")
        records = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        dev = records[0].get("device", "") if records else ""
        return micro_batch_rows(records), str(path.parent), dev
    if hasattr(item, "micro_batches"):  # a train.Run
        meta = getattr(item, "meta", {}) or {}
        return item.micro_batches, str(getattr(item, "out_dir", "")), meta.get("device", "")
    return item, "", ""
