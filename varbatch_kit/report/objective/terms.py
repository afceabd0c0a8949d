"""Every per-token term of slime's policy loss, before any reduction.

:func:`policy_objective` takes one micro-batch's samples (per-sample tensors
of full responses) and returns flat per-token tensors (samples
concatenated), keyed by the names slime logs. Reducing each with the report
mode's per-sample sums (slime's ``sum_of_sample_mean``; the training step's
:meth:`~varbatch_kit.report.ReportMode.microbatch_loss_sum`) gives slime's
values::

    pg_loss      = reduce(surrogate * w)            w: the TIS / ICEPOP weight, or 1
    pg_clipfrac  = reduce(clipped-token flag)
    ppo_kl       = reduce(old - new)                (GSPO: each sample's masked mean)
    entropy_loss = reduce(entropy)
    kl_loss      = reduce(KL estimate to the reference)        (use_kl_loss)
    loss         = pg_loss - entropy_coef * entropy_loss + kl_loss_coef * kl_loss

Because every reduction is the same linear map, the per-token ``loss``
entry ``surrogate * w - entropy_coef * entropy + kl_loss_coef * kl`` reduces
to the same ``loss`` (up to float rounding): the engine reduces that one
tensor for the gradient. The surrogate is PPO's clipped one
(:func:`~.policy_loss.ppo_clip_loss`, asymmetric with ``eps_clip_high``,
dual-clip with ``eps_clip_c``), or CISPO's (``advantage_estimator="cispo"``);
GSPO replaces the per-token ``old - new`` by the sample's masked mean of it
(slime's ``compute_gspo_kl``).

Old log-probs default to the current ones, detached (slime does the same when
no log-prob pass ran): the ratio is then 1 with the on-policy gradient.
``use_rollout_logprobs`` takes the rollout engine's log-probs as the old ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from varbatch_kit.report.objective.kl import KL_TYPES, approx_kl
from varbatch_kit.report.objective.policy_loss import (
    cispo_loss,
    icepop_weights,
    ppo_clip_loss,
    truncated_is_weights,
)

__all__ = ["OBJECTIVE_ESTIMATORS", "ObjectiveOptions", "metric_keys", "policy_objective"]

#: the advantage estimators whose policy loss :func:`policy_objective` computes
OBJECTIVE_ESTIMATORS = ("grpo", "gspo", "cispo", "reinforce_plus_plus",
                        "reinforce_plus_plus_baseline")


@dataclass(frozen=True)
class ObjectiveOptions:
    """The options of :func:`policy_objective`, by slime's flag names (see
    :class:`varbatch_kit.train.config.sub_configs.LossConfig` for their documentation)."""

    advantage_estimator: str = "grpo"
    eps_clip: float = 0.2
    eps_clip_high: float = 0.2
    eps_clip_c: float | None = None
    entropy_coef: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "k1"
    use_unbiased_kl: bool = False
    use_tis: bool = False
    tis_function: str = "vanilla"
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    use_rollout_logprobs: bool = False

    def __post_init__(self) -> None:
        if self.advantage_estimator not in OBJECTIVE_ESTIMATORS:
            raise ValueError(f"advantage_estimator={self.advantage_estimator!r}: choose one of "
                             f"{OBJECTIVE_ESTIMATORS}")
        if self.kl_loss_type not in KL_TYPES:
            raise ValueError(f"kl_loss_type={self.kl_loss_type!r}: choose one of {KL_TYPES}")
        if self.tis_function not in ("vanilla", "icepop"):
            raise ValueError(f"tis_function={self.tis_function!r}: choose vanilla or icepop")


def metric_keys(options: ObjectiveOptions, *, has_rollout_log_probs: bool) -> tuple[str, ...]:
    """The keys :func:`policy_objective` returns for these options, in slime's logging order."""
    keys = ["loss", "pg_loss", "entropy_loss", "pg_clipfrac", "ppo_kl"]
    if has_rollout_log_probs:
        keys.append("train_rollout_logprob_abs_diff")
    if options.use_kl_loss:
        keys.append("kl_loss")
    if options.use_tis:
        keys += ["ois", "tis", "tis_clipfrac", "tis_abs"]
    return tuple(keys)


