"""slime's ``policy_loss_function`` and ``loss_function``, with slime's signatures and results.

Built on the per-token terms the training engine itself uses
(:func:`varbatch_kit.report.objective.policy_objective`) and the log-prob pass
of :func:`varbatch_kit.report.objective.response_log_probs_and_entropy`;
checked end to end (loss, normalizer, every logged value, the gradient with
respect to the logits) against vectors recorded from slime's own
``backends/megatron_utils/loss.py`` (``tests/golden/objective/``, written by
``scripts/record_slime_loss.py``).

The reducer is ``compat.slime.get_sum_of_sample_mean`` (slime's signature, in
:mod:`.metrics`). The non-CP path: context-parallel size 1 (``args.context_parallel_size`` other
than 1, or ``args.allgather_cp``, is refused), tensor-parallel size 1 (the
logits hold the whole vocabulary), and the data-parallel size that
``loss_function`` multiplies the loss by is ``args.data_parallel_size``
(megatron's argument; 1 when absent) where slime asks
``mpu.get_data_parallel_world_size(with_context_parallel=True)``. Not
supported (a :class:`SlimeCompatError` names the flag): rollout top-p replay
(``rollout_top_p != 1``), OPD, and loss types other than ``policy_loss``.

``--custom-tis-function-path``: slime's (or ``compat.slime``'s)
``vanilla_tis_function`` / ``icepop_function`` select the engine's weights;
any other dotted path is imported and called with slime's keyword arguments,
as slime does. ``--get-mismatch-metrics`` applies the TIS function exactly as
``--use-tis`` does (slime's behaviour).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from varbatch_kit.compat.slime.errors import SlimeCompatError, raises_slime_errors
from varbatch_kit.compat.slime.metrics import get_sum_of_sample_mean
from varbatch_kit.report import objective as obj

__all__ = ["KNOWN_TIS_FUNCTIONS", "loss_function", "objective_options_from_args",
           "policy_loss_function"]

#: the last component of a ``--custom-tis-function-path`` naming slime's own TIS functions
KNOWN_TIS_FUNCTIONS = {"vanilla_tis_function": "vanilla", "icepop_function": "icepop"}
_ESTIMATORS = ("grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")


def _load_function(path: str) -> Callable:
    """slime's ``load_function``: ``"package.module.name"`` -> the object."""
    module, _, attr = path.rpartition(".")
    if not module:
        raise SlimeCompatError(f"function path {path!r} has no module; give 'module.function'")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise SlimeCompatError(f"cannot load {path!r}: {e}") from e


def _check_args(args: Any) -> None:
    if getattr(args, "allgather_cp", False):
        raise SlimeCompatError("args.allgather_cp=True is not supported: the compat loss takes "
                               "the non-CP path; set it False")
    cp = getattr(args, "context_parallel_size", 1)
    if cp != 1:
        raise SlimeCompatError(f"args.context_parallel_size={cp!r} is not supported: the "
                               "compat loss takes the non-CP path (1)")
    if getattr(args, "rollout_top_p", 1.0) != 1.0:
        raise SlimeCompatError(f"args.rollout_top_p={args.rollout_top_p!r} (top-p replay) is "
                               "not supported; use 1.0")
    if args.advantage_estimator not in _ESTIMATORS:
        raise SlimeCompatError(f"args.advantage_estimator={args.advantage_estimator!r}: the "
                               f"policy loss supports {_ESTIMATORS}")


def _tis_choice(args: Any) -> tuple[str, str | None]:
    """``(engine weight name, None)`` for slime's own TIS functions, else ``("", path)``."""
    path = getattr(args, "custom_tis_function_path", None)
    if path is None:
        return "vanilla", None
    name = path.rpartition(".")[2]
    if name in KNOWN_TIS_FUNCTIONS and path.startswith(("slime.", "varbatch_kit.")):
        return KNOWN_TIS_FUNCTIONS[name], None
    return "", path


def _options(args: Any, use_tis: bool, tis_function: str) -> obj.ObjectiveOptions:
    return obj.ObjectiveOptions(
        advantage_estimator=args.advantage_estimator, eps_clip=args.eps_clip,
        eps_clip_high=args.eps_clip_high, eps_clip_c=args.eps_clip_c,
        entropy_coef=args.entropy_coef, use_kl_loss=args.use_kl_loss,
        kl_loss_coef=getattr(args, "kl_loss_coef", 0.0),
        kl_loss_type=getattr(args, "kl_loss_type", "k1"),
        use_unbiased_kl=getattr(args, "use_unbiased_kl", False), use_tis=use_tis,
        tis_function=tis_function or "vanilla", tis_clip=getattr(args, "tis_clip", 2.0),
        tis_clip_low=getattr(args, "tis_clip_low", 0.0),
        use_rollout_logprobs=args.use_rollout_logprobs)


def _mismatch(args: Any) -> bool:
    return bool(args.use_tis or getattr(args, "get_mismatch_metrics", False))


