"""Faults under test: SIGKILL at named points and exact resume, a full disk while
checkpointing, a hanging rank, a killed launcher, a resume with another layout and on two
nodes (torchrun's c10d rendezvous on 127.0.0.1), and a node that never joins.

Real torchrun launches of the default toy GPT, 4 steps, dp=2 (world size 1-2). A raised
worker and the launch-wide timeout are covered in test_train_runs.py.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from _factories import synthetic_rollouts

from varbatch_kit import ScheduleConfig
from varbatch_kit.train import (
    CheckpointConfig,
    RunConfig,
    TrainConfig,
    TrainingError,
    TrainingTimeout,
    run,
)
from varbatch_kit.train.runs.checkpoint import checkpoint_dirs
from varbatch_kit.train.runs.results import param_rel_diff
from varbatch_kit.train.runs.supervise import _alive, job_processes

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

# columns that differ between two runs of the same training (timings, the label)
# wall-clock measurements (and the label) differ between runs; everything else must not
VOLATILE = ["wall_s", "step_time_s", "label", "micro_batch_timing", "busy_s", "straggler_s",
            "log_prob_pass_s"]
#: and those of pipelined runs (each stage's span and idle time)
PIPELINE_TIMES = ["pipeline_span_s", "pipeline_idle_s"]


BASE = TrainConfig(schedule=ScheduleConfig(dp=2, global_batch_size=4, max_tokens_per_gpu=256),
                   checkpoint=CheckpointConfig(save_every=1),
                   run=RunConfig(save_params_at=(4,), timeout_s=120))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _no_process_left(err: TrainingError) -> None:
    assert not any(_alive(p) for p in err.worker_pids)
    assert not _alive(err.torchrun_pid)
    assert job_processes(err.job_dir) == []


def _run_dir(root: Path) -> Path:
    (d,) = root.glob("run00-*")
    return d


def _steps(path: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (path / "steps.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run; every checkpoint kept (for the resumes from step 2)."""
    root = tmp_path_factory.mktemp("reference")
    return run(BASE.with_(keep_last=4, label="reference"), synthetic_rollouts(), out_dir=root,
               progress=False)


def test_killed_at_any_point_and_resumed_equals_the_uninterrupted_run_bitwise(tmp_path,
                                                                             reference):
    rollouts, root = synthetic_rollouts(), tmp_path
    cfg = BASE.with_(keep_last=2, label="chain")

    # 1. a full disk while writing the checkpoint of step 2: a clear error, step 1's stays
    with pytest.raises(TrainingError) as info:
        run(cfg.with_(disk_full_at_step=2), rollouts, out_dir=root, progress=False)
    msg = str(info.value)
    assert "could not write the checkpoint of step 2" in msg and "File too large" in msg
    assert "step_000001 is complete and can be resumed from" in msg
    _no_process_left(info.value)
    out = _run_dir(root)
    assert [s for s, _ in checkpoint_dirs(out / "checkpoints")] == [1]

    # 2. resumed from step 1 with SIGKILL to rank 1 in the middle of step 3 (its first
    #    forward; rank 0 waits in a collective and is stopped too)
    with pytest.raises(TrainingError, match="rank 1 was killed by SIGKILL") as info:
        run(cfg.with_(kill_at="mid_step:3", fail_rank=1), rollouts, out_dir=root,
            progress=False, resume=True)
    assert info.value.rank == 1
    _no_process_left(info.value)
    assert _steps(out) == [1, 2]
    assert [s for s, _ in checkpoint_dirs(out / "checkpoints")] == [1, 2]

    # 3. resumed from step 2 with SIGKILL to rank 0 (the writer) while it writes step 4's
    #    checkpoint (model file written, optimizer file not): step 4 is logged, its
    #    checkpoint is not visible
    with pytest.raises(TrainingError, match="SIGKILL"):
        run(cfg.with_(kill_at="ckpt_after_model:4"), rollouts, out_dir=root, progress=False,
            resume=True)
    assert _steps(out) == [1, 2, 3, 4]
    assert [s for s, _ in checkpoint_dirs(out / "checkpoints")] == [2, 3]
    assert any(p.name.startswith(".tmp-step_000004") for p in (out / "checkpoints").iterdir())

    # 4. resumed from step 3: the log is cut back to step 3, step 4 is trained again
    chain = run(cfg, rollouts, out_dir=root, progress=False, resume=True)
    assert chain.out_dir == out and _steps(out) == [1, 2, 3, 4]
    assert chain.meta["resumed_from_step"] == 3
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000003",
                                                                       "step_000004"]
    # bitwise: every report (losses, grad norms, LR, lr_next, ...) and every parameter
    pd.testing.assert_frame_equal(chain.steps.drop(columns=VOLATILE),
                                  reference.steps.drop(columns=VOLATILE), check_exact=True)
    a, b = chain.params(4), reference.params(4)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # a finished run resumed again is read back as is (no launch)
    again = run(cfg, rollouts, out_dir=root, progress=False, resume=True)
    assert np.isnan(again.launch_wall_s) and again.steps["loss"].tolist() == chain.losses.tolist()

    # what may not change is refused, naming what differs
    with pytest.raises(ValueError, match=r"(?s)cannot resume.*lr: checkpoint 0.003, now 0.01"):
        run(cfg.with_(lr=1e-2), rollouts, out_dir=root, progress=False, resume=True)
    with pytest.raises(ValueError, match="rollouts: a different rollout set"):
        run(cfg, synthetic_rollouts(seed=4), out_dir=root, progress=False, resume=True)


