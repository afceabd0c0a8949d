"""One training step of one rank (:func:`train_step`): forward/backward, optimizer, report.

World layout
------------
``dp * cp`` processes. World rank ``w`` is DP rank ``w // cp`` and CP rank
``w % cp``. megatron-core is initialised with tensor = pipeline = context
parallel size 1, so *its* data-parallel group is the whole world (DP x CP):
Megatron DDP averages gradients over all ``dp * cp`` ranks, which is the
gradient reduction CP needs. Context parallelism itself is **emulated**:
megatron-core's context-parallel attention and packed ``thd`` batches need
TransformerEngine, so every CP rank runs the full forward of its DP rank's
micro-batch and computes the loss and the reported metrics on its own zigzag
slice of every response (:mod:`varbatch_kit.report.cp`). Gradients, losses and
reports are what real CP computes; the compute and memory savings are not.

Dynamic CP (``ScheduleConfig(cp_mode="dynamic")``): the ``dp * cp`` ranks are
one pool and world rank ``w`` runs ``step.rank_program(w)``: per round the
micro-batch of the CP group holding it, sliced by that micro-batch's own degree
and ``w``'s place in the group; idle rounds are skipped, so ranks run different
micro-batch counts (the loss prescale uses the rank's own count, which Megatron
divides by). The normalisers get each sample's degree; the per-token count is
``n * K / c`` per rank (``K`` = lcm of the step's degrees), see
:mod:`varbatch_kit.report`.

One training step, top to bottom (:func:`train_step`)
------------------------------------------------------
1. The step's normalisers over *all* of its samples (per-rollout
   denominators, the report divisor) and the loss prescale factor
   (:mod:`varbatch_kit.report`, docs/reference_semantics.md §5).
2. This DP rank's micro-batches (from the :class:`~varbatch_kit.Schedule`),
   each packed into one row (:mod:`.batch`).
3. megatron-core's forward/backward schedule over them. The loss function
   returns ``(prescale * loss_sum, num_tokens, {"values": [...]})``: the
   policy-gradient loss ``-advantage * log p`` (PPO-clipped when the rollouts
   carry old log-probs; :mod:`.loss`) summed with the mode's denominators over
   the CP-local response tokens.
4. The megatron-core optimizer step (gradient norm before clipping), then
   ``OptimizerParamScheduler.step(increment=<rollouts or samples of the step>)``.
5. The report: micro-batch value vectors summed, all-reduced over DP x CP,
   divided by the step divisor; rank 0 appends one JSON line.
"""

from __future__ import annotations

import time
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["METRIC_KEYS", "reduce_step_report", "train_step"]

METRIC_KEYS = ("loss", "nll", "entropy", "token_acc", "advantage")