def _cat(parts: Sequence[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return torch.cat(list(parts)) if len(parts) else like.new_zeros(0)


def policy_objective(
    options: ObjectiveOptions,
    log_probs: Sequence[torch.Tensor],
    entropy: Sequence[torch.Tensor],
    advantages: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
    *,
    old_log_probs: Sequence[torch.Tensor] | None = None,
    ref_log_probs: Sequence[torch.Tensor] | None = None,
    rollout_log_probs: Sequence[torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Per-token terms of one micro-batch (see the module docstring), keyed as slime logs them.

    Every argument is a list with one tensor per sample over its response
    tokens: ``log_probs`` (differentiable) and ``entropy`` (differentiable when
    ``entropy_coef`` is non-zero), ``advantages``, ``loss_masks`` (used by GSPO's
    sequence mean only; the reduction applies the masks), and the optional old,
    reference (needed with ``use_kl_loss``) and rollout (needed with
    ``use_tis`` or ``use_rollout_logprobs``) log-probs. Returns flat tensors
    with :func:`metric_keys` ``(options, has_rollout_log_probs=...)`` keys.
    """
    n = len(log_probs)
    for name, seq in (("entropy", entropy), ("advantages", advantages),
                      ("loss_masks", loss_masks), ("old_log_probs", old_log_probs),
                      ("ref_log_probs", ref_log_probs),
                      ("rollout_log_probs", rollout_log_probs)):
        if seq is not None and len(seq) != n:
            raise ValueError(f"{name} has {len(seq)} samples, log_probs {n}: pass one tensor "
                             "per sample to each")
    if options.use_kl_loss and ref_log_probs is None:
        raise ValueError("use_kl_loss needs ref_log_probs (the reference model's log-probs)")
    if (options.use_tis or options.use_rollout_logprobs) and rollout_log_probs is None:
        raise ValueError("use_tis and use_rollout_logprobs need rollout_log_probs (the rollout "
                         "engine's log-probs of every response token)")
    new_parts = list(log_probs)
    like = new_parts[0] if n else torch.zeros(0)
    if options.use_rollout_logprobs:
        old_parts = list(rollout_log_probs)
    elif old_log_probs is not None:
        old_parts = list(old_log_probs)
    else:
        old_parts = [lp.detach() for lp in new_parts]
    old_parts = [o.to(device=lp.device, dtype=lp.dtype) for o, lp in zip(old_parts, new_parts)]
    new, old = _cat(new_parts, like), _cat(old_parts, like)
    adv = _cat(advantages, like).to(device=new.device, dtype=new.dtype)

    if options.advantage_estimator == "gspo":
        # each token carries its sample's masked mean of old - new (value and gradient)
        seq = []
        for lp, o, m in zip(new_parts, old_parts, loss_masks, strict=True):
            m = m.to(device=lp.device, dtype=lp.dtype)
            mean = ((o - lp) * m).sum() / m.sum().clamp_min(1)
            seq.append(mean.expand_as(lp))
        ppo_kl = _cat(seq, like)
    else:
        ppo_kl = old - new

    if options.advantage_estimator == "cispo":
        pg, clipfrac = cispo_loss(ppo_kl, new, adv, options.eps_clip, options.eps_clip_high)
    else:
        pg, clipfrac = ppo_clip_loss(ppo_kl, adv, options.eps_clip, options.eps_clip_high,
                                     eps_clip_c=options.eps_clip_c)
    out: dict[str, torch.Tensor] = {}
    tis_metrics: dict[str, torch.Tensor] = {}
    if options.use_tis:
        rollout = _cat(rollout_log_probs, like).to(device=new.device, dtype=new.dtype)
        # slime weighs by the log-prob pass's policy (else the current one, detached) against
        # the rollout engine's, whichever log-probs the ratio uses
        train_lp = (new.detach() if old_log_probs is None else
                    _cat(old_log_probs, like).to(device=new.device, dtype=new.dtype))
        weigh = truncated_is_weights if options.tis_function == "vanilla" else icepop_weights
        w = weigh(train_lp, rollout, options.tis_clip_low, options.tis_clip)
        pg = pg * w["weight"]
        tis_metrics = {"ois": torch.exp(-ppo_kl).detach(), "tis": w["ratio"].detach(),
                       "tis_clipfrac": w["clipfrac"].detach(), "tis_abs": w["abs"].detach()}
    ent = _cat(entropy, like).to(device=new.device, dtype=new.dtype)
    loss = pg - options.entropy_coef * ent
    kl = None
    if options.use_kl_loss:
        ref = _cat(ref_log_probs, like).to(device=new.device)
        ratio = torch.exp(new - old) if options.use_unbiased_kl else None
        kl = approx_kl(new, ref, options.kl_loss_type, weight=ratio).to(new.dtype)
        loss = loss + options.kl_loss_coef * kl
    out["loss"] = loss
    out["pg_loss"] = pg
    out["entropy_loss"] = ent
    out["pg_clipfrac"] = clipfrac.to(new.dtype)
    out["ppo_kl"] = ppo_kl
    if rollout_log_probs is not None:
        rollout = _cat(rollout_log_probs, like).to(device=new.device, dtype=new.dtype)
        compare = new if options.use_rollout_logprobs else old
        out["train_rollout_logprob_abs_diff"] = (compare - rollout).abs().detach()
    if kl is not None:
        out["kl_loss"] = kl
    out.update(tis_metrics)
    return out
