"""`TrainConfig`: one training run — layout, reporting mode, model size, optimiser, debug hooks."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from varbatch_kit.core.config import ScheduleConfig
from varbatch_kit.core.flops import ModelShape

__all__ = ["KILL_POINTS", "SCHEDULE_FIELDS", "TrainConfig"]

# ScheduleConfig fields that TrainConfig.with_() routes to the schedule
SCHEDULE_FIELDS = tuple(f.name for f in fields(ScheduleConfig) if f.init)

LR_DECAY_STYLES = ("constant", "linear", "cosine")
LR_INCREMENTS = ("auto", "rollouts", "samples")
DEVICES = ("auto", "cpu", "cuda")
# the toy GPT's shape when the fields are left unset (no ``model``)
TOY_DEFAULTS = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 64}
# where ``kill_at`` may SIGKILL a worker (see TrainConfig "Debug")
KILL_POINTS = ("before_step", "mid_step", "after_step", "ckpt_after_model", "ckpt_before_rename",
               "after_ckpt")
MODEL_SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size")


def _same_model(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return os.path.abspath(os.path.expanduser(a)) == os.path.abspath(os.path.expanduser(b))


def _default_schedule() -> ScheduleConfig:
    return ScheduleConfig(dp=1, global_batch_size=4, max_tokens_per_gpu=256)


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs besides the rollouts.

    Layout and policy
        ``schedule``: a :class:`~varbatch_kit.ScheduleConfig` (dp, cp,
        global_batch_size in rollouts, micro_batch_size or
        max_tokens_per_gpu, packing, distribution, cp_mode). ``cp > 1`` is
        *emulated* on CPU and without TransformerEngine: every CP rank runs
        the full forward and computes the loss and reports on its zigzag
        slice; gradients are averaged over all dp*cp ranks. With
        ``cp_mode="dynamic"`` each micro-batch runs on its own CP group of
        the dp*cp pool, sliced by its own degree.
    ``mode``
        Loss / report normalisation, a name in
        :data:`varbatch_kit.report.REPORT_MODES` (``per_rollout_mean`` is
        slime's default; ``naive_*`` modes are for comparison only).
    Model (megatron-core ``GPTModel``, local layer spec)
        ``model``: ``None`` (default) for the tiny toy GPT (random init,
        learned absolute positions): ``num_layers`` (default 2),
        ``hidden_size`` (64), ``num_attention_heads`` (4), ``ffn_hidden_size``
        (default ``4 * hidden_size``), ``vocab_size`` (64). Or a local
        Hugging Face checkpoint directory (``config.json`` + ``*.safetensors``;
        Llama, Qwen2, Qwen3, Mistral; see :mod:`varbatch_kit.train.hf`): the
        shape comes from its ``config.json`` and the weights from the
        checkpoint; ``num_layers`` keeps only the first N layers (default:
        all); the other shape fields may be left unset (they are filled in
        from the checkpoint) and must match it when given. The path is
        stored absolute.
        ``max_seq_len`` (default: the longest sample of the rollouts).
    Optimiser (megatron-core Adam, ``OptimizerParamScheduler``)
        ``lr``, ``min_lr``, ``lr_decay_style`` (constant / linear / cosine),
        ``lr_warmup_fraction`` (of the decay horizon), ``weight_decay``,
        ``adam_beta1``, ``adam_beta2``, ``adam_eps``, ``clip_grad`` (0 = off).
        ``lr_increment``: what one step advances the LR schedule by:
        ``rollouts`` or ``samples`` of that step; ``auto`` = rollouts when
        the mode divides by the rollout count, samples otherwise. The decay
        horizon is the total over all trained steps.
    Data
        ``seed`` (model init and toy task), ``n_samples_per_prompt`` (GRPO
        group size, in rollouts).
    Run
        ``max_steps`` (default: every step of the schedule), ``device``
        (auto / cpu / cuda), ``timeout_s``, ``threads_per_worker`` (CPU
        torch threads per worker, default 1: the tiny model gains nothing from
        more, and oversubscribed cores slow OpenMP down badly),
        ``save_params_at`` (1-based steps after
        whose optimiser step rank 0 saves the parameters), ``label``.
    Checkpoints (:mod:`varbatch_kit.train.checkpoint`, docs/checkpoints.md)
        ``save_every``: after every N-th optimiser step rank 0 saves a full
        checkpoint (model, optimiser, LR scheduler, RNG, step, consumed
        rollouts) into ``OUT/checkpoints/step_NNNNNN`` (0 = off, the default);
        ``keep_last``: how many complete checkpoints to keep (default 2).
        ``run(..., resume=True)`` continues from the newest one.
    Several nodes (torchrun's c10d rendezvous)
        ``nnodes`` (default 1), ``node_rank`` (this launcher's node, 0 hosts
        the rendezvous store), ``rdzv_endpoint`` (``"host:port"`` of node 0,
        required when ``nnodes > 1``), ``rdzv_timeout_s`` (how long a node
        waits for the others to join, default 300). Each node starts
        ``dp * cp / nnodes`` workers; the out folder must be on a filesystem
        every node sees. ``step_timeout_s``: a step that has not reported
        within this many seconds of the previous report stops the run
        (default None: only ``timeout_s`` for the whole launch).
    Debug (tests of failure handling; the hooks act on rank ``fail_rank``)
        ``fail_at_step``: that rank raises at the start of that (1-based)
        step. ``hang_at_step``: it sleeps forever there. ``kill_at``:
        ``"POINT:STEP"``, it SIGKILLs itself at that point of that step, one
        of :data:`KILL_POINTS` (``before_step``, ``mid_step`` — in the first
        forward of the step —, ``after_step`` — after the optimiser step,
        before the report —, ``ckpt_after_model`` / ``ckpt_before_rename`` —
        while writing the checkpoint after that step — and ``after_ckpt``).
        ``disk_full_at_step``: the checkpoint after that step is written
        under a 64 KiB file-size limit (``RLIMIT_FSIZE``), so its writes
        fail like on a full disk (rank 0 writes checkpoints).
    Loss (:mod:`varbatch_kit.train.loss`)
        ``clip_eps``: PPO ratio clipping range, ``clip(r, 1 - eps, 1 + eps)``
        (default 0.2); used when the rollouts carry old log-probs
        (``old_logprobs`` / ``rollout_log_probs``), else the loss is the
        on-policy ``-advantage * log p``.
    """

    schedule: ScheduleConfig = field(default_factory=_default_schedule)
    mode: str = "per_rollout_mean"
    # model (None: the toy default, or the checkpoint's value with ``model``)
    model: str | None = None
    num_layers: int | None = None
    hidden_size: int | None = None
    num_attention_heads: int | None = None
    ffn_hidden_size: int | None = None
    vocab_size: int | None = None
    max_seq_len: int | None = None
    # optimiser
    lr: float = 3e-3
    min_lr: float = 3e-4
    lr_decay_style: str = "cosine"
    lr_warmup_fraction: float = 0.0
    lr_increment: str = "auto"
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    # data
    seed: int = 1234
    n_samples_per_prompt: int = 4
    # run
    max_steps: int | None = None
    device: str = "auto"
    timeout_s: float = 600.0
    threads_per_worker: int = 1
    save_params_at: tuple[int, ...] = ()
    label: str | None = None
    # checkpoints and several nodes (docs/checkpoints.md)
    save_every: int = 0
    keep_last: int = 2
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    rdzv_timeout_s: float = 300.0
    step_timeout_s: float | None = None
    # debug
    fail_at_step: int | None = None
    fail_rank: int = 0
    hang_at_step: int | None = None
    kill_at: str | None = None
    disk_full_at_step: int | None = None
    # loss
    clip_eps: float = 0.2

    def __post_init__(self) -> None:
        from varbatch_kit.report import get_report_mode

        if not isinstance(self.schedule, ScheduleConfig):
            raise ValueError(  # noqa: TRY004 - user errors are ValueError (docs/architecture.md)
                f"schedule must be a ScheduleConfig, got {type(self.schedule).__name__}")
        get_report_mode(self.mode)
        if self.schedule.vpp != 1:
            raise ValueError(
                f"schedule.vpp={self.schedule.vpp}: the training engine has no pipeline "
                "parallelism; use vpp=1")
        self._resolve_model()
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                     "n_samples_per_prompt"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.model is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}")
        if isinstance(self.threads_per_worker, bool) or not isinstance(
                self.threads_per_worker, int) or self.threads_per_worker < 1:
            raise ValueError(
                f"threads_per_worker must be a positive integer, got {self.threads_per_worker!r}")
        for name in ("ffn_hidden_size", "max_seq_len", "max_steps",
                     "fail_at_step", "hang_at_step", "disk_full_at_step"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {v!r}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}")
        if not (0 <= self.min_lr <= self.lr):
            raise ValueError(f"min_lr must be in [0, lr={self.lr}], got {self.min_lr!r}")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(
                f"lr_decay_style={self.lr_decay_style!r}; choose one of {LR_DECAY_STYLES}")
        if not 0 <= self.lr_warmup_fraction < 1:
            raise ValueError(
                f"lr_warmup_fraction must be in [0, 1), got {self.lr_warmup_fraction!r}")
        if self.lr_increment not in LR_INCREMENTS:
            raise ValueError(
                f"lr_increment={self.lr_increment!r}; choose one of {LR_INCREMENTS}")
        if self.device not in DEVICES:
            raise ValueError(f"device={self.device!r}; choose one of {DEVICES}")
        if self.clip_grad < 0 or self.weight_decay < 0:
            raise ValueError("clip_grad and weight_decay must be >= 0")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        object.__setattr__(self, "save_params_at", tuple(int(s) for s in self.save_params_at))
        if any(s < 1 for s in self.save_params_at):
            raise ValueError(f"save_params_at holds 1-based steps, got {self.save_params_at}")
        if not 0 <= self.fail_rank < self.world_size:
            raise ValueError(
                f"fail_rank={self.fail_rank} is not a rank of a world of {self.world_size}")
        self._check_checkpoint_and_nodes()
        from varbatch_kit.train.loss import check_clip_eps

        object.__setattr__(self, "clip_eps", check_clip_eps(self.clip_eps))

    def _check_checkpoint_and_nodes(self) -> None:
        for name, lo in (("save_every", 0), ("keep_last", 1), ("nnodes", 1), ("node_rank", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
        if self.world_size % self.nnodes:
            raise ValueError(
                f"nnodes={self.nnodes} does not divide dp*cp={self.world_size}: every node "
                "starts dp*cp/nnodes workers")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} must be in [0, nnodes={self.nnodes})")
        if self.rdzv_endpoint is not None:
            host, _, port = str(self.rdzv_endpoint).rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(
                    f"rdzv_endpoint={self.rdzv_endpoint!r}; give 'host:port' (node 0's address)")
        elif self.nnodes > 1:
            raise ValueError(
                f"nnodes={self.nnodes} needs rdzv_endpoint='host:port' (node 0's address, the "
                "same on every node)")
        if not (isinstance(self.rdzv_timeout_s, (int, float)) and self.rdzv_timeout_s > 0):
            raise ValueError(f"rdzv_timeout_s must be > 0, got {self.rdzv_timeout_s!r}")
        if self.step_timeout_s is not None and not (
                isinstance(self.step_timeout_s, (int, float)) and self.step_timeout_s > 0):
            raise ValueError(f"step_timeout_s must be > 0 or None, got {self.step_timeout_s!r}")
        if self.kill_at is not None:
            point, _, step = str(self.kill_at).partition(":")
            if point not in KILL_POINTS or not step.isdigit() or int(step) < 1:
                raise ValueError(
                    f"kill_at={self.kill_at!r}; give 'POINT:STEP' with POINT one of "
                    f"{KILL_POINTS} and a 1-based STEP")

    def kill_point(self) -> tuple[str, int] | None:
        """``kill_at`` parsed: ``(point, step)``, or None."""
        if self.kill_at is None:
            return None
        point, _, step = self.kill_at.partition(":")
        return point, int(step)

    def _resolve_model(self) -> None:
        """Fill the unset model-shape fields: toy defaults, or the checkpoint's values."""
        for name in MODEL_SHAPE_FIELDS:
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.model is None:
            for name, default in TOY_DEFAULTS.items():
                if getattr(self, name) is None:
                    object.__setattr__(self, name, default)
            return
        if not isinstance(self.model, (str, os.PathLike)):
            raise ValueError(
                f"model must be a checkpoint directory path or None, got {self.model!r}")
        from varbatch_kit.train.hf import read_hf_model

        spec = read_hf_model(self.model)  # ValueError naming what is wrong / supported
        object.__setattr__(self, "model", str(spec.path))
        if self.num_layers is None:
            object.__setattr__(self, "num_layers", spec.num_layers)
        elif self.num_layers > spec.num_layers:
            raise ValueError(
                f"num_layers={self.num_layers}, but {spec.name} has {spec.num_layers} layers; "
                f"keep at most {spec.num_layers} (num_layers=N keeps the first N)")
        for name, value in (("hidden_size", spec.hidden_size),
                            ("num_attention_heads", spec.num_attention_heads),
                            ("ffn_hidden_size", spec.ffn_hidden_size),
                            ("vocab_size", spec.vocab_size)):
            given = getattr(self, name)
            if given is None:
                object.__setattr__(self, name, value)
            elif given != value:
                raise ValueError(
                    f"{name}={given} conflicts with the checkpoint {spec.name} ({name}={value}); "
                    "leave it unset with model=...")

    def hf_model(self):
        """The checkpoint's :class:`~varbatch_kit.train.hf.HFModelSpec` (``None`` for the toy)."""
        if self.model is None:
            return None
        from varbatch_kit.train.hf import read_hf_model

        return read_hf_model(self.model)

    # ----------------------------------------------------------------- derived
    @property
    def dp(self) -> int:
        return self.schedule.dp

    @property
    def cp(self) -> int:
        return self.schedule.cp

    @property
    def world_size(self) -> int:
        """Worker processes: dp * cp."""
        return self.schedule.dp * self.schedule.cp

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    def model_shape(self) -> ModelShape:
        """The model's shape, for FLOPs-balanced packings and distributions.

        For a checkpoint: :meth:`ModelShape.from_hf_config` of its ``config.json``
        with the kept ``num_layers``.
        """
        if self.model is not None:
            shape = ModelShape.from_hf_config(Path(self.model) / "config.json")
            name = Path(self.model).name
            if self.num_layers != shape.num_layers:
                name += f" (first {self.num_layers} of {shape.num_layers} layers)"
            return replace(shape, num_layers=self.num_layers, name=name)
        return ModelShape(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            ffn_hidden_size=self.ffn,
            vocab_size=self.vocab_size,
            name="varbatch-tiny-gpt",
        )

    def lr_increment_unit(self) -> str:
        """``rollouts`` or ``samples``: what the LR schedule counts."""
        if self.lr_increment != "auto":
            return self.lr_increment
        from varbatch_kit.report import get_report_mode

        return "rollouts" if get_report_mode(self.mode).divisor == "rollouts" else "samples"

    @property
    def name(self) -> str:
        """A short label: the given one, else ``dp2 cp1 first_fit/strided per_rollout_mean``."""
        if self.label:
            return self.label
        s = self.schedule
        cp = f"cp{s.cp}" + (" dynamic" if s.cp_mode == "dynamic" else "")
        return f"dp{s.dp} {cp} {s.packing}/{s.distribution} {self.mode}"

    def with_(self, **changes: Any) -> TrainConfig:
        """A copy with fields changed; schedule fields (dp, cp, packing, ...) go to the schedule.

        Changing ``model`` re-derives the model-shape fields not given too
        (``num_layers`` included: the new model's full depth).
        """
        sched = {k: changes.pop(k) for k in list(changes) if k in SCHEDULE_FIELDS}
        if sched:
            changes["schedule"] = changes.get("schedule", self.schedule).with_(**sched)
        if "model" in changes and not _same_model(changes["model"], self.model):
            for name in MODEL_SHAPE_FIELDS + ("ffn_hidden_size",):
                changes.setdefault(name, None)
        return replace(self, **changes)

    def summary(self) -> dict[str, Any]:
        """Flat dict of the fields a comparison table shows."""
        s = self.schedule
        return {
            "label": self.name, "dp": s.dp, "cp": s.cp, "cp_mode": s.cp_mode,
            "packing": s.packing,
            "distribution": s.distribution, "global_batch_size": s.global_batch_size,
            "micro_batch_size": s.micro_batch_size, "max_tokens_per_gpu": s.max_tokens_per_gpu,
            "mode": self.mode,
        }
