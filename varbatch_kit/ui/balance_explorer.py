"""The balance explorer: per-rank FLOPs and tokens of every step against the bound for this packing.

Built on :class:`~varbatch_kit.ui.explorer_engine.Explorer`; the figures come
from :mod:`varbatch_kit.ui.viz`. Made by
:func:`varbatch_kit.ui.widgets.balance_explorer`; see :mod:`varbatch_kit.ui.widgets`
for how to drive it.

An explorer's :meth:`~BalanceExplorer.config` is the config the user passed,
changed by the controls with :meth:`ScheduleConfig.with_batching`; every
field no control shows (``cp``, ``pp``, ``microbatch_order``,
``alignment_fallback``, ``cp_sizes``, ...) is kept. The cache is keyed on
that config (:class:`~varbatch_kit.ui.explorer_engine.ComputeKey`).
"""

from __future__ import annotations

import time

import ipywidgets as W
import plotly.graph_objects as go

from varbatch_kit.core.build import build_schedule
from varbatch_kit.core.config import ScheduleConfig
from varbatch_kit.core.flops import ModelShape, available_presets
from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.core.schedule import Schedule
from varbatch_kit.policies.registry import DISTRIBUTIONS, PACKERS
from varbatch_kit.ui import viz
from varbatch_kit.ui.explorer_controls import (
    DP_CHOICES,
    _cap_range,
    _check_batch_and_preset,
    _follow_required_distribution,
    _hardware_profiles,
    _packing_is_dynamic,
)
from varbatch_kit.ui.explorer_engine import ComputeKey, Explorer, span

__all__ = ["BALANCE_CONTROLS", "BalanceExplorer"]


#: control name -> description, balance explorer
BALANCE_CONTROLS = {  # plus "hardware" when varbatch_kit.analysis.simulate is installed
    "model": "model",
    "max_tokens_per_gpu": "max_tokens_per_gpu",
    "packing": "packing",
    "distribution": "distribution",
    "dp": "dp",
    "global_batch_size": "global_batch_size",
}


