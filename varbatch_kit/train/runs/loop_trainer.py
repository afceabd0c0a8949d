"""One training job kept up across rollout batches: the RL loop's trainer.

slime's actor stays up for the whole run: every rollout batch trains the same model with
the same optimizer (Adam's moments and step count go on) under one LR schedule.
:class:`LoopTrainer` does the same with the engine's torchrun workers: started once, in a
thread of the launching process (:func:`~varbatch_kit.train.runs.launch._launch`, with every
failure and timeout handling of a plain run), it is handed rollout batch after rollout
batch through a feed folder (:mod:`~varbatch_kit.train.runs.rollout_feed`). Each batch is
planned here (the schedule of its steps and of its log-prob pass, refused with a
ValueError like any run's), trained as the next steps of the one run, and its weights
saved after its last step (``run/params_stepN.pt``)::

    trainer = LoopTrainer(config, out_dir, horizon=...)
    trainer.put(0, rollouts)        # starts the workers with the first batch
    done = trainer.wait(0)          # {"first_step", "last_step", "params", "records"}
    trainer.put(1, more_rollouts)   # the same model and optimizer go on
    ...
    trainer.close()                 # the job ends; its step log is run/steps.jsonl

``put`` returns at once, so the caller may generate the next batch while the workers
train this one (the asynchronous loop). ``resume=True`` continues a job that was killed:
from the newest checkpoint in ``run/checkpoints`` (``checkpoint.save_every``), re-reading
the batches already put (a batch put again must be the same), else from the start.
"""

from __future__ import annotations

import pickle
import shutil
import threading
import time
import warnings
from pathlib import Path

from varbatch_kit.train.runs.rollout_feed import FeedBatch, RolloutFeed

__all__ = ["LoopTrainer"]


