"""Launch training from a notebook or the CLI: ``torchrun`` as a subprocess, reports back.

The caller (a notebook kernel) stays a single process. :func:`run` writes the
rollouts and the config to a job folder, starts ``python -m
torch.distributed.run --nproc_per_node=dp*cp`` on a free port, follows the
JSON lines rank 0 writes (one per step) with a tqdm bar, and returns a
:class:`Run` whose ``steps`` table holds them.

Failures never hang and never leave processes behind: when a worker writes
its traceback (``errors/rankN.txt``), torchrun exits non-zero, or the
timeout passes, :mod:`varbatch_kit.train.supervise` kills every worker and
torchrun and raises :class:`TrainingError` with the failing rank's
traceback. Workers also die with torchrun (``PR_SET_PDEATHSIG``). The
finished run is read back by :mod:`varbatch_kit.train.results`.

:func:`run_many` / :func:`compare` run several configurations on the same
rollouts and seed; configurations of the same world size share one torchrun
launch (they train one after the other, each from the same initial weights),
which saves the start-up cost of a launch per configuration.
"""

from __future__ import annotations

import os
import pickle
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.train.config import TrainConfig
from varbatch_kit.train.results import Run, load_run, param_rel_diff
from varbatch_kit.train.supervise import (
    TrainingError,
    TrainingTimeout,
    kill_job,
    raise_failure,
    read_new_lines,
    tail,
    worker_pids,
)

__all__ = ["Run", "TrainingError", "TrainingTimeout", "compare", "param_rel_diff", "run",
           "run_many"]


# ----------------------------------------------------------------------------- helpers
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _resolve_device(cfg: TrainConfig) -> str:
    import torch

    has_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= cfg.world_size
    if cfg.device == "cuda" and not has_gpus:
        raise ValueError(
            f"device='cuda' but {torch.cuda.device_count()} CUDA devices for dp*cp="
            f"{cfg.world_size} ranks; use device='cpu' or 'auto'")
    if cfg.device == "auto":
        return "cuda" if has_gpus else "cpu"
    return cfg.device


def _validate(cfg: TrainConfig, rollouts: Rollouts) -> int:
    """Raise ValueError for a config that cannot train on ``rollouts``; return its step count."""
    from varbatch_kit.core.schedule import build_schedule
    from varbatch_kit.train.data import validate_rollout_data

    if not isinstance(cfg, TrainConfig):
        raise ValueError(  # noqa: TRY004 - user errors are ValueError (docs/architecture.md)
            f"configs must be TrainConfig objects, got {type(cfg).__name__}")
    if (rollouts.prompt_len < 1).any():
        i = int(np.flatnonzero(rollouts.prompt_len < 1)[0])
        raise ValueError(
            f"prompt_len[{i}] = 0: training needs >= 1 prompt token per sample (the first "
            "response token is predicted from the token before it)")
    longest = int(rollouts.total_len.max())
    if cfg.max_seq_len is not None and cfg.max_seq_len < longest:
        raise ValueError(
            f"max_seq_len={cfg.max_seq_len} < longest sample ({longest} tokens); raise it "
            "or leave it None")
    # real token sequences are checked here, before any worker starts (no TrainingError wrap)
    validate_rollout_data(rollouts, vocab_size=cfg.vocab_size,
                          n_samples_per_prompt=cfg.n_samples_per_prompt)
    schedule = build_schedule(rollouts, cfg.schedule, model=cfg.model_shape())
    n = schedule.num_steps if cfg.max_steps is None else min(cfg.max_steps, schedule.num_steps)
    if cfg.fail_at_step is None and n < 1:
        raise ValueError("the schedule has no step to train")
    return n


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-")[:60]


def _package_root() -> str:
    import varbatch_kit

    return str(Path(varbatch_kit.__file__).resolve().parent.parent)


