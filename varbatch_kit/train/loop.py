"""The training worker: one process per rank, started by ``torchrun`` (see :mod:`.launch`).

Run as ``python -m varbatch_kit.train.loop JOB_DIR``. ``JOB_DIR/job.pkl``
holds the rollouts and one or more :class:`TrainConfig` s of the same world
size; they train one after the other, each from the same seed, writing to
its own output folder.

World layout
------------
``dp * cp`` processes. World rank ``w`` is DP rank ``w // cp`` and CP rank
``w % cp``. megatron-core is initialised with tensor = pipeline = context
parallel size 1, so *its* data-parallel group is the whole world (DP x CP):
Megatron DDP averages gradients over all ``dp * cp`` ranks, which is the
gradient reduction CP needs. Context parallelism itself is **emulated**:
megatron-core's context-parallel attention and packed ``thd`` batches need
TransformerEngine, so every CP rank runs the full forward of its DP rank's
micro-batch and computes the loss and the reported metrics on its own zigzag
slice of every response (:mod:`varbatch_kit.report.cp`). Gradients, losses and
reports are what real CP computes; the compute and memory savings are not.

Dynamic CP (``ScheduleConfig(cp_mode="dynamic")``): the ``dp * cp`` ranks are
one pool and world rank ``w`` runs ``step.rank_program(w)``: per round the
micro-batch of the CP group holding it, sliced by that micro-batch's own degree
and ``w``'s place in the group; idle rounds are skipped, so ranks run different
micro-batch counts (the loss prescale uses the rank's own count, which Megatron
divides by). The normalisers get each sample's degree; the per-token count is
``n * K / c`` per rank (``K`` = lcm of the step's degrees), see
:mod:`varbatch_kit.report`.

One training step, top to bottom (:func:`train_step`)
------------------------------------------------------
1. The step's normalisers over *all* of its samples (per-rollout
   denominators, the report divisor) and the loss prescale factor
   (:mod:`varbatch_kit.report`, docs/reference_semantics.md §5).
2. This DP rank's micro-batches (from the :class:`~varbatch_kit.Schedule`),
   each packed into one row (:mod:`.batch`).
3. megatron-core's forward/backward schedule over them. The loss function
   returns ``(prescale * loss_sum, num_tokens, {"values": [...]})``: the
   policy-gradient loss ``-advantage * log p`` (PPO-clipped when the rollouts
   carry old log-probs; :mod:`.loss`) summed with the mode's denominators over
   the CP-local response tokens.
4. The megatron-core optimizer step (gradient norm before clipping), then
   ``OptimizerParamScheduler.step(increment=<rollouts or samples of the step>)``.
5. The report: micro-batch value vectors summed, all-reduced over DP x CP,
   divided by the step divisor; rank 0 appends one JSON line.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import pickle
import signal
import socket
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.train.config import TrainConfig
from varbatch_kit.train.steplog import append_record, write_atomic

__all__ = ["CP_NOTE", "Job", "main", "setup_process", "single_process", "train", "train_step"]

CP_NOTE = (
    "context parallelism is emulated at the loss level: every CP rank runs the full forward "
    "and computes loss and reports on its zigzag slice; gradients are averaged over dp*cp ranks"
)
METRIC_KEYS = ("loss", "nll", "entropy", "token_acc", "advantage")


@dataclass
class Job:
    """What the launcher hands to the workers (pickled into ``JOB_DIR/job.pkl``)."""

    configs: list[TrainConfig]
    rollouts: Rollouts
    out_dirs: list[str]
    device: str  # "cpu" or "cuda"
    # per config: the checkpoint folder to continue from (None: from scratch), and the
    # fingerprint every checkpoint of it records (see train/checkpoint.py)
    resume_from: list | None = None
    fingerprints: list | None = None


# --------------------------------------------------------------------------- process setup
def _die_with_parent() -> None:
    """Linux: get SIGKILL when the parent (torchrun) dies, so no worker outlives it."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def setup_process(device: str, threads: int = 1) -> torch.device:
    """torch.distributed + megatron-core parallel state for this worker.

    CUDA + NCCL when ``device == "cuda"``; else CPU + gloo with the CPU shim.
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local_rank)
        dev, backend = torch.device("cuda", local_rank), "nccl"
    else:
        from varbatch_kit.train import cpu_shim

        cpu_shim.activate()
        torch.set_num_threads(threads)
        dev, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, rank=rank, world_size=world)
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        # tp = pp = cp = 1: megatron's data-parallel group spans all dp * cp ranks
        parallel_state.initialize_model_parallel(1, 1)
    return dev


@contextlib.contextmanager
def single_process(device: str, threads: int = 1):
    """Yield the torch device of a one-process torch.distributed group with megatron-core's
    parallel state (for work outside torchrun: calibration, tests); torn down afterwards.

    If a group already exists it is reused (and left alone); ``threads`` CPU threads.
    """
    from megatron.core import parallel_state

    from varbatch_kit.train import cpu_shim

    saved_threads = torch.get_num_threads()
    if dist.is_initialized():
        if device == "cpu":
            torch.set_num_threads(threads)
        try:
            yield torch.device("cuda", torch.cuda.current_device()) if device == "cuda" \
                else torch.device("cpu")
        finally:
            torch.set_num_threads(saved_threads)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield setup_process(device, threads=threads)
    finally:
        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
        if device != "cuda":
            cpu_shim.deactivate()
        torch.set_num_threads(saved_threads)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# --------------------------------------------------------------------------- one run
def _lr_of(optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])


def train(cfg: TrainConfig, rollouts: Rollouts, out_dir: Path, device: torch.device, *,
          resume_from: str | None = None, fingerprint: dict | None = None) -> None:
    """Train ``cfg`` on ``rollouts``; rank 0 writes ``out_dir/steps.jsonl``.

    From scratch, or from the checkpoint folder ``resume_from`` (every rank
    loads rank 0's full state; the launcher has truncated the step log to its
    step). With ``cfg.save_every`` rank 0 writes a checkpoint after every
    N-th step (:mod:`varbatch_kit.train.checkpoint`), recording ``fingerprint``.
    """
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from varbatch_kit.core.build import build_schedule
    from varbatch_kit.report import get_report_mode
    from varbatch_kit.train.data import make_training_data
    from varbatch_kit.train.model import build_gpt

    rank, world = dist.get_rank(), dist.get_world_size()
    if world != cfg.world_size:
        raise RuntimeError(f"{cfg.name}: world size {world}, config needs {cfg.world_size}")
    out_dir = Path(out_dir)
    mode = get_report_mode(cfg.mode)

    # the plan: steps -> DP ranks -> micro-batches, and the tokens and advantages: the
    # rollouts' own (Rollouts.extra tokens/reward/advantage), else the toy task's (train/data.py)
    schedule = build_schedule(rollouts, cfg.schedule, model=cfg.model_shape())
    steps = schedule.steps[: cfg.max_steps] if cfg.max_steps else schedule.steps
    data = make_training_data(rollouts, vocab_size=cfg.vocab_size, seed=cfg.seed,
                              n_samples_per_prompt=cfg.n_samples_per_prompt)
    max_seq_len = cfg.max_seq_len or int(rollouts.total_len.max())

    # model, DDP over all dp*cp ranks, optimizer, LR schedule — identical init on every rank
    torch.manual_seed(cfg.seed)
    model_parallel_cuda_manual_seed(cfg.seed, inference_rng_tracker=True, force_reset_rng=True)
    gpt = build_gpt(cfg, max_seq_len=max_seq_len,
                    per_token_loss=mode.megatron_per_token_loss).to(device)
    model = DistributedDataParallel(gpt.config, DistributedDataParallelConfig(), gpt)
    model.broadcast_params()
    gpt.config.finalize_model_grads_func = finalize_model_grads
    gpt.config.no_sync_func = model.no_sync
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr,
                        weight_decay=cfg.weight_decay, adam_beta1=cfg.adam_beta1,
                        adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
                        clip_grad=cfg.clip_grad),
        [model],
    )
    unit = cfg.lr_increment_unit()
    increments = [s.num_rollouts if unit == "rollouts" else s.num_samples for s in steps]
    horizon = max(sum(increments), 1)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=cfg.lr, min_lr=cfg.min_lr,
        lr_warmup_steps=int(cfg.lr_warmup_fraction * horizon), lr_decay_steps=horizon,
        lr_decay_style=cfg.lr_decay_style, start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay, wd_incr_steps=horizon, wd_incr_style="constant",
    )

    start, consumed, load_s = 0, 0, None
    if resume_from is not None:
        t_load = time.perf_counter()
        start, consumed = _restore(resume_from, gpt, optimizer, scheduler)
        load_s = time.perf_counter() - t_load
    kill = cfg.kill_point() if rank == cfg.fail_rank else None
    current = {"step": 0}
    if kill is not None and kill[0] == "mid_step":
        def _kill_in_forward(module, args):  # the first forward of the step: mid-step
            if current["step"] == kill[1]:
                _kill_self()
        gpt.register_forward_pre_hook(_kill_in_forward)

    def at(point: str, number: int) -> None:
        if kill is not None and kill == (point, number):
            _kill_self()

    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        meta = {
            "config": cfg.summary(), "device": device.type, "world_size": world,
            "cp_emulated": cfg.cp > 1, "cp_note": CP_NOTE if cfg.cp > 1 else "",
            "parameters": sum(p.numel() for p in gpt.parameters()),
            "max_seq_len": max_seq_len, "num_steps": len(steps), "lr_increment": unit,
            "data": data.source, "ppo_clipped": data.old_logprobs is not None,
            "torch": torch.__version__, "resumed_from_step": start if resume_from else None,
            "checkpoint_load_s": load_s,
        }
        write_atomic(out_dir / "meta.json", json.dumps(meta, indent=1).encode())
    for number, step in enumerate(steps, start=1):
        if number <= start:
            continue  # trained before the checkpoint
        current["step"] = number
        if cfg.fail_at_step == number and rank == cfg.fail_rank:
            raise RuntimeError(f"fail_at_step={number}: rank {rank} raises on purpose (debug hook)")
        if cfg.hang_at_step == number and rank == cfg.fail_rank:
            while True:  # debug hook: a rank that hangs (the launcher's step timeout fires)
                time.sleep(1)
        at("before_step", number)
        record = train_step(cfg, mode, model, optimizer, step, rollouts, data, device)
        at("after_step", number)
        record["lr"] = _lr_of(optimizer)  # the LR this step's update used
        scheduler.step(increment=increments[number - 1])  # rollouts or samples of this step
        consumed += increments[number - 1]
        record.update(step=number, lr_increment=increments[number - 1], lr_consumed=consumed,
                      lr_next=_lr_of(optimizer))
        if rank == 0:
            if number in cfg.save_params_at:
                torch.save({n: p.detach().cpu().clone() for n, p in gpt.named_parameters()},
                           out_dir / f"params_step{number}.pt")
            # one whole line per step, one write + fsync (train/steplog.py)
            append_record(out_dir / "steps.jsonl", _ordered(record, cfg, device))
            if cfg.save_every and number % cfg.save_every == 0:
                done = steps[:number]
                counters = {"step": number, "lr_consumed": consumed,
                            "rollouts_consumed": int(sum(s.num_rollouts for s in done)),
                            "samples_consumed": int(sum(s.num_samples for s in done))}
                _save(cfg, out_dir, counters, gpt, optimizer, scheduler, fingerprint,
                      hook=partial(_at_point, at, number))
                at("after_ckpt", number)
    dist.barrier()
    if rank == 0:
        (out_dir / "done").write_text("ok\n")


def _kill_self() -> None:
    """Debug hook: SIGKILL this worker now (no cleanup, like the OOM killer)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _at_point(at, number: int, point: str) -> None:
    at(point, number)