def _whole_and_cut(cfg, rollouts, root: Path, rank: int):
    """``cfg`` run whole, then again with world rank ``rank`` killed in step 3 (the launcher
    names it); returns the whole run and the cut run's folder (steps 1 and 2 logged)."""
    whole = run(cfg, rollouts, out_dir=root / "whole", progress=False)
    with pytest.raises(TrainingError, match=f"rank {rank} was killed by SIGKILL"):
        run(cfg.with_(kill_at="mid_step:3", fail_rank=rank), rollouts, out_dir=root / "cut",
            progress=False)
    out = _run_dir(root / "cut")
    assert _steps(out) == [1, 2]
    return whole, out


def test_model_parallel_shards_checkpoint_and_resume_bitwise(tmp_path, reference):
    """tp 2 x pp 2: each (stage, TP rank) shard in the checkpoint; rank 3 (last stage, TP rank
    1) killed in step 3, resumed from step 2's shards: bitwise the uninterrupted tp 2 x pp 2
    run, and within fp32 rounding of the dp 2 reference. A shard restored on the wrong rank
    (the two TP ranks hold different halves) would break the bitwise match."""
    from varbatch_kit.train.runs.checkpoint import load_checkpoint
    from varbatch_kit.train.runs.run_export import saved_weights

    rollouts = synthetic_rollouts()
    cfg = BASE.with_(dp=1, pp=2, tp=2, keep_last=4, label="tp2 pp2")
    whole, out = _whole_and_cut(cfg, rollouts, tmp_path, rank=3)
    ckpt = load_checkpoint(checkpoint_dirs(out / "checkpoints")[-1][1])
    assert [len(stage) for stage in ckpt["optimizer"]["stages"]] == [2, 2]
    assert {k.rsplit("/", 1)[0] for k in ckpt["model"]} == {
        "stage0/tp0", "stage0/tp1", "stage1/tp0", "stage1/tp1"}
    a, b = (ckpt["model"][f"stage0/tp{t}/0.embedding.word_embeddings.weight"] for t in (0, 1))
    assert a.shape == b.shape and not torch.equal(a, b)  # each TP rank's half of the vocab
    with pytest.raises(ValueError, match="holds pipeline-stage / tensor-parallel shards"):
        saved_weights(out, step=2)  # export reads full tensors (params files)
    resumed = run(cfg, rollouts, out_dir=tmp_path / "cut", progress=False, resume=True)
    assert resumed.meta["resumed_from_step"] == 2 and _steps(out) == [1, 2, 3, 4]
    volatile = VOLATILE + PIPELINE_TIMES
    pd.testing.assert_frame_equal(resumed.steps.drop(columns=volatile),
                                  whole.steps.drop(columns=volatile), check_exact=True)
    p, q = resumed.params(4), whole.params(4)
    assert p.keys() == q.keys() and all(torch.equal(p[k], q[k]) for k in p)
    for key in ("loss", "grad_norm", "lr"):
        np.testing.assert_allclose(resumed.steps[key], reference.steps[key], rtol=1e-5)
    assert param_rel_diff(p, reference.params(4)) < 1e-5
    # another tensor-parallel size cannot take these shards: refused before any worker starts
    with pytest.raises(ValueError, match=r"(?s)cannot resume.*tp: checkpoint 2, now 1"):
        run(cfg.with_(tp=1), rollouts, out_dir=tmp_path / "cut", progress=False, resume=True)


