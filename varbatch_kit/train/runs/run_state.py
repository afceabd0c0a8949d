"""A worker's run state in checkpoints: save after a step, restore on resume, RNG states.

Rank 0 writes (:mod:`varbatch_kit.train.runs.checkpoint` does the format and the
atomic write); every rank restores the same full state. With pipeline stages
(``pp > 1``) each stage has its own shard (its chunks' parameters, its optimizer
state): :func:`gather_stage_shards` collects them, rank 0 writes them side by
side (``model.pt`` keys ``stage{k}/NAME``, ``optimizer.pt`` ``{"stages": [...]}``)
and every rank restores its own stage's shard. Also the debug hook
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

__all__ = ["gather_stage_shards", "kill_self", "restore", "save"]


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


def gather_stage_shards(gpt, optimizer, layout) -> list[tuple[dict, dict]] | None:
    """Per pipeline stage ``(model state, optimizer state)`` on world rank 0 (None elsewhere),
    from each stage's pool rank 0 / tp rank 0 (a collective)."""
    import torch.distributed as dist

    c = layout.coords(dist.get_rank())
    mine = None
    if c.pool_rank == 0 and c.tp_rank == 0:
        mine = (c.pp_rank, _model_state(gpt), optimizer.state_dict())
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, parts, dst=0)
    if parts is None:
        return None
    by_stage = {p[0]: (p[1], p[2]) for p in parts if p is not None}
    return [by_stage[k] for k in range(layout.pp)]


def save(cfg, out_dir: Path, counters: dict, gpt, optimizer, scheduler, fingerprint,
          hook, shards: list | None = None) -> None:
    """Rank 0: checkpoint after step ``counters["step"]`` (full state: the same on every rank;
    ``shards``: per pipeline stage, :func:`gather_stage_shards`)."""
    from varbatch_kit.train.runs.checkpoint import save_checkpoint

    number = counters["step"]
    t_start = time.perf_counter()
    if cfg.faults.disk_full_at_step == number:  # debug hook: writes past 64 KiB fail (EFBIG)
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE,
                           (64 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    if shards is None:
        model_state, optim_state = _model_state(gpt), optimizer.state_dict()
    else:
        model_state = {f"stage{k}/{n}": t for k, (m, _) in enumerate(shards) for n, t in m.items()}
        optim_state = {"stages": [o for _, o in shards]}
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


def restore(path: str, gpt, optimizer, scheduler, *, stage: int | None = None) -> tuple[int, int]:
    """Load a checkpoint into the model (in place: DDP's buffers stay), optimizer, scheduler;
    ``stage``: this rank's pipeline stage, whose shard it loads."""
    from varbatch_kit.train.runs.checkpoint import load_checkpoint

    ckpt = load_checkpoint(Path(path))
    if stage is not None:
        head = f"stage{stage}/"
        if "stages" not in ckpt["optimizer"] or stage >= len(ckpt["optimizer"]["stages"]):
            raise ValueError(f"checkpoint {path} holds no pipeline stage {stage}")
        ckpt["model"] = {k[len(head):]: v for k, v in ckpt["model"].items()
                         if k.startswith(head)}
        ckpt["optimizer"] = ckpt["optimizer"]["stages"][stage]
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
