"""How a schedule's quality moves over the rollout steps of a whole run.

:func:`run_quality_table` schedules every rollout step of a
:class:`~varbatch_kit.core.run_dumps.RunDumps` (each dump is one rollout
batch, cut into training steps of ``global_batch_size`` rollouts) with a few
policies on one layout, and gives per rollout step and policy: the schedule's
quality (:func:`varbatch_kit.analysis.quality.step_quality`), its FLOPs
imbalance across the DP ranks and its simulated training time
(:func:`varbatch_kit.analysis.simulate.simulate`). By default the policies are
the config's own (e.g. slime's, from its flags) and ``balanced``.
:func:`varbatch_kit.ui.viz.run_quality_figure` draws the table.

Pure: no plotting, no printing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from varbatch_kit.analysis.quality import OVER_CAP_HELP
from varbatch_kit.analysis.warn_once import warn_once
from varbatch_kit.core.build import DROPPED_ROLLOUTS_MESSAGE, build_schedule
from varbatch_kit.core.config import ScheduleConfig
from varbatch_kit.core.flops import ModelShape
from varbatch_kit.core.hardware import DEFAULT_HARDWARE
from varbatch_kit.core.run_dumps import RunDumps

__all__ = ["BALANCED_POLICY", "RUN_QUALITY_COLUMNS", "run_policies", "run_quality_table"]

#: varbatch_kit's FLOPs-balanced packing and distribution
BALANCED_POLICY = ("balanced", "balanced")

#: the columns of :func:`run_quality_table`, in order, and what each means
RUN_QUALITY_COLUMNS = {
    "rollout_id": "the rollout step (slime's rollout_id of the dump)",
    "policy": "packing + distribution",
    "packing": "how a training step's samples become micro-batches",
    "distribution": "how the micro-batches are dealt to the DP ranks",
    "samples": "samples in the dump (count)",
    "steps": "training steps of global_batch_size rollouts in this rollout step (count)",
    "dropped_samples": "samples of the trailing rollouts that fill no training step, left out "
                       "(count)",
    "micro_batches": "micro-batches over the training steps and ranks (count)",
    "cap_violations": OVER_CAP_HELP["cap_violations"],
    "oversize_alone": OVER_CAP_HELP["oversize_alone"],
    "flops_imbalance": "busiest rank's forward FLOPs / the mean rank's, worst training step "
                       "(ratio; 1 = even)",
    "makespan_ratio": "busiest rank's FLOPs / the bound for any packing (max(step FLOPs / dp, "
                      "largest sample)), mean over the training steps (ratio; 1 = optimal)",
    "time_s": "simulated time of the rollout step's training steps (seconds, summed)",
    "bound_s": "the same for a perfect schedule of each training step (seconds, summed)",
    "above_bound_pct": "100 * (time_s / bound_s - 1) (percent)",
    "error": "the scheduler's message when the policy cannot run this step (numbers NaN)",
}

_NUMBERS = [c for c in RUN_QUALITY_COLUMNS
            if c not in ("rollout_id", "policy", "packing", "distribution", "error")]


def run_policies(config: ScheduleConfig) -> list[tuple[str, str]]:
    """The config's own ``(packing, distribution)`` and ``balanced``'s (once when equal)."""
    own = (config.packing, config.distribution)
    return [own] if own == BALANCED_POLICY else [own, BALANCED_POLICY]


def _config_for(config: ScheduleConfig, packing: str, distribution: str) -> ScheduleConfig:
    if (packing, distribution) == (config.packing, config.distribution):
        return config
    return config.with_batching(packing=packing, distribution=distribution)


def run_quality_table(run: RunDumps, config: ScheduleConfig, model: ModelShape,
                      policies: Sequence[tuple[str, str]] | None = None, *,
                      hardware: str = DEFAULT_HARDWARE,
                      flag_names: Mapping[tuple[str, str], str] | None = None,
                      **simulate_kwargs: Any):
    """Quality, imbalance and simulated time per rollout step and policy.

    Parameters
    ----------
    run:
        The rollout steps (:func:`varbatch_kit.core.run_dumps.read_run`).
    config:
        The layout (``dp``, the cap or ``micro_batch_size``,
        ``global_batch_size``, ...); every rollout step is scheduled with it,
        its packing and distribution replaced per policy.
    model:
        The model shape (FLOPs drive the balance and the simulation).
    policies:
        ``(packing, distribution)`` pairs (default :func:`run_policies`:
        the config's own and ``balanced``).
    hardware, simulate_kwargs:
        Passed to :func:`varbatch_kit.analysis.simulate.simulate`.
    flag_names:
        A framework's flags per pair (e.g.
        :data:`varbatch_kit.compat.slime.SLIME_FLAGS`): adds a ``slime``
        column (``""`` where it has none).

    Returns a pandas table with one row per rollout step and policy (steps in
    the run's order, the policies in the given order), the columns of
    :data:`RUN_QUALITY_COLUMNS` (and ``slime``). A policy that cannot run a
    step does not raise: its row holds NaN and the message in ``error``. The
    scheduler's warning about trailing rollouts that fill no training step is
    not logged here: ``dropped_samples`` counts them; its other warnings
    (samples longer than the cap, ...) are said once for the table, counted
    over its schedules (:func:`varbatch_kit.analysis.warn_once.warn_once`).
    """
    import pandas as pd

    from varbatch_kit.analysis.quality import step_quality
    from varbatch_kit.analysis.simulate import simulate

    if model is None:
        raise ValueError("run_quality_table needs a model shape (FLOPs); got model=None")
    if not len(run):
        raise ValueError("run has no rollout steps; read one with read_run")
    pairs = list(policies) if policies is not None else run_policies(config)
    if not pairs:
        raise ValueError("policies is empty: pass (packing, distribution) pairs, e.g. "
                         f"{run_policies(config)}")
    configs = {}
    for packing, distribution in pairs:
        try:
            configs[(packing, distribution)] = _config_for(config, packing, distribution)
        except ValueError as e:  # e.g. balanced on a static layout: no cap
            configs[(packing, distribution)] = str(e)
    rows = []
    # the rows count the dropped rollouts: no warning about them per step and policy
    with warn_once("schedules (rollout steps x policies)",
                   hold_back=(DROPPED_ROLLOUTS_MESSAGE,)) as tally:
        for step in run:
            for packing, distribution in pairs:
                row: dict[str, Any] = {"rollout_id": step.rollout_id,
                                       "policy": f"{packing} + {distribution}",
                                       "packing": packing, "distribution": distribution,
                                       **dict.fromkeys(_NUMBERS, np.nan), "error": ""}
                row["samples"] = len(step.rollouts)
                if flag_names is not None:
                    row["slime"] = flag_names.get((packing, distribution), "")
                cfg = configs[(packing, distribution)]
                try:
                    if isinstance(cfg, str):
                        raise ValueError(cfg)
                    with tally.case():
                        sched = build_schedule(step.rollouts, cfg, model)
                except ValueError as e:
                    row["error"] = str(e)
                    rows.append(row)
                    continue
                q = step_quality(sched)
                t = simulate(sched, hardware=hardware, timelines=False,
                             **simulate_kwargs).step_times
                time_s, bound_s = float(t["time_s"].sum()), float(t["bound_s"].sum())
                row.update(steps=len(q), dropped_samples=int(sched.dropped_samples.size),
                           micro_batches=int(q["micro_batches"].sum()),
                           cap_violations=int(q["cap_violations"].sum()),
                           oversize_alone=int(q["oversize_alone"].sum()),
                           flops_imbalance=float(q["flops_imbalance"].max()),
                           makespan_ratio=float(q["makespan_ratio"].mean()),
                           time_s=time_s, bound_s=bound_s,
                           above_bound_pct=100 * (time_s / bound_s - 1) if bound_s else np.nan)
                rows.append(row)
    cols = list(RUN_QUALITY_COLUMNS) + (["slime"] if flag_names is not None else [])
    table = pd.DataFrame(rows)[cols]
    for c in ("samples", "steps", "dropped_samples", "micro_batches", "cap_violations",
              "oversize_alone"):
        table[c] = table[c].astype("Int64")
    return table
