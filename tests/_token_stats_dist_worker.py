"""Worker body of the 2-rank vocab-parallel token-stats test (not collected by pytest).

Each rank holds one vocab shard of the same logits (an uneven split) and runs
:func:`varbatch_kit.report.objective.token_stats.chunked_token_stats` with the
world as ``tp_group``; values, its shard of the logits' gradient and the
errors of two bad calls go to ``outdir/rank{r}.pt`` for the parent test.
"""

from __future__ import annotations

import datetime
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from varbatch_kit.report.objective.token_stats import chunked_token_stats

N, V, SPLIT = 23, 37, 20  # rank 0 holds vocab [0, 20), rank 1 [20, 37)
TEMPERATURE, CHUNK = 0.7, 4


def case():
    """The full logits, targets and the two upstream gradients (the same on every rank)."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(N, V, generator=g) * 4
    targets = torch.randint(0, V, (N,), generator=g)
    top = logits.max() + 1  # ties across the shards: the first maximum is the argmax
    logits[0, 3] = logits[0, 25] = top
    targets[0] = 3  # on the first maximum: correct
    logits[1, 7] = logits[1, 30] = top
    targets[1] = 30  # on a later maximum: not correct
    logits[2, 33] = top
    targets[2] = 33  # the maximum on rank 1 alone
    targets[3], targets[4] = SPLIT - 1, SPLIT  # either side of the shard boundary
    w_lp = torch.rand(N, generator=g, dtype=torch.float64) * 2 - 1
    w_ent = torch.rand(N, generator=g, dtype=torch.float64) * 2 - 1
    return logits, targets, w_lp, w_ent


def shard(rank: int) -> tuple[int, int]:
    return (0, SPLIT) if rank == 0 else (SPLIT, V)


def run(rank: int, world: int, port: int, outdir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    results: dict = {}
    try:
        logits, targets, w_lp, w_ent = case()
        lo, hi = shard(rank)
        x = logits[:, lo:hi].clone().requires_grad_(True)
        out = chunked_token_stats(x, targets, temperature=TEMPERATURE, entropy_grad=True,
                                  chunk_tokens=CHUNK, tp_group=dist.group.WORLD, vocab_start=lo)
        ((out["logprob"] * w_lp).sum() + (out["entropy"] * w_ent).sum()).backward()
        results.update({k: v.detach() for k, v in out.items()}, grad=x.grad, shard=(lo, hi))
        for name, kwargs in (("gap", {"vocab_start": lo + rank}),  # rank 1 starts at 21
                             ("target", {"vocab_start": lo})):
            bad_targets = targets.clone()
            if name == "target":
                bad_targets[5] = V  # held by no shard
            try:
                chunked_token_stats(logits[:, lo:hi], bad_targets, tp_group=dist.group.WORLD,
                                    **kwargs)
                results[f"error_{name}"] = None
            except ValueError as e:
                results[f"error_{name}"] = str(e)
    except Exception:  # report, then let the parent see a non-zero exit
        results["error"] = traceback.format_exc()
        raise
    finally:
        torch.save(results, Path(outdir, f"rank{rank}.pt"))
        dist.destroy_process_group()
