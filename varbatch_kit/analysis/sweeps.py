"""Sweeps and comparisons behind the notebooks, the demo and ``varbatch-kit schedule``.

Pure computations: inputs in, tables and small result objects out; no
plotting, no printing. The figures that draw these values live in
:mod:`varbatch_kit.ui.viz`.

- :func:`sweep_table`: schedule quality over a ``max_tokens_per_gpu x dp`` grid.
- :func:`policy_pairs`, :func:`policy_table`: every registered
  ``(packing, distribution)`` pair on one layout; :func:`policy_table_by_trace`
  does it for several traces and :func:`policy_pivot` turns that into one
  line per policy and a column pair per trace.
- :func:`simulated_comparison`: simulated step times of several policies
  (:mod:`varbatch_kit.analysis.simulate`) and their total against a perfect schedule.

The metric-report invariance check of notebook 06 (``invariance_experiment``,
``worst_rel_diff``, ``invariance_verdict``) is :mod:`varbatch_kit.analysis.invariance`;
its names are importable from here too.

Each function builds many schedules and says each of their warnings once, with the
number of schedules that raised it (:func:`varbatch_kit.analysis.warn_once.warn_once`):
e.g. one ``OversizeSampleWarning`` "in 13 of 13 policies: ...", not thirteen.

Nothing here imports plotly, torch or the training engine: ``varbatch-kit
schedule`` and the demo use this module without them.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from varbatch_kit.analysis.warn_once import warn_once
from varbatch_kit.checks import positive_int
from varbatch_kit.core.build import build_schedule
from varbatch_kit.core.config import ScheduleConfig
from varbatch_kit.core.flops import ModelShape
from varbatch_kit.core.hardware import DEFAULT_HARDWARE
from varbatch_kit.core.rollouts import Rollouts

__all__ = [
    "SimulatedComparison",
    "policy_pairs",
    "policy_pivot",
    "policy_table",
    "policy_table_by_trace",
    "simulated_comparison",
    "sweep_table",
]

def _policy_name(packing: str, distribution: str) -> str:
    return f"{packing} + {distribution}"


# ------------------------------------------------------------------ sweeps
def sweep_table(rollouts: Rollouts, config: ScheduleConfig, model: ModelShape | None,
                max_tokens_per_gpu: Sequence[int], dp: Sequence[int]):
    """Schedule quality for every ``(max_tokens_per_gpu, dp)`` pair.

    Returns a pandas table with one row per pair: ``max_tokens_per_gpu, dp,
    micro_batches, mb_lower_bound, mb_ratio, cap_violations, flops_imbalance,
    token_imbalance, makespan_ratio, error``. An impossible layout does not
    raise: its row holds NaN and the scheduler's message in ``error``. Each
    scheduler warning is said once, counted over the layouts.
    """
    import pandas as pd

    from varbatch_kit.analysis.quality import step_quality

    rows = []
    with warn_once("layouts") as tally:
        for d in dp:
            for c in max_tokens_per_gpu:
                row: dict[str, Any] = {"max_tokens_per_gpu": int(c), "dp": int(d), "error": ""}
                try:
                    with tally.case():
                        sched = build_schedule(rollouts, config.with_(
                            dp=int(d), max_tokens_per_gpu=int(c)), model)
                except ValueError as e:
                    row.update(micro_batches=np.nan, mb_lower_bound=np.nan, mb_ratio=np.nan,
                               cap_violations=np.nan, flops_imbalance=np.nan,
                               token_imbalance=np.nan, makespan_ratio=np.nan, error=str(e))
                    rows.append(row)
                    continue
                q = step_quality(sched)
                mb = int(q["micro_batches"].sum())
                lb = float(q["mb_lower_bound"].sum())
                row.update(micro_batches=mb, mb_lower_bound=lb,
                           mb_ratio=mb / lb if lb else np.nan,
                           cap_violations=int(q["cap_violations"].sum()),
                           flops_imbalance=float(q["flops_imbalance"].max()),
                           token_imbalance=float(q["token_imbalance"].max()),
                           makespan_ratio=float(q["makespan_ratio"].max()))
                rows.append(row)
    return pd.DataFrame(rows)


# ---------------------------------------------------------------- policies
def policy_pairs(model: ModelShape | None = None, *, dynamic: bool = True
                 ) -> list[tuple[str, str]]:
    """Every registered ``(packing, distribution)`` pair that can run together.

    Taken from :data:`varbatch_kit.policies.packers.PACKERS` and
    :data:`varbatch_kit.policies.distributions.DISTRIBUTIONS`, so new policies appear
    automatically. Pairs needing FLOPs are left out when ``model`` is None;
    a packer that requires one distribution is paired with that one only.
    """
    from varbatch_kit.policies.registry import DISTRIBUTIONS, PACKERS

    pairs = []
    for pname, pspec in PACKERS.items():
        if pspec.dynamic != dynamic or (pspec.needs_flops and model is None):
            continue
        required = getattr(pspec, "requires_distribution", None)
        for dname, dspec in DISTRIBUTIONS.items():
            if required is not None and dname != required:
                continue
            if dspec.needs_flops and model is None:
                continue
            pairs.append((pname, dname))
    return pairs


def policy_table(rollouts: Rollouts, config: ScheduleConfig, model: ModelShape | None,
                 policies: Sequence[tuple[str, str]] | None = None, *,
                 flag_names: Mapping[tuple[str, str], str] | None = None,
                 memory=None, hardware_memory_gib: float | None = None):
    """Schedule quality of several ``(packing, distribution)`` policies on one layout.

    Returns a pandas table with one row per policy: ``packing, distribution``,
    ``slime`` when ``flag_names`` is given (a framework's flags for the pair,
    e.g. :data:`varbatch_kit.compat.slime.SLIME_FLAGS`; ``""`` where it has
    none), ``steps, micro_batches,
    mb_lower_bound`` (sum over steps of ``ceil(tokens/cap)``),
    ``cap_violations`` (micro-batches of two or more samples over the cap: a
    packing could have avoided them), ``oversize_alone`` (micro-batches of one
    sample longer than the cap: no packing can), ``max_flops_imbalance``,
    ``mean_mb_makespan_ratio`` (busiest rank / the *bound for this packing*,
    ``max(step FLOPs / dp, largest micro-batch)``: how well the micro-batches
    were dealt), ``mean_makespan_ratio`` (busiest rank / the *bound for any
    packing*, ``max(step FLOPs / dp, largest sample)``; both means over steps),
    ``max_makespan_ratio``, ``schedule_s`` (wall time) and ``error`` (the
    scheduler's message for a policy that cannot run this layout; its numbers
    are NaN). Each scheduler warning (samples longer than the cap, trailing
    rollouts dropped) is said once, with the number of policies it concerns.
    With ``memory`` (a :class:`~varbatch_kit.core.memory.MemoryLayout` of the config's dp
    and cp; needs ``model``): ``peak_gib``, the busiest GPU's predicted peak memory over
    the steps (:func:`~varbatch_kit.core.memory.predict_memory`), and with
    ``hardware_memory_gib`` ``over_memory``, the (step, GPU) pairs above it: a policy
    that breaks the cap (slime's ``--balance-by-flops``) says so in bytes.

    Parameters
    ----------
    rollouts, config, model:
        What :func:`build_schedule` takes; ``config`` gives the layout, its
        packing and distribution are replaced per row.
    policies:
        Pairs to compare (default :func:`policy_pairs` for the config's path).
    """
    import pandas as pd

    if memory is not None and model is None:
        raise ValueError("memory= needs a model shape (the activations depend on it)")
    pairs = list(policies) if policies is not None else policy_pairs(
        model, dynamic=config.dynamic)
    rows = []
    with warn_once("policies") as tally:
        for packing, distribution in pairs:
            rows.append(_policy_row(tally, rollouts, config, model, packing, distribution,
                                    flag_names, memory, hardware_memory_gib))
    return pd.DataFrame(rows)


def _policy_row(tally, rollouts: Rollouts, config: ScheduleConfig, model: ModelShape | None,
                packing: str, distribution: str,
                flag_names: Mapping[tuple[str, str], str] | None, memory=None,
                hardware_memory_gib: float | None = None) -> dict[str, Any]:
    """One row of :func:`policy_table` (its schedule built as a case of ``tally``)."""
    from varbatch_kit.analysis.quality import step_quality

    row: dict[str, Any] = {"packing": packing, "distribution": distribution}
    if flag_names is not None:
        row["slime"] = flag_names.get((packing, distribution), "")
    t0 = time.perf_counter()
    try:
        with tally.case():
            sched = build_schedule(rollouts, config.with_(packing=packing,
                                                          distribution=distribution), model)
    except ValueError as e:
        row.update(steps=np.nan, micro_batches=np.nan, mb_lower_bound=np.nan,
                   cap_violations=np.nan, oversize_alone=np.nan, max_flops_imbalance=np.nan,
                   mean_mb_makespan_ratio=np.nan, mean_makespan_ratio=np.nan,
                   max_makespan_ratio=np.nan,
                   schedule_s=time.perf_counter() - t0, error=str(e))
        return row
    dt = time.perf_counter() - t0
    q = step_quality(sched)
    bound = q["mb_lower_bound"]
    row.update(
        steps=len(q), micro_batches=int(q["micro_batches"].sum()),
        mb_lower_bound=float(bound.sum()) if bound.notna().all() else np.nan,
        cap_violations=int(q["cap_violations"].sum()),
        oversize_alone=int(q["oversize_alone"].sum()),
        max_flops_imbalance=float(q["flops_imbalance"].max()),
        mean_mb_makespan_ratio=float(q["mb_makespan_ratio"].mean()),
        mean_makespan_ratio=float(q["makespan_ratio"].mean()),
        max_makespan_ratio=float(q["makespan_ratio"].max()),
        schedule_s=dt, error="")
    if memory is not None:
        from varbatch_kit.core.memory import predict_memory

        peaks = predict_memory(sched, model, memory)["peak_bytes"]
        row["peak_gib"] = float(peaks.max()) / 2**30
        if hardware_memory_gib is not None:
            row["over_memory"] = int((peaks > hardware_memory_gib * 2**30).sum())
    return row


def policy_table_by_trace(traces: Mapping[str, Rollouts], model: ModelShape | None, *,
                          dp: int = 16, max_tokens_per_gpu: int = 16384, steps: int = 4,
                          policies: Sequence[tuple[str, str]] | None = None,
                          flag_names: Mapping[tuple[str, str], str] | None = None,
                          memory=None, hardware_memory_gib: float | None = None):
    """:func:`policy_table` for several traces on one layout, stacked, with a ``trace`` column.

    Each trace is cut into ``steps`` steps: ``global_batch_size`` is its
    number of rollouts ``// steps`` (at least 1). Rows come trace after
    trace, in the order of ``traces``, the policies in the order of
    ``policies`` (default :func:`policy_pairs` of the dynamic path);
    ``flag_names``, ``memory`` and ``hardware_memory_gib`` as in :func:`policy_table`
    (``memory``'s dp and cp are set to this layout's). Each scheduler warning is said
    once for the whole table, counted over its trace and policy schedules.
    """
    import pandas as pd

    if not traces:
        raise ValueError("traces is empty: pass a mapping name -> Rollouts")
    positive_int("steps", steps)
    tables = []
    with warn_once("schedules (traces x policies)"):  # the policy tables join it
        for name, r in traces.items():
            config = ScheduleConfig(dp=dp,
                                    global_batch_size=max(1, r.num_rollouts // int(steps)),
                                    max_tokens_per_gpu=max_tokens_per_gpu)
            mem = None if memory is None else replace(memory, dp=dp, cp=1)
            tables.append(policy_table(r, config, model, policies, flag_names=flag_names,
                                       memory=mem, hardware_memory_gib=hardware_memory_gib)
                          .assign(trace=str(name)))
    return pd.concat(tables, ignore_index=True)


#: the columns of :func:`policy_pivot`, per trace: (table column, label)
PIVOT_VALUES = (("mean_makespan_ratio", "busiest/bound"), ("cap_violations", "over cap"))


def policy_pivot(table):
    """One row per policy, a ``busiest/bound`` and an ``over cap`` column per trace.

    ``table`` is :func:`policy_table_by_trace`'s (columns ``trace, packing,
    distribution, mean_makespan_ratio, cap_violations``). The index is
    ``"packing + distribution"`` in the table's order; the columns are
    ``"<trace> busiest/bound"`` (busiest rank / its lower bound, mean over
    steps; 1.0 is optimal) and ``"<trace> over cap"`` (micro-batches of two
    or more samples over the token cap, an integer), sorted by name. A
    policy that could not run on a trace has NaN / ``<NA>`` there.
    """
    import pandas as pd

    need = [c for c in ("trace", "packing", "distribution", *dict(PIVOT_VALUES))
            if c not in table.columns]
    if need:
        raise ValueError(f"policy_pivot needs column(s) {need}; pass the table of "
                         "policy_table_by_trace (or a policy_table with a trace column)")
    policy = table["packing"] + " + " + table["distribution"]
    wide = table.assign(policy=policy).pivot(index="policy", columns="trace",
                                             values=[v for v, _ in PIVOT_VALUES])
    wide = wide.reindex(list(dict.fromkeys(policy)))
    labels = dict(PIVOT_VALUES)
    wide.columns = [f"{trace} {labels[v]}" for v, trace in wide.columns]
    for col in wide.columns:
        if col.endswith(" over cap"):
            wide[col] = wide[col].astype("Int64")
    out = wide[sorted(wide.columns)]
    out.index.name = "policy"
    out.columns.name = None
    return pd.DataFrame(out)


# --------------------------------------------------------------- simulation
@dataclass
class SimulatedComparison:
    """What :func:`simulated_comparison` returns.

    ``step_times``: ``policy -> per-step table`` (``simulate(...).step_times``:
    ``step, time_s, bound_s, ...``), what :func:`varbatch_kit.ui.viz.step_time_figure`
    draws. ``totals``: one row per policy, indexed by ``"packing +
    distribution"``, with ``time_s`` and ``bound_s`` (sums over the steps) and
    ``above_bound_pct`` (``100 * (time_s / bound_s - 1)``), sorted by it.
    ``errors``: ``policy -> scheduler message`` for policies that cannot run
    the layout (left out of the other two).
    """

    step_times: dict[str, Any]
    totals: Any
    errors: dict[str, str] = field(default_factory=dict)


def simulated_comparison(rollouts: Rollouts, config: ScheduleConfig, model: ModelShape,
                         policies: Sequence[tuple[str, str]] | None = None, *,
                         hardware: str = DEFAULT_HARDWARE,
                         **simulate_kwargs: Any) -> SimulatedComparison:
    """Simulated step times of several policies on one layout, against a perfect schedule.

    Every policy (default :func:`policy_pairs` for the config's path) is
    scheduled with :func:`build_schedule` and run through
    :func:`varbatch_kit.analysis.simulate.simulate` with ``hardware`` and
    ``simulate_kwargs``. Each scheduler warning is said once, counted over the
    policies.
    """
    import pandas as pd

    from varbatch_kit.analysis.simulate import simulate

    if model is None:
        raise ValueError("simulated_comparison needs a model shape (FLOPs); got model=None")
    pairs = list(policies) if policies is not None else policy_pairs(
        model, dynamic=config.dynamic)
    step_times: dict[str, Any] = {}
    errors: dict[str, str] = {}
    with warn_once("policies") as tally:
        for packing, distribution in pairs:
            name = _policy_name(packing, distribution)
            try:
                with tally.case():
                    sched = build_schedule(rollouts, config.with_(
                        packing=packing, distribution=distribution), model)
            except ValueError as e:
                errors[name] = str(e)
                continue
            step_times[name] = simulate(sched, hardware=hardware,
                                        **simulate_kwargs).step_times
    totals = pd.DataFrame(
        {"time_s": [float(t["time_s"].sum()) for t in step_times.values()],
         "bound_s": [float(t["bound_s"].sum()) for t in step_times.values()]},
        index=pd.Index(list(step_times), name="policy"))
    totals["above_bound_pct"] = 100 * (totals["time_s"] / totals["bound_s"] - 1)
    totals = totals.sort_values("above_bound_pct", kind="stable")
    return SimulatedComparison(step_times, totals, errors)
