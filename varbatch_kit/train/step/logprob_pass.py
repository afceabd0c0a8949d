"""The forward-only log-prob pass: every sample's log-probs under the actor, before training.

slime recomputes the old policy's log-probs (and, with a KL loss, the
reference model's) with the actor before a rollout batch's training steps, in
micro-batches packed under ``--log-probs-max-tokens-per-gpu``
(:func:`varbatch_kit.core.log_prob_schedule.build_log_prob_schedule`). Here:

- each world rank runs, without gradients, the micro-batches of the log-prob
  schedule it holds as CP rank 0 (fixed CP: DP rank ``w // cp``'s micro-batches
  on ``w % cp == 0``; dynamic CP: the first rank of each micro-batch's group),
  so every sample is computed exactly once (emulated CP: the full forward runs
  on that rank; all-gather CP, ``cp_allgather=True``: every rank of the
  micro-batch's CP group runs its zigzag share, as in training
  (:mod:`~varbatch_kit.train.parallel.cp_attention`), and the group's CP rank 0 keeps the gathered
  log-probs);
- the per-sample results are all-gathered, so every rank ends with the
  log-probs of every sample of the run's steps (what the loss and the
  advantages read).

The log-probs are float64, at the rollout temperature, computed as the
training step computes them (:func:`varbatch_kit.train.step.packed_batch.response_token_stats`):
on the same micro-batches the first training step's log-probs equal them
bit for bit, so its PPO ratio is exactly 1.

The pass runs before the first step of every rollout batch
(:mod:`~varbatch_kit.train.step.policy_inputs`). Rank 0 saves its result to
``OUT_DIR/log_probs_batch{K}.pt``; a run resumed in the middle of rollout
batch ``K`` reads it back (its actor has moved since the pass).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from varbatch_kit.train.step.tensor_files import save_tensors

__all__ = ["compute_log_probs", "load_or_compute", "log_probs_file"]


def log_probs_file(out_dir: Path, rollout_batch: int) -> Path:
    """Where rank 0 keeps rollout batch ``rollout_batch``'s log-prob pass."""
    return Path(out_dir) / f"log_probs_batch{int(rollout_batch)}.pt"


def _my_micro_batches(steps, rank: int, cp_allgather: bool = False) -> list:
    """This rank's micro-batches of the pass, as
    :class:`~varbatch_kit.train.parallel.cp_groups.CPRound`: those it holds
    as CP rank 0 (emulated CP), or every one it takes part in (all-gather CP)."""
    from varbatch_kit.train.parallel.cp_groups import CPRound, rank_rounds

    mine = []
    for step in steps:
        if cp_allgather:
            mine += rank_rounds(step, rank)
            continue
        for work in step.rank_program(rank):
            if work.samples.size and work.cp_rank == 0:
                mine.append(CPRound(work.samples, 1, 0, (rank,)))
    return mine


