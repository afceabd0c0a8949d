"""Rollout batches handed to a training job that stays up: the folder both sides read.

A :class:`~varbatch_kit.train.runs.loop_trainer.LoopTrainer` (the RL loop's trainer) keeps
its torchrun workers, model and optimizer across rollout batches. The launcher puts batch
``k`` (the rollouts, the steps of their schedule and of their log-prob pass, planned by the
launcher as for any run) into ``FEED/batchKK.pkl``; the workers train it as the next steps of
the same run (the step numbers, Adam's moments and the LR schedule go on), save the weights
after its last step and rank 0 writes ``FEED/batchKK.done`` (JSON: its first and last step,
the parameters file). ``FEED/stop`` ends the job once every batch put before it is trained.

Every file is written whole (a temporary name, then a rename): a reader never sees half a
batch. The batches stay in the folder, so a trainer relaunched after a failure
(``resume``) reads them again from batch 0, skips the steps its checkpoint holds and goes on.
"""

from __future__ import annotations

import json
import os
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["FeedBatch", "RolloutFeed"]


@dataclass
class FeedBatch:
    """One rollout batch for a running trainer: the rollouts, the steps that train them and
    the steps of their forward-only log-prob pass (:class:`~varbatch_kit.train.runs.plan.
    PlannedRun`'s)."""

    rollouts: Any  # varbatch_kit.core.rollouts.Rollouts
    steps: list
    log_prob_steps: list


def _write_whole(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.rename(path)


@dataclass(frozen=True)
class RolloutFeed:
    """The feed folder of one trainer. ``horizon``: the length of the LR schedule in its
    increments (rollouts or samples, ``TrainConfig.lr_increment_unit``), which a job that
    learns its batches one by one cannot count ahead."""

    folder: str
    horizon: int

    @property
    def path(self) -> Path:
        return Path(self.folder)

    def batch_path(self, k: int) -> Path:
        return self.path / f"batch{k:02d}.pkl"

    def done_path(self, k: int) -> Path:
        return self.path / f"batch{k:02d}.done"

    @property
    def stop_path(self) -> Path:
        return self.path / "stop"

    # ------------------------------------------------------------------ the launcher's side
    def put(self, k: int, batch: FeedBatch) -> None:
        """Put batch ``k`` (once; the done marker of an earlier try is removed first)."""
        self.path.mkdir(parents=True, exist_ok=True)
        _write_whole(self.batch_path(k), pickle.dumps(batch))

    def stop(self) -> None:
        """No batch follows: the job ends once the batches put are trained."""
        self.path.mkdir(parents=True, exist_ok=True)
        _write_whole(self.stop_path, b"stop\n")

    def done(self, k: int) -> dict | None:
        """What the workers recorded on finishing batch ``k`` (None: not finished)."""
        try:
            return json.loads(self.done_path(k).read_text())
        except FileNotFoundError:
            return None

    # ------------------------------------------------------------------- the workers' side
    def next_batch(self, k: int, *, wait: Callable[[], None] | None = None,
                   poll_s: float = 0.05) -> FeedBatch | None:
        """Batch ``k`` once it is there; None when ``stop`` came first. ``wait`` is called
        about every second while nothing is there (rank 0 shows the launcher it lives)."""
        last = time.monotonic()
        while True:
            path = self.batch_path(k)
            if path.is_file():
                with open(path, "rb") as f:
                    return pickle.load(f)
            if self.stop_path.is_file():
                return None
            if wait is not None and time.monotonic() - last >= 1.0:
                wait()
                last = time.monotonic()
            time.sleep(poll_s)

    def mark_done(self, k: int, record: dict) -> None:
        """Rank 0, after batch ``k``'s last step (its weights saved)."""
        _write_whole(self.done_path(k), json.dumps(record).encode())