class LoopTrainer:
    """A training job of ``config`` that stays up while rollout batches are put to it.

    ``out_dir``: its folder (``feed/``: the batches, ``run/``: the run's reports, weights and
    checkpoints, ``job/``: the torchrun job). ``horizon``: the LR schedule's length in its
    increments (rollouts or samples, ``TrainConfig.lr_increment_unit``; the loop knows how many
    batches it will put, the job does not). ``config.run.timeout_s`` bounds the whole job
    (the waits for batches included); ``config.run.save_params_at`` adds steps whose weights
    are saved besides each batch's last.
    """

    def __init__(self, config, out_dir, *, horizon: int, resume: bool = False) -> None:
        from varbatch_kit.checks import positive_int
        from varbatch_kit.train.config.train_config import TrainConfig

        if not isinstance(config, TrainConfig):
            raise ValueError(f"config={config!r}: give a TrainConfig")  # noqa: TRY004
        positive_int("horizon", horizon)
        if config.nodes.nnodes > 1:
            raise ValueError(f"nodes.nnodes={config.nodes.nnodes}: the loop's trainer runs "
                             "on one node")
        self.config = config
        self.root = Path(out_dir).expanduser().resolve()
        self.feed = RolloutFeed(str(self.root / "feed"), int(horizon))
        self.run_dir = self.root / "run"
        self.job_dir = self.root / "job"
        self.resume = resume
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._abort = threading.Event()
        self._closed = False
        if not resume and (self.run_dir / "steps.jsonl").exists():
            raise ValueError(f"{self.run_dir} already holds a run; give a fresh out_dir (or "
                             "resume=True)")

    # ----------------------------------------------------------------------- batches in
    def put(self, k: int, rollouts) -> int:
        """Hand rollout batch ``k`` to the job (batches go in order: 0, 1, ...); the first
        put starts it. Returns the number of steps the batch will train. A batch put before
        (a resumed job) must be the same rollouts: ValueError otherwise."""
        from varbatch_kit.train.runs.checkpoint import rollouts_hash
        from varbatch_kit.train.runs.plan import plan_runs

        self._raise_if_failed()
        if self._closed:
            raise ValueError("the trainer is closed: start another LoopTrainer")
        if k > 0 and not self.feed.batch_path(k - 1).is_file():
            raise ValueError(f"batch {k} put before batch {k - 1}: put them in order")
        plan = plan_runs([self.config], rollouts)[0]  # the ValueErrors of any run, here
        path = self.feed.batch_path(k)
        if path.is_file():  # put before the job was killed: it must be the same batch
            with open(path, "rb") as f:
                before = pickle.load(f)
            if rollouts_hash(before.rollouts) != rollouts_hash(rollouts):
                raise ValueError(f"batch {k} differs from the one put before in {path}: a "
                                 "resumed loop must regenerate the same rollouts")
        else:
            self.feed.put(k, FeedBatch(rollouts, plan.steps, plan.log_prob_steps))
        if self._thread is None:
            self._start(plan, rollouts if k == 0 else self._first_rollouts())
        return len(plan.steps)

    def _first_rollouts(self):
        with open(self.feed.batch_path(0), "rb") as f:
            return pickle.load(f).rollouts

    # ------------------------------------------------------------------------- results
    def wait(self, k: int, *, poll_s: float = 0.05) -> dict:
        """Block until batch ``k`` is trained; its done record (``first_step``,
        ``last_step``, ``params``: the weights after its last step) and ``records``: the
        step log's lines of its steps. Raises the job's error if it failed."""
        from varbatch_kit.train.runs.step_log import read_records

        if self._thread is None:
            raise ValueError(f"batch {k} was never put: put it first")
        while (done := self.feed.done(k)) is None:
            self._raise_if_failed()
            if not self._thread.is_alive():
                raise RuntimeError(f"the training job ended before batch {k} was trained")
            time.sleep(poll_s)
        first, last = int(done["first_step"]), int(done["last_step"])
        done["records"] = [r for r in read_records(self.run_dir / "steps.jsonl", warn=False)
                           if first <= int(r.get("step", 0)) <= last]
        return done

    def close(self) -> None:
        """No more batches: the job ends once the batches put are trained (and is
        waited for); raises its error if it failed."""
        if self._closed:
            return
        self._closed = True
        if self._thread is None:
            return
        self.feed.stop()
        self._thread.join()
        self._raise_if_failed()

    def abort(self) -> None:
        """Kill the job now (the loop failed): its workers are stopped, nothing waits."""
        self._closed = True
        if self._thread is not None:
            self._abort.set()
            self._thread.join()

    def __enter__(self) -> LoopTrainer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    # ------------------------------------------------------------------------ the job
    def _raise_if_failed(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            self._closed = True
            raise error

    def _resume_point(self, fp: dict) -> tuple[str | None, int]:
        """(checkpoint to continue from, its step); cleans what a resumed job redoes."""
        from varbatch_kit.train.runs.checkpoint import check_resumable, latest_checkpoint
        from varbatch_kit.train.runs.step_log import truncate_to_step

        found = latest_checkpoint(self.run_dir / "checkpoints")
        step = 0
        if found is not None:
            path, meta = found
            check_resumable(meta.get("fingerprint", {}), fp, path)
            step = int(meta["step"])
        elif (self.run_dir / "steps.jsonl").exists():
            warnings.warn(f"resume: no complete checkpoint in {self.run_dir}; the trainer "
                          "trains every batch put so far again", stacklevel=4)
        (self.run_dir / "done").unlink(missing_ok=True)
        truncate_to_step(self.run_dir / "steps.jsonl", step)
        truncate_to_step(self.run_dir / "checkpoints.jsonl", step)
        k = 0  # batches finished after the checkpoint are trained (and marked) again
        while self.feed.batch_path(k).is_file():
            done = self.feed.done(k)
            if done is not None and int(done["last_step"]) > step:
                self.feed.done_path(k).unlink()
            k += 1
        return (str(found[0]) if found is not None else None), step

    def _start(self, plan, first_rollouts) -> None:
        from varbatch_kit.train.parallel.devices import select_device
        from varbatch_kit.train.runs.checkpoint import fed_fingerprint
        from varbatch_kit.train.runs.launch import _launch, warm_agent_server

        fp = fed_fingerprint(self.config)
        self.feed.stop_path.unlink(missing_ok=True)  # a stop of an earlier job
        resume_from, done_steps = None, 0
        if self.resume:
            resume_from, done_steps = self._resume_point(fp)
        elif self.run_dir.exists():
            shutil.rmtree(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        device = select_device(self.config).device
        # the launch runs in a thread: its agent forks from the server started here (in the
        # caller's thread), not from a fresh interpreter (~3 s of CPU a launch)
        if threading.current_thread() is threading.main_thread():
            warm_agent_server(plan.config, self.job_dir, [fp], device)

        def launch() -> None:
            try:
                _launch([plan], first_rollouts, device, self.job_dir, [self.run_dir], False,
                        resume_from=[resume_from], fingerprints=[fp], done_steps=[done_steps],
                        feed=self.feed, abort=self._abort)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                self._error = e

        self._thread = threading.Thread(target=launch, name="varbatch-loop-trainer",
                                        daemon=True)
        self._thread.start()
