"""Training checkpoints: atomic save, newest complete one, prune, fingerprint check on resume.

Format (one folder per checkpoint; docs/checkpoints.md)::

    OUT/checkpoints/step_000004/
        model.pt       full, unsharded parameters and buffers {name: tensor} (rank 0's)
        optimizer.pt   megatron-core optimizer state_dict (Adam moments, step; full)
        state.pt       LR scheduler state_dict, RNG states (torch, numpy, python, CUDA
                       tracker), step, consumed rollouts / samples / LR increments
        meta.json      format, step, fingerprint, file sizes — written last

Without pipeline stages the engine keeps every parameter and the optimizer
state whole on every rank (without the distributed optimizer), and every rank holds the
same values, so rank 0's copy *is* the state of the run, independent of dp and
cp: a checkpoint can be resumed with another layout. The distributed optimizer's shards
are gathered to rank 0 first (:func:`~varbatch_kit.train.runs.run_state.optimizer_state`)
and scattered back on resume, so its checkpoints are as independent of dp and cp.
With ``pp > 1`` each stage has its own shard: ``model.pt`` holds ``stage{k}/NAME`` keys,
``optimizer.pt`` ``{"stages": [...]}`` (one megatron state dict per stage; rank 0 writes them
all, :mod:`varbatch_kit.train.runs.run_state`), and a resumed run keeps ``pp``. A checkpoint is
written
to ``.tmp-step_NNNNNN-PID``, every file and the folder fsynced, then renamed;
only names ``step_NNNNNN`` holding a ``meta.json`` whose file sizes match are
complete. Old checkpoints beyond ``keep_last`` are renamed to ``.trash-...``
and removed.

:func:`fingerprint` holds what a resumed run must not change: every
:class:`TrainConfig` field (``group.name``) except the layout and run fields in
:data:`MAY_CHANGE`, the rollouts (a hash of every per-sample field) and the
schedule's steps (which rollouts each step trains). :func:`check_resumable`
names what differs.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

import numpy as np

from varbatch_kit.train.runs.step_log import fsync_dir, write_synced

__all__ = ["FORMAT", "MAY_CHANGE", "CheckpointError", "check_resumable", "checkpoint_dirs",
           "fed_fingerprint", "fingerprint", "latest_checkpoint", "load_checkpoint", "prune",
           "save_checkpoint"]

FORMAT = "varbatch-checkpoint-1"
FILES = ("model.pt", "optimizer.pt", "state.pt")
_NAME = re.compile(r"^step_(\d{6,})$")
# TrainConfig / ScheduleConfig fields a resumed run may change: the layout, where and how long
# it runs, and the fault hooks. Everything else (model, optimiser, mode, seed, run.max_steps:
# the LR horizon, global batch size, ...) is fixed by the checkpoint.
MAY_CHANGE = frozenset({
    "schedule.dp", "schedule.cp", "schedule.packing", "schedule.distribution",
    "schedule.micro_batch_size", "schedule.max_tokens_per_gpu",
    "run.device", "run.timeout_s", "run.threads_per_worker", "run.save_params_at", "run.label",
    "run.step_timeout_s", "sequence_parallel",
    "checkpoint.save_every", "checkpoint.keep_last",
    "nodes.nnodes", "nodes.node_rank", "nodes.rdzv_endpoint", "nodes.rdzv_timeout_s",
    "faults.fail_at_step", "faults.fail_rank", "faults.hang_at_step", "faults.kill_at",
    "faults.disk_full_at_step",
})


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (the earlier ones are untouched)."""


# ----------------------------------------------------------------------------- fingerprint
def _hash_value(h, v) -> None:
    if isinstance(v, np.ndarray) or (isinstance(v, (list, tuple)) and v and not isinstance(
            v[0], (str, dict))):
        a = np.asarray(v)
        if a.dtype != object:
            h.update(str(a.dtype).encode() + str(a.shape).encode() + a.tobytes())
            return
    h.update(repr(v).encode())


def rollouts_hash(rollouts) -> str:
    """sha256 over every per-sample field of ``rollouts`` (lengths, ids, masks, extra columns)."""
    h = hashlib.sha256()
    for name in ("prompt_len", "response_len", "rollout_id"):
        _hash_value(h, np.asarray(getattr(rollouts, name)))
    for m in rollouts.masks():
        _hash_value(h, np.asarray(m))
    extra = rollouts.extra
    if extra is not None:
        for col in sorted(map(str, extra.columns)):
            h.update(b"col:" + col.encode())
            for v in extra[col].tolist():
                _hash_value(h, v)
    return h.hexdigest()


def _config_fields(cfg) -> dict[str, str]:
    """Every field of ``cfg`` as ``"name"`` or ``"group.name"`` (sub-configs, the schedule)."""
    out = {}
    for f in fields(cfg):
        if not f.init:
            continue
        v = getattr(cfg, f.name)
        if is_dataclass(v):
            for g in fields(v):
                if g.init:
                    out[f"{f.name}.{g.name}"] = repr(getattr(v, g.name))
        else:
            out[f.name] = repr(v)
    return {k: v for k, v in out.items() if k not in MAY_CHANGE}


def fingerprint(cfg, rollouts, steps) -> dict[str, Any]:
    """What a resumed run must share with the checkpoint (JSON-able)."""
    plan = hashlib.sha256(repr([sorted(int(r) for r in s.rollout_ids) for s in steps]).encode())
    return {"config": _config_fields(cfg), "rollouts": rollouts_hash(rollouts),
            "num_rollouts": int(rollouts.num_rollouts), "num_samples": int(rollouts.num_samples),
            "steps": plan.hexdigest(), "num_steps": len(steps)}


