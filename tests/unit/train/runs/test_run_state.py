"""Checkpoint shards of model-parallel ranks (train/runs/run_state.py): written side by side
by rank 0, each restored on its own (stage, TP rank), refused where the checkpoint has none."""

from __future__ import annotations

import pytest
import torch

from varbatch_kit.train import TrainConfig
from varbatch_kit.train.runs.checkpoint import checkpoint_dirs
from varbatch_kit.train.runs.run_state import restore, save, shard_prefix


class _Scheduler:
    def __init__(self):
        self.state = {"num_steps": 0}

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, state):
        self.state = dict(state)


def _rank(seed: int):
    """A model and an Adam optimizer that has stepped once, different for every seed."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return model, opt


def _fresh():
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.Adam(model.parameters(), lr=0.1), _Scheduler()


@pytest.mark.parametrize(("pp", "tp"), [(2, 1), (1, 2), (2, 2)])
def test_every_shard_is_restored_on_its_own_rank(tmp_path, pp, tp):
    ranks = {(k, t): _rank(10 * k + t) for k in range(pp) for t in range(tp)}
    shards = [[({n: v.detach().clone() for n, v in ranks[k, t][0].state_dict().items()},
                ranks[k, t][1].state_dict()) for t in range(tp)] for k in range(pp)]
    save(TrainConfig(), tmp_path, {"step": 2, "lr_consumed": 8}, None, None, _Scheduler(), {},
         hook=lambda point: None, shards=shards)
    (_, path), = checkpoint_dirs(tmp_path / "checkpoints")
    names = set(torch.load(path / "model.pt", weights_only=True))
    assert names == {f"{shard_prefix(k, t, tp)}{n}" for k in range(pp) for t in range(tp)
                     for n in ("weight", "bias")}
    for (k, t), (model, opt) in ranks.items():
        got, got_opt, sched = _fresh()
        step, consumed = restore(path, got, got_opt, sched, stage=k if pp > 1 else None,
                                 tp_rank=t, tp=tp)
        assert (step, consumed) == (2, 8)
        assert all(torch.equal(a, b) for a, b in zip(got.parameters(), model.parameters()))
        want = opt.state_dict()["state"]
        have = got_opt.state_dict()["state"]
        assert all(torch.equal(have[i]["exp_avg"], want[i]["exp_avg"]) for i in want)
    # a rank the checkpoint holds no shard for
    with pytest.raises(ValueError, match=f"no shard of pipeline stage {pp}"):
        restore(path, *_fresh(), stage=pp, tp_rank=0, tp=tp)
    if tp > 1:
        with pytest.raises(ValueError, match=f"tensor-parallel rank {tp} of {tp + 1}"):
            restore(path, *_fresh(), stage=0, tp_rank=tp, tp=tp + 1)
