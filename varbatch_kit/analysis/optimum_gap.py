"""How far the heuristics are from the optimum, on small random steps (CP-SAT as the yardstick).

:func:`random_small_steps` draws small long-tailed steps; :func:`gap_to_optimal`
schedules each with chosen policies and compares the busiest rank's FLOPs
with :func:`varbatch_kit.policies.optimal.solve_min_max_rank_flops`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from varbatch_kit.analysis.warn_once import warn_once
from varbatch_kit.core.build import build_schedule
from varbatch_kit.core.config import ScheduleConfig
from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.policies.optimal import MAX_SAMPLES, solve_min_max_rank_flops

__all__ = ["SmallStep", "gap_to_optimal", "random_small_steps"]


@dataclass(frozen=True)
class SmallStep:
    """A random one-step instance: one-sample rollouts of ``lengths``, a ``cap``, ``dp`` ranks."""

    lengths: np.ndarray
    cap: int
    dp: int


def random_small_steps(count: int, *, seed: int = 0, min_samples: int = 8,
                       max_samples: int = MAX_SAMPLES, cap: int = 8192) -> list[SmallStep]:
    """``count`` seeded instances: 8-40 samples, dp 2-4, log-normal lengths (some over the cap)."""
    if not (1 <= min_samples <= max_samples <= MAX_SAMPLES):
        raise ValueError(f"need 1 <= min_samples <= max_samples <= {MAX_SAMPLES}, got "
                         f"{min_samples}, {max_samples}")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(int(count)):
        n = int(rng.integers(min_samples, max_samples + 1))
        dp = int(rng.integers(2, 5))
        raw = rng.lognormal(np.log(cap / 4), 0.9, n)
        lengths = np.clip(np.ceil(raw), 16, int(2.5 * cap)).astype(np.int64)
        out.append(SmallStep(lengths, cap, dp))
    return out


def gap_to_optimal(step: SmallStep, model, policies=(("balanced", "balanced"),), *,
                   time_limit_s: float = 2.0, relative_gap: float = 1e-3) -> list[dict]:
    """Schedule ``step`` with each ``(packing, distribution)`` and compare it with CP-SAT.

    The optimum is solved for the same micro-batch count per rank as the
    policy's schedule (hinted with it). Each row: ``policy, samples, dp,
    micro_batches_per_rank, heuristic`` (its busiest rank's FLOPs),
    ``optimum`` (best found), ``bound`` (proven lower bound), ``proven``,
    ``gap_low = heuristic / optimum - 1`` and ``gap_high = heuristic /
    bound - 1``: the true gap lies between them (they differ by at most
    ``relative_gap`` when ``proven``; 0.1% by default, plenty to measure
    heuristics against, and far cheaper to prove than an exact optimum when
    the optimum sits just above ``total / dp``).
    """
    n = step.lengths.size
    rollouts = Rollouts(prompt_len=np.zeros(n, dtype=np.int64), response_len=step.lengths)
    flops = model.forward_flops(step.lengths)
    rows, cache = [], {}
    policies, scheds = list(policies), []
    with warn_once("policies") as tally:  # each scheduler warning once, not once per policy
        for packing, distribution in policies:
            cfg = ScheduleConfig(dp=step.dp, global_batch_size=n, max_tokens_per_gpu=step.cap,
                                 packing=packing, distribution=distribution)
            with tally.case():
                scheds.append(build_schedule(rollouts, cfg, model))
    for (packing, distribution), sched in zip(policies, scheds):
        st = sched.steps[0]
        m = st.num_microbatches
        heur = max(float(sum(flops[mb].sum() for mb in rank)) for rank in st.dp_ranks)
        bins = [mb.tolist() for mb in st.micro_batches]
        key = m
        res = cache.get(key)
        if res is None or res.max_rank_flops > heur:
            res = solve_min_max_rank_flops(step.lengths, flops, step.cap, step.dp, m,
                                           time_limit_s=time_limit_s, relative_gap=relative_gap,
                                           hint=(bins, st.dp_rank_bins))
            cache[key] = res
        best = min(res.max_rank_flops, heur)
        bound = min(max(res.lower_bound, float(flops.sum()) / step.dp, float(flops.max())), best)
        rows.append({"policy": f"{packing}+{distribution}", "samples": n, "dp": step.dp,
                         "micro_batches_per_rank": m, "heuristic": heur, "optimum": best,
                         "bound": bound,
                         "proven": res.proven_optimal, "gap_low": heur / best - 1.0,
                         "gap_high": heur / bound - 1.0, "solve_s": res.wall_s})
    return rows