def test_dp2_cp2_tp2_killed_and_resumed_bitwise(tmp_path):
    """World 8 (dp 2 x all-gather cp 2 x tp 2, sequence parallel: tp's default, and the
    distributed optimizer: each TP rank's Adam moments in four shards over its pool): world
    rank 5 (TP rank 1 of a CP rank) killed in step 3, resumed from step 2's checkpoint: bitwise
    the uninterrupted run (issue 30 items 4 and 7)."""
    from varbatch_kit.train.runs.checkpoint import load_checkpoint

    rollouts = synthetic_rollouts()
    cfg = BASE.with_(dp=2, cp=2, tp=2, cp_impl="allgather", max_tokens_per_gpu=64,
                     distributed=True, keep_last=4, label="dp2 cp2 tp2 dist-opt")
    whole, out = _whole_and_cut(cfg, rollouts, tmp_path, rank=5)
    ckpt = load_checkpoint(checkpoint_dirs(out / "checkpoints")[-1][1])
    (row,) = ckpt["optimizer"]["stages"]  # one stage, two TP shards, each its pool's gathered
    assert len(row) == 2 and all(set(part) == {"distributed"} for part in row)
    resumed = run(cfg, rollouts, out_dir=tmp_path / "cut", progress=False, resume=True)
    assert resumed.meta["resumed_from_step"] == 2 and _steps(out) == [1, 2, 3, 4]
    assert (whole.steps["layout"] == "dp2 cp2(allgather) pp1 tp2 sp").all()
    pd.testing.assert_frame_equal(resumed.steps.drop(columns=VOLATILE),
                                  whole.steps.drop(columns=VOLATILE), check_exact=True)
    p, q = resumed.params(4), whole.params(4)
    assert p.keys() == q.keys() and all(torch.equal(p[k], q[k]) for k in p)


def _copy_at_step_2(reference, root: Path) -> None:
    """The reference run's folder as it was when cut short after step 2's checkpoint."""
    out = root / reference.out_dir.name
    shutil.copytree(reference.out_dir, out)
    for step in (3, 4):
        shutil.rmtree(out / "checkpoints" / f"step_{step:06d}")
    (out / "done").unlink()


