"""Schedule quality: how far a schedule is from what its inputs allow.

Per step (:func:`step_quality`) and overall (:func:`summary`, :func:`compare`):

- micro-batches against the lower bound ``ceil(tokens / cap)``;
- cap violations: micro-batches over the token cap that hold two or more
  samples (an out-of-memory risk a scheduler can avoid); a single sample
  longer than the cap, alone in its micro-batch, is unavoidable and counted
  apart (``oversize_alone``);
- DP imbalance: busiest rank / mean rank, in tokens and in FLOPs;
- makespan against its lower bounds: the busiest rank's FLOPs against
  ``max(step FLOPs / dp, largest sample's FLOPs)`` (no schedule can beat it)
  and against ``max(step FLOPs / dp, largest micro-batch's FLOPs)`` (no
  distribution of these micro-batches can beat it);
- padding waste: the share of tokens that would be padding if each
  micro-batch were padded to its longest sample, as static batching does
  (packed dynamic micro-batches pay none of it; the figure says what packing
  saves).

Everything is computed with vectorised numpy per step, so it stays cheap for
hundreds of thousands of samples.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from varbatch_kit.core.schedule import Schedule

__all__ = ["CAP_VIOLATIONS", "OVER_CAP_HELP", "OVERSIZE_ALONE", "bin_efficiency", "compare",
           "load_cv", "load_imbalance", "load_spread", "micro_batch_arrays", "peer_quality",
           "peer_step_quality", "plan_quality", "slot_imbalance", "step_quality", "summary"]

#: The two kinds of micro-batch over the token cap, named the same way in every table,
#: figure, legend and help text: a micro-batch of two or more samples over the cap is a
#: *cap violation* (column ``cap_violations``: a packing could have avoided it); a single
#: sample longer than the cap, alone in its micro-batch, is *oversize (alone)* (column
#: ``oversize_alone``: no packing can avoid it).
CAP_VIOLATIONS = "cap violations"
OVERSIZE_ALONE = "oversize (alone)"
#: the help texts of the two columns (the tables' legends use them)
OVER_CAP_HELP = {
    "cap_violations": f"{CAP_VIOLATIONS}: micro-batches of two or more samples over the token "
                      "cap, which a packing could avoid (count; a single sample longer than "
                      f"the cap is {OVERSIZE_ALONE}, not this)",
    "oversize_alone": f"{OVERSIZE_ALONE}: single samples longer than the token cap, each alone "
                      "in its micro-batch, which no packing can avoid (count; raise the cap to "
                      "fit them)",
}


def micro_batch_arrays(schedule: Schedule, step) -> dict[str, np.ndarray]:
    """Per micro-batch of one step, in bin order: ``tokens, flops, samples, max_len, rank, pos``.

    ``rank`` is the DP rank that trains it and ``pos`` its position in that
    rank's sequence; ``flops`` is NaN without a model shape.
    """
    if not step.is_fixed_shape:
        raise ValueError(
            "micro_batch_arrays() gives each micro-batch one DP rank, and a dynamic-CP plan "
            "(cp_mode='dynamic') has none: use step.placements (round and CP group per "
            "micro-batch) or step.rank_program(world_rank)")
    lengths = schedule.rollouts.total_len
    mbs = step.micro_batches
    k = len(mbs)
    sizes = np.fromiter((mb.size for mb in mbs), dtype=np.int64, count=k)
    flat = np.concatenate(mbs) if k else np.zeros(0, dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    lens = lengths[flat]
    tokens = np.add.reduceat(lens, starts) if k else np.zeros(0, dtype=np.int64)
    max_len = np.maximum.reduceat(lens, starts) if k else np.zeros(0, dtype=np.int64)
    if schedule.sample_flops is not None and k:
        flops = np.add.reduceat(schedule.sample_flops[flat], starts)
    else:
        flops = np.full(k, np.nan)
    rank = np.empty(k, dtype=np.int64)
    pos = np.empty(k, dtype=np.int64)
    for r, bins in enumerate(step.dp_rank_bins):
        rank[bins] = r
        pos[bins] = np.arange(len(bins))
    return {"tokens": tokens, "flops": flops, "samples": sizes, "max_len": max_len,
            "rank": rank, "pos": pos}


def step_quality(schedule: Schedule, *, cap: int | None = None):
    """A pandas table with one row per step.

    Parameters
    ----------
    schedule:
        Any schedule.
    cap:
        Token cap to judge micro-batches against; defaults to the schedule's
        (``max_tokens_per_gpu * cp``). Pass one to see how a static schedule
        would fare against a token budget.

    Columns: ``step, rollouts, samples, tokens, micro_batches`` (total over
    ranks), ``micro_batches_per_rank``, ``mb_lower_bound`` (``ceil(tokens/cap)``,
    NaN without a cap), ``mb_over_bound`` (ratio), ``cap_violations``
    (over-cap micro-batches of two or more samples), ``oversize_alone``
    (single over-cap samples), ``max_mb_tokens``, ``token_imbalance``,
    ``flops_imbalance`` (max rank / mean rank), ``max_rank_flops``,
    ``flops_lower_bound`` (``max(step FLOPs / dp, largest sample)``),
    ``makespan_ratio`` (max rank FLOPs / that bound), ``mb_makespan_bound``
    (``max(step FLOPs / dp, largest micro-batch)``), ``mb_makespan_ratio``,
    ``padded_tokens`` (each micro-batch padded to its longest sample) and
    ``padding_waste`` (``1 - tokens / padded_tokens``).
    """
    import pandas as pd

    cap = schedule.config.cap if cap is None else int(cap)
    dp = schedule.config.dp
    sample_flops = schedule.sample_flops
    rows = []
    for step in schedule.steps:
        a = micro_batch_arrays(schedule, step)
        tokens = int(a["tokens"].sum())
        over = a["tokens"] > cap if cap else np.zeros(a["tokens"].size, dtype=bool)
        rank_tokens = np.bincount(a["rank"], weights=a["tokens"], minlength=dp)
        padded = int((a["samples"] * a["max_len"]).sum())
        lb = math.ceil(tokens / cap) if cap else np.nan
        k = int(a["tokens"].size)
        row = {
            "step": step.index,
            "rollouts": step.num_rollouts,
            "samples": step.num_samples,
            "tokens": tokens,
            "micro_batches": k,
            "micro_batches_per_rank": k // dp,
            "mb_lower_bound": lb,
            "mb_over_bound": k / lb if cap else np.nan,
            "cap_violations": int((over & (a["samples"] > 1)).sum()),
            "oversize_alone": int((over & (a["samples"] == 1)).sum()),
            "max_mb_tokens": int(a["tokens"].max()),
            "token_imbalance": float(rank_tokens.max() / rank_tokens.mean()),
        }
        if sample_flops is not None:
            rank_flops = np.bincount(a["rank"], weights=a["flops"], minlength=dp)
            total = float(rank_flops.sum())
            bound = max(total / dp, float(sample_flops[step.sample_indices].max()))
            mb_bound = max(total / dp, float(a["flops"].max()))
            top = float(rank_flops.max())
            row.update(
                flops_imbalance=top / float(rank_flops.mean()),
                max_rank_flops=top,
                flops_lower_bound=bound,
                makespan_ratio=top / bound,
                mb_makespan_bound=mb_bound,
                mb_makespan_ratio=top / mb_bound,
            )
        else:
            row.update(flops_imbalance=np.nan, max_rank_flops=np.nan, flops_lower_bound=np.nan,
                       makespan_ratio=np.nan, mb_makespan_bound=np.nan, mb_makespan_ratio=np.nan)
        row.update(padded_tokens=padded, padding_waste=1.0 - tokens / padded)
        rows.append(row)
    return pd.DataFrame(rows)


def summary(schedule: Schedule, *, cap: int | None = None) -> dict:
    """Figures over all steps (what the explorers and the benchmark print).

    Keys: ``steps, micro_batches, mb_lower_bound`` (None without a cap),
    ``mb_over_bound, cap_violations, oversize_alone, max_flops_imbalance,
    mean_flops_imbalance, max_token_imbalance, mean_makespan_ratio,
    max_makespan_ratio, mean_mb_makespan_ratio, padding_waste``.
    """
    q = step_quality(schedule, cap=cap)
    has_cap = bool(q["mb_lower_bound"].notna().all())
    lb = int(q["mb_lower_bound"].sum()) if has_cap else None
    return {
        "steps": len(q),
        "micro_batches": int(q["micro_batches"].sum()),
        "mb_lower_bound": lb,
        "mb_over_bound": float(q["micro_batches"].sum() / lb) if lb else float("nan"),
        "cap_violations": int(q["cap_violations"].sum()),
        "oversize_alone": int(q["oversize_alone"].sum()),
        "max_flops_imbalance": float(q["flops_imbalance"].max()),
        "mean_flops_imbalance": float(q["flops_imbalance"].mean()),
        "max_token_imbalance": float(q["token_imbalance"].max()),
        "mean_makespan_ratio": float(q["makespan_ratio"].mean()),
        "max_makespan_ratio": float(q["makespan_ratio"].max()),
        "mean_mb_makespan_ratio": float(q["mb_makespan_ratio"].mean()),
        "padding_waste": float(1.0 - q["tokens"].sum() / q["padded_tokens"].sum()),
    }


def compare(schedules: Mapping[str, Schedule], *, cap: int | None = None):
    """One :func:`summary` row per named schedule (a pandas table indexed by name)."""
    import pandas as pd

    if not schedules:
        raise ValueError("compare() needs at least one schedule, got an empty mapping")
    rows = {name: summary(s, cap=cap) for name, s in schedules.items()}
    return pd.DataFrame.from_dict(rows, orient="index")


# ---------------------------------------------------------------------------------------------
# The quality figures other frameworks log (issue 14 item 4), next to ours. Same functions for
# a Schedule (per step) and for a peer's plan (plain arrays).
#
# - bin efficiency (NeMo-RL): ``ceil(tokens / cap) / micro-batches used``, 1.0 at the bound;
# - per-rank load spread ``max - min`` (AReaL's "spread"), imbalance ``max / mean`` (AReaL logs
#   it as ``max_load_ratio``; its own ``imbalance_ratio`` is ``spread / mean``) and the
#   coefficient of variation ``std / mean`` (population std, as AReaL computes it);
# - per-slot cost imbalance (torchtitan-style): the j-th micro-batch of every rank runs in the
#   same time slot (ranks wait for each other at every gradient all-reduce with pipeline or
#   per-micro-batch sync); per slot ``max / mean`` of the micro-batch costs across ranks, a rank
#   without a j-th micro-batch counting 0.


def bin_efficiency(tokens: int, cap: int | None, bins: int) -> float:
    """NeMo-RL's bin efficiency: ``ceil(tokens / cap) / bins`` (NaN without a cap or bins)."""
    if not cap or bins <= 0:
        return float("nan")
    return math.ceil(int(tokens) / int(cap)) / int(bins)


