"""`TrainConfig`: one training run, as nested sub-configs (the layout, the model, the
optimiser, the loss, the data, the run, checkpoints, nodes and fault injection).
:class:`ModelConfig` is defined with its resolver in :mod:`~varbatch_kit.train.config.model_config`.

Every sub-config is a frozen dataclass that checks its own fields in
``__post_init__`` (ValueError naming the field, the value and what works);
:class:`TrainConfig` checks what spans them (``fail_rank`` against the world
size, ``nnodes`` dividing it, a layout the engine runs). Nothing here reads a
file: a checkpoint named by ``ModelConfig(path=...)`` is read once, by
:func:`varbatch_kit.train.config.model_config.resolve_model` (the launcher does it
before any worker starts). Each field's ``metadata["help"]`` is its
documentation and the help of its generated CLI flag (:mod:`~varbatch_kit.train.config.cli_flags`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from typing import Any

from varbatch_kit.core.config import ScheduleConfig
from varbatch_kit.core.flops import ModelShape
from varbatch_kit.train.config.field_checks import documented as _f
from varbatch_kit.train.config.model_config import (
    TOY_DEFAULTS,
    ModelConfig,
    ResolvedModel,
    resolve_model,
)
from varbatch_kit.train.config.parallel_layout import CP_IMPLS, ParallelLayout
from varbatch_kit.train.config.pipeline_checks import pipeline_depth_problem
from varbatch_kit.train.config.sub_configs import (
    CheckpointConfig,
    DataConfig,
    FaultConfig,
    LossConfig,
    NodesConfig,
    OptimConfig,
    RunConfig,
)

__all__ = ["DEFAULT_MAX_TOKENS_PER_GPU", "PRECISIONS", "SCHEDULE_FIELDS", "SUB_CONFIGS",
           "TrainConfig"]

# ScheduleConfig fields that TrainConfig.with_() routes to the schedule
SCHEDULE_FIELDS = tuple(f.name for f in fields(ScheduleConfig) if f.init)

#: TrainConfig.precision: fp32 (the default), bf16, or fp64 (float64 parameters, optimizer,
#: activations and reductions on the CPU: the reference of the layout-invariance matrices,
#: whose differences sit ~1e-14 below fp32's; tests/integration/test_train_parallel.py)
PRECISIONS = ("fp32", "bf16", "fp64")


#: TrainConfig's sub-config fields and their classes, in order
SUB_CONFIGS: dict[str, type] = {
    "model": ModelConfig, "optim": OptimConfig, "loss": LossConfig, "data": DataConfig,
    "run": RunConfig, "checkpoint": CheckpointConfig, "nodes": NodesConfig,
    "faults": FaultConfig,
}
# field name -> sub-config, for TrainConfig.with_(lr=...) (every name is unique)
_ROUTE = {f.name: group for group, cls in SUB_CONFIGS.items() for f in fields(cls)}
assert len(_ROUTE) == sum(len(fields(c)) for c in SUB_CONFIGS.values())
assert not set(_ROUTE) & (set(SCHEDULE_FIELDS) | set(SUB_CONFIGS) | {"mode", "schedule"})


#: the token cap of the default layout (and of the train CLI when no batch size is given)
DEFAULT_MAX_TOKENS_PER_GPU = 256


def _default_schedule() -> ScheduleConfig:
    return ScheduleConfig(dp=1, global_batch_size=4, max_tokens_per_gpu=DEFAULT_MAX_TOKENS_PER_GPU)


# --------------------------------------------------------------------------- TrainConfig
@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs besides the rollouts.

    ``schedule``: a :class:`~varbatch_kit.ScheduleConfig` (dp, cp,
    global_batch_size in rollouts, micro_batch_size or max_tokens_per_gpu,
    packing, distribution, cp_mode). ``cp > 1`` runs all-gather context
    parallelism by default (``cp_impl="allgather"``,
    :mod:`~varbatch_kit.train.parallel.cp_attention`):
    each CP rank runs the model on its zigzag share, K/V all-gathered over the
    micro-batch's CP group; ``cp_impl="emulated"`` is the reference (every CP
    rank runs the full forward, loss and reports on its zigzag slice).
    Gradients are averaged over all dp*cp ranks. With ``cp_mode="dynamic"``
    each micro-batch runs on its own CP group of the dp*cp pool. ``pp`` and
    ``vpp`` (the schedule's) and ``tp``
    (here) complete the layout (:class:`~varbatch_kit.train.config.parallel_layout.ParallelLayout`):
    ``world_size = dp * cp * pp * tp``; a layout the engine cannot run is refused
    here, before any worker starts. ``cp_impl`` says how ``cp > 1`` runs
    (:data:`~varbatch_kit.train.config.parallel_layout.CP_IMPLS`).

    ``mode``: loss / report normalisation, a name in
    :data:`varbatch_kit.report.REPORT_MODES` (``per_rollout_mean`` is slime's
    default; ``naive_*`` modes are for comparison only).

    The rest are sub-configs: ``model`` (:class:`ModelConfig`), ``optim``
    (:class:`OptimConfig`), ``loss`` (:class:`LossConfig`), ``data``
    (:class:`DataConfig`), ``run`` (:class:`RunConfig`), ``checkpoint``
    (:class:`CheckpointConfig`), ``nodes`` (:class:`NodesConfig`), ``faults``
    (:class:`FaultConfig`)::

        TrainConfig(schedule=ScheduleConfig(dp=2, global_batch_size=8, max_tokens_per_gpu=256),
                    model=ModelConfig(num_layers=2), optim=OptimConfig(lr=1e-3),
                    run=RunConfig(max_steps=5))

    :meth:`with_` changes fields by name across the sub-configs.
    """

    schedule: ScheduleConfig = field(default_factory=_default_schedule, metadata={
        "help": "the layout: a ScheduleConfig"})
    mode: str = _f("per_rollout_mean", "loss/report mode (varbatch_kit.report.REPORT_MODES)")
    tp: int = _f(1, "tensor-parallel size: megatron's column/row parallel layers over tp ranks")
    ep: int = _f(1, "expert-parallel size (a mixture of experts): each of ep ranks of the "
                    "data-parallel pool holds 1/ep of every MoE layer's experts, tokens "
                    "dispatched by all-to-all; divides dp")
    precision: str = _f("fp32", "fp32; bf16: megatron's bf16 (Float16Module) with fp32 main "
                                "params and grads, grads reduced in fp32, loss and reports in "
                                "fp32 or wider; fp64 (CPU only): everything in float64, the "
                                "reference of the layout-invariance tests", choices=PRECISIONS)
    cp_impl: str = _f("allgather", "how cp > 1 runs: allgather = each CP rank runs its zigzag "
                                  "share, K/V all-gathered; emulated = every CP rank runs the "
                                  "full forward, loss on its slice (the reference)",
                      choices=CP_IMPLS)
    sequence_parallel: bool | None = _f(
        None, "megatron's sequence parallelism over the tp ranks (norms and dropout on a "
              "1/tp slice of the sequence, packed rows padded to a multiple of tp); None: on "
              "when tp > 1, as slime runs tp (--sequence-parallel); True needs tp > 1")
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    nodes: NodesConfig = field(default_factory=NodesConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)

    def __post_init__(self) -> None:
        from varbatch_kit.report import get_report_mode

        if not isinstance(self.schedule, ScheduleConfig):
            raise ValueError(  # noqa: TRY004 - user errors are ValueError (docs/architecture.md)
                f"schedule={self.schedule!r}: give a ScheduleConfig")
        for name, cls in SUB_CONFIGS.items():
            value = getattr(self, name)
            if not isinstance(value, cls):
                raise ValueError(f"{name}={value!r}: give a {cls.__name__} (TrainConfig's "
                                 f"{name} sub-config)")
        get_report_mode(self.mode)
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r}: choose one of {PRECISIONS}")
        if self.sequence_parallel not in (None, True, False):
            raise ValueError(f"sequence_parallel={self.sequence_parallel!r}: give True, False or "
                             "None (on when tp > 1)")
        # accepted and ignored would be a bug: a layout the engine cannot run is refused here,
        # once (building the layout checks its sizes and cp_impl); the pipeline's depth here
        # when the config gives it, else once the checkpoint is read (plan_runs), and tp's
        # split of the heads there too
        self.layout.check()
        depth = self.known_depth()
        problem = depth and pipeline_depth_problem(num_layers=depth, pp=self.schedule.pp,
                                                   vpp=self.schedule.vpp)
        if problem:
            raise ValueError(problem)
        self._check_injected_bugs()
        if self.optim.distributed and self.precision == "fp64" and self.checkpoint.save_every:
            raise ValueError(
                "checkpoint.save_every with optim.distributed and precision='fp64': megatron's "
                "distributed optimizer gathers its shards for a checkpoint in float32, so a "
                "float64 run would not resume exactly; use precision 'fp32' or 'bf16', or "
                "optim.distributed=False")
        if not self.faults.fail_rank < self.world_size:
            raise ValueError(f"faults.fail_rank={self.faults.fail_rank}: give a rank of the "
                             f"world of dp*cp*pp*tp={self.world_size}, in [0, {self.world_size})")
        if self.world_size % self.nodes.nnodes:
            raise ValueError(f"nodes.nnodes={self.nodes.nnodes} does not divide dp*cp*pp*tp="
                             f"{self.world_size}: every node starts world_size/nnodes workers")

    def _check_injected_bugs(self) -> None:
        """An injected bug that would change nothing in this run is refused: a fault test
        that sets it wrong would test nothing."""
        from varbatch_kit.report import get_report_mode

        f, mode = self.faults, get_report_mode(self.mode)
        if f.stale_loss_prescale and mode.megatron_per_token_loss:
            raise ValueError(f"faults.stale_loss_prescale with mode={self.mode!r}: its loss "
                             "prescale does not use the micro-batch count; use a mode such as "
                             "'per_rollout_mean'")
        if f.cp_duplicate_token_counts and not (mode.megatron_per_token_loss and self.cp > 1):
            raise ValueError(f"faults.cp_duplicate_token_counts with mode={self.mode!r}, cp="
                             f"{self.cp}: it acts on per_token's token count under cp > 1; use "
                             "mode='per_token' and cp >= 2")
        swap = f.cp_swap_chunks_rank
        if swap is not None and (self.cp == 1 or self.cp_impl != "allgather" or swap >= self.cp):
            raise ValueError(f"faults.cp_swap_chunks_rank={swap} with cp={self.cp}, cp_impl="
                             f"{self.cp_impl!r}: it acts on the K/V exchange of all-gather CP, "
                             "on a CP rank in [0, cp); use cp >= 2, cp_impl='allgather' and a "
                             f"rank below {max(self.cp, 2)}")
        if f.sp_norm_grads_unreduced and not self.layout.sp:
            raise ValueError("faults.sp_norm_grads_unreduced without sequence parallelism: it "
                             "acts on the norms' gradients of a sequence-parallel run; use tp >= 2 "
                             "with sequence_parallel on")
        if f.microbatch_denominators and mode.denominators != "rollout":
            raise ValueError(f"faults.microbatch_denominators with mode={self.mode!r}: its "
                             "denominators do not depend on the other samples of the step; use "
                             "a mode with per-rollout denominators such as 'per_rollout_mean'")

    # ----------------------------------------------------------------- derived
    def known_depth(self) -> int | None:
        """The model's layer count when the config alone gives it (``num_layers``, or the toy
        GPT's default); None for a checkpoint at its own depth (read by ``plan_runs``)."""
        if self.model.num_layers is not None:
            return self.model.num_layers
        return TOY_DEFAULTS["num_layers"] if self.model.path is None else None

    @property
    def dp(self) -> int:
        return self.schedule.dp

    @property
    def cp(self) -> int:
        return self.schedule.cp

    @property
    def pp(self) -> int:
        return self.schedule.pp

    @cached_property
    def layout(self) -> ParallelLayout:
        """The whole parallel layout
        (:class:`~varbatch_kit.train.config.parallel_layout.ParallelLayout`), built (and
        checked) once per configuration."""
        s = self.schedule
        sp = self.tp > 1 if self.sequence_parallel is None else self.sequence_parallel
        return ParallelLayout(dp=s.dp, cp=s.cp, pp=s.pp, vpp=s.vpp, tp=self.tp,
                              cp_impl=self.cp_impl, cp_mode=s.cp_mode, mb_group=s.mb_group,
                              sp=sp, ep=self.ep)

    @property
    def world_size(self) -> int:
        """Worker processes: dp * cp * pp * tp."""
        return self.layout.world_size

    def resolve_model(self) -> ResolvedModel:
        """The model read once: :func:`~varbatch_kit.train.config.model_config.resolve_model`."""
        return resolve_model(self.model)

    def model_shape(self) -> ModelShape:
        """The model's shape (reads a checkpoint's ``config.json``: keep the
        :meth:`resolve_model` result when you need it more than once)."""
        return self.resolve_model().shape

    def lr_increment_unit(self) -> str:
        """``rollouts`` or ``samples``: what the LR schedule counts."""
        if self.optim.lr_increment != "auto":
            return self.optim.lr_increment
        from varbatch_kit.report import get_report_mode

        return "rollouts" if get_report_mode(self.mode).divisor == "rollouts" else "samples"

    @property
    def name(self) -> str:
        """A short label: the given one, else ``dp2 cp1 first_fit/strided per_rollout_mean``."""
        if self.run.label:
            return self.run.label
        s = self.schedule
        # a layout whose micro-batches may take several CP degrees says so ("cp2 dynamic")
        cp = f"cp{s.cp}" + ("" if len(s.cp_degrees) == 1 else f" {s.cp_mode}")
        more = "".join(f" {k}{v}" for k, v in (("pp", s.pp), ("vpp", s.vpp), ("tp", self.tp),
                                               ("ep", self.ep)) if v > 1)
        more += " no-sp" if self.tp > 1 and not self.layout.sp else ""
        more += " dist-opt" if self.optim.distributed else ""
        more += "" if self.precision == "fp32" else f" {self.precision}"
        return f"dp{s.dp} {cp}{more} {s.packing}/{s.distribution} {self.mode}"

    def with_(self, **changes: Any) -> TrainConfig:
        """A copy with fields changed, by name: ``schedule``, ``mode`` or a sub-config whole,
        a ScheduleConfig field (``dp``, ``packing``, ...) or a sub-config field (``lr``,
        ``max_steps``, ``num_layers``, ...: every name is unique), or ``"optim.lr"``.

        Changing ``path`` (the model's checkpoint) resets the shape fields not given
        (``num_layers`` included: the new model's full depth).
        """
        unknown = [k for k in changes if k.partition(".")[2] == "" and k not in _ROUTE
                   and k not in SCHEDULE_FIELDS and k not in {f.name for f in fields(self)}]
        if unknown:
            raise ValueError(f"with_: unknown field(s) {unknown}; give TrainConfig, "
                             "ScheduleConfig or sub-config field names (e.g. lr, dp, max_steps)")
        top: dict[str, Any] = {}
        per_group: dict[str, dict[str, Any]] = {}
        sched: dict[str, Any] = {}
        for key, value in changes.items():
            group, dot, name = key.partition(".")
            if dot:
                if group == "schedule":
                    sched[name] = value
                elif group in SUB_CONFIGS:
                    per_group.setdefault(group, {})[name] = value
                else:
                    raise ValueError(f"with_: {key!r} names no sub-config; choose one of "
                                     f"{tuple(SUB_CONFIGS)} or schedule")
            elif key in SCHEDULE_FIELDS:
                sched[key] = value
            elif key in _ROUTE:
                per_group.setdefault(_ROUTE[key], {})[key] = value
            else:
                top[key] = value
        if sched:
            top["schedule"] = top.get("schedule", self.schedule).with_(**sched)
        for group, kw in per_group.items():
            base = top.get(group, getattr(self, group))
            if group == "model" and "path" in kw and kw["path"] != base.path:
                for name in ("num_layers", "hidden_size", "num_attention_heads",
                             "ffn_hidden_size", "vocab_size"):
                    kw.setdefault(name, None)
            top[group] = replace(base, **kw)
        return replace(self, **top)

    def summary(self) -> dict[str, Any]:
        """Flat dict of the fields a comparison table shows."""
        s = self.schedule
        return {
            "label": self.name, "dp": s.dp, "cp": s.cp, "cp_mode": s.cp_mode, "pp": s.pp,
            "vpp": s.vpp, "tp": self.tp, "ep": self.ep, "sequence_parallel": self.layout.sp,
            "cp_impl": self.cp_impl if s.cp > 1 else None,
            "world_size": self.world_size, "precision": self.precision,
            "packing": s.packing,
            "distribution": s.distribution, "global_batch_size": s.global_batch_size,
            "micro_batch_size": s.micro_batch_size, "max_tokens_per_gpu": s.max_tokens_per_gpu,
            "mode": self.mode,
        }
