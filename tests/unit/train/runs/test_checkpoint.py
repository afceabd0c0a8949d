"""Checkpoint files, durable step logs and the resume fingerprint (no workers started)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from _factories import synthetic_rollouts

from varbatch_kit import Rollouts, ScheduleConfig
from varbatch_kit.train import FaultConfig, NodesConfig, TrainConfig
from varbatch_kit.train.runs.checkpoint import (
    CheckpointError,
    check_resumable,
    checkpoint_dirs,
    fingerprint,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from varbatch_kit.train.runs.plan import plan_runs
from varbatch_kit.train.runs.results import load_run
from varbatch_kit.train.runs.step_log import (
    TornLogWarning,
    append_record,
    read_records,
    truncate_to_step,
)


def _save(root, step, keep_last=2, hook=None, value=1.0):
    return save_checkpoint(
        root, step, model={"w": torch.full((3,), value)}, optimizer={"state": {}, "lr": 0.1},
        state={"step": step}, fingerprint={"config": {}}, keep_last=keep_last, hook=hook)


# ----------------------------------------------------------------------------- step logs
def test_step_log_lines_are_whole_and_a_torn_last_line_is_dropped_with_a_warning(tmp_path):
    path = tmp_path / "steps.jsonl"
    for s in (1, 2, 3):
        append_record(path, {"step": s, "loss": 0.5 / s})
    assert path.read_bytes().endswith(b"\n")
    with open(path, "ab") as f:  # an older writer crashed half-way through step 4's line
        f.write(b'{"step": 4, "lo')
    with pytest.warns(TornLogWarning, match="torn last line"):
        records = read_records(path)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[1]["loss"] == 0.25

    # load_run reads such a log (and warns)
    cfg = TrainConfig()
    with pytest.warns(TornLogWarning):
        run = load_run(cfg, tmp_path, float("nan"))
    assert run.steps["step"].tolist() == [1, 2, 3]

    # resume: cut back to the checkpoint's step, torn rest gone, no duplicates afterwards
    assert truncate_to_step(path, 2) == 2
    append_record(path, {"step": 3, "loss": 9.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        records = read_records(path)
    assert [r["step"] for r in records] == [1, 2, 3] and records[-1]["loss"] == 9.0


def test_a_bad_line_in_the_middle_of_a_log_is_an_error(tmp_path):
    path = tmp_path / "steps.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        read_records(path)


# ----------------------------------------------------------------------------- checkpoints
def test_checkpoints_are_atomic_listed_newest_last_and_pruned(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        _save(root, step, value=float(step))
    assert [s for s, _ in checkpoint_dirs(root)] == [2, 3]  # keep_last=2
    path, meta = latest_checkpoint(root)
    assert path.name == "step_000003" and meta["step"] == 3
    ck = load_checkpoint(path)
    assert torch.equal(ck["model"]["w"], torch.full((3,), 3.0))
    assert ck["optimizer"]["lr"] == 0.1 and ck["state"]["step"] == 3

    # a writer killed before the rename leaves only a hidden temporary: not a checkpoint
    class Killed(Exception):
        pass

    def die(point):
        if point == "ckpt_before_rename":
            raise Killed
    with pytest.raises(Killed):
        _save(root, 4, hook=die)
    assert any(p.name.startswith(".tmp-step_000004") for p in root.iterdir())
    assert latest_checkpoint(root)[0].name == "step_000003"
    # a short file (a torn copy) makes a folder incomplete
    (root / "step_000003" / "optimizer.pt").write_bytes(b"x")
    assert latest_checkpoint(root)[0].name == "step_000002"
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        load_checkpoint(root / "step_000003")
    # the next save removes the leftovers of killed writers
    _save(root, 5)
    assert not [p for p in root.iterdir() if p.name.startswith(".")]


def test_a_failed_write_raises_checkpoint_error_and_keeps_the_earlier_one(tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, 1)

    def full(point):
        raise OSError(28, "No space left on device")
    with pytest.raises(CheckpointError, match="step 2.*No space left.*step_000001 is complete"):
        _save(root, 2, hook=full)
    assert [s for s, _ in checkpoint_dirs(root)] == [1]
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp")]


# ----------------------------------------------------------------------------- fingerprint
def _steps(cfg, rollouts):
    return plan_runs([cfg], rollouts)[0].steps


def test_resume_fingerprint_allows_the_layout_and_names_what_differs(tmp_path):
    r = synthetic_rollouts()
    cfg = TrainConfig(schedule=ScheduleConfig(global_batch_size=4, max_tokens_per_gpu=256))
    fp = fingerprint(cfg, r, _steps(cfg, r))
    json.dumps(fp)  # stored in meta.json
    # layout and run settings may change
    other = cfg.with_(dp=2, cp=2, max_tokens_per_gpu=128, distribution="flops_kk",
                      timeout_s=5, save_every=3, label="x", kill_at="mid_step:2")
    check_resumable(fp, fingerprint(other, r, _steps(other, r)), tmp_path)
    # model, optimiser, mode, seed, horizon may not
    bad = cfg.with_(lr=1e-2, seed=7, mode="per_token")
    with pytest.raises(ValueError) as info:
        check_resumable(fp, fingerprint(bad, r, _steps(bad, r)), tmp_path)
    msg = str(info.value)
    assert "optim.lr: checkpoint 0.003, now 0.01" in msg
    assert "data.seed: checkpoint 1234, now 7" in msg and "mode:" in msg
    r2 = synthetic_rollouts(seed=4)
    with pytest.raises(ValueError, match="rollouts: a different rollout set"):
        check_resumable(fp, fingerprint(cfg, r2, _steps(cfg, r2)), tmp_path)
    # the same lengths with other loss masks are other rollouts too
    masks = [m.copy() for m in r.masks()]
    masks[0][0] = 0
    r3 = Rollouts(r.prompt_len, r.response_len, r.rollout_id, masks)
    with pytest.raises(ValueError, match="rollouts"):
        check_resumable(fp, fingerprint(cfg, r3, _steps(cfg, r3)), tmp_path)
    shorter = cfg.with_(max_steps=2)  # the LR horizon changes
    with pytest.raises(ValueError, match="run.max_steps"):
        check_resumable(fp, fingerprint(shorter, r, _steps(shorter, r)), tmp_path)


@pytest.mark.parametrize("kw, match", [
    ({"save_every": -1}, "save_every"),
    ({"keep_last": 0}, "keep_last"),
    ({"nnodes": 2, "schedule": ScheduleConfig(dp=2, global_batch_size=4,
                                              max_tokens_per_gpu=64)}, "rdzv_endpoint"),
    ({"nnodes": 3, "rdzv_endpoint": "h:1"}, "does not divide"),
    ({"nnodes": 1, "node_rank": 1}, "node_rank"),
    ({"rdzv_endpoint": "nohost"}, "host:port"),
    ({"kill_at": "mid_step"}, "POINT:STEP"),
    ({"kill_at": "lunch:3"}, "POINT:STEP"),
    ({"step_timeout_s": 0}, "step_timeout_s"),
    ({"rdzv_timeout_s": -1}, "rdzv_timeout_s"),
])
def test_config_validation_of_checkpoint_and_node_fields(kw, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig().with_(**kw)  # each name routed to its sub-config


def test_config_kill_point_and_node_fields():
    assert FaultConfig(kill_at="ckpt_after_model:3").kill_point() == ("ckpt_after_model", 3)
    assert TrainConfig().faults.kill_point() is None
    cfg = TrainConfig(schedule=ScheduleConfig(dp=2, global_batch_size=4, max_tokens_per_gpu=64),
                      nodes=NodesConfig(nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29400"))
    assert (cfg.nodes.nnodes, cfg.nodes.node_rank, cfg.checkpoint.save_every,
            cfg.checkpoint.keep_last) == (2, 1, 0, 2)


def test_resume_without_a_checkpoint_starts_fresh_and_says_so(tmp_path):
    from varbatch_kit.train.runs.launch import _prepare_resume

    r = synthetic_rollouts()
    cfg = TrainConfig(schedule=ScheduleConfig(global_batch_size=4, max_tokens_per_gpu=256))
    fp = fingerprint(cfg, r, _steps(cfg, r))
    out = tmp_path / "run00-x"
    out.mkdir()
    append_record(out / "steps.jsonl", {"step": 1})  # a run killed before its first checkpoint
    with pytest.warns(UserWarning, match="no complete checkpoint.*training from scratch"):
        assert _prepare_resume(cfg, out, fp, 4) == (None, 0, False)
    assert not (out / "steps.jsonl").exists()
    # with one: the log is cut back to its step
    for s in (2, 3):
        append_record(out / "steps.jsonl", {"step": s})
    save_checkpoint(out / "checkpoints", 2, model={}, optimizer={}, state={}, fingerprint=fp,
                    keep_last=2)
    path, kept, finished = _prepare_resume(cfg, out, fp, 4)
    assert Path(path).name == "step_000002" and kept == 1 and not finished
    assert [x["step"] for x in read_records(out / "steps.jsonl")] == [2]


def test_cli_resume_and_out_must_name_the_same_folder(tmp_path, capsys):
    from varbatch_kit.cli import main

    rc = main(["train", "--rollouts", "8", "--global-batch-size", "4", "--quiet",
               "--resume", str(tmp_path / "a"), "--out", str(tmp_path / "b"),
               "--checkpoint.save-every", "2", "--nodes.nnodes", "1"])
    assert rc == 2
    assert "--resume" in capsys.readouterr().err


TORCHRUN_SUMMARY = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
varbatch_kit.train.runs.worker FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-01_12:13:41
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 607)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 607
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_12:13:41
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 606)
  error_file: <N/A>
============================================================
"""