def _loads(loads) -> np.ndarray:
    a = np.asarray(loads, dtype=np.float64)
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"loads must be a non-empty 1-D array (one per rank), got shape {a.shape}")
    return a


def load_spread(loads) -> float:
    """``max - min`` of the per-rank loads (AReaL's spread)."""
    a = _loads(loads)
    return float(a.max() - a.min())


def load_imbalance(loads) -> float:
    """``max / mean`` of the per-rank loads (1.0 when balanced; NaN when all are 0)."""
    a = _loads(loads)
    m = a.mean()
    return float(a.max() / m) if m > 0 else float("nan")


def load_cv(loads) -> float:
    """Coefficient of variation ``std / mean`` (population std) of the per-rank loads."""
    a = _loads(loads)
    m = a.mean()
    return float(a.std() / m) if m > 0 else float("nan")


def slot_imbalance(rank_slot_costs) -> np.ndarray:
    """Per micro-batch slot j: ``max / mean`` over ranks of their j-th micro-batch's cost.

    ``rank_slot_costs[r]``: rank r's micro-batch costs in training order. A
    rank with fewer micro-batches counts 0 in the later slots. NaN for a slot
    whose costs are all 0.
    """
    ranks = [np.asarray(c, dtype=np.float64) for c in rank_slot_costs]
    if not ranks:
        raise ValueError("rank_slot_costs needs at least one rank")
    slots = max(c.size for c in ranks)
    grid = np.zeros((len(ranks), slots))
    for r, c in enumerate(ranks):
        grid[r, :c.size] = c
    mean = grid.mean(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(mean > 0, grid.max(axis=0) / np.where(mean > 0, mean, 1.0), np.nan)


def _figures(tokens, costs, rank, pos, dp, cap, samples=None) -> dict:
    """The peer figures of one step from per-micro-batch arrays (``costs`` may be None)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    k = int(tokens.size)
    over = tokens > cap if cap else np.zeros(k, dtype=bool)
    multi = np.ones(k, dtype=bool) if samples is None else np.asarray(samples) > 1
    out = {"micro_batches": k,
           "mb_lower_bound": math.ceil(int(tokens.sum()) / cap) if cap else float("nan"),
           "bin_efficiency": bin_efficiency(int(tokens.sum()), cap, k),
           "cap_violations": int((over & multi).sum())}
    rank_tokens = np.bincount(rank, weights=tokens, minlength=dp)
    out.update(token_spread=load_spread(rank_tokens), token_imbalance=load_imbalance(rank_tokens),
               token_cv=load_cv(rank_tokens))
    cost = tokens.astype(np.float64) if costs is None else np.asarray(costs, dtype=np.float64)
    if costs is not None:
        rank_cost = np.bincount(rank, weights=cost, minlength=dp)
        out.update(cost_spread=load_spread(rank_cost), cost_imbalance=load_imbalance(rank_cost),
                   cost_cv=load_cv(rank_cost))
    else:
        out.update(cost_spread=np.nan, cost_imbalance=np.nan, cost_cv=np.nan)
    slots = int(pos.max()) + 1 if k else 0
    grid = np.zeros((dp, max(slots, 1)))
    np.add.at(grid, (rank, pos), cost)
    si = slot_imbalance(list(grid)) if k else np.array([np.nan])
    out.update(slot_imbalance_mean=float(np.nanmean(si)) if np.any(~np.isnan(si)) else np.nan,
               slot_imbalance_max=float(np.nanmax(si)) if np.any(~np.isnan(si)) else np.nan)
    return out


def plan_quality(rank_micro_batches, lengths, *, cap: int | None, costs=None) -> dict:
    """The peer figures of one step given as plain arrays (or a ``PeerPlan``).

    ``rank_micro_batches[r][j]``: sample indices of rank r's j-th micro-batch;
    ``lengths`` per-sample tokens; ``costs`` optional per-sample cost (FLOPs)
    for the cost and slot figures (tokens when omitted; the ``cost_*`` keys are
    NaN then). Keys: ``micro_batches, mb_lower_bound, bin_efficiency,
    cap_violations`` (micro-batches of two or more samples over the cap),
    ``token_spread, token_imbalance, token_cv, cost_spread, cost_imbalance,
    cost_cv, slot_imbalance_mean, slot_imbalance_max``.
    """
    rank_micro_batches = getattr(rank_micro_batches, "rank_micro_batches", rank_micro_batches)
    lens = np.asarray(lengths, dtype=np.int64)
    c = None if costs is None else np.asarray(costs, dtype=np.float64)
    tok, cst, rank, pos, size = [], [], [], [], []
    for r, mbs in enumerate(rank_micro_batches):
        for j, mb in enumerate(mbs):
            mb = np.asarray(mb, dtype=np.int64)
            tok.append(int(lens[mb].sum()))
            cst.append(float(c[mb].sum()) if c is not None else 0.0)
            rank.append(r)
            pos.append(j)
            size.append(mb.size)
    dp = len(rank_micro_batches)
    if dp == 0:
        raise ValueError("rank_micro_batches needs at least one rank")
    return _figures(np.asarray(tok, dtype=np.int64), None if c is None else np.asarray(cst),
                    np.asarray(rank, dtype=np.int64), np.asarray(pos, dtype=np.int64), dp,
                    None if cap is None else int(cap), np.asarray(size))


def peer_step_quality(schedule: Schedule, *, cap: int | None = None):
    """The peer figures of :func:`plan_quality` per step of a schedule (a pandas table).

    Costs are the schedule's sample FLOPs (the ``cost_*`` columns are NaN
    without a model shape; the slot figures then use tokens).
    """
    import pandas as pd

    cap = schedule.config.cap if cap is None else int(cap)
    dp = schedule.config.dp
    rows = []
    for step in schedule.steps:
        a = micro_batch_arrays(schedule, step)
        costs = None if schedule.sample_flops is None else a["flops"]
        rows.append({"step": step.index, **_figures(a["tokens"], costs, a["rank"], a["pos"], dp,
                                                     cap, a["samples"])})
    return pd.DataFrame(rows)


def peer_quality(schedule: Schedule, *, cap: int | None = None) -> dict:
    """Over all steps: ``bin_efficiency`` (total bound / total micro-batches), the
    ``cap_violations`` total, and the mean over steps of every other figure of
    :func:`peer_step_quality` (``mean_<name>``) plus the worst step's
    ``max_cost_imbalance`` and ``max_slot_imbalance``.
    """
    q = peer_step_quality(schedule, cap=cap)
    out = {"steps": len(q), "micro_batches": int(q["micro_batches"].sum())}
    has_cap = bool(q["mb_lower_bound"].notna().all())
    out["bin_efficiency"] = (float(q["mb_lower_bound"].sum() / q["micro_batches"].sum())
                             if has_cap else float("nan"))
    out["cap_violations"] = int(q["cap_violations"].sum())
    for c in ("token_spread", "token_imbalance", "token_cv", "cost_spread", "cost_imbalance",
              "cost_cv", "slot_imbalance_mean"):
        out[f"mean_{c}"] = float(q[c].mean())
    out["max_cost_imbalance"] = float(q["cost_imbalance"].max())
    out["max_slot_imbalance"] = float(q["slot_imbalance_max"].max())
    return out
