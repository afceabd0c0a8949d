"""The training worker: one process per rank, started by ``torchrun`` (see
:mod:`~varbatch_kit.train.runs.launch`).

Run as ``python -m varbatch_kit.train.runs.worker JOB_DIR``. ``JOB_DIR/job.pkl``
holds the rollouts and one or more runs of the same world size: each a
:class:`TrainConfig`, its model resolved once by the launcher
(:class:`~varbatch_kit.train.config.model_config.ResolvedModel`) and the steps of its
schedule, built once by the launcher (a worker builds no schedule). They train
one after the other, each from the same seed, writing to its own output folder.

The pieces: process setup (:mod:`~varbatch_kit.train.parallel.process_setup`), one step
(:mod:`~varbatch_kit.train.step.train_step`, which
also describes the world layout and all-gather / emulated / dynamic CP), checkpoint state
(:mod:`~varbatch_kit.train.runs.run_state`); this module holds the loop over the steps
(:func:`train`)
and the entry point (:func:`main`).
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
import traceback
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.train.config.train_config import TrainConfig
from varbatch_kit.train.runs.results import param_sq_sums
from varbatch_kit.train.runs.step_log import append_record, write_atomic
from varbatch_kit.train.step.tensor_files import save_tensors

__all__ = ["CP_NOTE", "Job", "main", "train"]

CP_NOTE = (
    "emulated CP (cp_impl='emulated'): every CP rank runs the full forward "
    "and computes loss and reports on its zigzag slice; gradients are averaged over dp*cp ranks"
)


@dataclass
class Job:
    """What the launcher hands to the workers (pickled into ``JOB_DIR/job.pkl``).

    Per run: ``configs[k]``, its resolved model ``models[k]``, the steps it
    trains ``steps[k]`` (the launcher's one build of the schedule, cut to
    ``run.max_steps``), the steps of its log-prob pass ``log_prob_steps[k]``
    (:func:`~varbatch_kit.core.log_prob_schedule.build_log_prob_schedule`'s, all of
    them: the rollout batches are the schedule's), ``out_dirs[k]``.
    """

    configs: list[TrainConfig]
    models: list  # ResolvedModel per config
    steps: list  # list[Step] per config
    log_prob_steps: list  # list[Step] per config
    rollouts: Rollouts
    out_dirs: list[str]
    device: str  # "cpu" or "cuda"
    # per config: the checkpoint folder to continue from (None: from scratch), and the
    # fingerprint every checkpoint of it records (see train/runs/checkpoint.py)
    resume_from: list | None = None
    fingerprints: list | None = None
    # a training job kept up across rollout batches (one config): where its batches arrive
    # (train/runs/rollout_feed.py; None: the rollouts above are all it trains)
    feed: object | None = None
    # per config: the folder of the run whose saved parameters it compares its own with at
    # each step of run.save_params_at instead of saving them (None: it saves them; compare's
    # keep_params=False)
    params_refs: list | None = None


# --------------------------------------------------------------------------- one run
def _lr_of(optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])


def _at_point(at, number: int, point: str) -> None:
    at(point, number)


def _segments(steps, log_prob_steps, rollouts, feed, rank: int, out_dir: Path):
    """The parts a run trains one after the other: ``(index, rollouts, steps,
    log_prob_steps)``. Without a feed, one: the job's. With one, the rollout batches of
    ``feed`` (:class:`~varbatch_kit.train.runs.rollout_feed.RolloutFeed`) as they arrive, until
    its stop; while waiting, rank 0 touches ``meta.json`` (the launcher's sign of life)."""
    if feed is None:
        yield 0, rollouts, steps, log_prob_steps
        return

    def alive() -> None:
        if rank == 0:
            os.utime(out_dir / "meta.json")

    k = 0
    while (batch := feed.next_batch(k, wait=alive)) is not None:
        yield k, batch.rollouts, batch.steps, batch.log_prob_steps
        k += 1


def train(cfg: TrainConfig, model_spec, steps: list, log_prob_steps: list, rollouts: Rollouts,
          out_dir: Path, device: torch.device, *, resume_from: str | None = None,
          fingerprint: dict | None = None, feed=None, params_ref: str | None = None) -> None:
    """Train ``cfg`` on ``rollouts`` over ``steps``; rank 0 writes ``out_dir/steps.jsonl``.

    ``model_spec``: the :class:`~varbatch_kit.train.config.model_config.ResolvedModel`;
    ``steps``: the schedule's steps to train (the launcher built them), and
    ``log_prob_steps`` those of the forward-only log-prob pass that runs before
    step 1 (:mod:`varbatch_kit.train.step.policy_inputs`). From
    scratch, or from the checkpoint folder ``resume_from`` (every rank loads
    rank 0's full state; the launcher has truncated the step log to its
    step). With ``cfg.checkpoint.save_every`` rank 0 writes a checkpoint after
    every N-th step (:mod:`varbatch_kit.train.runs.checkpoint`), recording ``fingerprint``.

    ``feed`` (a :class:`~varbatch_kit.train.runs.rollout_feed.RolloutFeed`): the job stays up
    across rollout batches that arrive one by one (the RL loop's trainer,
    :mod:`~varbatch_kit.train.runs.loop_trainer`); ``rollouts`` / ``steps`` are the first
    batch's (its longest sample sets ``max_seq_len`` unless the config does). Each batch's
    steps go on numbering from the last one, one model, optimizer and LR schedule (over
    ``feed.horizon``); after a batch's last step its weights are saved
    (``params_stepN.pt``) and rank 0 marks it done. A resumed job reads the batches again
    from the first and trains only the steps after its checkpoint.

    ``params_ref`` (a run folder, no feed): at each step of ``run.save_params_at`` whose
    parameters that run saved already, rank 0 records ``param_sq_diff`` and ``param_sq_ref``
    against them (:func:`compared_with`) instead of saving its own (``compare``'s
    ``keep_params=False``).
    """
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from varbatch_kit.report import get_report_mode
    from varbatch_kit.train.data.rollout_data import make_training_data
    from varbatch_kit.train.model.gpt import build_gpt, wrap_precision
    from varbatch_kit.train.parallel.expert_parallel import gather_all_experts
    from varbatch_kit.train.parallel.tensor_parallel import (
        full_numel,
        full_parameter_count,
        gather_full_parameters,
    )
    from varbatch_kit.train.runs.run_state import kill_self, restore, save
    from varbatch_kit.train.step.expert_load import expert_load_watch
    from varbatch_kit.train.step.peak_memory import memory_watch
    from varbatch_kit.train.step.policy_inputs import (
        RolloutBatches,
        initial_state_if_needed,
        prepare_policy_inputs,
    )
    from varbatch_kit.train.step.train_step import report_keys, train_step

    rank, world = dist.get_rank(), dist.get_world_size()
    if world != cfg.world_size:
        raise RuntimeError(f"{cfg.name}: world size {world}, config needs {cfg.world_size}")
    out_dir = Path(out_dir)
    mode = get_report_mode(cfg.mode)
    opt, faults = cfg.optim, cfg.faults
    layout = cfg.layout  # the run's parallel layout, built once: every builder and step take it

    max_seq_len = cfg.model.max_seq_len or int(rollouts.total_len.max())

    # model, DDP over all dp*cp ranks, optimizer, LR schedule — identical init on every rank
    torch.manual_seed(cfg.data.seed)
    model_parallel_cuda_manual_seed(cfg.data.seed, inference_rng_tracker=True,
                                    force_reset_rng=True)
    stage = None  # pp > 1: this rank's model chunks (train/model/pipeline_stages.py)
    if layout.pp > 1:
        from varbatch_kit.train.model.pipeline_stages import build_chunks

        stage = build_chunks(model_spec, layout, rank, max_seq_len=max_seq_len,
                             per_token_loss=mode.megatron_per_token_loss,
                             precision=cfg.precision)
        chunks = [c.to(device) for c in stage.chunks]
        gpt = stage.module  # the stage's chunks as one module (its state, its parameters)
    else:
        gpt = build_gpt(model_spec, max_seq_len=max_seq_len, layout=layout, world_rank=rank,
                        per_token_loss=mode.megatron_per_token_loss,
                        precision=cfg.precision).to(device)
        chunks = [gpt]
    if faults.sp_norm_grads_unreduced:  # an injected bug: the norms' gradients stay partial
        from varbatch_kit.train.model.norms import mark_sequence_parallel

        for c in chunks:
            for m in c.modules():
                if isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm)):
                    mark_sequence_parallel(m, False)
    # saved parameters / gradients go to rank 0: without pipelining only its TP group (pool
    # rank 0) gathers them (each dp / cp replica's copy, the size of the model, was dropped)
    # (expert parallelism: every rank, each holding its experts; gather_all_experts below)
    saver = stage is not None or layout.coords(rank).pool_rank == 0 or layout.ep > 1
    experts = model_spec.hf.num_experts if model_spec.is_moe else 0

    def whole(tensors):  # the whole model's tensors on rank 0 (ep > 1: a world collective)
        return gather_all_experts(tensors, layout, rank, experts) if experts else tensors
    # bf16: megatron's Float16Module (bf16 parameters), gradients reduced in fp32 and an
    # optimizer with fp32 main parameters and gradients (train/model/gpt.py wrap_precision)
    bf16 = cfg.precision == "bf16"
    # optim.distributed: megatron's distributed optimizer, its states sharded over the dp*cp
    # pool (megatron's data-parallel group here), gradients reduce-scattered into the shards
    ddp = [DistributedDataParallel(c.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=bf16, use_distributed_optimizer=opt.distributed),
        wrap_precision(c, cfg.precision)) for c in chunks]
    for m in ddp:
        m.broadcast_params()
    config = chunks[0].config  # one config shared by the chunks
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp[0].no_sync if len(ddp) == 1 else [m.no_sync for m in ddp]
    model = ddp[0] if stage is None else ddp
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=opt.lr, min_lr=opt.min_lr,
                        weight_decay=opt.weight_decay, adam_beta1=opt.adam_beta1,
                        adam_beta2=opt.adam_beta2, adam_eps=opt.adam_eps,
                        clip_grad=opt.clip_grad, bf16=bf16,
                        use_distributed_optimizer=opt.distributed),
        ddp,
    )
    if device.type == "cpu":
        fuse_cpu_adam(optimizer)
        # the word embedding's rows into main_grad, not a dense table per micro-batch
        from varbatch_kit.train.model.embedding_grad import route_embedding_grads

        route_embedding_grads(ddp)
    unit = cfg.lr_increment_unit()

    def increments_of(part: list) -> list[int]:  # the LR schedule's increment of each step
        return [s.num_rollouts if unit == "rollouts" else s.num_samples for s in part]

    horizon = max(feed.horizon if feed is not None else sum(increments_of(steps)), 1)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=opt.lr, min_lr=opt.min_lr,
        lr_warmup_steps=int(opt.lr_warmup_fraction * horizon), lr_decay_steps=horizon,
        lr_decay_style=opt.lr_decay_style, start_wd=opt.weight_decay,
        end_wd=opt.weight_decay, wd_incr_steps=horizon, wd_incr_style="constant",
    )

    initial = initial_state_if_needed(cfg.loss, gpt)  # the reference model's weights (a KL term)
    start, consumed, load_s = 0, 0, None
    if resume_from is not None:
        t_load = time.perf_counter()
        start, consumed = restore(resume_from, gpt, optimizer, scheduler,
                                  stage=layout.coords(rank).pp_rank if stage else None,
                                  tp_rank=layout.coords(rank).tp_rank, tp=layout.tp)
        load_s = time.perf_counter() - t_load
    kill = faults.kill_point() if rank == faults.fail_rank else None
    current = {"step": 0}
    if kill is not None and kill[0] == "mid_step":
        def _kill_in_forward(module, args):  # the first forward of the step: mid-step
            if current["step"] == kill[1]:
                kill_self()
        chunks[0].register_forward_pre_hook(_kill_in_forward)

    def at(point: str, number: int) -> None:
        if kill is not None and kill == (point, number):
            kill_self()

    emulated = layout.cp > 1 and layout.cp_impl == "emulated"

    def training_data(part_rollouts):
        # the tokens and advantages: the rollouts' own (Rollouts.extra tokens/reward/
        # advantage), else the toy task's (train/data/rollout_data.py)
        return make_training_data(part_rollouts, vocab_size=model_spec.vocab_size,
                                  seed=cfg.data.seed, data=cfg.data, loss=cfg.loss)

    first_data = training_data(rollouts)  # the first (without a feed: the only) part's
    # the whole model's parameter count, at any tp, ep and pp: a stage counts its own (the
    # last stage's copy of tied embeddings, megatron's `shared`, not), a TP shard counts tp
    # times, an expert-parallel rank's experts ep times; summed over the stages
    parameters = torch.tensor(full_parameter_count(gpt, layout.tp) - sum(
        p.numel() for p in gpt.parameters() if getattr(p, "shared", False)) + (layout.ep - 1) * sum(
        full_numel(p, layout.tp) for n, p in gpt.named_parameters() if ".local_experts." in n))
    if stage is not None:
        from megatron.core import parallel_state

        dist.all_reduce(parameters, group=parallel_state.get_pipeline_model_parallel_group())
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        meta = {
            "config": cfg.summary(), "device": device.type, "world_size": world,
            "layout": layout.describe(),
            "cp_emulated": emulated,
            "cp_note": CP_NOTE if emulated else "",
            # the model, for `varbatch-kit export RUN_DIR` (train/runs/run_export.py)
            "model": {"path": model_spec.path, "num_layers": model_spec.num_layers},
            "parameters": int(parameters),
            "max_seq_len": max_seq_len, "lr_increment": unit,
            # a fed job learns its batches one by one: no step count ahead
            "num_steps": None if feed is not None else len(steps),
            "rollout_feed": None if feed is None else feed.folder,
            "data": first_data.source,
            "rollout_log_probs": first_data.rollout_log_probs is not None,
            "metrics": list(report_keys(cfg.loss, first_data.rollout_log_probs is not None,
                                        moe=model_spec.is_moe)),
            "steps_per_rollout_batch": None if feed is not None else RolloutBatches(
                len(log_prob_steps), cfg.data.num_steps_per_rollout).per_batch,
            "torch": torch.__version__, "resumed_from_step": start if resume_from else None,
            "checkpoint_load_s": load_s,
        }
        write_atomic(out_dir / "meta.json", json.dumps(meta, indent=1).encode())
    # the parts trained one after the other (one, or a feed's rollout batches); the step
    # numbers, the LR schedule's count and the rollout batches' numbers run on across them
    offset, batch_offset = 0, 0
    totals = {"rollouts": 0, "samples": 0}  # consumed by the parts before this one
    for part, part_rollouts, part_steps, part_lp_steps in _segments(
            steps, log_prob_steps, rollouts, feed, rank, out_dir):
        data = first_data if part == 0 else training_data(part_rollouts)
        # rollout batches of data.num_steps_per_rollout steps (a fed batch: one): before the
        # first step of each, the log-prob pass, the advantages and the rollout log-probs
        # (train/step/policy_inputs.py)
        batches = RolloutBatches(len(part_lp_steps),
                                 None if feed is not None else cfg.data.num_steps_per_rollout)
        if offset + len(part_steps) > start and layout.cp > 1 and layout.cp_impl == "allgather":
            # every CP group the steps use, made once
            from varbatch_kit.train.parallel.cp_groups import cp_groups_for_run

            cp_groups_for_run(layout, [*part_steps, *part_lp_steps])  # a resumed job: the
            # parts its checkpoint holds make none
        save_params = set(cfg.run.save_params_at)
        if feed is not None and part_steps:
            save_params.add(offset + len(part_steps))  # a fed batch's weights: its last step
        increments = increments_of(part_steps)
        inputs, inputs_of, pass_s = None, None, 0.0

        def inputs_for(local: int, part_rollouts=part_rollouts, data=data, batches=batches,
                       part_lp_steps=part_lp_steps, batch_offset=batch_offset):
            nonlocal inputs, inputs_of, pass_s
            k = batch_offset + batches.index(local)  # the rollout batch's number in the run
            if inputs_of != k:
                t_pass = time.perf_counter()
                inputs = prepare_policy_inputs(
                    layout, cfg.loss, cfg.data, model, gpt,
                    batches.steps(part_lp_steps, batches.index(local)), part_rollouts, data,
                    device, out_dir, rollout_batch=k, initial_state=initial,
                    resumed=not batches.starts(local) and resume_from is not None)
                inputs_of, pass_s = k, time.perf_counter() - t_pass
            return inputs

        for local, step in enumerate(part_steps, start=1):
            number = offset + local
            if number <= start:
                continue  # trained before the checkpoint
            current["step"] = number
            if faults.fail_at_step == number and rank == faults.fail_rank:
                raise RuntimeError(
                    f"fail_at_step={number}: rank {rank} raises on purpose (debug hook)")
            if faults.hang_at_step == number and rank == faults.fail_rank:
                while True:  # debug hook: a rank that hangs (the launcher's step timeout fires)
                    time.sleep(1)
            at("before_step", number)
            # the saved gradient: the saver's TP group gathers it; under the distributed
            # optimizer every rank first gathers the reduced shards of its pool (a collective)
            grads = ({} if number in cfg.run.save_grads_at and (saver or opt.distributed)
                     else None)
            # each rank's peak memory over the step (CUDA: the allocator's; CPU under
            # run.track_memory: live tensor bytes, train/step/peak_memory.py)
            inputs = inputs_for(local)  # the rollout batch's log-prob pass, before the watch
            # and, for a mixture of experts, the tokens each expert received
            with memory_watch(device, cfg.run.track_memory, ddp, optimizer) as memory, \
                    expert_load_watch(chunks, layout.ep, model_spec.num_layers if experts else 0,
                                      layout.cp if layout.cp_impl == "emulated" else 1) as load:
                record = train_step(layout, cfg.loss, faults, mode, model, optimizer, step,
                                    part_rollouts, data, inputs, device, run_name=cfg.name,
                                    grads_out=grads,
                                    num_moe_layers=model_spec.num_layers if experts else 0)
            if grads is not None and stage is None:
                grads = whole(grads)
            record.update(memory.gathered())
            record.update(load.gathered())
            # the rollout batch's log-prob pass (and advantages) ran before this step: its time
            record["log_prob_pass_s"] = pass_s if batches.starts(local) else 0.0
            at("after_step", number)
            record["lr"] = _lr_of(optimizer)  # the LR this step's update used
            scheduler.step(increment=increments[local - 1])  # rollouts or samples of the step
            consumed += increments[local - 1]
            record.update(step=number, lr_increment=increments[local - 1],
                          lr_consumed=consumed, lr_next=_lr_of(optimizer))
            if feed is not None:
                record["rollout_batch"] = part
            every = cfg.checkpoint.save_every
            params = shards = optim_state = None
            if every and number % every == 0 and (stage is not None or layout.tp > 1):
                # each pipeline stage's and TP rank's model and optimizer shard, to rank 0
                from varbatch_kit.train.runs.run_state import gather_model_shards

                shards = gather_model_shards(gpt, optimizer, layout)
            elif every and number % every == 0 and opt.distributed:
                # the distributed optimizer's shards, gathered to rank 0 (a collective)
                from varbatch_kit.train.runs.run_state import optimizer_state

                optim_state = optimizer_state(optimizer)
            if stage is not None:  # pp: the stages' parts, gathered to rank 0 (collectives)
                from varbatch_kit.train.model.pipeline_stages import (
                    gather_full_params,
                    gather_grads,
                )

                if number in save_params:
                    params = gather_full_params(stage, layout, experts)
                if grads is not None:
                    grads = gather_grads(grads, layout, experts)
            elif number in save_params and saver:
                # the full tensors under tp 1's names (a collective over rank 0's TP group)
                params = whole(gather_full_parameters(gpt, copy=False))  # before the update
            if rank == 0:
                if number in save_params:
                    sums = (compared_with(params, Path(params_ref) / f"params_step{number}.pt")
                            if params_ref is not None and feed is None else None)
                    if sums is None:
                        save_tensors(params, out_dir / f"params_step{number}.pt")
                    else:  # compare reads ||p - p_ref|| / ||p_ref|| from the step log
                        record["param_sq_diff"], record["param_sq_ref"] = sums
                if grads is not None:
                    save_tensors(grads, out_dir / f"grads_step{number}.pt")
                # one whole line per step, one write + fsync (train/runs/step_log.py)
                append_record(out_dir / "steps.jsonl", _ordered(record, cfg, device))
                if every and number % every == 0:
                    done = part_steps[:local]
                    counters = {
                        "step": number, "lr_consumed": consumed,
                        "rollouts_consumed": totals["rollouts"] + int(
                            sum(s.num_rollouts for s in done)),
                        "samples_consumed": totals["samples"] + int(
                            sum(s.num_samples for s in done))}
                    save(cfg, out_dir, counters, gpt, optimizer, scheduler, fingerprint,
                         hook=partial(_at_point, at, number), shards=shards,
                         optim_state=optim_state)
                    at("after_ckpt", number)
            if cfg.checkpoint.save_every and number % cfg.checkpoint.save_every == 0:
                # no rank starts the next step before rank 0's checkpoint is complete: a rank
                # that fails early in the next step must not cut the checkpoint short
                dist.barrier()
        for s in part_steps:
            totals["rollouts"] += int(s.num_rollouts)
            totals["samples"] += int(s.num_samples)
        offset += len(part_steps)
        batch_offset += 1  # a fed batch is one rollout batch (without a feed: the only part)
        if feed is not None:
            last = offset
            saved = out_dir / f"params_step{last}.pt"
            if part_steps and last <= start and not saved.is_file():
                # resumed at this batch's very end: its weights are the checkpoint's (every
                # rank sees the same folder: the collectives below run on all or none)
                params = None
                if stage is not None:
                    from varbatch_kit.train.model.pipeline_stages import gather_full_params

                    params = gather_full_params(stage, layout, experts)
                elif saver:
                    params = whole(gather_full_parameters(gpt, copy=False))
                if rank == 0:
                    save_tensors(params, saved)
            dist.barrier()  # every rank done with the batch before it is marked done
            if rank == 0:
                feed.mark_done(part, {"first_step": last - len(part_steps) + 1,
                                      "last_step": last, "params": str(saved)})
    dist.barrier()
    if rank == 0:
        (out_dir / "done").write_text("ok\n")