@raises_slime_errors
def objective_options_from_args(args: Any) -> obj.ObjectiveOptions:
    """The engine's per-token objective options
    (:class:`~varbatch_kit.report.objective.ObjectiveOptions`) for slime's ``args``.

    ``get_mismatch_metrics`` counts as ``use_tis`` (slime weighs the loss then
    too); ``custom_tis_function_path`` must be None or name slime's
    ``vanilla_tis_function`` / ``icepop_function`` (:data:`KNOWN_TIS_FUNCTIONS`);
    :func:`policy_loss_function` calls any other function itself.
    """
    _check_args(args)
    name, func = _tis_choice(args) if _mismatch(args) else ("vanilla", None)
    if func is not None:
        raise SlimeCompatError(f"args.custom_tis_function_path={args.custom_tis_function_path!r}"
                               " is not one of slime's TIS functions "
                               f"{sorted(KNOWN_TIS_FUNCTIONS)}: the per-token objective has no "
                               "weights for it")
    return _options(args, _mismatch(args), name)


@raises_slime_errors
def policy_loss_function(args: Any, batch: dict, logits: torch.Tensor,
                         sum_of_sample_mean: Callable[[torch.Tensor], torch.Tensor]
                         ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(loss, reported_loss)`` of slime's policy loss on ``logits [1, T, V]`` (float32).

    ``batch`` holds slime's micro-batch lists (``unconcat_tokens``,
    ``total_lengths``, ``response_lengths``, ``loss_masks``, ``advantages``, and
    ``log_probs``, ``ref_log_probs``, ``rollout_log_probs``,
    ``rollout_mask_sums`` as the options need them). ``reported_loss`` has
    slime's keys in slime's order: ``loss``, ``pg_loss``, ``entropy_loss``,
    ``pg_clipfrac``, ``ppo_kl``, then ``train_rollout_logprob_abs_diff`` (with
    rollout log-probs), ``kl_loss`` (``use_kl_loss``), ``ois``, ``tis``,
    ``tis_clipfrac``, ``tis_abs`` (``use_tis`` / ``get_mismatch_metrics``) and
    ``opsm_clipfrac`` (``use_opsm``).
    """
    _check_args(args)
    if logits.dtype != torch.float32 or logits.ndim != 3 or logits.size(0) != 1:
        raise SlimeCompatError(f"logits must be float32 [1, T, V], got {logits.dtype} "
                               f"{tuple(logits.shape)}")
    if batch.get("opd_reverse_kl"):
        raise SlimeCompatError("batch['opd_reverse_kl'] (OPD) is not supported")
    total_lengths, response_lengths = batch["total_lengths"], batch["response_lengths"]
    masks = batch["loss_masks"]
    log_probs, entropy = obj.response_log_probs_and_entropy(
        logits[0], batch["unconcat_tokens"], total_lengths, response_lengths,
        getattr(args, "rollout_temperature", 1.0))
    if args.entropy_coef == 0:
        entropy = [e.detach() for e in entropy]  # slime keeps no entropy gradient then
    train_log_probs = batch.get("log_probs") or None
    rollout_log_probs = batch.get("rollout_log_probs") or None
    mismatch = _mismatch(args)
    tis_name, tis_path = _tis_choice(args) if mismatch else ("", None)
    tis_func = _load_function(tis_path) if tis_path is not None else None
    if mismatch and rollout_log_probs is None:
        raise SlimeCompatError("rollout_log_probs must be provided for TIS "
                               "(batch['rollout_log_probs'])")
    if args.use_rollout_logprobs and rollout_log_probs is None:
        raise SlimeCompatError("use_rollout_logprobs needs batch['rollout_log_probs']")
    terms = obj.policy_objective(
        _options(args, mismatch and tis_func is None, tis_name), log_probs, entropy,
        batch["advantages"], masks, old_log_probs=train_log_probs,
        ref_log_probs=batch.get("ref_log_probs") if args.use_kl_loss else None,
        rollout_log_probs=rollout_log_probs)

    pg_loss = terms["pg_loss"]
    opsm_clipfrac = None
    if getattr(args, "use_opsm", False):
        if args.use_rollout_logprobs:
            old = rollout_log_probs
        else:
            old = train_log_probs or [lp.detach() for lp in log_probs]
        keep, opsm_clipfrac = obj.opsm_keep_mask(log_probs, old, batch["advantages"], masks,
                                                 args.opsm_delta)
        pg_loss = pg_loss * keep  # 0/1: the same in either order as slime's (before TIS)

    metric_reducer = sum_of_sample_mean
    tis_metrics: dict[str, torch.Tensor] = {}
    if mismatch:
        if tis_func is not None:
            pg_loss, masks_after, tis_metrics = tis_func(
                args=args, pg_loss=pg_loss,
                train_log_probs=train_log_probs or [lp.detach() for lp in log_probs],
                rollout_log_probs=rollout_log_probs, loss_masks=masks,
                total_lengths=total_lengths, response_lengths=response_lengths)
        else:
            masks_after = masks
            tis_metrics = {k: terms[k] for k in ("tis", "tis_clipfrac", "tis_abs")}
        # slime: the loss terms are reduced with the TIS masks over the rollout denominators
        sum_of_sample_mean = get_sum_of_sample_mean(
            total_lengths, response_lengths, masks_after, batch["rollout_mask_sums"],
            args.calculate_per_token_loss)

    reducer_path = getattr(args, "custom_pg_loss_reducer_function_path", None)
    if reducer_path is not None:
        pg_masks = masks_after if mismatch else masks
        pg_reducer = _load_function(reducer_path)(total_lengths, response_lengths, pg_masks,
                                                  args.calculate_per_token_loss)
    else:
        pg_reducer = sum_of_sample_mean

    pg_loss = pg_reducer(pg_loss)
    pg_clipfrac = sum_of_sample_mean(terms["pg_clipfrac"])
    ppo_kl = sum_of_sample_mean(terms["ppo_kl"])
    entropy_loss = sum_of_sample_mean(terms["entropy_loss"])
    loss = pg_loss - args.entropy_coef * entropy_loss
    if args.use_kl_loss:
        kl_loss = sum_of_sample_mean(terms["kl_loss"])
        loss = loss + args.kl_loss_coef * kl_loss

    reported = {"loss": loss.clone().detach(), "pg_loss": pg_loss.clone().detach(),
                "entropy_loss": entropy_loss.clone().detach(),
                "pg_clipfrac": pg_clipfrac.clone().detach(), "ppo_kl": ppo_kl.clone().detach()}
    if sum(response_lengths) == 0:
        loss = loss + 0 * logits.sum()  # slime: the gradient reaches the logits
    if "train_rollout_logprob_abs_diff" in terms:
        reported["train_rollout_logprob_abs_diff"] = sum_of_sample_mean(
            terms["train_rollout_logprob_abs_diff"])
    if args.use_kl_loss:
        reported["kl_loss"] = kl_loss.clone().detach()
    if mismatch:
        reported["ois"] = metric_reducer(torch.exp(-terms["ppo_kl"]).detach()).clone().detach()
        for key, value in tis_metrics.items():
            reported[key] = metric_reducer(value)
    if opsm_clipfrac is not None:
        reported["opsm_clipfrac"] = opsm_clipfrac
    return loss, reported


@raises_slime_errors
def loss_function(args: Any, batch: dict, num_microbatches: int, step_global_batch_size: int,
                  logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """``(scaled_loss, normalizer, {"keys": [...], "values": tensor})``, as slime's.

    The reducer is ``get_sum_of_sample_mean(total_lengths, response_lengths,
    loss_masks, rollout_mask_sums, calculate_per_token_loss)``. With
    ``calculate_per_token_loss`` the normalizer is the micro-batch's token
    count, each sample counting at least one token (a fully masked sample
    counts 1: ``clamp_min(loss_mask.sum(), 1)``), and the loss is unscaled (CP
    size 1); else the normalizer is ``tensor(1)`` and the loss is scaled by
    ``num_microbatches / step_global_batch_size * data_parallel_size``.
    ``values[0]`` is the token count (per-token) or 0, then the logged values.
    """
    loss_type = getattr(args, "loss_type", "policy_loss")
    if loss_type != "policy_loss":
        raise SlimeCompatError(f"Unknown loss type: {loss_type}; args.loss_type={loss_type!r} "
                               "is not supported here: use 'policy_loss'")
    _check_args(args)
    if step_global_batch_size <= 0 or num_microbatches <= 0:
        raise SlimeCompatError(f"num_microbatches={num_microbatches}, step_global_batch_size="
                               f"{step_global_batch_size}: both must be positive")
    dp = getattr(args, "data_parallel_size", 1)
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise SlimeCompatError(f"args.data_parallel_size={dp!r}: give the data-parallel world "
                               "size, an integer >= 1")
    num_tokens = sum(torch.clamp_min(m.sum(), 1) for m in batch["loss_masks"])
    reducer = get_sum_of_sample_mean(batch["total_lengths"], batch["response_lengths"],
                                     batch["loss_masks"], batch["rollout_mask_sums"],
                                     args.calculate_per_token_loss)
    loss, log = policy_loss_function(args, batch, logits, reducer)
    if not args.calculate_per_token_loss:
        loss = loss * num_microbatches / step_global_batch_size * dp
    normalizer = num_tokens if args.calculate_per_token_loss else \
        torch.tensor(1, device=logits.device)
    head = num_tokens if args.calculate_per_token_loss else 0
    values = torch.tensor([float(head)] + [float(v) for v in log.values()],
                          dtype=torch.float32, device=logits.device)
    return loss, normalizer, {"keys": list(log.keys()), "values": values}
