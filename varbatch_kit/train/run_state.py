"""A worker's run state in checkpoints: save after a step, restore on resume, RNG states.

Rank 0 writes (:mod:`varbatch_kit.train.checkpoint` does the format and the
atomic write); every rank restores the same full state. Also the debug hook
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

from varbatch_kit.train.steplog import append_record

__all__ = ["kill_self", "restore", "save"]


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


def save(cfg, out_dir: Path, counters: dict, gpt, optimizer, scheduler, fingerprint,
          hook) -> None:
    """Rank 0: checkpoint after step ``counters["step"]`` (full state: the same on every rank)."""
    from varbatch_kit.train.checkpoint import save_checkpoint

    number = counters["step"]
    t_start = time.perf_counter()
    if cfg.faults.disk_full_at_step == number:  # debug hook: writes past 64 KiB fail (EFBIG)
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
                           fingerprint=fingerprint or {}, keep_last=cfg.checkpoint.keep_last,
                           hook=hook)
    # one line per checkpoint: how long it took (state gathered, written, fsynced, renamed)
    append_record(out_dir / "checkpoints.jsonl", {
        "step": number, "save_s": time.perf_counter() - t_start, "write_s":
        time.perf_counter() - t0, "bytes": sum(p.stat().st_size for p in path.iterdir())})


def restore(path: str, gpt, optimizer, scheduler) -> tuple[int, int]:
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
