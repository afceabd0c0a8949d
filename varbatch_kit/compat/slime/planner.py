"""Which layout to run on N GPUs: the fastest tp x pp x cp x dp, token cap, recomputation and
packing whose predicted peak memory fits the device, as slime command lines.

:func:`plan_layouts` searches, for one rollout batch and one model on ``gpus`` GPUs of one
kind (``hardware``):

- every ``tp`` (dividing the attention heads and the query groups, at most ``max_tp``: one
  node's NVLink), ``pp`` (dividing the layers, at most ``max_pp``) and ``cp`` (1, 2, 4, ...,
  at most ``max_cp``) whose product divides ``gpus`` (``dp`` is the rest);
- the token caps ``caps`` (``--max-tokens-per-gpu``, dynamic batching);
- the packings: slime's default (``--use-dynamic-batch-size``), ``--balance-data`` and
  varbatch_kit's ``balanced`` (not a slime flag);
- recomputation ``none``, ``selective``, ``full`` (the first that fits: each costs time).

Each candidate's step time comes from :func:`varbatch_kit.analysis.simulate.simulate`
(full recomputation runs the forward twice: ``backward_factor + 1``) and its memory from
:func:`varbatch_kit.core.memory.predict_memory` (bf16, distributed optimizer and sequence
parallelism by default, as slime's scripts run). Pruned without building a schedule: a
layout whose parameters, gradients and optimizer states alone exceed the device's memory,
and a cap larger than one that did not fit under full recomputation. Pruned without
predicting its memory: a candidate whose simulated time is no better than the ``top``-th
fitting one found so far.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from varbatch_kit.checks import positive_int
from varbatch_kit.core.flops import ModelShape, as_model_shape
from varbatch_kit.core.hardware import DEFAULT_HARDWARE, hardware_profile
from varbatch_kit.core.memory import RECOMPUTE, MemoryLayout, predict_memory, static_memory
from varbatch_kit.core.rollouts import Rollouts

__all__ = ["PACKINGS", "LayoutPlan", "plan_layouts"]

#: packing name -> (packing, distribution, the slime flags beyond --use-dynamic-batch-size)
PACKINGS = {
    "slime": ("first_fit", "strided", ""),
    "slime-balance-data": ("first_fit", "flops_kk", " --balance-data"),
    "balanced": ("balanced", "balanced", None),  # varbatch_kit's: no slime flag
}
_RECOMPUTE_FLAGS = {"none": "", "selective": " --recompute-granularity selective",
                    "full": " --recompute-granularity full --recompute-method uniform "
                            "--recompute-num-layers 1"}


@dataclass(frozen=True)
class LayoutPlan:
    """What :func:`plan_layouts` returns.

    ``table``: every candidate evaluated (pandas), fastest first: ``tp, pp, cp, dp,
    max_tokens_per_gpu, packing, recompute, time_s`` (simulated seconds for the rollout
    batch), ``step_s``, ``gpu_hours`` (per rollout batch: ``time_s * gpus / 3600``),
    ``peak_gib`` (the busiest GPU's predicted peak; NaN where not predicted: pruned by
    time), ``fits``, ``command`` (the slime flags; None for ``balanced``). ``best``: its
    first fitting row (a dict; None when nothing fits). ``pruned``: how many candidates
    each rule skipped. ``search_s``: the wall time.
    """

    table: Any
    best: dict | None
    gpus: int
    hardware: str
    memory_gib: float
    pruned: dict
    search_s: float

    def top(self, n: int = 5):
        """The ``n`` fastest fitting candidates."""
        return self.table[self.table["fits"]].head(n)

    def figure(self):
        """Simulated time against predicted peak memory, one point per candidate, the
        device's memory as a line (plotly)."""
        import plotly.express as px

        t = self.table.dropna(subset=["peak_gib"]).assign(
            layout=lambda d: [f"tp{a} pp{b} cp{c} dp{e}" for a, b, c, e in
                              zip(d.tp, d.pp, d.cp, d.dp)])
        fig = px.scatter(t, x="peak_gib", y="time_s", color="packing", symbol="recompute",
                         hover_data=["layout", "max_tokens_per_gpu", "gpu_hours"],
                         labels={"peak_gib": "predicted peak memory per GPU (GiB)",
                                 "time_s": "simulated seconds per rollout batch"},
                         title=f"layouts on {self.gpus} x {self.hardware}: time against memory")
        fig.add_vline(x=self.memory_gib, line_dash="dash", line_color="#d62728",
                      annotation_text=f"{self.hardware} memory")
        return fig


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _layouts(model: ModelShape, gpus: int, max_tp: int, max_pp: int, max_cp: int):
    for tp in _divisors(gpus, max_tp):
        if model.num_attention_heads % tp or model.num_query_groups % tp:
            continue
        for pp in _divisors(gpus // tp, max_pp):
            if model.num_layers % pp:
                continue
            cp = 1
            while cp <= max_cp and (gpus // (tp * pp)) % cp == 0:
                yield tp, pp, cp, gpus // (tp * pp * cp)
                cp *= 2


def _command(tp, pp, cp, cap, packing, recompute, gbs, precision, dist_opt) -> str | None:
    extra = PACKINGS[packing][2]
    if extra is None:
        return None
    flags = (f"--tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp} "
             f"--context-parallel-size {cp} --global-batch-size {gbs} "
             f"--use-dynamic-batch-size --max-tokens-per-gpu {cap}{extra}")
    if tp > 1:
        flags += " --sequence-parallel"
    if dist_opt:
        flags += " --use-distributed-optimizer"
    if precision == "bf16":
        flags += " --bf16"
    return flags + _RECOMPUTE_FLAGS[recompute]


def plan_layouts(rollouts: Rollouts, model: ModelShape | str, gpus: int, *,
                 hardware: str = DEFAULT_HARDWARE, global_batch_size: int | None = None,
                 caps: Sequence[int] = (8192, 16384, 32768),
                 packings: Sequence[str] = tuple(PACKINGS),
                 recompute: Sequence[str] = RECOMPUTE, precision: str = "bf16",
                 distributed_optimizer: bool = True, max_tp: int = 8, max_pp: int = 8,
                 max_cp: int = 8, top: int = 10, progress: bool = False) -> LayoutPlan:
    """The fastest layouts of ``rollouts`` on ``gpus`` GPUs whose predicted peak fits (see the
    module docstring). ``global_batch_size``: rollouts per step (default: all of them, one
    step). ``top``: how many fitting candidates to keep exact (the rest is pruned by time
    once ``top`` fit)."""
    from varbatch_kit.analysis.simulate import simulate
    from varbatch_kit.core.build import build_schedule
    from varbatch_kit.core.config import ScheduleConfig

    t0 = time.perf_counter()
    if not isinstance(rollouts, Rollouts):
        raise ValueError(f"rollouts must be a Rollouts, got {type(rollouts).__name__}")
    model = as_model_shape(model)
    gpus = positive_int("gpus", gpus)
    top = positive_int("top", top)
    prof = hardware_profile(hardware)
    budget = prof.memory_gib * 2**30
    gbs = positive_int("global_batch_size", global_batch_size or rollouts.num_rollouts)
    caps = sorted({positive_int("caps", c) for c in caps})
    unknown = [p for p in packings if p not in PACKINGS]
    bad = [r for r in recompute if r not in RECOMPUTE]
    if unknown or bad or not packings or not recompute:
        raise ValueError(f"packings must be among {list(PACKINGS)} and recompute among "
                         f"{list(RECOMPUTE)} (non-empty), got {list(packings)}, "
                         f"{list(recompute)}")
    recompute = [r for r in RECOMPUTE if r in recompute]  # cheapest first
    for name, value in (("max_tp", max_tp), ("max_pp", max_pp), ("max_cp", max_cp)):
        positive_int(name, value)
    layouts = list(_layouts(model, gpus, max_tp, max_pp, max_cp))  # tp = pp = cp = 1 at least
    rows: list[dict] = []
    pruned = {"static memory": 0, "larger cap than one that did not fit": 0, "time": 0,
              "cannot run": 0}
    fitting: list[float] = []  # simulated times of the fitting candidates, sorted

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(layouts), desc="layouts", unit="layout")
    for tp, pp, cp, dp in layouts:
        if bar is not None:
            bar.update(1)
        mem0 = MemoryLayout(dp=dp, cp=cp, tp=tp, pp=pp, precision=precision,
                            distributed_optimizer=distributed_optimizer)
        static = max(sum(static_memory(model, mem0, r).values()) for r in range(pp))
        if static > budget:
            pruned["static memory"] += len(caps) * len(packings) * len(recompute)
            continue
        for packing in packings:
            pack, dist, _ = PACKINGS[packing]
            for i, cap in enumerate(caps):
                cfg = ScheduleConfig(dp=dp, cp=cp, pp=pp, global_batch_size=gbs,
                                     max_tokens_per_gpu=cap, packing=pack, distribution=dist)
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        sched = build_schedule(rollouts, cfg, model)
                except ValueError:
                    pruned["cannot run"] += len(recompute)
                    continue
                times = {}
                for rc in recompute:
                    bf = 3.0 if rc == "full" else 2.0  # full recomputation: a second forward
                    if bf not in times:
                        sim = simulate(sched, prof, tp=tp, backward_factor=bf, timelines=False)
                        times[bf] = float(sim.total_time_s)
                    t = times[bf]
                    row = {"tp": tp, "pp": pp, "cp": cp, "dp": dp, "max_tokens_per_gpu": cap,
                           "packing": packing, "recompute": rc, "time_s": t,
                           "step_s": t / sched.num_steps, "gpu_hours": t * gpus / 3600,
                           "peak_gib": np.nan, "fits": False,
                           "command": _command(tp, pp, cp, cap, packing, rc, gbs, precision,
                                               distributed_optimizer)}
                    if len(fitting) >= top and t >= fitting[top - 1]:
                        pruned["time"] += 1  # cannot enter the top: memory not predicted
                        rows.append(row)
                        continue
                    mem = MemoryLayout(dp=dp, cp=cp, tp=tp, pp=pp, precision=precision,
                                       recompute=rc,
                                       distributed_optimizer=distributed_optimizer)
                    peak = int(predict_memory(sched, model, mem)["peak_bytes"].max())
                    row.update(peak_gib=peak / 2**30, fits=peak <= budget)
                    rows.append(row)
                    if row["fits"]:
                        fitting = sorted([*fitting, t])
                        break  # more recomputation only costs time
                else:
                    if rows and not rows[-1]["fits"] and rows[-1]["recompute"] == recompute[-1] \
                            and not np.isnan(rows[-1]["peak_gib"]):
                        # nothing fit at this cap: a larger one holds more tokens per GPU
                        skipped = len(caps) - i - 1
                        pruned["larger cap than one that did not fit"] += skipped * len(
                            recompute)
                        break
    if bar is not None:
        bar.close()
    import pandas as pd

    table = pd.DataFrame(rows)
    if not table.empty:
        table = table.sort_values(["fits", "time_s"], ascending=[False, True],
                                  kind="stable").reset_index(drop=True)
    fits = table[table["fits"]] if not table.empty else table
    best = None
    if len(fits):
        best = {k: (None if k == "command" and not isinstance(v, str) else v)
                for k, v in fits.iloc[0].to_dict().items()}
    return LayoutPlan(table=table, best=best, gpus=gpus, hardware=prof.name,
                      memory_gib=prof.memory_gib, pruned=pruned,
                      search_s=time.perf_counter() - t0)