def test_a_rank_killed_by_a_signal_is_named_as_the_cause():
    """torchrun (torch 2.13) may call the follow-up failure of rank 0 the root cause."""
    from varbatch_kit.train.runs.launch import _torchrun_failure

    msg, rank = _torchrun_failure(TrainConfig(), TORCHRUN_SUMMARY)
    assert rank == 1 and "rank 1 was killed by SIGKILL (exit code -9)" in msg
    assert _torchrun_failure(TrainConfig(), TORCHRUN_SUMMARY.replace("-9", "1")) is None
    cfg = TrainConfig(schedule=ScheduleConfig(dp=2, global_batch_size=4, max_tokens_per_gpu=64),
                      nodes=NodesConfig(nnodes=2, rdzv_endpoint="h:5", rdzv_timeout_s=3))
    msg, rank = _torchrun_failure(cfg, "...RendezvousTimeoutError...")
    assert rank is None and "did not complete within rdzv_timeout_s=3 s" in msg


def test_the_killed_rank_not_torchruns_sigterm_is_the_cause_in_either_order():
    """Under load torchrun may list rank 0, stopped by its own SIGTERM, before rank 1."""
    from varbatch_kit.train.runs.launch import _torchrun_failure

    loaded = (TORCHRUN_SUMMARY.replace("rank      : 1 (local_rank: 1)", "rank      : X")
              .replace("rank      : 0 (local_rank: 0)\n  exitcode  : 1 (pid: 606)",
                       "rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 607)")
              .replace("rank      : X\n  exitcode  : -9 (pid: 607)  (SIGKILL)",
                       "rank      : 0 (local_rank: 0)\n  exitcode  : -15 (pid: 606)  (SIGTERM)"))
    assert loaded.index("-15") < loaded.index("-9")
    msg, rank = _torchrun_failure(TrainConfig(), loaded)
    assert rank == 1 and "rank 1 was killed by SIGKILL (exit code -9)" in msg
    alone = TORCHRUN_SUMMARY.replace("-9 (pid: 607)  (SIGKILL)", "-15 (pid: 607)  (SIGTERM)")
    msg, rank = _torchrun_failure(TrainConfig(), alone)
    assert rank == 1 and "rank 1 was killed by SIGTERM (exit code -15)" in msg


def test_a_sigterm_is_not_the_cause_when_a_rank_wrote_a_traceback():
    """torchrun SIGTERMs the other ranks once one raised; which it lists depends on load (a
    fresh-clone run named rank 0's SIGTERM instead of rank 1's traceback)."""
    from varbatch_kit.train.runs.launch import _torchrun_failure

    alone = TORCHRUN_SUMMARY.replace("-9", "-15")
    assert _torchrun_failure(TrainConfig(), alone)[1] is not None
    assert _torchrun_failure(TrainConfig(), alone, traceback=True) is None
    assert _torchrun_failure(TrainConfig(), TORCHRUN_SUMMARY, traceback=True)[1] is not None