def _rng_state() -> dict:
    import random

    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
             "python": random.getstate()}
    try:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        state["cuda_tracker"] = get_cuda_rng_tracker().get_states()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
    except Exception:  # noqa: BLE001 - the tracker is optional (CPU shim)
        pass
    return state


def _set_rng_state(state: dict) -> None:
    import random

    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda_tracker" in state:
        try:
            from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

            get_cuda_rng_tracker().set_states(state["cuda_tracker"])
        except Exception:  # noqa: BLE001
            pass
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _save(cfg, out_dir: Path, counters: dict, gpt, optimizer, scheduler, fingerprint,
          hook) -> None:
    """Rank 0: checkpoint after step ``counters["step"]`` (full state: the same on every rank)."""
    from varbatch_kit.train.checkpoint import save_checkpoint

    number = counters["step"]
    t_start = time.perf_counter()
    if cfg.disk_full_at_step == number:  # debug hook: writes past 64 KiB fail (EFBIG)
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE,
                           (64 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    model_state = {k: v.detach().cpu().clone() for k, v in gpt.state_dict().items()
                   if isinstance(v, torch.Tensor)}
    state = {**counters, "scheduler": scheduler.state_dict(), "rng": _rng_state()}
    t0 = time.perf_counter()
    path = save_checkpoint(out_dir / "checkpoints", number, model=model_state,
                           optimizer=optimizer.state_dict(), state=state,
                           fingerprint=fingerprint or {}, keep_last=cfg.keep_last, hook=hook)
    # one line per checkpoint: how long it took (state gathered, written, fsynced, renamed)
    append_record(out_dir / "checkpoints.jsonl", {
        "step": number, "save_s": time.perf_counter() - t_start, "write_s":
        time.perf_counter() - t0, "bytes": sum(p.stat().st_size for p in path.iterdir())})


def _restore(path: str, gpt, optimizer, scheduler) -> tuple[int, int]:
    """Load a checkpoint into the model (in place: DDP's buffers stay), optimizer, scheduler."""
    from varbatch_kit.train.checkpoint import load_checkpoint

    ckpt = load_checkpoint(Path(path))
    current = gpt.state_dict(keep_vars=True)
    missing = sorted(set(ckpt["model"]) ^ {k for k, v in current.items()
                                           if isinstance(v, torch.Tensor)})
    if missing:
        raise ValueError(f"checkpoint {path} does not fit the model: keys {missing[:5]} differ")
    with torch.no_grad():
        for name, value in ckpt["model"].items():
            current[name].data.copy_(value)
    optimizer.load_state_dict(ckpt["optimizer"])
    scheduler.load_state_dict(ckpt["state"]["scheduler"])
    _set_rng_state(ckpt["state"]["rng"])
    return int(ckpt["state"]["step"]), int(ckpt["state"]["lr_consumed"])


def _ordered(record: dict, cfg: TrainConfig, device: torch.device) -> dict:
    head = {k: record.pop(k) for k in ("step", "rollouts", "samples", "tokens")}
    tail = {"mode": cfg.mode, "dp": cfg.dp, "cp": cfg.cp, "cp_emulated": cfg.cp > 1,
            "packing": cfg.schedule.packing, "distribution": cfg.schedule.distribution,
            "device": device.type, "label": cfg.name}
    return {**head, **record, **tail}


# --------------------------------------------------------------------------- one step
def train_step(cfg, mode, model, optimizer, step, rollouts, data, device) -> dict:
    """Forward/backward over this rank's micro-batches, optimizer step, reduced report."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    from varbatch_kit.core.placement import RankWork
    from varbatch_kit.report.cp import slice_flat_responses_for_cp
    from varbatch_kit.train.batch import pack, response_logits, response_token_stats
    from varbatch_kit.train.loss import policy_gradient_loss
    from varbatch_kit.train.timing import MicroBatchTimer, busy_and_straggler, gather_timings

    t0 = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    dynamic = not step.is_fixed_shape
    # this world rank's rounds: fixed CP, DP rank rank // cp's micro-batches at cp_rank rank % cp;
    # dynamic CP, the micro-batch of the group holding it (own degree and CP rank), idle rounds
    # skipped (ranks may then run different micro-batch counts; Megatron divides by its own)
    work = [w for w in step.rank_program(rank) if not w.idle]
    n_mb = len(work)

    # 1. step-wide normalisers over ALL samples of the step (before packing); dynamic CP: each
    # sample's own degree, and as its "DP rank" (naive_rank_mean only) the lowest world rank of
    # its CP group // cp, the replica that holds the group in the fixed layout
    samples = step.sample_indices
    local_of = {int(g): i for i, g in enumerate(samples)}
    all_masks = rollouts.masks()
    masks = {int(g): torch.as_tensor(all_masks[g], dtype=torch.float64) for g in samples}
    rank_of_sample = np.empty(samples.size, dtype=np.int64)
    for mb, p in zip(step.micro_batches, step.placements):  # fixed CP: its DP rank
        rank_of_sample[[local_of[int(g)] for g in mb]] = min(p.ranks) // cfg.cp
    norm = mode.step_normalizers(
        rollouts.rollout_id[samples], [masks[g] for g in samples],
        global_batch_size=step.num_rollouts, dp_size=cfg.dp,
        cp_size=step.sample_cp_sizes().tolist() if dynamic else cfg.cp,
        num_microbatches=step.num_rounds, dp_rank_of_sample=rank_of_sample,
    )
    prescale = mode.loss_prescale(norm, num_microbatches=max(n_mb, 1), dp_size=cfg.dp,
                                  cp_size=cfg.cp)

    # 2. this rank's micro-batches, packed, each with its (weight, cp_size, cp_rank); a rank
    # idle all step runs one zero-weight micro-batch so that it joins the gradient sync
    if not work:
        work = [RankWork(step.micro_batches[0], 1, 0)]
    weight = 1.0 if n_mb else 0.0
    batches = [
        (pack([data.tokens[g] for g in w.samples], rollouts.prompt_len[w.samples], w.samples,
              device=device), w.cp_size, w.cp_rank)
        for w in work
    ]

    def loss_func(batch, cp_size, cp_rank, logits):
        idx = [int(g) for g in batch.sample_indices]
        stats = response_token_stats(logits, batch, at_response_rows=True)
        adv = torch.cat([torch.full((int(rollouts.response_len[g]),),
                                    float(data.sample_advantage[g]), dtype=torch.float64)
                         for g in idx]).to(device)
        old = None if data.old_logprobs is None else torch.from_numpy(
            np.concatenate([data.old_logprobs[g] for g in idx]).astype(np.float64)).to(device)
        per_token = {  # the loss: train/loss.py (-A log p, or PPO-clipped with old log-probs)
            "loss": policy_gradient_loss(stats["logprob"], adv, old, clip_eps=cfg.clip_eps),
            "nll": -stats["logprob"].detach(),
            "entropy": stats["entropy"],
            "token_acc": stats["correct"],
            "advantage": adv,
        }
        kw = {
            "total_lengths": list(batch.lengths),
            "response_lengths": list(batch.response_lens),
            "loss_masks": [masks[g].to(device) for g in idx],
            "sample_denominators": norm.denominators_for([local_of[g] for g in idx]),
            "cp_rank": cp_rank,
            "cp_size": cp_size,
        }
        sums = {}
        for key in METRIC_KEYS:
            local = slice_flat_responses_for_cp(
                per_token[key], kw["total_lengths"], kw["response_lengths"],
                cp_rank=cp_rank, cp_size=cp_size)
            sums[key] = mode.microbatch_loss_sum(local, **kw)
        # per_token: each of a sample's c ranks counts n * K / c tokens (K = norm.reference_cp)
        count = {"cp_size": cp_size, "reference_cp": norm.reference_cp} if dynamic else {}
        num_tokens = mode.megatron_num_tokens(kw["loss_masks"], **count) if weight else 0
        values = torch.stack([torch.tensor(float(mode.count_slot(kw["loss_masks"], **count)))]
                             + [sums[k].detach().cpu().double() for k in METRIC_KEYS]) * weight
        return (weight * prescale * sums["loss"],
                torch.tensor(num_tokens, dtype=torch.int, device=device),
                {"values": values})

    timer = MicroBatchTimer(cuda=device.type == "cuda")  # fwd/bwd wall time per micro-batch

    def forward_step(data_iterator, model):
        batch, cp_size, cp_rank = next(data_iterator)
        timer.forward_start(batch.lengths)
        logits = response_logits(model, batch)  # the output layer on response rows only
        return logits, timer.wrap_loss(partial(loss_func, batch, cp_size, cp_rank))

    # 3. megatron-core's forward/backward schedule (no pipelining), DDP grad sync at the end
    model.zero_grad_buffer()
    optimizer.zero_grad()
    timer.attach(get_model_config(model))  # the last backward ends where the grad sync starts
    outputs = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=len(batches),
        seq_length=max(b.num_tokens for b, _, _ in batches),
        micro_batch_size=1,
        forward_only=False,
    )
    timer.detach()

    # 4. optimizer step; grad_norm is the norm before clipping
    ok, grad_norm, _ = optimizer.step()
    wall = time.perf_counter() - t0

    # 5. report: sum micro-batch vectors, all-reduce over DP x CP, divide by the step divisor
    report = reduce_step_report([o["values"] for o in outputs], mode=mode, norm=norm,
                                cp_size=norm.reference_cp)
    walls = torch.tensor([wall], dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(walls) for _ in range(world)]
    dist.all_gather(gathered, walls)
    timings = gather_timings(timer.records)  # per world rank
    busy, straggler = busy_and_straggler(timings)

    tokens = rollouts.total_len
    # fixed CP: per DP rank; dynamic CP: per world rank, the micro-batches it takes part in
    per_rank = step.ranks if dynamic else step.dp_ranks
    cp_of = ([[step.placements[b].degree for b in bins] for bins in step.rank_bins]
             if dynamic else None)
    dyn = {} if not dynamic else {
        "cp_mode": "dynamic", "num_rounds": step.num_rounds, "cp_degrees": cp_of,
        "tokens_per_rank": [int(round(sum(int(tokens[mb].sum()) / c for mb, c in zip(mbs, cs))))
                            for mbs, cs in zip(per_rank, cp_of)],
    }
    return {
        "rollouts": step.num_rollouts,
        "samples": step.num_samples,
        "tokens": int(tokens[samples].sum()),
        "loss_tokens": int(norm.num_tokens),
        "num_microbatches": [len(mbs) for mbs in per_rank],
        "samples_per_rank": [int(sum(mb.size for mb in mbs)) for mbs in per_rank],
        "tokens_per_rank": [int(sum(tokens[mb].sum() for mb in mbs)) for mbs in per_rank],
        "micro_batch_tokens": [[int(tokens[mb].sum()) for mb in mbs] for mbs in per_rank],
        **dyn,
        **report,
        "reward": _reward(data, step),
        "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
        "update_ok": bool(ok),
        "report_divisor": float(norm.report_divisor),
        "loss_prescale": float(prescale),
        "wall_s": [float(w.item()) for w in gathered],
        "step_time_s": max(float(w.item()) for w in gathered),
        "micro_batch_timing": timings,
        "busy_s": busy,
        "straggler_s": straggler,
    }


def _reward(data, step) -> float:
    """Mean reward of the step's rollouts (layout-free, computed from the data; NaN when the
    rollouts carry advantages but no rewards)."""
    pos = {int(r): k for k, r in enumerate(data.rollout_ids)}
    return float(np.mean([data.rollout_reward[pos[int(r)]] for r in step.rollout_ids]))


def reduce_step_report(values, *, mode, norm, cp_size) -> dict[str, float]:
    """:func:`varbatch_kit.report.reduce_train_step_metrics` over megatron's DP x CP group.

    With emulated CP, megatron's data-parallel group is the whole dp * cp world.
    ``divisor=None`` is slime's per-token path (all-reduced token count / cp).
    """
    from megatron.core import parallel_state

    from varbatch_kit.report import reduce_train_step_metrics

    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    divisor = None if mode.megatron_per_token_loss else norm.report_divisor
    return reduce_train_step_metrics(values, keys=METRIC_KEYS, divisor=divisor,
                                     cp_size=cp_size, group=group)


# --------------------------------------------------------------------------- entry point
def _write_error(job_dir: Path, rank: int, text: str) -> None:
    err_dir = job_dir / "errors"
    err_dir.mkdir(exist_ok=True)
    tmp = err_dir / f".rank{rank}.tmp"
    tmp.write_text(text)
    tmp.rename(err_dir / f"rank{rank}.txt")  # atomic: the launcher never reads half a file


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    job_dir = Path(argv[0])
    rank = int(os.environ["RANK"])
    _die_with_parent()
    (job_dir / "pids").mkdir(exist_ok=True)
    (job_dir / "pids" / f"rank{rank}.pid").write_text(str(os.getpid()))
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    current = "setup"
    try:
        with open(job_dir / "job.pkl", "rb") as f:
            job: Job = pickle.load(f)
        device = setup_process(job.device, job.configs[0].threads_per_worker)
        resume = job.resume_from or [None] * len(job.configs)
        prints = job.fingerprints or [None] * len(job.configs)
        for cfg, out, ckpt, fp in zip(job.configs, job.out_dirs, resume, prints):
            current = cfg.name
            train(cfg, job.rollouts, Path(out), device, resume_from=ckpt, fingerprint=fp)
    except BaseException:  # noqa: BLE001 - any failure must reach the launcher, then exit
        _write_error(job_dir, rank, f"rank {rank} failed in {current!r}:\n{traceback.format_exc()}")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # peers are stuck in collectives: do not wait for a clean shutdown
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