@torch.no_grad()
def compute_log_probs(model, steps, rollouts, tokens, device, *, temperature: float = 1.0,
                      layout=None, cp_allgather: bool = False) -> dict[int, np.ndarray]:
    """Log-probs (float64 per response token) of every sample of ``steps``, on every rank.

    ``steps``: the log-prob schedule's steps (or the training steps);
    ``tokens[i]``: sample ``i``'s prompt + response ids. ``layout`` (the run's
    :class:`~varbatch_kit.train.config.parallel_layout.ParallelLayout`; None: the world is the
    pool):
    a world rank runs the micro-batches of its pool rank, so the TP ranks of one
    pool rank run the same ones, their logits vocab-parallel; with pipeline stages
    (``model`` a list of chunks) through megatron's forward-only pipeline schedule,
    the log-probs coming out of the last stage. ``cp_allgather``: micro-batches of
    degree > 1 run over their CP group (its process groups made before,
    :func:`~varbatch_kit.train.parallel.cp_groups.cp_groups_for_run`). Collective: every rank
    of the world calls it.
    """
    from varbatch_kit.train.parallel.cp_groups import share_for
    from varbatch_kit.train.step.cp_response import chunk_output, chunk_stats
    from varbatch_kit.train.step.packed_batch import pack

    models = model if isinstance(model, list) else [model]
    rank = dist.get_rank()
    pool_rank = rank if layout is None else layout.coords(rank).pool_rank
    tp = _tp_of(layout, rank)
    was_training = models[0].training
    for m in models:
        m.eval()
    mine: dict[int, np.ndarray] = {}

    def keep(batch, lp) -> None:
        for g, piece in zip(batch.sample_indices.tolist(),
                            np.split(lp, np.cumsum(batch.response_lens)[:-1])):
            mine[int(g)] = piece

    try:
        rounds = _my_micro_batches(steps, pool_rank, cp_allgather)
        items = []  # (round, packed batch, this rank's CP share or None)
        for rnd in rounds:
            batch = pack([tokens[g] for g in rnd.samples], rollouts.prompt_len[rnd.samples],
                         rnd.samples, device=device)
            items.append((rnd, batch, share_for(rnd, batch)))
        if isinstance(model, list):  # pipeline stages
            _pipelined(models, items, keep, layout, temperature, tp)
        for rnd, batch, share in items if not isinstance(model, list) else ():
            stats = chunk_stats(chunk_output(model, batch, share), batch, share, **tp,
                                temperature=temperature)
            if rnd.cp_rank:
                continue  # the group's CP rank 0 keeps the micro-batch's log-probs
            keep(batch, stats["logprob"].cpu().numpy())
    finally:
        for m in models:
            m.train(was_training)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    out: dict[int, np.ndarray] = {}
    for part in gathered:
        out.update(part)
    return out


def _tp_of(layout, rank: int) -> dict:
    """This rank's tensor-parallel rank and size in ``layout`` (None: tp 1), for
    :func:`~varbatch_kit.train.parallel.tensor_parallel.vocab_shard`."""
    if layout is None:
        return {"tp_rank": 0, "tp_size": 1}
    return {"tp_rank": layout.coords(rank).tp_rank, "tp_size": layout.tp}


def _pipelined(models, items, keep, layout, temperature, tp: dict) -> None:
    """The forward-only pipeline over ``items`` (``(round, batch, CP share or None)``,
    :mod:`~varbatch_kit.train.step.pipeline_schedule`); the last stage keeps the log-probs
    (of CP rank 0 in a group). The interleaved schedule takes all micro-batches as one group
    of at least ``pp``: a shorter list is padded with repeats (their results are the same
    values)."""
    from megatron.core.utils import get_model_config

    from varbatch_kit.train.step import pipeline_schedule
    from varbatch_kit.train.step.cp_response import chunk_output, chunk_stats

    if not items:
        return
    if len(models) > 1:
        items = items + [items[-1]] * max(0, layout.pp - len(items))
    config = get_model_config(models[0])
    saved = config.microbatch_group_size_per_vp_stage
    if len(models) > 1:
        config.microbatch_group_size_per_vp_stage = len(items)

    def forward_step(data_iterator, model):
        rnd, batch, share = next(data_iterator)
        if not pipeline_schedule.is_post_process(model):
            return chunk_output(model, batch, share, post_process=False), None
        logits = chunk_output(model, batch, share)

        def loss_func(out):
            lp = chunk_stats(out, batch, share, **tp, temperature=temperature)["logprob"]
            if not rnd.cp_rank:  # the group's CP rank 0 keeps the micro-batch's log-probs
                keep(batch, lp.cpu().numpy())
            return torch.zeros((), device=out.device), {}
        return logits, loss_func

    try:
        pipeline_schedule.forward_backward(models, items, forward_step, forward_only=True)
    finally:
        config.microbatch_group_size_per_vp_stage = saved


def load_or_compute(compute, path: Path, *, resumed: bool):
    """``compute()`` (a collective; rank 0 saves its result to ``path``), or, for a run resumed
    inside the rollout batch, the result saved there."""
    path = Path(path)
    if resumed:
        if not path.exists():
            raise RuntimeError(f"resuming inside a rollout batch needs its log-prob pass, {path}, "
                               "which is missing: train the run again from step 1")
        return torch.load(path, weights_only=False)
    out = compute()
    if dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_tensors(out, path)
    return out