class BalanceExplorer(Explorer):
    """Per-rank FLOPs and tokens of every step against the bound for this packing.

    Controls: ``model`` (Dropdown of :func:`available_presets`),
    ``max_tokens_per_gpu`` (IntSlider), ``packing``, ``distribution``,
    ``dp`` (Dropdowns), ``global_batch_size`` (BoundedIntText) and, when
    :mod:`varbatch_kit.analysis.simulate` is installed, ``hardware`` (Dropdown of its
    profiles) for the predicted step time.

    ``state`` keys: ``steps, micro_batches, cap_violations,
    worst_flops_imbalance, worst_makespan_ratio, mean_makespan_ratio`` and,
    with the simulator, ``predicted_s`` (all steps) and ``predicted_bound_s``.
    """

    kind = "balance-explorer"

    def __init__(self, rollouts: Rollouts, model: str = "qwen3-8b", *,
                 config: ScheduleConfig | None = None, debounce_s: float = 0.05,
                 background: bool = True) -> None:
        _check_batch_and_preset(rollouts, model)
        self.rollouts = rollouts
        self._models: dict[str, ModelShape] = {}
        self._initial_model = model
        if config is None:
            config = ScheduleConfig(dp=16, global_batch_size=max(1, rollouts.num_rollouts // 4),
                                    max_tokens_per_gpu=16384, distribution="flops_kk")
        if config.batching != "dynamic":
            raise ValueError("balance_explorer explores token-capped (dynamic) packings: pass a "
                             f"config with max_tokens_per_gpu, got batching={config.batching!r} "
                             f"(micro_batch_size={config.micro_batch_size})")
        self._initial = config
        super().__init__(debounce_s=debounce_s, background=background)

    @property
    def schedule(self) -> Schedule | None:
        """The schedule shown (the last valid one)."""
        return None if self._last_good is None else self._last_good["schedule"]

    def model_shape(self, name: str) -> ModelShape:
        """The preset ``name`` (cached)."""
        if name not in self._models:
            self._models[name] = ModelShape.preset(name)
        return self._models[name]

    def _make_controls(self) -> dict[str, W.Widget]:
        c = self._initial
        lo, hi = _cap_range(self.rollouts, c.max_tokens_per_gpu)
        style = {"description_width": "initial"}
        dynamic_packers = [n for n in PACKERS if _packing_is_dynamic(n)]
        hardware = _hardware_profiles()
        extra = {} if not hardware else {
            "hardware": W.Dropdown(options=hardware, value=hardware[0], description="hardware",
                                   style=style, layout=W.Layout(width="170px"))}
        return {
            "model": W.Dropdown(options=available_presets(), value=self._initial_model,
                                description="model", style=style,
                                layout=W.Layout(width="230px")),
            "max_tokens_per_gpu": W.IntSlider(
                value=c.max_tokens_per_gpu, min=lo, max=hi, step=512,
                description="max_tokens_per_gpu", style=style, layout=W.Layout(width="420px")),
            "packing": W.Dropdown(options=dynamic_packers, value=c.packing,
                                  description="packing", style=style,
                                  layout=W.Layout(width="210px")),
            "distribution": W.Dropdown(options=list(DISTRIBUTIONS), value=c.distribution,
                                       description="distribution", style=style,
                                       layout=W.Layout(width="230px")),
            "dp": W.Dropdown(options=sorted(set(DP_CHOICES) | {c.dp}), value=c.dp,
                             description="dp", style=style, layout=W.Layout(width="140px")),
            "global_batch_size": W.BoundedIntText(
                value=c.global_batch_size, min=1,
                max=max(self.rollouts.num_rollouts, c.global_batch_size),
                description="global_batch_size", style=style, layout=W.Layout(width="230px")),
            **extra,
        }

    def _skeleton(self) -> go.Figure:
        return viz.empty_balance_figure()

    def _sync_controls(self, change: dict) -> None:
        if change.get("owner") is self.controls["packing"]:
            _follow_required_distribution(self)

    def config(self) -> ScheduleConfig:
        """The config the controls describe: the one passed, changed by the controls.

        Every field without a control (``cp``, ``pp``, ``microbatch_order``,
        ``alignment_fallback``, ``cp_sizes``, ...) is the passed config's.
        """
        v = {k: w.value for k, w in self.controls.items()}
        return self._initial.with_batching(
            packing=v["packing"], max_tokens_per_gpu=int(v["max_tokens_per_gpu"]),
            distribution=v["distribution"], dp=int(v["dp"]),
            global_batch_size=int(v["global_batch_size"]))

    def _inputs(self) -> dict[str, str | None]:
        return {"model": self.controls["model"].value,
                "hardware": self.controls["hardware"].value if "hardware" in self.controls
                else None}

    def _compute(self, params: ComputeKey) -> tuple[dict, dict[str, float]]:
        from varbatch_kit.analysis.quality import step_quality

        t0 = time.perf_counter()
        model = self.model_shape(params["model"])
        schedule = build_schedule(self.rollouts, params.config, model)
        t1 = time.perf_counter()
        quality = step_quality(schedule)
        data = viz.balance_traces(schedule)
        predicted = None
        if params["hardware"] is not None:
            from varbatch_kit.analysis.simulate import simulate

            sim = simulate(schedule, hardware=params["hardware"], timelines=False)
            predicted = (float(sim.step_times["time_s"].sum()),
                         float(sim.step_times["bound_s"].sum()))
        t2 = time.perf_counter()
        return ({"schedule": schedule, "quality": quality, "data": data, "predicted": predicted},
                {"schedule_ms": 1e3 * (t1 - t0), "stats_ms": 1e3 * (t2 - t1)})

    def _render(self, result: dict) -> None:
        q = result["quality"]
        data = result["data"]
        with self.figure.batch_update():
            viz.apply_traces(self.figure, data)
        self.state = {
            "steps": len(q), "micro_batches": int(q["micro_batches"].sum()),
            "cap_violations": int(q["cap_violations"].sum()),
            "worst_flops_imbalance": float(q["flops_imbalance"].max()),
            "worst_makespan_ratio": float(q["makespan_ratio"].max()),
            "mean_makespan_ratio": float(q["makespan_ratio"].mean()),
        }
        parts = []
        if result.get("predicted") is not None:
            t, b = result["predicted"]
            self.state.update(predicted_s=t, predicted_bound_s=b)
            parts.append(f"predicted on {self.controls['hardware'].value}: "
                         + span("vbk-predicted", f"{t:.2f} s")
                         + f" for all steps ({100 * (t / b - 1):.1f}% above a perfect schedule)")
        s = self.state
        self.summary.value = " · ".join([
            (f'<span class="vbk-status"></span>{s["steps"]} steps, '
            f'{span("vbk-micro-batches", s["micro_batches"])} micro-batches'),
            f'{span("vbk-over-cap", s["cap_violations"])} over the cap',
            "worst DP FLOPs imbalance " + span("vbk-imbalance",
                                                f"{s['worst_flops_imbalance']:.4f}"),
            "busiest rank / bound for any packing: worst " + span("vbk-makespan",
                                                   f"{s['worst_makespan_ratio']:.4f}")
            + f", mean {s['mean_makespan_ratio']:.4f}",
            *parts,
        ])
