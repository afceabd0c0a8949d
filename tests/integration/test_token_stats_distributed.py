"""Vocab-parallel token stats on two real gloo ranks against the single-shard result.

Two processes, each holding one (uneven) vocab shard of the same logits, with
argmax ties across the shards; the reference is the single-shard
``chunked_token_stats`` in this process (itself checked against the float64
path in ``tests/unit/report/test_token_stats.py``): values, each rank's shard
of the gradient, and the refusals of a shard gap and of a target no shard holds.
"""


import pytest
import torch
from _spawn import run_ranks

from varbatch_kit.report.objective.token_stats import chunked_token_stats

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

WORKER_TIMEOUT_S = 90



def test_two_vocab_shards_match_the_single_shard(tmp_path):
    import _token_stats_dist_worker as worker

    ranks = run_ranks(worker.run, 2, tmp_path, timeout_s=WORKER_TIMEOUT_S)

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
