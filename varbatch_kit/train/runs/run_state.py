"""A worker's run state in checkpoints: save after a step, restore on resume, RNG states.

Rank 0 writes (:mod:`varbatch_kit.train.runs.checkpoint` does the format and the
atomic write); without model parallelism every rank restores the same full state. With
pipeline stages (``pp > 1``) or tensor parallelism (``tp > 1``) each model-parallel rank
(pipeline stage ``k``, tensor-parallel rank ``t``) holds its own shard (its chunks'
parameters, its optimizer state): :func:`gather_model_shards` collects them from the
replicas of dp / cp rank 0, rank 0 writes them side by side, and every rank restores its own:

- ``tp == 1``: ``model.pt`` keys ``stage{k}/NAME``, ``optimizer.pt`` ``{"stages": [state_k]}``;
- ``tp > 1``: ``model.pt`` keys ``stage{k}/tp{t}/NAME``, ``optimizer.pt``
  ``{"stages": [[state_k_t0, state_k_t1, ...], ...]}`` (``pp == 1`` is stage 0).

A run resumes onto the pp and tp it saved with (both are in the checkpoint's fingerprint, so
another is refused before any worker starts); dp and cp may change. Also the debug hook
that SIGKILLs a worker (``FaultConfig.kill_at``).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch

from varbatch_kit.train.runs.step_log import append_record

__all__ = ["gather_model_shards", "kill_self", "restore", "save", "shard_prefix"]


def kill_self() -> None:
    """Debug hook: SIGKILL this worker now (no cleanup, like the OOM killer)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


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


def _model_state(gpt) -> dict:
    return {k: v.detach().cpu().clone() for k, v in gpt.state_dict().items()
            if isinstance(v, torch.Tensor)}


def shard_prefix(stage: int, tp_rank: int, tp: int) -> str:
    """The ``model.pt`` key prefix of the shard of pipeline stage ``stage``, TP rank
    ``tp_rank`` in a run of tensor-parallel size ``tp``."""
    return f"stage{stage}/" if tp == 1 else f"stage{stage}/tp{tp_rank}/"


def _optimizers(optimizer) -> list:
    """The optimizers inside megatron's (chained) optimizer."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def is_distributed(optimizer) -> bool:
    """Whether ``optimizer`` is megatron's distributed optimizer (its states sharded)."""
    return any(hasattr(o, "get_parameter_state_dp_zero") for o in _optimizers(optimizer))


def optimizer_state(optimizer) -> dict | None:
    """The optimizer's whole state. Under the distributed optimizer a collective over the
    data-parallel group: each shard's parameter state (Adam's moments, the main parameters)
    gathered to DP rank 0 (megatron's ``get_parameter_state_dp_zero``, over its gloo group,
    in float32) beside megatron's own ``state_dict`` (the param groups and step); complete on
    DP rank 0 only."""
    if not is_distributed(optimizer):
        return optimizer.state_dict()
    return {"distributed": [{"common": o.state_dict(), "params": o.get_parameter_state_dp_zero()}
                            for o in _optimizers(optimizer)]}


def load_optimizer_state(optimizer, state: dict) -> None:
    """:func:`optimizer_state` loaded back (under the distributed optimizer a collective: DP
    rank 0's copy is scattered to the shards)."""
    saved = state.get("distributed") if isinstance(state, dict) else None
    if (saved is not None) != is_distributed(optimizer):
        raise ValueError("the checkpoint's optimizer state and this run's optimizer differ in "
                         "optim.distributed")
    if saved is None:
        optimizer.load_state_dict(state)
        return
    for o, part in zip(_optimizers(optimizer), saved, strict=True):
        o.load_state_dict(part["common"])
        with torch.no_grad():  # the shards are views of the parameters, written in place
            o.load_parameter_state_from_dp_zero(part["params"])


def gather_model_shards(gpt, optimizer, layout) -> list[list[tuple[dict, dict]]] | None:
    """``shards[k][t]``: ``(model state, optimizer state)`` of pipeline stage ``k``, TP rank
    ``t`` on world rank 0 (None elsewhere), from the ranks of dp / cp rank 0 (a collective;
    under the distributed optimizer each pool gathers its shards first)."""
    import torch.distributed as dist

    from varbatch_kit.train.parallel.object_gather import gather_to_rank0

    c = layout.coords(dist.get_rank())
    mine = None
    state = optimizer_state(optimizer) if is_distributed(optimizer) else None
    if c.pool_rank == 0:
        mine = (c.pp_rank, c.tp_rank, _model_state(gpt),
                optimizer.state_dict() if state is None else state)
    parts = gather_to_rank0(mine)  # the tensors point to point, not pickled and padded
    if parts is None:
        return None
    found = {(p[0], p[1]): (p[2], p[3]) for p in parts if p is not None}
    return [[found[k, t] for t in range(layout.tp)] for k in range(layout.pp)]


