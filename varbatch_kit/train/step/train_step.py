"""One training step of one rank (:func:`train_step`): forward/backward, optimizer, report.

World layout
------------
``dp * cp * pp * tp`` processes
(:class:`~varbatch_kit.train.config.parallel_layout.ParallelLayout`);
the schedule places micro-batches on the pool of ``dp * cp`` ranks, pool rank
``r`` is DP rank ``r // cp`` and CP rank ``r % cp``, and every pipeline stage
(and TP rank) holds a copy of the pool. With ``pp > 1`` the model is cut into
stages (:mod:`varbatch_kit.train.model.pipeline_stages`) and megatron-core's 1F1B schedule
(interleaved with ``vpp > 1``) runs the pool rank's micro-batches through them;
losses and reports exist on the last stage, are reduced over its DP group there
and handed to world rank 0. megatron-core is initialised with context parallel
size 1, so *its* data-parallel group at a stage is the whole pool (DP x CP):
Megatron DDP averages gradients over all ``dp * cp`` ranks, which is the
gradient reduction CP needs. megatron-core's context-parallel attention and
packed ``thd`` batches need TransformerEngine, so the engine runs its own CP
(``TrainConfig.cp_impl``):

- ``"allgather"`` (the default, :mod:`~varbatch_kit.train.parallel.cp_attention`): each CP rank
runs the
  model on its zigzag share of the micro-batch only; core attention
  all-gathers K/V over the micro-batch's CP group (:mod:`~varbatch_kit.train.parallel.cp_groups`,
  made
  once per run); the response log-probs and entropies are all-gathered into
  whole responses, so the loss function below runs unchanged and keeps the
  rank's zigzag slice for its sums.
- ``"emulated"`` (the reference): every CP rank runs the full forward of its
  DP rank's micro-batch and computes the loss and the reported metrics on its
  own zigzag slice of every response (:mod:`varbatch_kit.report.cp`).

Both give the gradients, losses and reports of no CP; only the first saves
compute and memory per rank.

Dynamic CP (``ScheduleConfig(cp_mode="dynamic")``): the ``dp * cp`` ranks are
one pool and world rank ``w`` runs its rounds of the plan
(:func:`~varbatch_kit.train.parallel.cp_groups.rank_rounds`, as ``step.rank_program(w)``):
per round the micro-batch of the CP group holding it, run on that group with
its own degree and ``w``'s place in the group; idle rounds are skipped, so
ranks run different micro-batch counts (the loss prescale uses the rank's own
count, which Megatron divides by); a rank idle all step runs one zero-weight
micro-batch alone, to join the gradient sync: the step's shortest sample
(:func:`~varbatch_kit.train.parallel.cp_groups.idle_round`). The normalisers get each
sample's degree; the per-token count is
``n * K / c`` per rank (``K`` = lcm of the step's degrees), see
:mod:`varbatch_kit.report`.

One training step, top to bottom (:func:`train_step`)
------------------------------------------------------
1. The step's normalisers over *all* of its samples (per-rollout
   denominators, the report divisor) and the loss prescale factor
   (:mod:`varbatch_kit.report`, docs/reference_semantics.md §5).
2. This DP rank's micro-batches (from the :class:`~varbatch_kit.Schedule`),
   each packed into one row (:mod:`~varbatch_kit.train.step.packed_batch`).
3. megatron-core's forward/backward schedule over them. The loss function
   returns ``(prescale * loss_sum, num_tokens, {"values": [...]})``: every
   per-token term of slime's policy loss
   (:func:`varbatch_kit.report.objective.policy_objective`: the PPO / CISPO /
   GSPO surrogate on the log-prob pass's old log-probs, TIS, the entropy
   bonus, the KL loss) computed on the full responses, then each summed with
   the mode's denominators over the CP-local response tokens; the loss is
   the sum of the combined per-token loss.
4. The megatron-core optimizer step (gradient norm before clipping), then
   ``OptimizerParamScheduler.step(increment=<rollouts or samples of the step>)``.
5. The report: micro-batch value vectors summed, all-reduced over DP x CP,
   divided by the step divisor; rank 0 appends one JSON line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["EXTRA_METRIC_KEYS", "PolicyInputs", "optimizer_state_bytes", "reduce_step_report",
           "report_keys", "train_step"]

#: reported beside slime's policy-loss metrics: the response tokens' negative log-likelihood,
#: the share the argmax predicts, and the mean advantage (all under the report mode)
EXTRA_METRIC_KEYS = ("nll", "token_acc", "advantage")

#: FaultConfig.stale_loss_prescale: the micro-batch count of the first step each run (by
#: label) trained in this process, reused by every later step (the injected bug)
_stale_counts: dict[str, int] = {}


@dataclass(frozen=True, eq=False)
class PolicyInputs:
    """What the policy loss reads per sample besides the model's output, for a whole run.

    ``advantages[i]``: one float per response token of sample ``i`` (the samples of the
    current rollout batch);
    ``old_log_probs`` / ``ref_log_probs``: the log-prob pass's (sample -> array;
    ``ref_log_probs`` only with a KL loss); ``rollout_log_probs[i]``: the
    rollout engine's, or None.
    """

    advantages: list
    old_log_probs: dict
    ref_log_probs: dict | None = None
    rollout_log_probs: list | None = None


def report_keys(loss, has_rollout_log_probs: bool, moe: bool = False) -> tuple[str, ...]:
    """The reported metric names of a run with ``loss`` (its ``LossConfig``): slime's
    policy-loss metrics, then the extras, then (``moe``: a mixture-of-experts model) the
    router's losses (:mod:`~varbatch_kit.train.step.router_losses`)."""
    from varbatch_kit.report.objective import metric_keys
    from varbatch_kit.train.step.router_losses import ROUTER_LOSS_KEYS

    return (metric_keys(loss.objective_options(), has_rollout_log_probs=has_rollout_log_probs)
            + EXTRA_METRIC_KEYS + (ROUTER_LOSS_KEYS if moe else ()))


