"""Schedule quality: how far a schedule is from what its inputs allow.

Per step: micro-batches per rank vs the lower bound ``ceil(tokens / cap)``
(rounded up to the alignment), cap violations, DP FLOPs and token imbalance
(busiest rank / mean rank), and the busiest rank's FLOPs against the lower
bound ``max(step FLOPs / dp, largest sample's FLOPs)``.
"""

from __future__ import annotations

import math

import numpy as np

from varbatch_kit.schedule import Schedule

__all__ = ["step_quality", "summary"]


def step_quality(schedule: Schedule):
    """A pandas table with one row per step.

    Columns: ``step, rollouts, samples, tokens, micro_batches`` (total over
    ranks), ``mb_lower_bound`` (``ceil(tokens/cap)``, NaN when static),
    ``cap_violations``, ``max_mb_tokens``, ``token_imbalance``,
    ``flops_imbalance`` (max rank / mean rank), ``max_rank_flops``,
    ``flops_lower_bound`` and ``makespan_ratio`` (max rank FLOPs / bound).
    """
    import pandas as pd

    stats = schedule.stats()
    mb = schedule.micro_batch_table()
    cap = schedule.config.cap
    dp = schedule.config.dp
    flops = schedule.sample_flops
    rows = []
    per_step = stats.groupby("step")
    per_step_mb = mb.groupby("step")
    for step in schedule.steps:
        st = per_step.get_group(step.index)
        m = per_step_mb.get_group(step.index)
        tokens = int(st["tokens"].sum())
        row = dict(
            step=step.index,
            rollouts=step.num_rollouts,
            samples=step.num_samples,
            tokens=tokens,
            micro_batches=int(len(m)),
            mb_lower_bound=math.ceil(tokens / cap) if cap else np.nan,
            cap_violations=int(m["over_cap"].sum()),
            max_mb_tokens=int(m["tokens"].max()),
            token_imbalance=float(st["tokens"].max() / st["tokens"].mean()),
        )
        if flops is not None:
            rank_flops = st["flops"].to_numpy()
            bound = max(rank_flops.sum() / dp, float(flops[step.sample_indices].max()))
            row.update(
                flops_imbalance=float(rank_flops.max() / rank_flops.mean()),
                max_rank_flops=float(rank_flops.max()),
                flops_lower_bound=float(bound),
                makespan_ratio=float(rank_flops.max() / bound),
            )
        else:
            row.update(flops_imbalance=np.nan, max_rank_flops=np.nan,
                       flops_lower_bound=np.nan, makespan_ratio=np.nan)
        rows.append(row)
    return pd.DataFrame(rows)


def summary(schedule: Schedule) -> dict:
    """One-line figures over all steps (what the explorers print).

    Keys: ``steps, micro_batches, mb_lower_bound, cap_violations,
    max_flops_imbalance, mean_flops_imbalance, max_token_imbalance,
    mean_makespan_ratio``.
    """
    q = step_quality(schedule)
    return dict(
        steps=int(len(q)),
        micro_batches=int(q["micro_batches"].sum()),
        mb_lower_bound=(int(q["mb_lower_bound"].sum()) if q["mb_lower_bound"].notna().all()
                        else None),
        cap_violations=int(q["cap_violations"].sum()),
        max_flops_imbalance=float(q["flops_imbalance"].max()),
        mean_flops_imbalance=float(q["flops_imbalance"].mean()),
        max_token_imbalance=float(q["token_imbalance"].max()),
        mean_makespan_ratio=float(q["makespan_ratio"].mean()),
    )
