"""All-gather CP's loss side (train/step/cp_response.py): each CP rank's response-token
values from its local logits, gathered over the group, equal the values of the full
micro-batch without CP, and are computed by the same chunked kernel: backward keeps the
local logits and per-token scalars only, no float64 ``[R, V]`` copy, no full log-softmax
(issue 30: a CP rank's largest activation, eating what CP saves). Real gloo groups of 2 and
3 forked processes.
"""

from __future__ import annotations

import os

import pytest
import torch
from _gloo_group import run_forked_group

LENGTHS = (7, 12, 3, 9)
PROMPTS = (3, 4, 1, 8)
VOCAB = 50


def _worker(rank, size, port, queue):
    import torch.distributed as dist

    from varbatch_kit.train.parallel.cp_attention import CPShare
    from varbatch_kit.train.step.cp_response import cp_response_stats
    from varbatch_kit.train.step.packed_batch import pack, response_token_stats

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        gen = torch.Generator().manual_seed(0)
        seqs = [torch.randint(0, VOCAB, (n,), generator=gen).numpy() for n in LENGTHS]
        batch = pack(seqs, list(PROMPTS), list(range(len(LENGTHS))))
        full = torch.randn(sum(LENGTHS), VOCAB, generator=gen)  # float32, every row
        rows = batch.response_positions()
        want = response_token_stats(full[rows], batch, at_response_rows=True,
                                    temperature=0.8, entropy_grad=True)

        share = CPShare(group=dist.group.WORLD, rank=rank, size=size, lengths=LENGTHS,
                        prompt_lens=PROMPTS, slot_ranks=tuple(range(size)))
        mine = [share.offsets[i] + share.prompt_lens[i] - 1 + q
                for _, i, q in share.response_rows[rank]]
        local = full[mine].clone().requires_grad_(True)
        saved = []

        def keep(t):
            saved.append((tuple(t.shape), t.dtype, t.data_ptr()))
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            got = cp_response_stats(local, batch, share, temperature=0.8, entropy_grad=True)
        (got["logprob"].sum() + got["entropy"].sum()).backward()
        wide = [s for s in saved if len(s[0]) > 1 and s[0][1] == VOCAB]
        diffs = {k: float((got[k] - want[k]).abs().max()) for k in want}
        queue.put((rank, (diffs, wide, (tuple(local.shape), local.data_ptr()),
                          local.grad is not None and bool(torch.isfinite(local.grad).all()))))
    finally:
        dist.destroy_process_group()


def run_group(size):
    return run_forked_group(_worker, size)


@pytest.mark.multiprocess
@pytest.mark.parametrize("size", [2, 3])
def test_cp_ranks_gather_the_full_values_from_the_chunked_kernel(size):
    for rank, (diffs, wide, (shape, ptr), grad_ok) in run_group(size).items():
        assert max(diffs.values()) < 1e-6, (rank, diffs)  # float32 chunks, float64 sums
        # backward keeps the rank's own float32 logits, no wider or second [R, V] tensor
        assert wide and all(s == (shape, torch.float32, ptr) for s in wide), (rank, wide)
        assert grad_ok