def train_step(layout, loss, faults, mode, model, optimizer, step, rollouts, data,
               inputs: PolicyInputs, device, *, run_name: str,
               grads_out: dict | None = None, num_moe_layers: int = 0) -> dict:
    """Forward/backward over this rank's micro-batches, optimizer step, reduced report.

    ``layout``: the run's :class:`~varbatch_kit.train.config.parallel_layout.ParallelLayout`
    (built once per run: which micro-batches this rank trains, its CP, TP and pipeline
    coordinates); ``loss``, ``faults``: the run's ``LossConfig`` and ``FaultConfig``;
    ``run_name``: its label (an injected stale count is kept per run).

    ``grads_out`` (a dict): receives the gradients (name -> CPU tensor) after the backward,
    reduced over the ranks, before clipping and the optimiser step. ``num_moe_layers``: a
    mixture of experts' MoE layers, the whole model's (the router losses are their mean).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    from varbatch_kit.report.cp import slice_flat_responses_for_cp
    from varbatch_kit.report.objective import policy_objective
    from varbatch_kit.train.parallel.cp_groups import idle_round, rank_rounds, share_for
    from varbatch_kit.train.step.cp_response import chunk_output, chunk_stats
    from varbatch_kit.train.step.expert_load import routers_of
    from varbatch_kit.train.step.microbatch_timer import (
        MicroBatchTimer,
        busy_and_straggler,
        gather_timings,
    )
    from varbatch_kit.train.step.packed_batch import pack
    from varbatch_kit.train.step.router_losses import ROUTER_LOSS_KEYS, RouterLosses

    t0 = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    # the schedule places micro-batches on the dp * cp pool; tp / pp replicate it
    # (train/config/parallel_layout.py): this rank trains the micro-batches of its pool rank
    here = layout.coords(rank)
    pool_rank = here.pool_rank
    dynamic = not step.is_fixed_shape
    # this pool rank's rounds: fixed CP, DP rank pool_rank // cp's micro-batches at cp_rank
    # pool_rank % cp; dynamic CP, the micro-batch of the group holding it (own degree and CP
    # rank), idle rounds skipped (ranks may then run different micro-batch counts; Megatron
    # divides by its own)
    # (with the pool ranks of each micro-batch's CP group: all-gather CP runs on it)
    work = rank_rounds(step, pool_rank)
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
        rank_of_sample[[local_of[int(g)] for g in mb]] = min(p.ranks) // layout.cp
    norm = mode.step_normalizers(
        rollouts.rollout_id[samples], [masks[g] for g in samples],
        global_batch_size=step.num_rollouts, dp_size=layout.dp,
        cp_size=step.sample_cp_sizes().tolist() if dynamic else layout.cp,
        num_microbatches=step.num_rounds, dp_rank_of_sample=rank_of_sample,
    )
    counted = max(n_mb, 1)
    if faults.stale_loss_prescale:  # injected bug: the first step's count, never refreshed
        counted = _stale_counts.setdefault(run_name, counted)
    prescale = mode.loss_prescale(norm, num_microbatches=counted, dp_size=layout.dp,
                                  cp_size=layout.cp)
    report_cp = norm.reference_cp
    if faults.cp_duplicate_token_counts:  # injected bug: the CP ranks' counts as distinct tokens
        prescale, report_cp = prescale / norm.reference_cp, 1

    # 2. this rank's micro-batches, packed, each with its (weight, cp_size, cp_rank); a rank
    # idle all step runs one zero-weight micro-batch so that it joins the gradient sync
    if not work:
        work = [idle_round(step, pool_rank, rollouts.total_len)]
    weight = 1.0 if n_mb else 0.0
    batches = []
    for w in work:
        b = pack([data.tokens[g] for g in w.samples], rollouts.prompt_len[w.samples], w.samples,
                 device=device)
        # all-gather CP: this rank's zigzag share of b and its group (None: the whole row)
        share = (share_for(w, b, swap_chunks_of=faults.cp_swap_chunks_rank)
                 if layout.cp_impl == "allgather" else None)
        batches.append((b, w.cp_size, w.cp_rank, share))

    models = model if isinstance(model, list) else [model]
    # a mixture of experts: the router's load-balancing and z losses, per sample, computed and
    # trained where each router runs (train/step/router_losses.py)
    routers = RouterLosses(routers_of(models), num_moe_layers=num_moe_layers,
                           aux_coeff=loss.moe_aux_loss_coeff, z_coeff=loss.moe_z_loss_coeff,
                           per_row=faults.moe_aux_per_row)

    def sum_kwargs(batch, cp_size, cp_rank) -> dict:
        """The report mode's sum over a micro-batch: its samples, their denominators and the
        rank's CP slice (every per-token term and the router losses go through it)."""
        idx = [int(g) for g in batch.sample_indices]
        return {
            "total_lengths": list(batch.lengths),
            "response_lengths": list(batch.response_lens),
            "loss_masks": [masks[g].to(device) for g in idx],
            "sample_denominators": (
                norm.denominators_for([local_of[g] for g in idx])
                if not faults.microbatch_denominators  # injected bug: over this micro-batch
                else mode.step_normalizers(rollouts.rollout_id[idx], [masks[g] for g in idx],
                                           dp_size=layout.dp).sample_denominators),
            "cp_rank": cp_rank,
            "cp_size": cp_size,
        }

    def mode_sum(kw: dict, values: torch.Tensor) -> torch.Tensor:
        local = slice_flat_responses_for_cp(values, kw["total_lengths"],
                                            kw["response_lengths"], cp_rank=kw["cp_rank"],
                                            cp_size=kw["cp_size"])
        return mode.microbatch_loss_sum(local, **kw)

    options = loss.objective_options()
    keys = report_keys(loss, inputs.rollout_log_probs is not None, moe=routers.active)

    def _f64(arrays, idx):
        # a copy: the job's arrays arrive read-only (torch warns on a non-writable buffer)
        return [torch.tensor(np.asarray(arrays[g], dtype=np.float64), device=device)
                for g in idx]

    def loss_func(batch, cp_size, cp_rank, share, logits):
        idx = [int(g) for g in batch.sample_indices]
        # the full responses' values (all-gather CP: gathered from the group's shares;
        # tp > 1: vocab-parallel)
        stats = chunk_stats(logits, batch, share, tp_rank=here.tp_rank, tp_size=layout.tp,
                            temperature=loss.rollout_temperature,
                            entropy_grad=loss.entropy_coef != 0)
        splits = list(batch.response_lens)
        adv = _f64(inputs.advantages, idx)
        # every term of slime's policy loss on the full responses (train/objective docs)
        per_token = policy_objective(
            options, list(stats["logprob"].split(splits)), list(stats["entropy"].split(splits)),
            adv, [masks[g].to(device) for g in idx],
            old_log_probs=_f64(inputs.old_log_probs, idx),
            ref_log_probs=None if inputs.ref_log_probs is None else _f64(inputs.ref_log_probs,
                                                                         idx),
            rollout_log_probs=None if inputs.rollout_log_probs is None else _f64(
                inputs.rollout_log_probs, idx))
        per_token["nll"] = -stats["logprob"].detach()
        per_token["token_acc"] = stats["correct"]
        per_token["advantage"] = torch.cat(adv)
        kw = sum_kwargs(batch, cp_size, cp_rank)
        sums = {}
        for key in keys:
            if key in ROUTER_LOSS_KEYS:  # summed by the routers (RouterLosses), added below
                sums[key] = torch.zeros((), dtype=torch.float64)
                continue
            sums[key] = mode_sum(kw, per_token[key])
        # per_token: each of a sample's c ranks counts n * K / c tokens (K = norm.reference_cp)
        count = {"cp_size": cp_size, "reference_cp": norm.reference_cp} if dynamic else {}
        num_tokens = mode.megatron_num_tokens(kw["loss_masks"], **count) if weight else 0
        values = torch.stack([torch.tensor(float(mode.count_slot(kw["loss_masks"], **count)))]
                             + [sums[k].detach().cpu().double() for k in keys]) * weight
        return (weight * prescale * sums["loss"],
                torch.tensor(num_tokens, dtype=torch.int, device=device),
                {"values": values})

    staged = layout.pp > 1  # pipeline parallelism: megatron's 1F1B over model chunks
    if staged:
        from varbatch_kit.train.model import pipeline_stages as pipeline
        from varbatch_kit.train.step import pipeline_schedule

    # fwd/bwd wall time per micro-batch (and chunk), the schedule's span and idle time
    timer = MicroBatchTimer(cuda=device.type == "cuda")

    # megatron's schedule gives each micro-batch's loss the gradient 1 / (its micro-batches)
    # (1 on its per-token path, which divides by the token count later): the routers' too
    router_scale = 1.0 if mode.megatron_per_token_loss else 1.0 / len(batches)

    def forward_step(data_iterator, model):
        batch, cp_size, cp_rank, share = next(data_iterator)
        timer.lengths = list(batch.lengths)
        loss = partial(loss_func, batch, cp_size, cp_rank, share)
        if routers.active:  # what the routers of this forward see (a mixture of experts)
            routers.micro_batch(batch.lengths, batch.response_lens,
                                loss_sum=partial(mode_sum, sum_kwargs(batch, cp_size, cp_rank)),
                                weight=weight * prescale, scale=router_scale,
                                counted=bool(weight), share=share)
        # the output layer on response rows only, or a pipeline stage's hidden states (all-
        # gather CP: of this rank's share)
        last = not staged or pipeline_schedule.is_post_process(model)
        return chunk_output(model, batch, share, post_process=last), loss

    # 3. megatron-core's forward/backward schedule (no pipelining, or 1F1B over pp stages),
    # DDP grad sync at the end
    for m in models:
        m.zero_grad_buffer()
    optimizer.zero_grad()
    with routers.attached():  # the routers' logits recorded (a mixture of experts)
        if staged:
            outputs = pipeline_schedule.forward_backward(models, batches, forward_step, timer=timer)
        else:
            # the last backward ends where the grad sync starts (not counted)
            with timer.around(get_model_config(model), [model]):
                outputs = get_forward_backward_func()(
                    forward_step_func=forward_step,
                    data_iterator=iter(batches),
                    model=[model],
                    num_microbatches=len(batches),
                    seq_length=max(b.num_tokens for b, *_ in batches),
                    micro_batch_size=1,
                    forward_only=False,
                )
            for rec, (_, cp_size, _, share) in zip(timer.records, batches):  # what this rank
                rec.update(cp_size=cp_size, cp_share=share is not None)  # computed: share or row
    if grads_out is not None:  # DDP has reduced them into main_grad (finalize_model_grads)
        from varbatch_kit.train.model.gpt import unwrap_model
        from varbatch_kit.train.parallel.tensor_parallel import gather_full_parameters

        for m in models:
            if m.ddp_config.use_distributed_optimizer:
                _gather_reduced_grad_shards(m)
            gpt = unwrap_model(m)
            rename = getattr(gpt, "full_name_of", None) or (lambda n: n)
            local = {}
            for name, p in gpt.named_parameters():
                g = getattr(p, "main_grad", None)
                g = p.grad if g is None else g
                local[name] = (torch.zeros_like(p) if g is None  # fp32 or wider (fp64 stays)
                               else g.detach().to(torch.promote_types(g.dtype, torch.float32)))
            # full tensors under tp 1's names (a collective over the TP group), then the
            # full model's names (pipeline chunks)
            for name, g in gather_full_parameters(gpt, tensors=local).items():
                if rename(name) is not None:
                    grads_out[rename(name)] = g

    # 4. optimizer step; grad_norm is the norm before clipping
    ok, grad_norm, _ = optimizer.step()
    wall = time.perf_counter() - t0

    # 5. report: sum micro-batch vectors, all-reduce over DP x CP, divide by the step divisor
    values = [o["values"] for o in outputs] if outputs else []
    if routers.active:  # the router losses: summed by the routers of every stage
        router = routers.report()
        if staged:  # this pool rank's layers live on its stages: summed on the last one
            from megatron.core import parallel_state

            dist.all_reduce(router, group=parallel_state.get_pipeline_model_parallel_group())
        extra = torch.zeros(1 + len(keys), dtype=torch.float64)
        for i, key in enumerate(ROUTER_LOSS_KEYS):
            extra[1 + keys.index(key)] = router[i]
        values.append(extra)
    if layout.coords(rank).pp_rank == layout.pp - 1:  # the losses are on the last stage
        report = reduce_step_report(values, keys=keys, mode=mode, norm=norm,
                                    cp_size=report_cp)
    else:
        report = None
    if staged:  # reduced on the last stage, as slime does, then handed to rank 0
        report = pipeline.from_last_stage(report, layout)
    walls = torch.tensor([wall, optimizer_state_bytes(optimizer)], dtype=torch.float64,
                         device=device)  # with this rank's optimizer-state bytes
    gathered = [torch.zeros_like(walls) for _ in range(world)]
    dist.all_gather(gathered, walls)
    timings = gather_timings(timer.records)  # per world rank
    busy, straggler = busy_and_straggler(timings)
    piped = {}
    if staged:  # per world rank: the schedule's span and the stage's idle time in it
        spans = [None] * world
        dist.all_gather_object(spans, (timer.span_s, timer.idle_s))
        piped = {"pipeline_span_s": [a for a, _ in spans],
                 "pipeline_idle_s": [b for _, b in spans]}

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
        "wall_s": [float(w[0]) for w in gathered],
        "step_time_s": max(float(w[0]) for w in gathered),
        "optimizer_state_bytes": [int(w[1]) for w in gathered],
        "micro_batch_timing": timings,
        "busy_s": busy,
        "straggler_s": straggler,
        **piped,
    }


