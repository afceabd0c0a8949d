"""One training job across rollout batches (train/runs/loop_trainer.py), on the toy GPT.

The independent path: a plain run over the rollout batches concatenated, with
``data.num_steps_per_rollout`` set to the steps of one batch, trains the same rollout batches
(each its own log-prob pass, reference log-probs and advantages) with one optimizer and one
LR schedule. A job fed the batches one by one must end with the same weights bitwise; one
that restarted its optimizer, its LR schedule or its step count at a batch would not.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _factories import TINY_GPT, masked_rollouts

from varbatch_kit import Rollouts
from varbatch_kit.train import TrainConfig, TrainingError, run
from varbatch_kit.train.runs.checkpoint import latest_checkpoint
from varbatch_kit.train.runs.loop_trainer import LoopTrainer

# one pytest-xdist worker: the tests share the plain run (a module fixture)
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600),
              pytest.mark.xdist_group("loop_trainer")]

GBS = 6  # rollouts per step: every batch of 12 rollouts trains 2 steps
STEPS_PER_BATCH = 2


def batch(k: int) -> Rollouts:
    """12 rollouts (ids 12k..12k+11) of 1-2 samples; the batches' micro-batch counts differ
    (longer responses in later batches), so a count carried over from a batch shows."""
    counts = np.random.default_rng(100 + k).integers(1, 3, 12)
    return masked_rollouts(counts, seed=200 + k, prompt=(3, 7),
                           response=(5 + 4 * k, 14 + 8 * k), first_id=12 * k)


def concatenated(batches: list[Rollouts]) -> Rollouts:
    return Rollouts(np.concatenate([b.prompt_len for b in batches]),
                    np.concatenate([b.response_len for b in batches]),
                    np.concatenate([b.rollout_id for b in batches]),
                    [m for b in batches for m in b.masks()])


def base_config(**kw) -> TrainConfig:
    # a decaying LR (a restarted schedule shows), Adam, a KL loss to the initial model (the
    # reference of batches 1 and 2 is the initial model, not the batch's start), float64
    return TrainConfig().with_(
        lr=1e-3, min_lr=1e-4, lr_decay_style="cosine", global_batch_size=GBS,
        max_tokens_per_gpu=48, packing="first_fit", n_samples_per_prompt=3, entropy_coef=0.01,
        use_kl_loss=True, kl_loss_coef=0.05, precision="fp64", max_seq_len=64, dp=2,
        **TINY_GPT, **kw)


def params(path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The plain run over the three batches: weights after each batch, its step log."""
    batches = [batch(k) for k in range(3)]
    cfg = base_config(num_steps_per_rollout=STEPS_PER_BATCH,
                      save_params_at=(2, 4, 6))
    res = run(cfg, concatenated(batches), out_dir=tmp_path_factory.mktemp("plain"),
              progress=False)
    assert len(res.steps) == 3 * STEPS_PER_BATCH
    return batches, res, cfg.lr_increment_unit()


def horizon(batches) -> int:
    return sum(b.num_rollouts for b in batches)  # per_rollout_mean: the LR counts rollouts


def test_a_fed_job_keeps_one_optimizer_across_rollout_batches(reference, tmp_path):
    batches, plain, unit = reference
    assert unit == "rollouts"
    micro = [sum(plain.steps["num_microbatches"][i]) for i in range(6)]
    assert len(set(micro)) > 1, micro  # the steps differ in their micro-batches
    cfg = base_config(save_every=3)
    with LoopTrainer(cfg, tmp_path, horizon=horizon(batches)) as trainer:
        done = []
        for k, b in enumerate(batches):
            assert trainer.put(k, b) == STEPS_PER_BATCH
            done.append(trainer.wait(k))
    # the step numbers go on across the batches; each batch's weights equal the plain run's
    assert [(d["first_step"], d["last_step"]) for d in done] == [(1, 2), (3, 4), (5, 6)]
    for d in done:
        assert_same(params(d["params"]), plain.params(d["last_step"]))
    records = [r for d in done for r in d["records"]]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["rollout_batch"] for r in records] == [0, 0, 1, 1, 2, 2]
    np.testing.assert_array_equal([r["loss"] for r in records], plain.steps["loss"])
    np.testing.assert_array_equal([r["lr"] for r in records], plain.steps["lr"])
    # the LR schedule decays over the whole horizon, not per batch
    lrs = [r["lr"] for r in records]
    assert all(a > b for a, b in zip(lrs[1:], lrs[2:])), lrs
    # one optimizer: Adam's step count is the job's, 6 after the last batch
    path, meta = latest_checkpoint(trainer.run_dir / "checkpoints")
    assert meta["step"] == 6
    optim = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False)
    steps = {int(s["step"]) for s in _adam_states(optim)}
    assert steps == {6}, steps


def _adam_states(state) -> list:
    """Every per-parameter Adam state in a (possibly chained) megatron optimizer state."""
    found = []

    def walk(x):
        if isinstance(x, dict):
            if "exp_avg" in x and "step" in x:
                found.append(x)
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(state)
    assert found
    return found


def test_a_job_killed_in_the_second_batch_resumes_bitwise(reference, tmp_path):
    """Killed in the first forward of step 4 (batch 1), checkpoints every step: a new job
    on the same folder re-reads batches 0 and 1, trains from step 4 and ends where the plain
    run ends; a batch put again must be the same."""
    batches, plain, _ = reference
    cfg = base_config(save_every=1)
    trainer = LoopTrainer(cfg.with_(kill_at="mid_step:4"), tmp_path, horizon=horizon(batches))
    trainer.put(0, batches[0])
    trainer.wait(0)
    trainer.put(1, batches[1])
    with pytest.raises(TrainingError):
        trainer.wait(1)
    trainer.abort()
    resumed = LoopTrainer(cfg, tmp_path, horizon=horizon(batches), resume=True)
    with pytest.raises(ValueError, match="differs from the one put before"):
        resumed.put(0, batches[2])
    with resumed:
        resumed.put(1, batches[1])  # batch 0 is in the feed folder already
        done = resumed.wait(1)
        assert (done["first_step"], done["last_step"]) == (3, 4)
        assert_same(params(done["params"]), plain.params(4))
        resumed.put(2, batches[2])
        done = resumed.wait(2)
    assert_same(params(done["params"]), plain.params(6))
    steps = [r["step"] for r in done["records"]]
    assert steps == [5, 6]


def test_refusals_before_anything_starts(tmp_path):
    cfg = base_config()
    with pytest.raises(ValueError, match="horizon"):
        LoopTrainer(cfg, tmp_path, horizon=0)
    trainer = LoopTrainer(cfg, tmp_path, horizon=10)
    with pytest.raises(ValueError, match="put them in order"):
        trainer.put(1, batch(1))
    with pytest.raises(ValueError, match="never put"):
        trainer.wait(0)
    trainer.close()
