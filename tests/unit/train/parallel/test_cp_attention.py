"""All-gather CP attention (train/parallel/cp_attention.py) against full per-sample attention.

The share layout is checked against report/cp.py's zigzag slicing (pure); the
exchange runs on 2 and 3 forked gloo processes (a few hundred ms): outputs and
gradients of the local queries, keys and values equal those of full causal
attention per sample, also when the group's process ranks hold the CP ranks in
another order (issue 30: no test permuted them; ignoring ``slot_ranks`` fails
it), and a fault-injected exchange (a rank's two chunks read in swapped order)
does not.
"""

from __future__ import annotations

import os

import pytest
import torch
from _gloo_group import run_forked_group

from varbatch_kit.report.cp import zigzag_slice
from varbatch_kit.train.parallel.cp_attention import CPShare, zigzag_chunks

LENGTHS = (7, 12, 3, 9)
PROMPTS = (3, 4, 1, 8)


def share(rank, size, group=None, fault=None, slots=None):
    return CPShare(group=group, rank=rank, size=size, lengths=LENGTHS, prompt_lens=PROMPTS,
                   slot_ranks=tuple(range(size)) if slots is None else tuple(slots),
                   swap_chunks_of=fault)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_shares_tile_the_row_and_score_the_zigzag_slice(size):
    seen = []
    for r in range(size):
        s = share(r, size)
        seen += s.local_row.tolist()
        by_sample = {}
        for _, i, q in s.response_rows[r]:
            by_sample.setdefault(i, []).append(q)
        for i, (t, p) in enumerate(zip(LENGTHS, PROMPTS)):
            z = zigzag_slice(t, t - p, cp_rank=r, cp_size=size) if size > 1 else None
            want = (list(range(t - p)) if z is None else
                    [q for a, b in z.response_ranges for q in range(a, b)])
            assert by_sample.get(i, []) == want
    assert sorted(seen) == list(range(sum(LENGTHS)))
    assert zigzag_chunks(5, 0, 2) == ((0, 2), (5, 5)) and zigzag_chunks(5, 1, 2) == ((2, 4), (4, 5))


def reference(q, k, v):
    """Causal attention within each sample, plain softmax (float64)."""
    outs, o = [], 0
    rep = q.size(1) // k.size(1)
    for n in LENGTHS:
        qs, ks, vs = (t[o:o + n].transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        scores = qs @ ks.transpose(1, 2) * 0.3
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        outs.append((scores.softmax(-1) @ vs).transpose(0, 1))
        o += n
    return torch.cat(outs)


def _worker(rank, size, port, queue, fault=None, perm=None):
    import torch.distributed as dist

    from varbatch_kit.train.parallel import cp_attention

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        gen = torch.Generator().manual_seed(0)
        total = sum(LENGTHS)
        q, k, v = (torch.randn(total, h, 8, generator=gen, dtype=torch.float64)
                   for h in (4, 2, 2))
        w = torch.randn(total, 4, 8, generator=gen, dtype=torch.float64)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = reference(*full)
        (ref * w).sum().backward()

        # perm: process-group rank g holds CP rank perm[g] (a group whose world ranks are not
        # in CP-rank order, as dynamic CP's groups can be)
        cp_rank = rank if perm is None else perm[rank]
        s = share(cp_rank, size, group=dist.group.WORLD, fault=fault, slots=perm)
        rows = s.local_row
        local = [t[rows].clone().requires_grad_() for t in (q, k, v)]
        out = cp_attention.cp_core_attention(*local, s, scale=0.3)
        (out * w[rows]).sum().backward()
        diffs = [float((out - ref[rows]).abs().max())] + [
            float((a.grad - b.grad[rows]).abs().max()) for a, b in zip(local, full)]
        queue.put((rank, diffs))
    finally:
        dist.destroy_process_group()


def run_group(size, fault=None, perm=None):
    return run_forked_group(_worker, size, fault, perm)


@pytest.mark.multiprocess
@pytest.mark.parametrize("size", [2, 3])
def test_allgather_attention_equals_full_attention_values_and_grads(size):
    for rank, (out, dq, dk, dv) in run_group(size).items():
        assert max(out, dq, dk, dv) < 1e-12, (rank, out, dq, dk, dv)


@pytest.mark.multiprocess
@pytest.mark.parametrize("perm", [(1, 0), (2, 0, 1), (1, 2, 0)])
def test_a_group_not_in_cp_rank_order_gives_full_attention(perm):
    """The group's process ranks hold CP ranks in another order (``slot_ranks``)."""
    for rank, (out, dq, dk, dv) in run_group(len(perm), perm=perm).items():
        assert max(out, dq, dk, dv) < 1e-12, (rank, perm, out, dq, dk, dv)


@pytest.mark.multiprocess
def test_a_swapped_chunk_order_in_the_exchange_is_caught():
    """Fault injection: rank 1's two chunks reassembled in swapped order."""
    got = run_group(2, fault=1)
    assert max(max(d) for d in got.values()) > 1e-3, got


def test_allgather_is_the_default_cp_and_runs():
    from varbatch_kit.train import TrainConfig
    from varbatch_kit.train.config.parallel_layout import ParallelLayout

    cfg = TrainConfig().with_(dp=2, cp=2, cp_mode="dynamic")
    assert cfg.cp_impl == "allgather"
    assert cfg.layout.describe() == "dp2 cp2(allgather, dynamic) pp1 tp1"
    assert ParallelLayout(cp=2).unsupported() == []
    assert "cp_swap_chunks_rank" in repr(cfg.faults) and cfg.faults.cp_swap_chunks_rank is None


def test_groups_and_rounds_come_from_the_plan():
    import numpy as np

    from varbatch_kit import Rollouts, ScheduleConfig, build_schedule
    from varbatch_kit.train.config.parallel_layout import ParallelLayout
    from varbatch_kit.train.parallel.cp_groups import cp_group_members, rank_rounds

    resp = np.array([60, 6, 7, 8, 5, 9, 62, 6])
    rollouts = Rollouts(np.full(8, 4), resp, np.arange(8), [np.ones(r, int) for r in resp])
    sched = ScheduleConfig(dp=2, cp=2, cp_mode="dynamic", global_batch_size=4,
                           max_tokens_per_gpu=40, packing="first_fit")
    from varbatch_kit.train import TrainConfig

    shape = TrainConfig().with_(num_layers=2, hidden_size=32, num_attention_heads=2,
                                vocab_size=64).model_shape()
    steps = build_schedule(rollouts, sched, model=shape).steps
    lay = ParallelLayout(dp=2, cp=2, cp_mode="dynamic")
    groups = cp_group_members(lay, steps)
    used = {tuple(sorted(p.ranks)) for s in steps for p in s.placements if p.degree > 1}
    assert groups and set(groups) == used and groups == sorted(groups, key=lambda g: (len(g), g))
    for step in steps:
        for rank in range(4):
            want = [w for w in step.rank_program(rank) if not w.idle]
            got = rank_rounds(step, rank)
            assert [(w.samples.tolist(), w.cp_size, w.cp_rank) for w in want] == [
                (r.samples.tolist(), r.cp_size, r.cp_rank) for r in got]
            assert all(r.members[r.cp_rank] == rank and len(r.members) == r.cp_size for r in got)
    fixed = ParallelLayout(dp=2, cp=2)
    assert cp_group_members(fixed, []) == [(0, 1), (2, 3)]
