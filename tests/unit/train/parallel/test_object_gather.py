"""gather_to_rank0 (train/parallel/object_gather.py): what ``gather_object`` gives, its tensors
sent point to point, on real gloo groups of forked ranks."""

from __future__ import annotations

import os
import pickle
from collections import OrderedDict, defaultdict

import pytest
import torch
from _gloo_group import run_forked_group


def _obj(rank: int):
    """Per rank: nested containers holding tensors of several dtypes and shapes (an empty
    one, a scalar, bf16, int64), plain values, and nothing at all on rank 2."""
    if rank == 2:
        return {}
    g = torch.Generator().manual_seed(rank)
    state = defaultdict(dict)
    state[0]["exp_avg"] = torch.randn(3, 4, dtype=torch.float64, generator=g)
    state[0]["step"] = torch.tensor(float(rank + 1))
    return (rank, "name", OrderedDict(
        w=torch.randn(5, generator=g).to(torch.bfloat16),
        ids=torch.arange(rank + 3), empty=torch.zeros(0, 7),
        groups=[{"lr": 0.1 * rank, "params": [0, 1]}], state=state,
        view=torch.arange(12.0).reshape(3, 4)[:, 1]))  # not contiguous


def _worker(rank, size, port, queue, kind):
    import torch.distributed as dist

    from varbatch_kit.train.parallel.object_gather import gather_to_rank0

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        obj = _obj(rank)
        if kind == "ours":
            got = gather_to_rank0(obj)
            same = got is None if rank else got[0] is obj  # rank 0's own: not copied
        else:
            got = [None] * size if rank == 0 else None
            dist.gather_object(obj, got, dst=0)
            same = True
        # as bytes: a queued tensor would be shared through this process, which may be gone
        # by the time the test reads it
        queue.put((rank, pickle.dumps((got, same))))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.multiprocess
def test_rank0_gets_what_gather_object_gives():
    ours = {r: pickle.loads(b) for r, b in run_forked_group(_worker, 3, "ours").items()}
    ref = {r: pickle.loads(b) for r, b in run_forked_group(_worker, 3, "reference").items()}
    assert all(same for _, same in ours.values())
    assert ours[1][0] is None and ours[2][0] is None
    got, want = ours[0][0], ref[0][0]
    assert len(got) == 3 and _equal(got, want)
    assert isinstance(got[1][2]["state"], defaultdict)  # the containers keep their types