def _launch(configs: list[TrainConfig], rollouts: Rollouts, device: str, job_dir: Path,
            out_dirs: list[Path], planned: list[int], progress: bool) -> float:
    """One torchrun for ``configs`` (same world size); returns its wall time."""
    from varbatch_kit.train.loop import Job

    world = configs[0].world_size
    job_dir.mkdir(parents=True, exist_ok=True)
    with open(job_dir / "job.pkl", "wb") as f:
        pickle.dump(Job(list(configs), rollouts, [str(d) for d in out_dirs], device), f)
    threads = configs[0].threads_per_worker
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [_package_root(),
                                                         env.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
           "--nnodes=1", "--master_addr=127.0.0.1", f"--master_port={_free_port()}",
           "--max_restarts=0", "--monitor_interval=0.2",
           "-m", "varbatch_kit.train.loop", str(job_dir)]
    timeout = sum(c.timeout_s for c in configs)
    log_path = job_dir / "torchrun.log"
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(planned), desc=configs[0].name, unit="step", leave=True)
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, cwd=str(job_dir))
    states: list[dict] = [{} for _ in configs]

    def follow_reports() -> None:  # the progress bar is fed by the JSON lines rank 0 writes
        for k, (out, st) in enumerate(zip(out_dirs, states)):
            for rec in read_new_lines(out / "steps.jsonl", st):
                if bar is not None:
                    bar.set_description(configs[k].name)
                    bar.set_postfix(loss=f"{rec['loss']:.4g}", step=rec["step"])
                    bar.update(1)

    try:
        while True:
            follow_reports()
            errors = sorted((job_dir / "errors").glob("rank*.txt"),
                            key=lambda p: p.stat().st_mtime_ns)
            rc = proc.poll()
            if errors or (rc is not None and rc != 0):
                if not errors:  # torchrun failed: give a dying worker a moment to report
                    time.sleep(0.5)
                    errors = sorted((job_dir / "errors").glob("rank*.txt"),
                                    key=lambda p: p.stat().st_mtime_ns)
                raise_failure(proc, job_dir, errors, log_path)
            if rc == 0:
                missing = [str(d) for d in out_dirs if not (d / "done").is_file()]
                if missing:
                    raise_failure(proc, job_dir, [], log_path,
                                   f"torchrun exited 0 but runs did not finish: {missing}")
                follow_reports()
                break
            if time.monotonic() - t0 > timeout:
                pids = worker_pids(job_dir)
                kill_job(proc, job_dir)
                raise TrainingTimeout(
                    f"training timed out after {timeout:.0f} s (timeout_s); workers killed.\n"
                    f"torchrun log tail:\n{tail(log_path)}",
                    job_dir=job_dir, worker_pids=pids, torchrun_pid=proc.pid,
                    log_tail=tail(log_path))
            time.sleep(0.1)
    except BaseException:
        kill_job(proc, job_dir)  # also on KeyboardInterrupt in a notebook: no orphans
        raise
    finally:
        if bar is not None:
            bar.close()
    return time.monotonic() - t0


# ----------------------------------------------------------------------------- public API
def run_many(configs: Sequence[TrainConfig], rollouts: Rollouts, *, out_dir=None,
             progress: bool = True) -> list[Run]:
    """Train every configuration on ``rollouts``; one :class:`Run` per configuration, in order.

    Configurations with the same world size (dp * cp), device and ``threads_per_worker``
    share one torchrun launch.
    """
    configs = list(configs)
    if not configs:
        raise ValueError("configs is empty: pass at least one TrainConfig")
    if not isinstance(rollouts, Rollouts):
        raise ValueError(  # noqa: TRY004 - user errors are ValueError (docs/architecture.md)
            f"rollouts must be a varbatch_kit.Rollouts, got {type(rollouts).__name__}")
    planned = [_validate(c, rollouts) for c in configs]
    devices = [_resolve_device(c) for c in configs]
    root = (Path(out_dir) if out_dir is not None
            else Path(tempfile.mkdtemp(prefix="varbatch_train_")))
    root.mkdir(parents=True, exist_ok=True)
    out_dirs = [root / f"run{k:02d}-{_slug(c.name)}" for k, c in enumerate(configs)]
    for d in out_dirs:
        if (d / "steps.jsonl").exists():
            raise ValueError(f"{d} already holds a run; pass a fresh out_dir")
    groups: dict[tuple[int, str, int], list[int]] = {}
    for k, (c, dev) in enumerate(zip(configs, devices)):
        groups.setdefault((c.world_size, dev, c.threads_per_worker), []).append(k)
    walls = [float("nan")] * len(configs)
    for g, ((world, dev, _), members) in enumerate(groups.items()):
        wall = _launch([configs[k] for k in members], rollouts, dev,
                       root / f"job{g}-world{world}-{dev}", [out_dirs[k] for k in members],
                       [planned[k] for k in members], progress)
        for k in members:
            walls[k] = wall
    return [load_run(c, d, w) for c, d, w in zip(configs, out_dirs, walls)]