def train_step(cfg, mode, model, optimizer, step, rollouts, data, device,
               advantages=None) -> dict:
    """Forward/backward over this rank's micro-batches, optimizer step, reduced report.

    ``advantages``: per sample, one float per response token
    (:func:`varbatch_kit.train.advantages.token_advantages`; computed here when None).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    from varbatch_kit.core.placement import RankWork
    from varbatch_kit.report.cp import slice_flat_responses_for_cp
    from varbatch_kit.train.advantages import token_advantages
    from varbatch_kit.train.batch import pack, response_logits, response_token_stats
    from varbatch_kit.train.loss import policy_gradient_loss
    from varbatch_kit.train.timing import MicroBatchTimer, busy_and_straggler, gather_timings

    t0 = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    if advantages is None:
        advantages = token_advantages(data, rollouts, loss=cfg.loss, data_cfg=cfg.data)
    dynamic = not step.is_fixed_shape
    # this world rank's rounds: fixed CP, DP rank rank // cp's micro-batches at cp_rank rank % cp;
    # dynamic CP, the micro-batch of the group holding it (own degree and CP rank), idle rounds
    # skipped (ranks may then run different micro-batch counts; Megatron divides by its own)
    work = [w for w in step.rank_program(rank) if not w.idle]
    n_mb = len(work)

    # 1. step-wide normalisers over ALL samples of the step (before packing); dynamic CP: each
    # sample's own degree, and as its "DP rank" (naive_rank_mean only) the lowest world rank of
    # its CP group // cp, the replica that holds the group in the fixed layout
    samples = step.sample_indices
    local_of = {int(g): i for i, g in enumerate(samples)}
    all_masks = rollouts.masks()
    masks = {int(g): torch.as_tensor(all_masks[g], dtype=torch.float64) for g in samples}
    rank_of_sample = np.empty(samples.size, dtype=np.int64)
    for mb, p in zip(step.micro_batches, step.placements):  # fixed CP: its DP rank
        rank_of_sample[[local_of[int(g)] for g in mb]] = min(p.ranks) // cfg.cp
    norm = mode.step_normalizers(
        rollouts.rollout_id[samples], [masks[g] for g in samples],
        global_batch_size=step.num_rollouts, dp_size=cfg.dp,
        cp_size=step.sample_cp_sizes().tolist() if dynamic else cfg.cp,
        num_microbatches=step.num_rounds, dp_rank_of_sample=rank_of_sample,
    )
    prescale = mode.loss_prescale(norm, num_microbatches=max(n_mb, 1), dp_size=cfg.dp,
                                  cp_size=cfg.cp)

    # 2. this rank's micro-batches, packed, each with its (weight, cp_size, cp_rank); a rank
    # idle all step runs one zero-weight micro-batch so that it joins the gradient sync
    if not work:
        work = [RankWork(step.micro_batches[0], 1, 0)]
    weight = 1.0 if n_mb else 0.0
    batches = [
        (pack([data.tokens[g] for g in w.samples], rollouts.prompt_len[w.samples], w.samples,
              device=device), w.cp_size, w.cp_rank)
        for w in work
    ]

    def loss_func(batch, cp_size, cp_rank, logits):
        idx = [int(g) for g in batch.sample_indices]
        stats = response_token_stats(logits, batch, at_response_rows=True)
        adv = torch.from_numpy(np.concatenate([advantages[g] for g in idx])).to(device)
        old = None if data.rollout_log_probs is None else torch.from_numpy(
            np.concatenate([data.rollout_log_probs[g] for g in idx]).astype(np.float64)).to(device)
        per_token = {  # the loss: train/loss.py (-A log p, or PPO-clipped with old log-probs)
            "loss": policy_gradient_loss(stats["logprob"], adv, old, clip_eps=cfg.loss.eps_clip),
            "nll": -stats["logprob"].detach(),
            "entropy": stats["entropy"],
            "token_acc": stats["correct"],
            "advantage": adv,
        }
        kw = {
            "total_lengths": list(batch.lengths),
            "response_lengths": list(batch.response_lens),
            "loss_masks": [masks[g].to(device) for g in idx],
            "sample_denominators": norm.denominators_for([local_of[g] for g in idx]),
            "cp_rank": cp_rank,
            "cp_size": cp_size,
        }
        sums = {}
        for key in METRIC_KEYS:
            local = slice_flat_responses_for_cp(
                per_token[key], kw["total_lengths"], kw["response_lengths"],
                cp_rank=cp_rank, cp_size=cp_size)
            sums[key] = mode.microbatch_loss_sum(local, **kw)
        # per_token: each of a sample's c ranks counts n * K / c tokens (K = norm.reference_cp)
        count = {"cp_size": cp_size, "reference_cp": norm.reference_cp} if dynamic else {}
        num_tokens = mode.megatron_num_tokens(kw["loss_masks"], **count) if weight else 0
        values = torch.stack([torch.tensor(float(mode.count_slot(kw["loss_masks"], **count)))]
                             + [sums[k].detach().cpu().double() for k in METRIC_KEYS]) * weight
        return (weight * prescale * sums["loss"],
                torch.tensor(num_tokens, dtype=torch.int, device=device),
                {"values": values})

    timer = MicroBatchTimer(cuda=device.type == "cuda")  # fwd/bwd wall time per micro-batch

    def forward_step(data_iterator, model):
        batch, cp_size, cp_rank = next(data_iterator)
        timer.forward_start(batch.lengths)
        logits = response_logits(model, batch)  # the output layer on response rows only
        return logits, timer.wrap_loss(partial(loss_func, batch, cp_size, cp_rank))

    # 3. megatron-core's forward/backward schedule (no pipelining), DDP grad sync at the end
    model.zero_grad_buffer()
    optimizer.zero_grad()
    timer.attach(get_model_config(model))  # the last backward ends where the grad sync starts
    outputs = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=len(batches),
        seq_length=max(b.num_tokens for b, _, _ in batches),
        micro_batch_size=1,
        forward_only=False,
    )
    timer.detach()

    # 4. optimizer step; grad_norm is the norm before clipping
    ok, grad_norm, _ = optimizer.step()
    wall = time.perf_counter() - t0

    # 5. report: sum micro-batch vectors, all-reduce over DP x CP, divide by the step divisor
    report = reduce_step_report([o["values"] for o in outputs], mode=mode, norm=norm,
                                cp_size=norm.reference_cp)
    walls = torch.tensor([wall], dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(walls) for _ in range(world)]
    dist.all_gather(gathered, walls)
    timings = gather_timings(timer.records)  # per world rank
    busy, straggler = busy_and_straggler(timings)

    tokens = rollouts.total_len
    # fixed CP: per DP rank; dynamic CP: per world rank, the micro-batches it takes part in
    per_rank = step.ranks if dynamic else step.dp_ranks
    cp_of = ([[step.placements[b].degree for b in bins] for bins in step.rank_bins]
             if dynamic else None)
    dyn = {} if not dynamic else {
        "cp_mode": "dynamic", "num_rounds": step.num_rounds, "cp_degrees": cp_of,
        "tokens_per_rank": [int(round(sum(int(tokens[mb].sum()) / c for mb, c in zip(mbs, cs))))
                            for mbs, cs in zip(per_rank, cp_of)],
    }
    return {
        "rollouts": step.num_rollouts,
        "samples": step.num_samples,
        "tokens": int(tokens[samples].sum()),
        "loss_tokens": int(norm.num_tokens),
        "num_microbatches": [len(mbs) for mbs in per_rank],
        "samples_per_rank": [int(sum(mb.size for mb in mbs)) for mbs in per_rank],
        "tokens_per_rank": [int(sum(tokens[mb].sum() for mb in mbs)) for mbs in per_rank],
        "micro_batch_tokens": [[int(tokens[mb].sum()) for mb in mbs] for mbs in per_rank],
        **dyn,
        **report,
        "reward": _reward(data, step),
        "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
        "update_ok": bool(ok),
        "report_divisor": float(norm.report_divisor),
        "loss_prescale": float(prescale),
        "wall_s": [float(w.item()) for w in gathered],
        "step_time_s": max(float(w.item()) for w in gathered),
        "micro_batch_timing": timings,
        "busy_s": busy,
        "straggler_s": straggler,
    }


def _reward(data, step) -> float:
    """Mean reward of the step's rollouts (layout-free, computed from the data; NaN when the
    rollouts carry advantages but no rewards)."""
    pos = {int(r): k for k, r in enumerate(data.rollout_ids)}
    return float(np.mean([data.rollout_reward[pos[int(r)]] for r in step.rollout_ids]))


def reduce_step_report(values, *, mode, norm, cp_size) -> dict[str, float]:
    """:func:`varbatch_kit.report.reduce_train_step_metrics` over megatron's DP x CP group.

    With emulated CP, megatron's data-parallel group is the whole dp * cp world.
    ``divisor=None`` is slime's per-token path (all-reduced token count / cp).
    """
    from megatron.core import parallel_state

    from varbatch_kit.report import reduce_train_step_metrics

    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    divisor = None if mode.megatron_per_token_loss else norm.report_divisor
    return reduce_train_step_metrics(values, keys=METRIC_KEYS, divisor=divisor,
                                     cp_size=cp_size, group=group)
