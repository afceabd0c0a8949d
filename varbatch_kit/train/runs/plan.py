"""What the launcher prepares before any worker starts: one :class:`PlannedRun` per config.

:func:`plan_runs` resolves each distinct model once
(:func:`~varbatch_kit.train.config.model_config.resolve_model`: the checkpoint's
``config.json`` and weights index are read once) and builds each
configuration's schedule **once** (:func:`~varbatch_kit.core.schedule.build_schedule`);
the steps go to the workers in the job file, the checkpoint fingerprint and
the step count come from the same build. It also refuses, with a ValueError,
a configuration that cannot train on the rollouts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from varbatch_kit.core.build import build_schedule
from varbatch_kit.core.log_prob_schedule import build_log_prob_schedule
from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.train.config.model_config import ResolvedModel, resolve_model
from varbatch_kit.train.config.pipeline_checks import pipeline_depth_problem
from varbatch_kit.train.config.train_config import TrainConfig
from varbatch_kit.train.parallel.tensor_parallel import check_tp_split

__all__ = ["PlannedRun", "plan_runs"]


@dataclass(frozen=True)
class PlannedRun:
    """One configuration ready to train: its resolved model, its schedule (built once), the
    steps it trains (the schedule's, cut to ``run.max_steps``) and the steps of its
    forward-only log-prob pass: every step of the log-prob schedule, not cut (the rollout
    batches, and so the advantages and the old log-probs, do not depend on ``max_steps``); the
    training steps themselves unless ``log_probs_max_tokens_per_gpu`` sets another cap."""

    config: TrainConfig
    model: ResolvedModel
    schedule: Any  # varbatch_kit.core.schedule.Schedule
    steps: list
    log_prob_steps: list

    @property
    def num_steps(self) -> int:
        return len(self.steps)


def _check_rollouts(cfg: TrainConfig, model: ResolvedModel, rollouts: Rollouts) -> None:
    from varbatch_kit.train.data.rollout_data import validate_rollout_data

    if (rollouts.prompt_len < 1).any():
        i = int(np.flatnonzero(rollouts.prompt_len < 1)[0])
        raise ValueError(
            f"prompt_len[{i}] = 0: training needs >= 1 prompt token per sample (the first "
            "response token is predicted from the token before it)")
    longest = int(rollouts.total_len.max())
    if cfg.model.max_seq_len is not None and cfg.model.max_seq_len < longest:
        raise ValueError(
            f"model.max_seq_len={cfg.model.max_seq_len} < longest sample ({longest} tokens); "
            "raise it or leave it None")
    # real token sequences are checked here, before any worker starts (no TrainingError wrap)
    validate_rollout_data(rollouts, vocab_size=model.vocab_size, data=cfg.data, loss=cfg.loss)


def _check_interleaved(cfg: TrainConfig, steps) -> None:
    """With ``vpp > 1``: every rank's micro-batch count fits megatron's interleaved schedule."""
    if cfg.schedule.vpp == 1 or cfg.pp == 1:
        return
    from varbatch_kit.train.config.pipeline_checks import interleaved_count_problem

    group = max(cfg.schedule.mb_group, cfg.pp)
    for s in steps:
        for r in range(cfg.layout.pool_size):
            m = sum(1 for w in s.rank_program(r) if not w.idle)
            problem = interleaved_count_problem(m, group, cfg.pp, vpp=cfg.schedule.vpp)
            if problem:
                raise ValueError(f"step {s.index + 1}, pool rank {r}: {problem}")


def _check_moe_layout(cfg: TrainConfig, model: ResolvedModel) -> None:
    """A mixture-of-experts model trains under every layout the engine builds (dp, cp, pp, tp
    with sequence parallelism, ep); ``ep`` divides the expert count. A dense model refuses the
    expert settings (ep, the router's loss coefficients, the injected per-row bug): nothing
    would use them."""
    spec = model.hf
    if not model.is_moe:
        moe_only = {k: v for k, v in (("ep", cfg.ep if cfg.ep > 1 else 0),
                                      ("loss.moe_aux_loss_coeff", cfg.loss.moe_aux_loss_coeff),
                                      ("loss.moe_z_loss_coeff", cfg.loss.moe_z_loss_coeff),
                                      ("faults.moe_aux_per_row", cfg.faults.moe_aux_per_row))
                    if v}
        if moe_only:
            shown = ", ".join(f"{k}={v}" for k, v in moe_only.items())
            raise ValueError(f"{shown}: {model.path or 'the toy GPT'} is a dense model (no "
                             "router); these apply to a mixture-of-experts checkpoint only")
        return
    if cfg.tp > 1 and not cfg.layout.sp:
        raise ValueError(f"tp={cfg.tp} without sequence parallelism: megatron-core's MoE "
                         "layers under tensor parallelism need it (the router and the token "
                         "dispatcher run on each TP rank's slice of the sequence); set "
                         "sequence_parallel=True (the default with tp > 1)")
    if cfg.ep > 1 and cfg.checkpoint.save_every:
        raise ValueError(f"checkpoint.save_every={cfg.checkpoint.save_every} with ep={cfg.ep}: "
                         "checkpoints of an expert-parallel run are not built yet (each rank "
                         "holds other experts and their optimizer states); use ep=1 to "
                         "checkpoint")
    if spec.num_experts % cfg.ep:
        raise ValueError(f"ep={cfg.ep} does not divide the {spec.num_experts} experts of "
                         f"{spec.name}: each expert-parallel rank holds an equal share")


def plan_runs(configs: Sequence[TrainConfig], rollouts: Rollouts) -> list[PlannedRun]:
    """One :class:`PlannedRun` per configuration, in order; ValueError for one that cannot
    train on ``rollouts`` (not a TrainConfig, bad rollouts, no step to train)."""
    models: dict[Any, ResolvedModel] = {}
    plans = []
    for cfg in configs:
        if not isinstance(cfg, TrainConfig):
            raise ValueError(  # noqa: TRY004 - user errors are ValueError
                f"configs must be TrainConfig objects, got {type(cfg).__name__}")
        if cfg.model not in models:
            models[cfg.model] = resolve_model(cfg.model)
        model = models[cfg.model]
        # the layout's rules that need the model read (the others: TrainConfig, once)
        check_tp_split(model, cfg.tp)  # heads, query groups, FFN, vocab divisible by tp
        _check_moe_layout(cfg, model)
        problem = cfg.known_depth() is None and pipeline_depth_problem(
            num_layers=model.num_layers, pp=cfg.pp, vpp=cfg.schedule.vpp)
        if problem:
            raise ValueError(f"{problem} ({model.path or 'the toy GPT'})")
        _check_rollouts(cfg, model, rollouts)
        schedule = build_schedule(rollouts, cfg.schedule, model=model.shape)
        steps = list(schedule.steps[: cfg.run.max_steps] if cfg.run.max_steps
                     else schedule.steps)
        if cfg.faults.fail_at_step is None and not steps:
            raise ValueError("the schedule has no step to train")
        _check_interleaved(cfg, steps)
        # the log-prob pass re-packs each DP rank's samples under its own cap (fixed CP only:
        # a dynamic-CP plan's log-prob pass runs on the training micro-batches)
        lp_steps = list(schedule.steps)
        if schedule.steps and schedule.steps[0].is_fixed_shape:
            lp = build_log_prob_schedule(rollouts, cfg.schedule, model.shape, schedule=schedule)
            lp_steps = list(lp.steps)
        plans.append(PlannedRun(cfg, model, schedule, steps, lp_steps))
    return plans