def run(config: TrainConfig, rollouts: Rollouts, *, out_dir=None, progress: bool = True) -> Run:
    """Train one configuration in ``dp * cp`` torchrun workers; return its per-step reports.

    Raises :class:`TrainingError` (with the failing rank's traceback) when a
    worker fails or ``config.timeout_s`` passes; no worker is left running.
    """
    return run_many([config], rollouts, out_dir=out_dir, progress=progress)[0]


def compare(configs: Sequence[TrainConfig], rollouts: Rollouts, *, reference: int | None = None,
            out_dir=None, progress: bool = True, runs: list | None = None):
    """Run ``configs`` on the same rollouts and seed; one table, one row per (config, step).

    Columns: ``config`` (index into ``configs``), ``reference`` (the index it is
    compared with), the config summary (label, dp, cp, packing, distribution,
    mode, ...), the step report (step, rollouts, samples, tokens,
    num_microbatches, loss, metrics, grad_norm, lr, step_time_s, ...), and,
    against the reference at the same step: ``loss_rel_diff``,
    ``grad_norm_rel_diff`` and ``param_rel_diff`` (``||p - p_ref|| / ||p_ref||``
    where both saved parameters at that step, see ``save_params_at``; else NaN).

    ``reference``: an index into ``configs``; ``None`` (default) compares each
    configuration with the first one of the same report mode. Pass a list as
    ``runs`` to receive the :class:`Run` objects too.
    """
    import pandas as pd

    results = run_many(configs, rollouts, out_dir=out_dir, progress=progress)
    if runs is not None:
        runs.extend(results)
    first_of_mode: dict[str, int] = {}
    for k, c in enumerate(configs):
        first_of_mode.setdefault(c.mode, k)
    frames, ref_params = [], {}
    for k, r in enumerate(results):
        ref_k = first_of_mode[r.config.mode] if reference is None else reference
        ref = results[ref_k]
        ref_steps = ref.steps.set_index("step")
        df = r.steps.copy()
        for key, value in reversed(list(r.config.summary().items())):
            if key in df.columns:
                df = df.drop(columns=key)
            df.insert(0, key, value)
        df.insert(0, "reference", ref_k)
        df.insert(0, "config", k)
        ref_loss = ref_steps["loss"].reindex(df["step"]).to_numpy()
        ref_gn = ref_steps["grad_norm"].reindex(df["step"]).to_numpy()
        with np.errstate(divide="ignore", invalid="ignore"):
            df["loss_rel_diff"] = np.abs(df["loss"].to_numpy() - ref_loss) / np.abs(ref_loss)
            df["grad_norm_rel_diff"] = np.abs(df["grad_norm"].to_numpy() - ref_gn) / np.abs(ref_gn)
        diffs = []
        for s in df["step"]:
            if s in r.config.save_params_at and s in ref.config.save_params_at:
                if (ref_k, s) not in ref_params:
                    ref_params[(ref_k, s)] = ref.params(s)
                diffs.append(param_rel_diff(r.params(s), ref_params[(ref_k, s)]))
            else:
                diffs.append(float("nan"))
        df["param_rel_diff"] = diffs
        frames.append(df)
    return pd.concat(frames, ignore_index=True)