def test_resume_with_another_layout_and_on_two_nodes(tmp_path, reference):
    rollouts = synthetic_rollouts()
    # one node, dp=1 (world size 1), from the dp=2 checkpoint of step 2
    _copy_at_step_2(reference, tmp_path / "one")
    one = run(BASE.with_(dp=1, label="dp1"), rollouts, out_dir=tmp_path / "one",
              progress=False, resume=True)
    # two nodes of one worker each (c10d rendezvous on 127.0.0.1), from the same checkpoint
    _copy_at_step_2(reference, tmp_path / "two")
    two_nodes = BASE.with_(nnodes=2, rdzv_endpoint=f"127.0.0.1:{_free_port()}",
                           rdzv_timeout_s=60, label="two nodes")
    results: dict = {}

    def node(rank: int) -> None:
        try:
            results[rank] = run(two_nodes.with_(node_rank=rank), rollouts,
                                out_dir=tmp_path / "two", progress=False, resume=True)
        except BaseException as e:  # noqa: BLE001 - re-raised below in the test thread
            results[rank] = e

    threads = [threading.Thread(target=node, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in (0, 1):
        if isinstance(results[r], BaseException):
            raise results[r]
    two = results[0]
    assert sorted(p.name for p in (tmp_path / "two").glob("job*")) == [
        "job0-world2-cpu-node0", "job0-world2-cpu-node1"]
    assert results[1].steps["loss"].tolist() == two.steps["loss"].tolist()
    ref = reference.steps.set_index("step")
    for r in (one, two):
        assert r.steps["step"].tolist() == [1, 2, 3, 4]
        assert r.meta["resumed_from_step"] == 2

    # two nodes give the reports of one node of the same world size (the reference)
    cols = ["loss", "nll", "grad_norm", "lr", "lr_next", "tokens", "num_microbatches"]
    pd.testing.assert_frame_equal(two.steps[cols], reference.steps[cols], check_exact=False,
                                  rtol=1e-12)
    assert param_rel_diff(two.params(4), reference.params(4)) < 1e-12

    # another layout (dp=1): steps 3-4 within the layout tolerance, the LR schedule exactly
    s = one.steps.set_index("step")
    assert s.loc[[3, 4], "dp"].tolist() == [1, 1]
    for col in ("loss", "grad_norm"):
        np.testing.assert_allclose(s.loc[[3, 4], col], ref.loc[[3, 4], col], rtol=1e-4)
    assert s["lr"].tolist() == ref["lr"].tolist()
    assert param_rel_diff(one.params(4), reference.params(4)) < 1e-4


def test_a_node_that_never_joins_fails_within_the_rendezvous_timeout(tmp_path):
    cfg = BASE.with_(nnodes=2, rdzv_endpoint=f"127.0.0.1:{_free_port()}",
                     rdzv_timeout_s=3, save_every=0)
    with pytest.raises(TrainingError, match="did not complete within rdzv_timeout_s=3 s") as i:
        run(cfg, synthetic_rollouts(), out_dir=tmp_path, progress=False)
    # the rendezvous timeout ended it, not the launch timeout (timeout_s=120): an ordering
    assert not isinstance(i.value, TrainingTimeout), str(i.value)
    assert "nnodes=2" in str(i.value)
    _no_process_left(i.value)


def test_a_hanging_rank_trips_the_step_timeout(tmp_path):
    cfg = BASE.with_(hang_at_step=2, fail_rank=1, step_timeout_s=4, save_every=0)
    with pytest.raises(TrainingTimeout, match="within step_timeout_s=4 s") as info:
        run(cfg, synthetic_rollouts(), out_dir=tmp_path, progress=False)
    # the step timeout fired before the launch timeout (timeout_s=120) would have
    assert "(timeout_s)" not in str(info.value)
    # where each rank was: rank 1 in the hang hook's sleep, rank 0 waiting in step 2
    message = str(info.value)
    print(message[:3000])
    rank0 = message.split("rank0 (most recent call first):\n")[1].split("rank1 (")[0]
    rank1 = message.split("rank1 (most recent call first):\n")[1].splitlines()
    assert "worker.py" in rank1[0] and rank1[0].endswith(" in train"), rank1[0]  # the hook
    assert " in train_step" in rank0, rank0  # waiting for rank 1 in step 2's collectives
    _no_process_left(info.value)
    assert _steps(_run_dir(tmp_path)) == [1]


LAUNCHER = """
import sys
from pathlib import Path
from varbatch_kit import Rollouts, ScheduleConfig
from varbatch_kit.train import TrainConfig, run
rollouts = Rollouts.synthetic(16, samples_per_rollout=(1, 2), prompt_len=(4, 8),
                              response_len=12, response_sigma=0.5, max_response_len=24, seed=3)
cfg = TrainConfig().with_(schedule=ScheduleConfig(global_batch_size=4, max_tokens_per_gpu=256),
                  hang_at_step=2, timeout_s=120)
run(cfg, rollouts, out_dir=Path(sys.argv[1]), progress=False)
"""


def test_workers_do_not_outlive_a_killed_launcher(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path)])
    try:
        deadline = time.monotonic() + 90
        while not list(tmp_path.glob("run00-*/steps.jsonl")):  # step 1 done, step 2 hangs
            assert launcher.poll() is None, "the launcher ended early"
            assert time.monotonic() < deadline, "no step reported"
            time.sleep(0.2)
        (job_dir,) = tmp_path.glob("job0-*")
        procs = job_processes(job_dir)
        assert len(procs) >= 2  # torchrun and the worker
        launcher.send_signal(signal.SIGKILL)  # like a notebook kernel that is killed
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in procs)
        assert job_processes(job_dir) == []
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def test_distributed_optimizer_killed_and_resumed_bitwise_and_on_another_dp(tmp_path):
    """The distributed optimizer (dp 2: Adam's moments in two shards): rank 1 killed in step 3,
    resumed from step 2's checkpoint (each shard gathered to rank 0, scattered back): bitwise
    the uninterrupted run. The same checkpoint resumed at dp 4 (the moments cut into four
    shards) trains steps 3 and 4 as the dp 2 run does, to fp32 rounding."""
    from varbatch_kit.train.runs.checkpoint import load_checkpoint

    rollouts = synthetic_rollouts()
    cfg = BASE.with_(dp=2, distributed=True, keep_last=4, label="dp2 dist-opt")
    whole, out = _whole_and_cut(cfg, rollouts, tmp_path, rank=1)
    ckpt = load_checkpoint(checkpoint_dirs(out / "checkpoints")[-1][1])
    (part,) = ckpt["optimizer"]["distributed"]  # megatron's state and the gathered shards
    assert set(part) == {"common", "params"}
    resumed = run(cfg, rollouts, out_dir=tmp_path / "cut", progress=False, resume=True)
    assert resumed.meta["resumed_from_step"] == 2 and _steps(out) == [1, 2, 3, 4]
    pd.testing.assert_frame_equal(resumed.steps.drop(columns=VOLATILE),
                                  whole.steps.drop(columns=VOLATILE), check_exact=True)
    p, q = resumed.params(4), whole.params(4)
    assert p.keys() == q.keys() and all(torch.equal(p[k], q[k]) for k in p)

    wider = tmp_path / "dp4"
    wider.mkdir()
    shutil.copytree(whole.out_dir, wider / whole.out_dir.name)
    for step in (3, 4):
        shutil.rmtree(wider / whole.out_dir.name / "checkpoints" / f"step_{step:06d}")
    (wider / whole.out_dir.name / "done").unlink()
    dp4 = run(cfg.with_(dp=4), rollouts, out_dir=wider, progress=False, resume=True)
    assert dp4.meta["resumed_from_step"] == 2 and dp4.config.world_size == 4
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(dp4.steps[key], whole.steps[key], rtol=1e-5)
    assert param_rel_diff(dp4.params(4), q) < 1e-5
    ratio = (max(dp4.steps["optimizer_state_bytes"].iloc[-1])
             / max(whole.steps["optimizer_state_bytes"].iloc[-1]))
    assert ratio <= 0.51, ratio  # each rank holds a quarter of the moments, not a half