def fed_fingerprint(cfg) -> dict[str, Any]:
    """:func:`fingerprint` of a job fed its rollout batches one by one
    (:mod:`~varbatch_kit.train.runs.rollout_feed`): the configuration only (the batches are
    read again from the feed folder on resume)."""
    return {"config": _config_fields(cfg), "rollouts": "rollout feed", "num_rollouts": 0,
            "num_samples": 0, "steps": "rollout feed", "num_steps": 0}


def check_resumable(saved: dict, current: dict, where: Path) -> None:
    """Raise ValueError naming every difference between two fingerprints."""
    diffs = []
    a, b = saved.get("config", {}), current["config"]
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            diffs.append(f"{k}: checkpoint {a.get(k, '<unset>')}, now {b.get(k, '<unset>')}")
    if saved.get("rollouts") != current["rollouts"]:
        diffs.append(
            f"rollouts: a different rollout set (checkpoint {saved.get('num_rollouts')} rollouts"
            f" / {saved.get('num_samples')} samples, now {current['num_rollouts']} / "
            f"{current['num_samples']}, or different lengths, masks, tokens or rewards)")
    elif saved.get("steps") != current["steps"]:
        diffs.append(f"schedule steps: the steps train other rollouts (checkpoint "
                     f"{saved.get('num_steps')} steps, now {current['num_steps']})")
    if diffs:
        raise ValueError(
            f"cannot resume from {where}: the run differs from the checkpoint in\n  "
            + "\n  ".join(diffs)
            + "\n(only the layout and run settings may change on resume: "
            + ", ".join(sorted(MAY_CHANGE)) + ")")


# ----------------------------------------------------------------------------- listing
def _complete(path: Path) -> dict | None:
    try:
        meta = json.loads((path / "meta.json").read_text())
        for name, size in meta["files"].items():
            if (path / name).stat().st_size != size:
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return meta if meta.get("format") == FORMAT else None


def checkpoint_dirs(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` (``OUT/checkpoints``), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_dir() and _complete(p) is not None:
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(root: Path) -> tuple[Path, dict] | None:
    """The newest complete checkpoint under ``root`` and its meta, or None."""
    dirs = checkpoint_dirs(root)
    if not dirs:
        return None
    path = dirs[-1][1]
    return path, _complete(path)


def prune(root: Path, keep_last: int) -> None:
    """Remove all but the newest ``keep_last`` complete checkpoints, and leftover temporaries."""
    root = Path(root)
    for _, p in checkpoint_dirs(root)[:-keep_last]:
        trash = root / f".trash-{p.name}-{os.getpid()}"
        os.replace(p, trash)  # atomic: never a half-removed 'step_' folder
    fsync_dir(root)
    for p in root.glob(".t*"):  # trash, and the partial folders of writers that were killed
        if p.name.startswith((".trash-", ".tmp-")):
            shutil.rmtree(p, ignore_errors=True)


# ----------------------------------------------------------------------------- save / load
def _save_file(obj, path: Path) -> int:
    """torch.save into memory, then plain writes + fsync: a full disk is an OSError naming it."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    write_synced(path, buf.getbuffer())
    return path.stat().st_size


def save_checkpoint(root: Path, step: int, *, model: dict, optimizer: dict, state: dict,
                    fingerprint: dict, keep_last: int,
                    hook: Callable[[str], None] | None = None) -> Path:
    """Write checkpoint ``step`` under ``root`` atomically; prune to ``keep_last``.

    ``hook(point)`` is called after the model file (``"ckpt_after_model"``) and
    before the rename (``"ckpt_before_rename"``): the kill points of the tests.
    Raises :class:`CheckpointError` when a write fails (disk full, ...), after
    removing the partial folder; earlier checkpoints stay complete.
    """
    root = Path(root)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp-step_{step:06d}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        sizes = {"model.pt": _save_file(model, tmp / "model.pt")}
        if hook is not None:
            hook("ckpt_after_model")
        sizes["optimizer.pt"] = _save_file(optimizer, tmp / "optimizer.pt")
        sizes["state.pt"] = _save_file(state, tmp / "state.pt")
        meta = {"format": FORMAT, "step": step, "files": sizes, "fingerprint": fingerprint}
        write_synced(tmp / "meta.json", json.dumps(meta, indent=1).encode())
        fsync_dir(tmp)
        if hook is not None:
            hook("ckpt_before_rename")
        if final.exists():  # a checkpoint of this step from a run cut short after it: replace
            os.replace(final, root / f".trash-{final.name}-{os.getpid()}")
        os.replace(tmp, final)
        fsync_dir(root)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        prev = latest_checkpoint(root)
        raise CheckpointError(
            f"could not write the checkpoint of step {step} in {root}: {e}; "
            + (f"the previous checkpoint {prev[0].name} is complete and can be resumed from"
               if prev else "there is no earlier complete checkpoint")) from e
    prune(root, keep_last)
    return final


def load_checkpoint(path: Path) -> dict:
    """``{"model", "optimizer", "state", "meta"}`` of the checkpoint folder ``path`` (CPU)."""
    import torch

    path = Path(path)
    meta = _complete(path)
    if meta is None:
        raise ValueError(f"{path} is not a complete checkpoint (no meta.json or short files)")
    out = {"meta": meta}
    for name in FILES:
        out[name[:-3]] = torch.load(path / name, map_location="cpu", weights_only=False)
    return out