def fuse_cpu_adam(optimizer) -> int:
    """Run the torch Adam(W) inside megatron's (chained) optimizer with torch's fused CPU
    kernel: one pass over parameters, gradients and moments instead of one per operation
    (megatron, without TransformerEngine or Apex, builds ``torch.optim.Adam`` with the
    defaults, which on CPU tensors are the per-tensor loop: 0.67 s against 0.13 s a step for
    SmolLM2's 42M float64 parameters, one thread). The same update, up to rounding; every CPU
    run uses it, a resumed one too (the flag is in the saved param groups). Returns the number
    of param groups switched."""
    import torch

    switched = 0
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_opt = getattr(inner, "optimizer", None)
        if not isinstance(torch_opt, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in torch_opt.param_groups:
            group.update(fused=True, foreach=False)
            switched += 1
    return switched


def compared_with(params: dict, ref_file: Path) -> tuple[float, float] | None:
    """``(||params - ref||^2, ||ref||^2)`` against the parameters saved in ``ref_file``
    (:func:`~varbatch_kit.train.runs.results.param_sq_sums`, the arithmetic of ``compare``'s
    ``param_rel_diff``); None when there is no such file or it holds other parameter names:
    the caller then saves its own parameters, and ``compare`` reads both files as before."""
    if not ref_file.is_file():
        return None
    ref = torch.load(ref_file, map_location="cpu", weights_only=True, mmap=True)
    if set(ref) != set(params):
        return None
    return param_sq_sums(params, ref)


def _ordered(record: dict, cfg: TrainConfig, device: torch.device) -> dict:
    head = {k: record.pop(k) for k in ("step", "rollouts", "samples", "tokens")}
    layout = cfg.layout
    tail = {"mode": cfg.mode, **layout.as_dict(), "layout": layout.describe(),
            "precision": cfg.precision,
            "cp_emulated": layout.cp > 1 and layout.cp_impl == "emulated",
            "packing": cfg.schedule.packing, "distribution": cfg.schedule.distribution,
            "device": device.type, "label": cfg.name}
    return {**head, **record, **tail}


# --------------------------------------------------------------------------- entry point
def _write_error(job_dir: Path, rank: int, text: str) -> None:
    err_dir = job_dir / "errors"
    err_dir.mkdir(exist_ok=True)
    tmp = err_dir / f".rank{rank}.tmp"
    tmp.write_text(text)
    tmp.rename(err_dir / f"rank{rank}.txt")  # atomic: the launcher never reads half a file


#: the signal on which a worker writes every thread's Python stack to ``JOB_DIR/stacks``
#: (the launcher sends it to a job that timed out, before it kills it)
STACKS_SIGNAL = "SIGUSR1"
_stack_files: list = []  # kept open for the life of the process (faulthandler writes to them)


def _stacks_on_request(job_dir: Path, rank: int) -> None:
    """On :data:`STACKS_SIGNAL`, write every thread's Python stack to
    ``JOB_DIR/stacks/rankN.txt`` (``faulthandler``: from the signal handler, also while the
    rank waits in a collective): a hung job's launcher names where each rank was."""
    import faulthandler
    import signal

    folder = job_dir / "stacks"
    folder.mkdir(exist_ok=True)
    f = open(folder / f"rank{rank}.txt", "w")  # noqa: SIM115 - open for the process's life
    _stack_files.append(f)
    faulthandler.register(getattr(signal, STACKS_SIGNAL), file=f, all_threads=True)


#: what a worker imports after :func:`~varbatch_kit.train.parallel.megatron_import.import_megatron`
#: (torch's optimizer imports ``torch._dynamo`` at its first step)
PRELOAD_MODULES = (
    "varbatch_kit.train.parallel.process_setup",
    "varbatch_kit.train.parallel.cpu_shim",
    "varbatch_kit.train.model.gpt",
    "varbatch_kit.train.model.pipeline_stages",
    "varbatch_kit.train.step.train_step",
    "varbatch_kit.train.step.pipeline_schedule",
    "varbatch_kit.train.runs.run_state",
    "torch._dynamo",
)


def preload() -> None:
    """Import what a CPU worker imports, in the torchrun agent that then forks the ranks
    (``torchrun --start-method=fork``, :mod:`varbatch_kit.train.runs.launch`): each rank starts
    with them imported instead of paying about 2 s of CPU for its own imports. The same way
    as the worker's own megatron import (:func:`~varbatch_kit.train.parallel.megatron_import.
    import_megatron`: ``torch.compile`` deferred, the garbage collector paused, then frozen).
    Nothing here starts a thread or touches a device."""
    from varbatch_kit.train.parallel.megatron_import import WORKER_MODULES, import_megatron

    import_megatron(WORKER_MODULES + PRELOAD_MODULES)


def main(argv: list[str] | None = None) -> int:
    # before anything imports megatron: its notices hidden, its import at half the cost
    from varbatch_kit.train.parallel.megatron_import import import_megatron

    import_megatron()
    from varbatch_kit.train.parallel.process_setup import (
        die_with_parent,
        setup_process,
        use_layout,
    )
    from varbatch_kit.train.runs.pid_files import write_pid_file

    argv = sys.argv[1:] if argv is None else argv
    job_dir = Path(argv[0])
    rank = int(os.environ["RANK"])
    die_with_parent()
    write_pid_file(job_dir / "pids" / f"rank{rank}.pid")  # pid and start time (supervise)
    _stacks_on_request(job_dir, rank)
    current = "setup"
    try:
        with open(job_dir / "job.pkl", "rb") as f:
            job: Job = pickle.load(f)
        device = setup_process(job.device, job.configs[0].run.threads_per_worker,
                               layout=job.configs[0].layout)
        resume = job.resume_from or [None] * len(job.configs)
        prints = job.fingerprints or [None] * len(job.configs)
        refs = job.params_refs or [None] * len(job.configs)
        for k, (cfg, spec, steps, lp_steps, out, ckpt, fp) in enumerate(zip(
                job.configs, job.models, job.steps, job.log_prob_steps, job.out_dirs, resume,
                prints)):
            current = cfg.name
            use_layout(cfg.layout)  # megatron's tp / pp / vpp sizes of this run
            train(cfg, spec, steps, lp_steps, job.rollouts, Path(out), device, resume_from=ckpt,
                  fingerprint=fp, feed=job.feed, params_ref=refs[k])
    except BaseException:  # noqa: BLE001 - any failure must reach the launcher, then exit
        _write_error(job_dir, rank, f"rank {rank} failed in {current!r}:\n{traceback.format_exc()}")
        sys.stdout.flush()
        sys.stderr.flush()
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a killed peer is named first
            from varbatch_kit.train.runs.supervise import FAILED_RANK_EXIT_DELAY_S

            time.sleep(FAILED_RANK_EXIT_DELAY_S)
        os._exit(1)  # peers are stuck in collectives: do not wait for a clean shutdown
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