def optimizer_state_bytes(optimizer) -> int:
    """The bytes of optimizer state this rank holds: every tensor of the torch optimizers'
    state (Adam's moments and step) and the main parameters that are copies, not the model's
    parameters or views of them (bf16's fp32 main parameters). Under the distributed optimizer
    these are this DP rank's shards: the total falls as 1/(dp*cp)."""
    total = 0
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_opt = getattr(inner, "optimizer", None)
        if torch_opt is None:
            continue
        for state in torch_opt.state.values():
            total += sum(t.numel() * t.element_size() for t in state.values()
                         if isinstance(t, torch.Tensor))
        for group in torch_opt.param_groups:
            total += sum(p.numel() * p.element_size() for p in group["params"]
                         if not isinstance(p, torch.nn.Parameter) and p._base is None)
    return total


def _gather_reduced_grad_shards(ddp) -> None:
    """Under the distributed optimizer DDP reduce-scatters the gradients: a DP rank's grad
    buffer holds the reduced sum on its own shard only (elsewhere its local, unreduced
    gradient). All-gather the shards, so that the buffer holds the whole reduced gradient (for
    ``grads_out``; the rank's own shard, which its optimizer steps, is unchanged)."""
    import torch.distributed as dist

    for buffer in [*ddp.buffers, *ddp.expert_parallel_buffers]:
        group = buffer.data_parallel_group
        size = group.size()
        if size == 1:
            continue
        for bucket in buffer.buckets:
            mine = bucket.grad_data.view(size, -1)[group.rank()].clone()
            dist.all_gather_into_tensor(bucket.grad_data, mine, group=group)


def _reward(data, step) -> float:
    """Mean reward of the step's rollouts (layout-free, computed from the data; NaN when the
    rollouts carry advantages but no rewards)."""
    pos = {int(r): k for k, r in enumerate(data.rollout_ids)}
    return float(np.mean([data.rollout_reward[pos[int(r)]] for r in step.rollout_ids]))


def reduce_step_report(values, *, keys, mode, norm, cp_size) -> dict[str, float]:
    """:func:`varbatch_kit.report.reduce_train_step_metrics` over megatron's DP x CP group.

    With emulated CP, megatron's data-parallel group is the whole dp * cp world.
    ``divisor=None`` is slime's per-token path (all-reduced token count / cp).
    """
    from megatron.core import parallel_state

    from varbatch_kit.report import reduce_train_step_metrics

    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    divisor = None if mode.megatron_per_token_loss else norm.report_divisor
    return reduce_train_step_metrics(values, keys=keys, divisor=divisor,
                                     cp_size=cp_size, group=group)
