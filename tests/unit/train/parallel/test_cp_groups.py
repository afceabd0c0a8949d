"""The CP process groups of a run (train/parallel/cp_groups.py) under tensor and pipeline
parallelism: one group per (tp, pp) coordinate, each rank in its own coordinate's; the runs of
one launch (one world) of different layouts each get their own."""

from __future__ import annotations

import os

import pytest
import torch
from _gloo_group import run_forked_group

from varbatch_kit.train.config.parallel_layout import ParallelLayout

#: the runs of one launch of 8 workers, in order: the same pool ranks (0, 1) are other world
#: ranks in each (a group kept by pool ranks alone would be reused, wrongly, by the next run)
LAYOUTS = [ParallelLayout(dp=1, cp=2, pp=2, tp=2), ParallelLayout(dp=4, cp=2),
           ParallelLayout(dp=2, cp=2, tp=2), ParallelLayout(dp=1, cp=2, pp=2, tp=2)]


def _worker(rank, size, port, queue, layouts):
    import torch.distributed as dist

    from varbatch_kit.train.parallel.cp_groups import cp_group, cp_groups_for_run

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        out = []
        for layout in layouts:
            groups = cp_groups_for_run(layout, [])
            members = None
            if layout.coords(rank).pool_rank in (0, 1):  # a member at its coordinate
                group = cp_group((1, 0))
                got = [torch.zeros(1, dtype=torch.int64) for _ in range(group.size())]
                dist.all_gather(got, torch.tensor([rank]), group=group)
                members = [int(t) for t in got]
            out.append((sorted(groups)[0], members))
        queue.put((rank, out))
        # rank 0 hosts the store the other pairs connect through: nobody leaves before all did
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_each_coordinate_and_each_layout_has_its_own_cp_group():
    """The CP group of pool ranks (0, 1) holds the two world ranks at this rank's (tp, pp)
    coordinate, in pool-rank order (world-rank order), for each run's layout in turn."""
    got = run_forked_group(_worker, 8, LAYOUTS)
    for k, layout in enumerate(LAYOUTS):
        pairs = set()
        for rank, per_run in got.items():
            key, members = per_run[k]
            c = layout.coords(rank)
            assert key == (0, 1)
            if members is not None:
                want = [layout.world_rank(p, c.tp_rank, c.pp_rank) for p in (0, 1)]
                assert members == want, (layout.describe(), rank, members)
                pairs.add(tuple(members))
        assert len(pairs) == layout.tp * layout.pp, layout.describe()
