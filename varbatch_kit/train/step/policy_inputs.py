"""A rollout batch's policy-loss inputs, prepared before its first step: old and reference
log-probs, per-token advantages, rollout log-probs
(:class:`~varbatch_kit.train.step.train_step.PolicyInputs`).

The schedule's steps form rollout batches of ``data.num_steps_per_rollout``
consecutive steps (default: one batch, every step of the schedule), as slime
trains ``--num-steps-per-rollout`` steps on each rollout batch. A batch is the
schedule's whatever ``run.max_steps`` trains of it: its advantages and old
log-probs do not depend on where the run stops. Before a batch's
first step, in slime's order:

1. the forward-only log-prob pass (:mod:`~varbatch_kit.train.step.logprob_pass`) over the batch's
   samples gives the old policy's log-probs (the actor as it is now);
2. with a KL loss or ``kl_coef``, the reference log-probs: the same pass with
   the initial model's weights, a frozen copy kept in memory and swapped in
   for the pass (in the first batch the actor still is the initial model, so
   the old log-probs are reused);
3. the advantages of the batch's samples from their rewards and those
   log-probs (:func:`varbatch_kit.train.data.rollout_advantages.token_advantages`: slime's
   reward post-processing, the estimator's returns, optional whitening, all
   over this rollout batch);
4. the rollout engine's log-probs, when the rollouts carry them (TIS,
   ``use_rollout_logprobs``, ``train_rollout_logprob_abs_diff``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from varbatch_kit.train.step.train_step import PolicyInputs

__all__ = ["RolloutBatches", "initial_state_if_needed", "prepare_policy_inputs"]


class RolloutBatches:
    """The rollout batches of a run's steps: batch ``k`` is steps ``k*n+1 .. (k+1)*n``."""

    def __init__(self, num_steps: int, num_steps_per_rollout: int | None):
        self.per_batch = int(num_steps_per_rollout or max(num_steps, 1))

    def index(self, step_number: int) -> int:
        """The rollout batch of the 1-based step ``step_number``."""
        return (int(step_number) - 1) // self.per_batch

    def starts(self, step_number: int) -> bool:
        """Whether ``step_number`` is the first step of its rollout batch."""
        return (int(step_number) - 1) % self.per_batch == 0

    def steps(self, items: list, k: int) -> list:
        """Batch ``k``'s entries of a per-step list."""
        return items[k * self.per_batch:(k + 1) * self.per_batch]


def _samples(steps) -> np.ndarray:
    return np.unique(np.concatenate([s.sample_indices for s in steps]))


def prepare_policy_inputs(layout, loss, data_cfg, model, gpt, log_prob_steps, rollouts, data,
                          device, out_dir: Path, *, rollout_batch: int,
                          initial_state: dict | None, resumed: bool = False) -> PolicyInputs:
    """The :class:`PolicyInputs` of rollout batch ``rollout_batch`` (collective).

    ``layout``: the run's :class:`~varbatch_kit.train.config.parallel_layout.ParallelLayout`;
    ``loss``, ``data_cfg``: its ``LossConfig`` and ``DataConfig``;
    ``log_prob_steps``: the batch's steps of the log-prob schedule; ``gpt``: the
    model inside ``model``'s DDP wrapper; ``initial_state``: the initial
    model's weights (None when no reference is needed); ``resumed``: the run
    resumes inside this batch, so the pass saved before is read back.
    """
    from varbatch_kit.train.data.rollout_advantages import token_advantages
    from varbatch_kit.train.step.logprob_pass import (
        compute_log_probs,
        load_or_compute,
        log_probs_file,
    )

    needs_ref = loss.use_kl_loss or loss.kl_coef > 0
    temperature = loss.rollout_temperature
    # all-gather CP: the pass runs each micro-batch over its CP group too, as training does
    cp_allgather = layout.cp > 1 and layout.cp_impl == "allgather"

    def run_pass() -> dict:
        old = compute_log_probs(model, log_prob_steps, rollouts, data.tokens, device,
                                temperature=temperature, layout=layout,
                                cp_allgather=cp_allgather)
        ref = None
        if needs_ref and rollout_batch == 0:
            ref = old  # the actor has not moved yet: it is the reference model
        elif needs_ref:
            current = _weights(gpt)
            _load(gpt, initial_state)
            try:
                ref = compute_log_probs(model, log_prob_steps, rollouts, data.tokens, device,
                                        temperature=temperature, layout=layout,
                                        cp_allgather=cp_allgather)
            finally:
                _load(gpt, current)
        return {"old": old, "ref": ref}

    saved = load_or_compute(run_pass, log_probs_file(out_dir, rollout_batch), resumed=resumed)
    old, ref = saved["old"], saved["ref"]
    samples = _samples(log_prob_steps)
    advantages = token_advantages(
        data, rollouts, loss=loss, data_cfg=data_cfg, samples=samples,
        log_probs=[old[int(i)] for i in samples],
        ref_log_probs=None if ref is None else [ref[int(i)] for i in samples])
    by_sample = dict(zip(samples.tolist(), advantages))
    return PolicyInputs(advantages=by_sample, old_log_probs=old,
                        ref_log_probs=ref if loss.use_kl_loss else None,
                        rollout_log_probs=data.rollout_log_probs)


def _weights(gpt) -> dict:
    return {n: p.detach().clone() for n, p in gpt.named_parameters()}


@torch.no_grad()
def _load(gpt, weights: dict) -> None:
    for n, p in gpt.named_parameters():
        p.copy_(weights[n])


def initial_state_if_needed(loss, gpt) -> dict | None:
    """A frozen copy of the initial model's weights when ``loss`` (a ``LossConfig``) needs a
    reference model."""
    if not (loss.use_kl_loss or loss.kl_coef > 0):
        return None
    return _weights(gpt)
