"""The packing explorer: how one step is packed into micro-batches and spread over ranks.

Built on :class:`~varbatch_kit.ui.explorer_engine.Explorer`; the figures come
from :mod:`varbatch_kit.ui.viz`. Made by
:func:`varbatch_kit.ui.widgets.packing_explorer`; see :mod:`varbatch_kit.ui.widgets`
for how to drive it.

An explorer's :meth:`~PackingExplorer.config` is the config the user passed,
changed by the controls with :meth:`ScheduleConfig.with_batching` (the
packing control picks static or dynamic batching through
:func:`varbatch_kit.core.config.decide_batching`); every field no control
shows (``pp``, ``microbatch_order``, ``alignment_fallback``, ``cp_sizes``,
``log_probs_max_tokens_per_gpu`` on the dynamic path, ...) is kept. The
cache is keyed on that config (:class:`~varbatch_kit.ui.explorer_engine.ComputeKey`).
"""

from __future__ import annotations

import time

import ipywidgets as W
import numpy as np
import plotly.graph_objects as go

from varbatch_kit.core.build import build_schedule
from varbatch_kit.core.config import ScheduleConfig
from varbatch_kit.core.flops import ModelShape
from varbatch_kit.core.hardware import DEFAULT_HARDWARE, hardware_profile
from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.core.schedule import Schedule
from varbatch_kit.policies.registry import DISTRIBUTIONS, PACKERS
from varbatch_kit.ui import viz
from varbatch_kit.ui.explorer_controls import (
    CP_CHOICES,
    DP_CHOICES,
    MB_GROUP_CHOICES,
    VPP_CHOICES,
    _cap_range,
    _follow_required_distribution,
    _packing_is_dynamic,
)
from varbatch_kit.ui.explorer_engine import ComputeKey, Explorer, span
from varbatch_kit.ui.figure_output import FigureOutput

__all__ = ["PACKING_CONTROLS", "PackingExplorer"]


#: control name -> description shown next to it, packing explorer
#: the memory the summary's headroom is against: the default hardware's
MEMORY_GIB = hardware_profile(DEFAULT_HARDWARE).memory_gib

PACKING_CONTROLS = {
    "max_tokens_per_gpu": "max_tokens_per_gpu",
    "micro_batch_size": "micro_batch_size",
    "packing": "packing",
    "distribution": "distribution",
    "dp": "dp",
    "cp": "cp",
    "cp_mode": "cp_mode",
    "vpp": "vpp",
    "mb_group": "mb_group",
    "global_batch_size": "global_batch_size",
    "step": "step",
}


def _degree_counts(schedule: Schedule, step: int) -> dict[int, int]:
    """Micro-batches of the step per CP degree (fixed CP: all at ``cp``)."""
    st = schedule.step(step)
    out: dict[int, int] = {}
    for p in st.placements:
        out[p.degree] = out.get(p.degree, 0) + 1
    return dict(sorted(out.items()))


