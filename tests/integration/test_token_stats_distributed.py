"""Vocab-parallel token stats on two real gloo ranks against the single-shard result.

Two processes, each holding one (uneven) vocab shard of the same logits, with
argmax ties across the shards; the reference is the single-shard
``chunked_token_stats`` in this process (itself checked against the float64
path in ``tests/unit/report/test_token_stats.py``): values, each rank's shard
of the gradient, and the refusals of a shard gap and of a target no shard holds.
"""

import socket
import time

import pytest
import torch
import torch.multiprocessing as mp

from varbatch_kit.report.objective.token_stats import chunked_token_stats

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

WORKER_TIMEOUT_S = 90


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_vocab_shards_match_the_single_shard(tmp_path):
    import _token_stats_dist_worker as worker

    ctx = mp.start_processes(worker.run, args=(2, free_port(), str(tmp_path)), nprocs=2,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    try:
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                pytest.fail(f"2 gloo workers did not finish within {WORKER_TIMEOUT_S} s")
    finally:
        for p in ctx.processes:  # only the processes this test started
            if p.is_alive():
                p.kill()
                p.join(5)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]

    logits, targets, w_lp, w_ent = worker.case()
    x = logits.clone().requires_grad_(True)
    ref = chunked_token_stats(x, targets, temperature=worker.TEMPERATURE, entropy_grad=True)
    ((ref["logprob"] * w_lp).sum() + (ref["entropy"] * w_ent).sum()).backward()
    assert ref["correct"][:3].tolist() == [1.0, 0.0, 1.0]
    for rank, got in enumerate(ranks):
        where = f"rank {rank}"
        assert "error" not in got, (where, got.get("error"))
        lo, hi = got["shard"]
        for key in ("logprob", "entropy"):
            torch.testing.assert_close(got[key], ref[key].detach(), rtol=1e-6, atol=1e-6)
        assert torch.equal(got["correct"], ref["correct"]), where
        torch.testing.assert_close(got["grad"], x.grad[:, lo:hi], rtol=1e-6, atol=1e-6)
        assert "do not tile [0, V)" in got["error_gap"], got["error_gap"]
        assert got["error_target"] == (f"targets: token id {worker.V} lies outside the "
                                      f"vocabulary [0, {worker.V})")
    for key in ("logprob", "entropy"):  # every rank combines the same partials the same way
        assert torch.equal(ranks[0][key], ranks[1][key])
