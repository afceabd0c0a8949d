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

__all__ = ["compare", "micro_batch_arrays", "step_quality", "summary"]


def micro_batch_arrays(schedule: Schedule, step) -> dict[str, np.ndarray]:
    """Per micro-batch of one step, in bin order: ``tokens, flops, samples, max_len, rank, pos``.

    ``rank`` is the DP rank that trains it and ``pos`` its position in that
    rank's sequence; ``flops`` is NaN without a model shape.
    """
    if step.placements is not None:
        raise ValueError(
            "micro_batch_arrays() gives each micro-batch one DP rank, and a dynamic-CP plan "
            "(cp_mode='dynamic') has none: use step.placements (round and CP group per "
            "micro-batch) or step.rank_program(world_rank, cp)")
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
    for r, bins in enumerate(step.rank_bins):
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