class PackingExplorer(Explorer):
    """Explore how one step is packed into micro-batches and spread over ranks.

    Controls (``controls[name]``; the description equals the name):
    ``max_tokens_per_gpu`` (IntSlider, the token cap; disabled for static
    packing), ``micro_batch_size`` (IntSlider; static packing only),
    ``packing`` and ``distribution`` (Dropdowns listing the registered
    policies), ``dp``, ``cp``, ``vpp``, ``mb_group`` (Dropdowns),
    ``cp_mode`` (ToggleButtons ``fixed`` / ``dynamic``: one CP degree for
    every micro-batch, or a degree and a CP group per micro-batch),
    ``global_batch_size`` (BoundedIntText, rollouts per step) and ``step``
    (Dropdown of the schedule's steps).

    Below the packing figure, :attr:`cp_figure` shows the step's CP plan
    (:func:`varbatch_kit.ui.viz.cp_plan_figure`: world ranks x rounds, each
    micro-batch over its CP group, coloured by degree). Under dynamic CP the
    packing figure shows the fixed-CP plan of the same settings (the one the
    planner compares against) and the CP plan figure the dynamic one.

    ``state`` keys (the shown step): ``step, micro_batches`` (= bars of the
    figure's ``micro-batches`` trace), ``mb_lower_bound, over_cap`` (▼
    markers: every micro-batch over the cap), ``cap_violations`` (those with
    two or more samples), ``oversize_alone`` (a single sample longer than the
    cap), ``flops_imbalance, makespan_ratio, token_imbalance, samples,
    tokens``, ``cp_mode, rounds, fixed_rounds, degrees`` (micro-batches per
    CP degree), under dynamic CP with a model ``fixed_s, dynamic_s, speedup``
    (simulated seconds of all steps, :func:`varbatch_kit.analysis.simulate.simulate`
    on its default profile, H100); with a model ``peak_gib, headroom_gib`` (the step's
    busiest GPU, :func:`varbatch_kit.core.memory.predict_memory` in bf16 with tp 1 and the
    distributed optimizer, against H100's memory; the summary shows both next to the cap);
    and over the schedule ``steps, total_micro_batches`` (plus ``error`` while one is shown).
    """

    kind = "packing-explorer"

    def __init__(self, rollouts: Rollouts, model: ModelShape | None = None, *,
                 config: ScheduleConfig | None = None, step: int = 0,
                 debounce_s: float = 0.05, background: bool = True) -> None:
        if not isinstance(rollouts, Rollouts):
            raise ValueError(  # noqa: TRY004 - the project reports user errors as ValueError
                f"rollouts must be a Rollouts, got {type(rollouts).__name__}")
        self.rollouts = rollouts
        self.model = model
        if config is None:
            config = ScheduleConfig(
                dp=8, global_batch_size=max(1, rollouts.num_rollouts // 4),
                max_tokens_per_gpu=16384,
                distribution="flops_kk" if model is not None else "strided")
        self._initial = config
        self._initial_step = step
        super().__init__(debounce_s=debounce_s, background=background)
        if getattr(self, "cp_figure", None) is None:
            self.cp_figure = go.Figure()
        self.cp_output = FigureOutput(self.cp_figure, "vbk-cp-figure")
        children = list(self.widget.children)
        children.insert(children.index(self.figure_output.widget) + 1, self.cp_output.widget)
        self.widget.children = tuple(children)

    @property
    def schedule(self) -> Schedule | None:
        """The schedule shown (the last valid one)."""
        return None if self._last_good is None else self._last_good["schedule"]

    def _make_controls(self) -> dict[str, W.Widget]:
        c = self._initial
        cap = c.max_tokens_per_gpu or 16384
        lo, hi = _cap_range(self.rollouts, cap)  # the config's values stay reachable
        style = {"description_width": "initial"}
        wide = W.Layout(width="420px")
        small = W.Layout(width="150px")

        def dd(name, options, value, layout=small):
            opts = list(options)
            if value not in opts:
                opts.append(value)
            return W.Dropdown(options=opts, value=value, description=name, style=style,
                              layout=layout)

        n_roll = self.rollouts.num_rollouts
        controls = {
            "max_tokens_per_gpu": W.IntSlider(
                value=cap, min=lo, max=hi, step=512,
                description="max_tokens_per_gpu", continuous_update=True, style=style,
                layout=wide, disabled=not c.dynamic),
            "micro_batch_size": W.IntSlider(
                value=c.micro_batch_size or 4, min=1, max=max(64, c.micro_batch_size or 4),
                description="micro_batch_size",
                style=style, layout=W.Layout(width="300px"), disabled=c.dynamic),
            "packing": dd("packing", PACKERS, c.packing, W.Layout(width="210px")),
            "distribution": dd("distribution", DISTRIBUTIONS, c.distribution,
                               W.Layout(width="230px")),
            "dp": dd("dp", DP_CHOICES, c.dp, W.Layout(width="140px")),
            "cp": dd("cp", CP_CHOICES, c.cp, W.Layout(width="110px")),
            "cp_mode": W.ToggleButtons(options=["fixed", "dynamic"], value=c.cp_mode,
                                       description="cp_mode", style={
                                           "description_width": "initial",
                                           "button_width": "70px"}),
            "vpp": dd("vpp", VPP_CHOICES, c.vpp, W.Layout(width="110px")),
            "mb_group": dd("mb_group", MB_GROUP_CHOICES, c.mb_group, W.Layout(width="150px")),
            "global_batch_size": W.BoundedIntText(
                value=c.global_batch_size, min=1, max=max(n_roll, c.global_batch_size),
                description="global_batch_size", style=style, layout=W.Layout(width="230px")),
            "step": W.Dropdown(options=[self._initial_step], value=self._initial_step,
                               description="step", style=style, layout=W.Layout(width="130px")),
        }
        return controls

    def _control_box(self) -> W.Widget:
        c = self.controls
        return W.VBox([
            W.HBox([c["packing"], c["distribution"], c["max_tokens_per_gpu"],
                    c["micro_batch_size"]], layout=W.Layout(flex_flow="row wrap")),
            W.HBox([c["dp"], c["cp"], c["cp_mode"], c["vpp"], c["mb_group"],
                    c["global_batch_size"], c["step"]], layout=W.Layout(flex_flow="row wrap")),
        ])

    def _skeleton(self) -> go.Figure:
        return viz.empty_packing_figure()

    def _sync_controls(self, change: dict) -> None:
        if change.get("owner") is self.controls["packing"]:
            dynamic = _packing_is_dynamic(self.controls["packing"].value)
            self.controls["max_tokens_per_gpu"].disabled = not dynamic
            self.controls["micro_batch_size"].disabled = dynamic
            _follow_required_distribution(self)

    def config(self) -> ScheduleConfig:
        """The config the controls describe: the one passed, changed by the controls.

        The packing control picks the batching path and with it the size
        slider that counts (:meth:`ScheduleConfig.with_batching`); the fields
        no control shows are the passed config's. ``ValueError`` if the
        controls describe no valid config.
        """
        v = {k: w.value for k, w in self.controls.items()}
        return self._initial.with_batching(
            packing=v["packing"], micro_batch_size=int(v["micro_batch_size"]),
            max_tokens_per_gpu=int(v["max_tokens_per_gpu"]), distribution=v["distribution"],
            dp=int(v["dp"]), cp=int(v["cp"]), vpp=int(v["vpp"]), mb_group=int(v["mb_group"]),
            global_batch_size=int(v["global_batch_size"]), cp_mode=v["cp_mode"])

    def _compute(self, params: ComputeKey) -> tuple[dict, dict[str, float]]:
        from varbatch_kit.analysis.quality import step_quality

        t0 = time.perf_counter()
        config = params.config
        schedule = build_schedule(self.rollouts, config, self.model)
        # the packing view and its quality numbers come from the fixed-CP plan of the same
        # settings (a dynamic plan has no DP ranks); when that is another plan, the CP plan
        # view shows both and the simulator times both the same way
        fixed_config = config.with_(cp_mode="fixed")
        fixed = (schedule if fixed_config == config else
                 build_schedule(self.rollouts, fixed_config, self.model))
        compared = fixed is not schedule
        simulated = None
        if compared and self.model is not None:
            from varbatch_kit.analysis.simulate import simulate

            # the whole schedule on the default profile, the one the planner's default
            # cost model describes
            simulated = {k: simulate(s, timelines=False).total_time_s
                         for k, s in (("fixed", fixed), ("dynamic", schedule))}
        memory = None
        if self.model is not None:  # each step's busiest GPU, as slime's scripts train
            from varbatch_kit.core.memory import MemoryLayout, predict_memory

            c = fixed.config
            try:
                layout = MemoryLayout(dp=c.dp, cp=c.cp, pp=c.pp, vpp=c.vpp, precision="bf16",
                                      distributed_optimizer=True,
                                      mb_group=c.mb_group if c.vpp > 1 else None)
                memory = predict_memory(fixed, self.model, layout).groupby("step")[
                    "peak_bytes"].max()
            except ValueError as e:  # e.g. the model's layers do not split over pp x vpp
                memory = str(e)
        t1 = time.perf_counter()
        quality = step_quality(fixed)
        t2 = time.perf_counter()
        return ({"schedule": schedule, "fixed": fixed, "compared": compared, "quality": quality,
                 "simulated": simulated, "memory": memory},
                {"schedule_ms": 1e3 * (t1 - t0), "stats_ms": 1e3 * (t2 - t1)})

    def _render(self, result: dict) -> None:
        schedule: Schedule = result["schedule"]
        q = result["quality"]
        steps = list(range(schedule.num_steps))
        step_ctl = self.controls["step"]
        step = step_ctl.value if step_ctl.value in steps else 0
        if list(step_ctl.options) != steps or step_ctl.value != step:
            self._suspend = True
            try:
                step_ctl.options = steps
                step_ctl.value = step
            finally:
                self._suspend = False
        fixed: Schedule = result.get("fixed", schedule)
        data = viz.packing_traces(fixed, step)
        compared = bool(result.get("compared", False))
        if compared:
            data["layout"]["title"]["text"] = (
                "fixed-CP plan of these settings (dynamic plan below) — "
                + data["layout"]["title"]["text"])
        with self.figure.batch_update():
            viz.apply_traces(self.figure, data)
        self._render_cp_plan(schedule, step)
        row = q.iloc[step]
        info = data["info"]
        bound = row["mb_lower_bound"]
        # quality counts a lone sample longer than the cap apart from real violations
        violations = int(row["cap_violations"])
        alone = int(row["oversize_alone"]) if "oversize_alone" in row.index else 0
        self.state = {
            "step": step, "micro_batches": info["micro_batches"],
            "mb_lower_bound": None if np.isnan(bound) else int(bound),
            "over_cap": info["over_cap"], "cap_violations": violations, "oversize_alone": alone,
            "samples": info["samples"], "tokens": info["tokens"],
            "flops_imbalance": float(row["flops_imbalance"]),
            "makespan_ratio": float(row["makespan_ratio"]),
            "token_imbalance": float(row["token_imbalance"]),
            "steps": schedule.num_steps, "total_micro_batches": int(q["micro_batches"].sum()),
            "cp_mode": schedule.config.cp_mode,
            "rounds": schedule.step(step).num_rounds,
            "fixed_rounds": fixed.step(step).num_rounds,
            "degrees": _degree_counts(schedule, step),
        }
        memory = result.get("memory")
        if isinstance(memory, str):
            self.state["memory_note"] = memory
        elif memory is not None:
            peak = float(memory.loc[step]) / 2**30
            self.state.update(peak_gib=peak, headroom_gib=MEMORY_GIB - peak)
        sim = result.get("simulated")
        if sim is not None:
            self.state.update(fixed_s=sim["fixed"], dynamic_s=sim["dynamic"],
                              speedup=sim["fixed"] / sim["dynamic"])
        s = self.state
        imb = s["flops_imbalance"]
        lb = s["mb_lower_bound"] if s["mb_lower_bound"] is not None else "n/a (static)"
        from varbatch_kit.analysis.quality import CAP_VIOLATIONS, OVERSIZE_ALONE

        # the figure's and the tables' words (analysis.quality)
        over = f'{span("vbk-over-cap", s["cap_violations"])} {CAP_VIOLATIONS}'
        if alone:
            over += (f" (+ {span('vbk-oversize-alone', alone)} {OVERSIZE_ALONE}: single "
                     "samples longer than the cap)")
        parts = [
            (f'<span class="vbk-status"></span>step {span("vbk-step", step)}: '
             f'{span("vbk-micro-batches", s["micro_batches"])} micro-batches '
             f'(lower bound ceil(tokens/cap) = {span("vbk-mb-bound", lb)})'),
            over,
            ("DP FLOPs imbalance "
             + span("vbk-imbalance", "n/a" if np.isnan(imb) else f"{imb:.4f}")),
            ("busiest rank / bound for any packing "
             + span("vbk-makespan", "n/a" if np.isnan(imb) else f"{s['makespan_ratio']:.4f}")),
            (f"{s['samples']} samples · {s['steps']} steps, {s['total_micro_batches']} "
             "micro-batches in all"),
        ]
        if "memory_note" in s:
            parts.append(f"predicted peak per GPU: n/a ({s['memory_note']})")
        if "peak_gib" in s:
            parts.append(f"predicted peak per GPU {span('vbk-peak', format(s['peak_gib'], '.1f'))}"
                         f" GiB, headroom {s['headroom_gib']:.1f} GiB of {DEFAULT_HARDWARE}'s "
                         f"{MEMORY_GIB:g} (bf16, tp 1, distributed optimizer; "
                         "varbatch_kit.core.memory)")
        if compared:
            degrees = ", ".join(f"c={c}: {n}" for c, n in s["degrees"].items())
            parts.append(f"dynamic CP: {span('vbk-rounds', s['rounds'])} rounds "
                         f"(fixed {s['fixed_rounds']}), micro-batches per degree {degrees}")
            if "speedup" in s:
                parts.append(f"simulated ({DEFAULT_HARDWARE}, all steps): fixed "
                             f"{s['fixed_s']:.2f} s, dynamic {s['dynamic_s']:.2f} s, "
                             f"{span('vbk-cp-speedup', format(s['speedup'], '.2f'))}× faster")
        self.summary.value = " · ".join(parts)

    def _figure_outputs(self) -> list[FigureOutput]:
        cp = getattr(self, "cp_output", None)
        return super()._figure_outputs() + ([cp] if cp is not None else [])

    def snapshot_figures(self) -> list:
        """The packing figure and, with context parallelism (``cp > 1``: the packing
        figure's title then may point to "the dynamic plan below"), the CP plan below it,
        as in the widget; at ``cp == 1`` the plan is the packing itself and is left out."""
        cp = getattr(self, "cp_figure", None)
        sched = self.schedule
        with_plan = cp is not None and len(cp.data) and sched is not None and sched.config.cp > 1
        return [self.figure] + ([cp] if with_plan else [])

    def _render_cp_plan(self, schedule: Schedule, step: int) -> None:
        """Redraw :attr:`cp_figure` (its traces depend on the degrees present)."""
        new = viz.cp_plan_figure(schedule, step, max_ranks=64)
        fig = getattr(self, "cp_figure", None)
        if fig is None:  # first render, before the widget exists
            self.cp_figure = new
            return
        with fig.batch_update():
            fig.data = ()
            fig.add_traces(list(new.data))
            fig.layout = new.layout
