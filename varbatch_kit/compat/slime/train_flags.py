"""slime's command line → :class:`~varbatch_kit.train.TrainConfig` (objective, data, optimiser).

:func:`train_config_from_slime_args` reads the flags of a slime run that
decide what a training step computes and maps each onto the
:class:`~varbatch_kit.train.TrainConfig` field of the same name (the flag
without dashes; ``LossConfig`` carries slime's names):

======================================  =======================================
slime flag                              TrainConfig field
======================================  =======================================
``--advantage-estimator``               ``loss.advantage_estimator`` (``ppo``:
                                        refused, it needs a critic)
``--eps-clip``                          ``loss.eps_clip``
``--eps-clip-high``                     ``loss.eps_clip_high``
``--eps-clip-c``                        ``loss.eps_clip_c``
``--use-kl-loss``                       ``loss.use_kl_loss = True``
``--kl-loss-coef``                      ``loss.kl_loss_coef``
``--kl-loss-type``                      ``loss.kl_loss_type``
``--use-unbiased-kl``                   ``loss.use_unbiased_kl = True``
``--kl-coef``                           ``loss.kl_coef``
``--entropy-coef``                      ``loss.entropy_coef``
``--gamma``                             ``loss.gamma``
``--normalize-advantages``              ``loss.normalize_advantages = True``
``--disable-rewards-normalization``     ``loss.rewards_normalization = False``
``--disable-grpo-std-normalization``    ``loss.grpo_std_normalization = False``
``--use-tis``                           ``loss.use_tis = True``
``--custom-tis-function-path``          ``loss.tis_function``: ``"vanilla"`` for
                                        ``slime.backends.megatron_utils.loss.vanilla_tis_function``,
                                        ``"icepop"`` for ``....icepop_function``
                                        (any other path: ``ValueError``)
``--tis-clip``                          ``loss.tis_clip``
``--tis-clip-low``                      ``loss.tis_clip_low``
``--use-rollout-logprobs``              ``loss.use_rollout_logprobs = True``
``--reward-key``                        ``loss.reward_key``
``--rollout-temperature``               ``loss.rollout_temperature`` (the log-probs'
                                        temperature)
``--moe-aux-loss-coeff``                ``loss.moe_aux_loss_coeff`` (a mixture of
                                        experts: the load-balancing loss, per
                                        sample, whether megatron's
                                        ``--moe-router-load-balancing-type`` is
                                        ``aux_loss`` or ``seq_aux_loss``)
``--moe-z-loss-coeff``                  ``loss.moe_z_loss_coeff``
``--seed``                              ``data.seed``
``--n-samples-per-prompt``              ``data.n_samples_per_prompt``
``--rollout-batch-size``                ``data.rollout_batch_size``
``--num-steps-per-rollout``             ``data.num_steps_per_rollout`` (steps per
                                        rollout batch: one log-prob pass each)
``--lr``, ``--min-lr``                  ``optim.lr``, ``optim.min_lr``
``--lr-decay-style``                    ``optim.lr_decay_style`` (constant,
                                        linear, cosine)
``--lr-warmup-fraction``                ``optim.lr_warmup_fraction``
``--weight-decay``                      ``optim.weight_decay``
``--adam-beta1``, ``--adam-beta2``      ``optim.adam_beta1``, ``optim.adam_beta2``
``--adam-eps``                          ``optim.adam_eps``
``--clip-grad``                         ``optim.clip_grad``
``--use-distributed-optimizer``         ``optim.distributed = True``
``--calculate-per-token-loss``          ``mode = "per_token"``
``--tensor-model-parallel-size``        ``tp``
``--expert-model-parallel-size``        ``ep`` (a mixture of experts; out of
                                        dp, as megatron counts it)
``--sequence-parallel``                 ``sequence_parallel`` (megatron's rule:
                                        off at tp 1; with
                                        ``--tensor-model-parallel-size`` and
                                        without this flag, off)
the schedule flags                      ``schedule``, by
                                        :func:`~varbatch_kit.compat.slime.schedule_config_from_slime_args`
======================================  =======================================

The rules:

- **Flags not given keep** ``base``'s **values.** ``base`` (a ``TrainConfig``)
  supplies everything slime's flags do not (the model, the run, checkpoints,
  ...); ``base=None`` is ``TrainConfig()``, whose ``LossConfig`` defaults are
  slime's defaults for every objective flag. Not so elsewhere:
  ``data.n_samples_per_prompt`` defaults to 4 (slime: 1) and ``OptimConfig``
  to a toy model's values (slime: ``--lr 1e-6``, megatron's ``--min-lr 0``,
  ``--weight-decay 0.01``, linear decay), so give those flags, or a ``base``
  holding them. A flag overrides base's field; a value that conflicts with a
  field kept from base (``--lr`` below base's ``min_lr``) is a ``ValueError``
  naming both.
- **The schedule** comes from the flags when any schedule flag is given
  (``--global-batch-size``, ``--micro-batch-size``, ``--use-dynamic-batch-size``,
  ``--max-tokens-per-gpu``, the parallel sizes, ...): then
  ``schedule_config_from_slime_args`` maps them and its result replaces
  base's schedule whole (so ``--global-batch-size`` is required, and what is
  not given takes slime's default: dp from ``--actor-num-gpus-per-node`` etc.,
  one GPU when absent). Without schedule flags base's schedule stays.
- ``--calculate-per-token-loss`` selects the ``per_token`` report mode;
  without it base's mode stays (``per_rollout_mean``, slime's default, for
  ``base=None``).
- **Strict, as the schedule flags** (one parser and one known-flag table for
  both, :func:`~varbatch_kit.compat.slime.flags.parse_flag_table`): a bad
  value is a ``ValueError`` naming the flag; an abbreviation of a known flag
  is refused; every other flag (slime's model, rollout and logging flags, or
  a flag slime does not have) is ignored, and one warning lists them all.
- **Flags that change training in a way the engine does not implement are
  refused**, never accepted and ignored: ``--advantage-estimator ppo`` and
  every flag of :data:`UNSUPPORTED_TRAIN_FLAGS` (OPSM, on-policy
  distillation, routing replay, a load-balancing loss other than
  the per-sample one, a kept old actor, reference updates, custom
  loss / advantage / reducer functions, ``--loss-type`` other than
  ``policy_loss``, optimiser resets, another optimiser, megatron's iteration-
  or sample-based LR warm-up and decay) unless given its no-op value.
  The rest of slime's objective-adjacent flags that change nothing without
  one of those (``--lambd`` and ``--value-clip`` of PPO's critic,
  ``--opsm-delta``, ``--opd-*``) are in the warning.

``flags`` is a command-line string, a list of arguments (``sys.argv``-style)
or a namespace with slime's attribute names (``argparse.Namespace``,
``SimpleNamespace``). A namespace carries values, not "given" flags: each
attribute present sets its field; ``None`` is slime's "unset" and keeps base's
value, except for the flags whose slime default is None (``eps_clip_high``,
``eps_clip_c``, ``reward_key``: None is the value; ``custom_tis_function_path``:
None is vanilla TIS); ``False`` for ``calculate_per_token_loss`` keeps base's
mode. A namespace's other attributes are not warned about.

``TrainConfig`` lives in :mod:`varbatch_kit.train`, which needs the
``[train]`` extra; it is imported when the function runs, so
``varbatch_kit.compat.slime`` imports without the extra and the extra's
``ImportError`` says what to install.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from dataclasses import field as dc_field
from typing import TYPE_CHECKING, Any

from varbatch_kit.compat.slime.flags import (
    SCHEDULE_DESTS,
    SCHEDULE_FLAG_TABLE,
    flag_dest,
    parse_flag_table,
    positive_int,
    schedule_config_from_slime_args,
)

if TYPE_CHECKING:
    from varbatch_kit.train.config.train_config import TrainConfig

__all__ = ["SLIME_ADVANTAGE_ESTIMATORS", "TIS_FUNCTION_PATHS", "TRAIN_FLAGS",
           "UNSUPPORTED_TRAIN_FLAGS", "MappedFlag", "UnsupportedFlag",
           "train_config_from_slime_args"]

#: slime's ``--advantage-estimator`` choices (``ppo`` is refused: the engine trains no critic)
SLIME_ADVANTAGE_ESTIMATORS = ("grpo", "gspo", "cispo", "reinforce_plus_plus",
                              "reinforce_plus_plus_baseline", "ppo")
#: the ``--custom-tis-function-path`` values the engine implements -> ``LossConfig.tis_function``
TIS_FUNCTION_PATHS = {
    "slime.backends.megatron_utils.loss.vanilla_tis_function": "vanilla",
    "slime.backends.megatron_utils.loss.icepop_function": "icepop",
}


def _tis_function(path: str | None) -> str:
    if path is None:  # slime's default: vanilla TIS
        return "vanilla"
    if path not in TIS_FUNCTION_PATHS:
        raise ValueError(
            f"slime flag --custom-tis-function-path {path!r}: only slime's two TIS functions are "
            f"supported: {' or '.join(TIS_FUNCTION_PATHS)}")
    return TIS_FUNCTION_PATHS[path]


@dataclass(frozen=True)
class MappedFlag:
    """A slime flag the training config reads: ``section.field`` gets its (converted) value.

    ``section`` is a ``TrainConfig`` sub-config (``loss``, ``data``, ``optim``), ``mode`` or
    ``layout`` (a ``TrainConfig`` field of the layout, set with ``tp``); ``kwargs`` are its
    argparse keyword arguments; ``none_is_value``:
    slime's default is None and means something (a namespace's None sets it).
    """

    flag: str
    section: str
    field: str
    kwargs: dict[str, Any] = dc_field(default_factory=dict)
    convert: Callable[[Any], Any] | None = None
    none_is_value: bool = False

    @property
    def dest(self) -> str:
        """slime's attribute name (argparse's ``dest``)."""
        return flag_dest(self.flag, self.kwargs)


def _mapped(section: str, flag: str, kind: Any, *, name: str | None = None,
            kwargs: dict[str, Any] | None = None, convert: Callable[[Any], Any] | None = None,
            none_is_value: bool = False) -> MappedFlag:
    """A row: ``kind`` is an argparse type, or ``"true"`` / ``"false"`` for a switch."""
    kwargs = dict(kwargs or {})
    if kind in ("true", "false"):
        kwargs["action"] = f"store_{kind}"
    else:
        kwargs["type"] = kind
    dest = flag_dest(flag, kwargs)
    return MappedFlag(flag, section, name or dest, kwargs, convert, none_is_value)


def _loss(flag: str, kind: Any, **kw: Any) -> MappedFlag:
    return _mapped("loss", flag, kind, **kw)


#: every flag :func:`train_config_from_slime_args` maps, besides the schedule flags
TRAIN_FLAGS: tuple[MappedFlag, ...] = (
    _loss("--advantage-estimator", str, kwargs={"choices": SLIME_ADVANTAGE_ESTIMATORS}),
    _loss("--eps-clip", float),
    _loss("--eps-clip-high", float, none_is_value=True),
    _loss("--eps-clip-c", float, none_is_value=True),
    _loss("--use-kl-loss", "true"),
    _loss("--kl-loss-coef", float),
    _loss("--kl-loss-type", str, kwargs={"choices": ("k1", "k2", "k3", "low_var_kl")}),
    _loss("--use-unbiased-kl", "true"),
    _loss("--kl-coef", float),
    _loss("--entropy-coef", float),
    _loss("--gamma", float),
    _loss("--normalize-advantages", "true"),
    _loss("--disable-rewards-normalization", "false",
          kwargs={"dest": "rewards_normalization"}),
    _loss("--disable-grpo-std-normalization", "false",
          kwargs={"dest": "grpo_std_normalization"}),
    _loss("--use-tis", "true"),
    _loss("--custom-tis-function-path", str, name="tis_function", convert=_tis_function,
          none_is_value=True),
    _loss("--tis-clip", float),
    _loss("--tis-clip-low", float),
    _loss("--use-rollout-logprobs", "true"),
    _loss("--reward-key", str, none_is_value=True),
    _loss("--rollout-temperature", float),
    _loss("--moe-aux-loss-coeff", float),
    _loss("--moe-z-loss-coeff", float),
    _mapped("data", "--seed", int),
    _mapped("data", "--n-samples-per-prompt", positive_int),
    _mapped("data", "--rollout-batch-size", positive_int),
    _mapped("data", "--num-steps-per-rollout", positive_int),
    _mapped("optim", "--lr", float),
    _mapped("optim", "--min-lr", float),
    _mapped("optim", "--lr-decay-style", str),
    _mapped("optim", "--lr-warmup-fraction", float),
    _mapped("optim", "--weight-decay", float),
    _mapped("optim", "--adam-beta1", float),
    _mapped("optim", "--adam-beta2", float),
    _mapped("optim", "--adam-eps", float),
    _mapped("optim", "--clip-grad", float),
    _mapped("optim", "--use-distributed-optimizer", "true", name="distributed"),
    _mapped("mode", "--calculate-per-token-loss", "true", name="mode"),
    _mapped("layout", "--sequence-parallel", "true"),
    _mapped("layout", "--expert-model-parallel-size", positive_int, name="ep"),
)


@dataclass(frozen=True)
class UnsupportedFlag:
    """A slime flag that changes training in a way the engine does not implement.

    Refused unless its value is one of ``noop`` (slime's default, under which it
    changes nothing) or equals the namespace's ``same_as`` attribute.
    """

    flag: str
    what: str
    kwargs: dict[str, Any]
    noop: tuple[Any, ...]
    same_as: str | None = None

    @property
    def dest(self) -> str:
        return flag_dest(self.flag, self.kwargs)


def _switch(flag: str, what: str) -> UnsupportedFlag:
    return UnsupportedFlag(flag, what, {"action": "store_true"}, (False,))


def _valued(flag: str, what: str, kind: Any, *noop: Any, same_as: str | None = None
            ) -> UnsupportedFlag:
    return UnsupportedFlag(flag, what, {"type": kind}, noop, same_as)


#: the flags refused unless at their no-op value (slime's default)
UNSUPPORTED_TRAIN_FLAGS: tuple[UnsupportedFlag, ...] = (
    _switch("--use-opsm", "off-policy sequence masking"),
    _switch("--use-opd", "on-policy distillation"),
    _switch("--keep-old-actor", "old log-probs from a kept old actor"),
    _switch("--use-routing-replay", "MoE routing replay"),
    _switch("--use-rollout-routing-replay", "MoE rollout routing replay"),
    _switch("--reset-optimizer-states", "optimiser resets after each rollout"),
    _switch("--use-stateless-adam", "a stateless Adam"),
    UnsupportedFlag("--disable-compute-advantages-and-returns", "training without advantages",
                    {"action": "store_false", "dest": "compute_advantages_and_returns"},
                    (True,)),
    _valued("--loss-type", "a loss other than policy_loss", str, "policy_loss"),
    _valued("--custom-advantage-function-path", "a custom advantage function", str, None),
    _valued("--custom-pg-loss-reducer-function-path", "a custom pg_loss reducer", str, None),
    _valued("--ref-update-interval", "reference-model updates (the reference is the initial "
            "model)", int, None),
    _valued("--optimizer", "an optimiser other than adam", str, "adam"),
    _valued("--moe-router-load-balancing-type", "a load-balancing loss other than the per-"
            "sample aux / seq_aux loss (global_aux_loss, sinkhorn, none)", str, "aux_loss",
            "seq_aux_loss"),
    _valued("--lr-warmup-iters", "iteration-based LR warm-up (use --lr-warmup-fraction)", int,
            0),
    _valued("--lr-warmup-samples", "sample-based LR warm-up (use --lr-warmup-fraction)", int,
            0),
    _valued("--lr-warmup-init", "an LR warm-up from a non-zero LR", float, 0.0),
    _valued("--lr-decay-iters", "an LR decay horizon other than the run", int, None),
    _valued("--lr-decay-samples", "an LR decay horizon other than the run", int, None),
    _valued("--weight-decay-incr-style", "a changing weight decay", str, "constant"),
    _valued("--start-weight-decay", "a changing weight decay", float, None,
            same_as="weight_decay"),
    _valued("--end-weight-decay", "a changing weight decay", float, None,
            same_as="weight_decay"),
)

#: every flag the training config knows: the one parser's table (schedule flags included)
_TABLE: tuple[tuple[str, dict[str, Any]], ...] = (
    SCHEDULE_FLAG_TABLE + tuple((m.flag, m.kwargs) for m in TRAIN_FLAGS)
    + tuple((u.flag, u.kwargs) for u in UNSUPPORTED_TRAIN_FLAGS))
_BY_FIELD = {(m.section, m.field): m for m in TRAIN_FLAGS}


def _given(flags: Any) -> tuple[dict[str, Any], Any, bool]:
    """``(attribute -> value, the namespace the schedule reads, parsed from a command line)``."""
    if isinstance(flags, (str, list, tuple)):
        ns = parse_flag_table(flags, _TABLE, ignored_because="the training config does not "
                              "read", given_only=True, stacklevel=3)
        return vars(ns), ns, True
    if not hasattr(flags, "__dict__"):
        raise ValueError(
            f"slime args must be a command-line string, a list of strings or a namespace, got "
            f"{type(flags).__name__}")
    dests = list(SCHEDULE_DESTS) + [m.dest for m in TRAIN_FLAGS] + [
        u.dest for u in UNSUPPORTED_TRAIN_FLAGS]
    return {d: getattr(flags, d) for d in dests if hasattr(flags, d)}, flags, False


def _refuse_unsupported(given: dict[str, Any]) -> None:
    bad = []
    if given.get("advantage_estimator") == "ppo":
        others = ", ".join(e for e in SLIME_ADVANTAGE_ESTIMATORS if e != "ppo")
        bad.append("--advantage-estimator ppo (PPO needs a critic, a value model, which the "
                   f"engine does not train; use one of {others})")
    for u in UNSUPPORTED_TRAIN_FLAGS:
        if u.dest not in given:
            continue
        v = given[u.dest]
        if v in u.noop or (u.same_as is not None and v == given.get(u.same_as)):
            continue
        shown = "" if isinstance(v, bool) else f" {v!r}"
        bad.append(f"{u.flag}{shown} ({u.what})")
    if bad:
        raise ValueError("slime flags the training engine does not implement: "
                         + "; ".join(bad) + ". Drop them (or give slime's default) to train "
                         "with varbatch_kit")


def _named(section: str, changes: dict[str, Any], err: ValueError) -> str:
    """``err`` of building ``section`` from ``changes``, with the slime flags it is about."""
    text = str(err)
    m = re.match(r"(\w+)\.(\w+)=", text)
    row = _BY_FIELD.get((section, m.group(2))) if m and m.group(1) == section else None
    if row is not None and row.field in changes:
        return f"slime flag {row.flag} {changes[row.field]!r}: {text}"
    given = ", ".join(_BY_FIELD[(section, f)].flag for f in changes)
    kept = (f" ({section}.{m.group(2)} is base's value" + (f": give {row.flag} too)" if row
                                                           else ")")) if m else ""
    return f"slime flags {given}: {text}{kept}"


def train_config_from_slime_args(flags: Any, base: TrainConfig | None = None) -> TrainConfig:
    """Map slime's command line onto a :class:`~varbatch_kit.train.TrainConfig`.

    ``flags``: a command-line string (``"--advantage-estimator grpo --eps-clip
    0.2 --eps-clip-high 0.28 --use-kl-loss --kl-loss-coef 0.01"``), a list of
    arguments, or a namespace with slime's attribute names. ``base``: the
    ``TrainConfig`` that supplies every field the flags do not set (default
    ``TrainConfig()``). The mapping table and the rules are in the module's
    documentation; a bad value, an abbreviation or a flag the engine does not
    implement (``--advantage-estimator ppo``, ``--use-opsm``, ...) is a
    ``ValueError`` naming the flag, and flags the training config does not read
    are listed in one warning.
    """
    from varbatch_kit.train.config.train_config import TrainConfig  # needs the [train] extra

    if base is None:
        base = TrainConfig()
    elif not isinstance(base, TrainConfig):
        raise ValueError(f"base={base!r}: give a TrainConfig (or None for TrainConfig())")
    given, namespace, parsed = _given(flags)
    _refuse_unsupported(given)

    changes: dict[str, dict[str, Any]] = {"loss": {}, "data": {}, "optim": {}}
    mode = base.mode
    for row in TRAIN_FLAGS:
        if row.dest not in given:
            continue
        value = given[row.dest]
        if value is None and not row.none_is_value:
            continue  # a namespace's "unset": base's value stays
        if row.section == "layout":
            continue  # with tp, below
        if row.section == "mode":
            if value is True:
                mode = "per_token"
            elif value is not False:
                raise ValueError(f"slime flag {row.flag}: calculate_per_token_loss={value!r}; "
                                 "give True or False")
            continue
        changes[row.section][row.field] = row.convert(value) if row.convert else value

    sections = {}
    for section, kw in changes.items():
        if kw:
            try:
                sections[section] = replace(getattr(base, section), **kw)
            except ValueError as e:
                raise ValueError(_named(section, kw, e)) from None
    schedule = base.schedule
    if any(given.get(d) is not None for d in SCHEDULE_DESTS if d in given):
        schedule = schedule_config_from_slime_args(
            namespace if not parsed else argparse.Namespace(**given))
    tp = base.tp  # the schedule counted it in dp (GPUs / tp*pp*cp); the engine runs it too
    sp = base.sequence_parallel
    if given.get("tensor_model_parallel_size") is not None:
        tp = int(given["tensor_model_parallel_size"])
    if given.get("tensor_model_parallel_size") is not None or \
            given.get("sequence_parallel") is not None:
        # slime runs what megatron runs: sequence parallelism when asked for, off at tp 1
        sp = bool(given.get("sequence_parallel")) and tp > 1
    ep = base.ep  # expert parallelism: carved out of dp, as megatron does (no extra GPUs)
    if given.get("expert_model_parallel_size") is not None:
        ep = int(given["expert_model_parallel_size"])
    try:
        return replace(base, schedule=schedule, mode=mode, tp=tp, sequence_parallel=sp, ep=ep,
                       **sections)
    except ValueError as e:
        raise ValueError(f"slime flags: {e}") from None