def save(cfg, out_dir: Path, counters: dict, gpt, optimizer, scheduler, fingerprint,
          hook, shards: list | None = None, optim_state: dict | None = None) -> None:
    """Rank 0: checkpoint after step ``counters["step"]`` (full state: the same on every rank;
    ``shards``: per pipeline stage and TP rank, :func:`gather_model_shards`; ``optim_state``:
    the distributed optimizer's, :func:`optimizer_state`)."""
    from varbatch_kit.train.runs.checkpoint import save_checkpoint

    number = counters["step"]
    t_start = time.perf_counter()
    if cfg.faults.disk_full_at_step == number:  # debug hook: writes past 64 KiB fail (EFBIG)
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE,
                           (64 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    if shards is None:
        model_state = _model_state(gpt)
        optim_state = optimizer.state_dict() if optim_state is None else optim_state
    else:
        tp = len(shards[0])
        model_state = {f"{shard_prefix(k, r, tp)}{n}": t
                       for k, row in enumerate(shards) for r, (m, _) in enumerate(row)
                       for n, t in m.items()}
        optim_state = {"stages": [[o for _, o in row] if tp > 1 else row[0][1]
                                  for row in shards]}
    state = {**counters, "scheduler": scheduler.state_dict(), "rng": _rng_state()}
    t0 = time.perf_counter()
    path = save_checkpoint(out_dir / "checkpoints", number, model=model_state,
                           optimizer=optim_state, state=state,
                           fingerprint=fingerprint or {}, keep_last=cfg.checkpoint.keep_last,
                           hook=hook)
    # one line per checkpoint: how long it took (state gathered, written, fsynced, renamed)
    append_record(out_dir / "checkpoints.jsonl", {
        "step": number, "save_s": time.perf_counter() - t_start, "write_s":
        time.perf_counter() - t0, "bytes": sum(p.stat().st_size for p in path.iterdir())})


def restore(path: str, gpt, optimizer, scheduler, *, stage: int | None = None,
            tp_rank: int = 0, tp: int = 1) -> tuple[int, int]:
    """Load a checkpoint into the model (in place: DDP's buffers stay), optimizer, scheduler;
    ``stage`` (pipeline stage; None without pipelining) and ``tp_rank`` of ``tp``: with either
    parallelism, the shard this rank loads."""
    from varbatch_kit.train.runs.checkpoint import load_checkpoint

    ckpt = load_checkpoint(Path(path))
    if stage is not None or tp > 1:
        k = stage or 0
        head = shard_prefix(k, tp_rank, tp)
        stages = ckpt["optimizer"].get("stages", [])
        shard = stages[k] if k < len(stages) else None
        if tp > 1:
            shard = shard[tp_rank] if isinstance(shard, list) and tp_rank < len(shard) else None
        elif isinstance(shard, list):
            shard = None
        if shard is None:
            raise ValueError(f"checkpoint {path} holds no shard of pipeline stage {k}, tensor-"
                             f"parallel rank {tp_rank} of {tp}")
        ckpt["model"] = {n[len(head):]: v for n, v in ckpt["model"].items()
                         if n.startswith(head)}
        ckpt["optimizer"] = shard
    current = gpt.state_dict(keep_vars=True)
    missing = sorted(set(ckpt["model"]) ^ {k for k, v in current.items()
                                           if isinstance(v, torch.Tensor)})
    if missing:
        raise ValueError(f"checkpoint {path} does not fit the model: keys {missing[:5]} differ")
    with torch.no_grad():
        for name, value in ckpt["model"].items():
            current[name].data.copy_(value)
    load_optimizer_state(optimizer, ckpt["optimizer"])
    scheduler.load_state_dict(ckpt["state"]["scheduler"])
    _set_rng_state(ckpt["state"]["rng"])
    return int(ckpt["state"]["step"]), int(ckpt["state"]["lr_consumed"])
