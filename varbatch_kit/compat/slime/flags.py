"""slime's command-line flags → :class:`~varbatch_kit.ScheduleConfig`.

slime's flags map onto the config's two knobs, ``packing`` (how a step
becomes micro-batches) and ``distribution`` (how micro-batches go to DP
ranks):

========================================  ===========  ============
slime flags                               packing      distribution
========================================  ===========  ============
(none)                                    static       strided
--balance-data                            static       flops_kk
--use-dynamic-batch-size                  first_fit    strided
--use-dynamic-batch-size --balance-data   first_fit    flops_kk
--use-dynamic-batch-size                  flops_kk     flops_kk
--balance-by-flops
========================================  ===========  ============

:func:`schedule_config_from_slime_args` accepts a command-line string, a
list of arguments (``sys.argv``-style) or a namespace with slime's attribute
names. Strings and lists are parsed strictly: a bad value or an abbreviated
flag is a ``ValueError`` naming the flag; flags that do not affect the
schedule are ignored with one warning listing them. The parser is
:func:`parse_flag_table` over a known-flag table (:data:`SCHEDULE_FLAG_TABLE`);
:mod:`.train_flags` parses its own flags and these in the same single pass, so
a training command line is warned about once.

**The global batch size from the rollout settings.** slime derives
``--global-batch-size`` when ``--num-steps-per-rollout`` is given:
``rollout_batch_size * n_samples_per_prompt // num_steps_per_rollout`` (a
given ``--global-batch-size`` must equal it; ``--n-samples-per-prompt``
defaults to 1, ``--rollout-batch-size`` is required). The product is the
number of rollouts one rollout step generates (prompts times responses per
prompt), so the derived value counts rollouts per training step, which is
what this toolkit's ``global_batch_size`` counts (a compact rollout of several
samples is one of them; ``docs/reference_semantics.md`` section 1).
:func:`derive_global_batch_size` does this; without
``--num-steps-per-rollout`` the two rollout flags do not affect the schedule.

Also mapped: ``--pipeline-model-parallel-size`` → ``pp`` (what
``microbatch_order`` optimises for and the simulator's default) and, with
``--use-dynamic-batch-size``, ``--log-probs-max-tokens-per-gpu`` →
``log_probs_max_tokens_per_gpu`` (slime sets it to ``--max-tokens-per-gpu``
when unset, and reads it only on the dynamic path).
"""

from __future__ import annotations

import argparse
import difflib
import shlex
import warnings
from collections.abc import Sequence
from typing import Any

from varbatch_kit.core.config import ScheduleConfig, batching_fields

__all__ = ["ROLLOUT_SIZE_FLAG_TABLE", "SCHEDULE_DESTS", "SCHEDULE_FLAG_TABLE", "SLIME_FLAGS",
           "SLIME_SCHEDULE_FLAGS", "derive_global_batch_size", "flag_dest", "parse_flag_table",
           "parse_slime_flags", "positive_int", "schedule_config_from_slime_args"]

#: slime's command-line flags for each (packing, distribution) pair it offers
SLIME_FLAGS = {
    ("static", "strided"): "(default)",
    ("static", "flops_kk"): "--balance-data",
    ("first_fit", "strided"): "--use-dynamic-batch-size",
    ("first_fit", "flops_kk"): "--use-dynamic-batch-size --balance-data",
    ("flops_kk", "flops_kk"): "--use-dynamic-batch-size --balance-by-flops",
}

#: the integer flags that shape the schedule
_INT_FLAGS = (
    "--global-batch-size", "--micro-batch-size", "--max-tokens-per-gpu",
    "--context-parallel-size", "--tensor-model-parallel-size",
    "--pipeline-model-parallel-size", "--virtual-pipeline-model-parallel-size",
    "--microbatch-group-size-per-vp-stage", "--actor-num-nodes", "--actor-num-gpus-per-node",
    "--dp-size", "--log-probs-max-tokens-per-gpu",
)
_BOOL_FLAGS = ("--use-dynamic-batch-size", "--balance-data", "--balance-by-flops")
_ALIASES = {"--microbatch-group-size-per-virtual-pipeline-stage":
            "microbatch_group_size_per_vp_stage"}
#: every flag :func:`parse_slime_flags` reads
SLIME_SCHEDULE_FLAGS: tuple[str, ...] = _INT_FLAGS + tuple(_ALIASES) + _BOOL_FLAGS


class _StrictParser(argparse.ArgumentParser):
    """An ArgumentParser that raises ``ValueError`` instead of printing usage and exiting."""

    def error(self, message: str):  # argparse calls this for every parse error
        raise ValueError(f"slime flags: {message}")


def positive_int(text: str) -> int:
    """argparse type of a positive whole number (its error names the flag through argparse)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {value}")
    return value


#: the known-flag table of the schedule: (flag, argparse keyword arguments), one row a flag
SCHEDULE_FLAG_TABLE: tuple[tuple[str, dict[str, Any]], ...] = (
    tuple((flag, {"type": positive_int}) for flag in _INT_FLAGS)
    + tuple((flag, {"type": positive_int, "dest": dest}) for flag, dest in _ALIASES.items())
    + tuple((flag, {"action": "store_true"}) for flag in _BOOL_FLAGS)
)


def flag_dest(flag: str, kwargs: dict[str, Any]) -> str:
    """The attribute a table row sets (argparse's ``dest``: ``--eps-clip`` -> ``eps_clip``)."""
    return kwargs.get("dest", flag.lstrip("-").replace("-", "_"))


#: the rollout settings slime derives ``--global-batch-size`` from (with
#: ``--num-steps-per-rollout``); kept apart from :data:`SCHEDULE_FLAG_TABLE` because the
#: training flags (:mod:`.train_flags`) map the same three onto ``DataConfig`` in one table
ROLLOUT_SIZE_FLAG_TABLE: tuple[tuple[str, dict[str, Any]], ...] = tuple(
    (flag, {"type": positive_int})
    for flag in ("--rollout-batch-size", "--n-samples-per-prompt", "--num-steps-per-rollout"))

#: the namespace attributes the schedule reads
SCHEDULE_DESTS: tuple[str, ...] = tuple(flag_dest(f, kw) for f, kw in SCHEDULE_FLAG_TABLE)


def _tokens(argv: str | Sequence[str]) -> list[str]:
    if isinstance(argv, str):
        return shlex.split(argv)
    if isinstance(argv, Sequence) and all(isinstance(t, str) for t in argv):
        return list(argv)
    raise ValueError(
        f"slime args must be a command-line string, a list of strings or a namespace, got "
        f"{type(argv).__name__}")


#: how alike (difflib's ratio) an ignored flag and a flag of the table must be for the warning
#: to suggest it: typos measure 0.93 and up, slime's own other flags at most 0.86
TYPO_SIMILARITY = 0.9


def parse_flag_table(argv: str | Sequence[str], table: Sequence[tuple[str, dict[str, Any]]], *,
                     ignored_because: str, given_only: bool = False,
                     stacklevel: int = 2) -> argparse.Namespace:
    """Parse the flags of ``table`` out of a slime command line, strictly; the one parser.

    ``table`` rows are ``(flag, argparse keyword arguments)``. A bad value or an
    abbreviated flag (a prefix of a flag of the table) is a ``ValueError`` naming
    the flag; every other flag is ignored, and ONE warning lists them all
    ("slime flags that {ignored_because} were ignored: ..."), a near miss of a flag of
    the table with the flag it resembles ("--balanse-data (did you mean
    --balance-data?)", similarity at least :data:`TYPO_SIMILARITY`). With
    ``given_only`` the namespace holds only the flags given (no defaults).
    ``stacklevel`` is the warning's, counted from the caller of this function.
    """
    tokens = _tokens(argv)
    p = _StrictParser(prog="slime", add_help=False, allow_abbrev=False,
                      argument_default=argparse.SUPPRESS if given_only else None)
    for flag, kwargs in table:
        p.add_argument(flag, **kwargs)
    known = [flag for flag, _ in table]
    ns, unknown = p.parse_known_args(tokens)
    ignored = []
    for tok in unknown:
        if not tok.startswith("--"):
            continue  # the value of an ignored flag
        name = tok.split("=", 1)[0]
        prefixed = [f for f in known if f.startswith(name) and f != name]
        if prefixed:
            raise ValueError(
                f"slime flag {name!r} is not a flag; abbreviations are not accepted: did you "
                f"mean {' or '.join(prefixed)}?")
        # a near miss of a flag the table reads (a typo: --balanse-data) says which; slime's
        # other flags sit further from them (--expert-model-parallel-size: 0.86 of the
        # closest, --rollout-num-gpus-per-node: 0.81)
        near = difflib.get_close_matches(name, known, n=1, cutoff=TYPO_SIMILARITY)
        ignored.append(f"{name} (did you mean {near[0]}?)" if near else name)
    if ignored:
        warnings.warn(f"slime flags that {ignored_because} were ignored: {', '.join(ignored)}",
                      stacklevel=stacklevel + 1)
    return ns


def parse_slime_flags(argv: str | Sequence[str]) -> argparse.Namespace:
    """Parse the scheduling flags of a slime command line (a string or a list of arguments).

    Raises ``ValueError`` naming the flag for a bad value or an abbreviated
    flag (``--balance-dat``); warns once, listing them, about flags that do
    not affect the schedule.
    """
    return parse_flag_table(argv, SCHEDULE_FLAG_TABLE + ROLLOUT_SIZE_FLAG_TABLE,
                            ignored_because="do not affect the schedule", stacklevel=3)


def derive_global_batch_size(global_batch_size: int | None, *,
                             rollout_batch_size: int | None = None,
                             n_samples_per_prompt: int | None = None,
                             num_steps_per_rollout: int | None = None) -> int | None:
    """The global batch size slime trains with, in rollouts per step.

    With ``num_steps_per_rollout``: ``rollout_batch_size * n_samples_per_prompt
    // num_steps_per_rollout`` (``n_samples_per_prompt`` None is slime's default
    1), which a given ``global_batch_size`` must equal, as slime asserts.
    Without it: ``global_batch_size`` as given (None when not given). A missing
    ``--rollout-batch-size``, a mismatch or a derived size of 0 is a
    ``ValueError`` naming the flags.
    """
    if num_steps_per_rollout is None:
        return global_batch_size
    if rollout_batch_size is None:
        raise ValueError("--num-steps-per-rollout needs --rollout-batch-size (prompts per "
                         "rollout step): slime derives the global batch size as "
                         "rollout_batch_size * n_samples_per_prompt // num_steps_per_rollout")
    n = 1 if n_samples_per_prompt is None else int(n_samples_per_prompt)
    derived = int(rollout_batch_size) * n // int(num_steps_per_rollout)
    formula = (f"--rollout-batch-size {rollout_batch_size} * --n-samples-per-prompt {n} "
               f"// --num-steps-per-rollout {num_steps_per_rollout}")
    if derived < 1:
        raise ValueError(f"{formula} = {derived}: a step needs at least one rollout; give fewer "
                         "steps per rollout")
    if global_batch_size is not None and int(global_batch_size) != derived:
        raise ValueError(f"--global-batch-size {global_batch_size} is not {formula} = {derived} "
                         "(slime refuses this too): drop one of them")
    return derived


def schedule_config_from_slime_args(args: Any, *, dp: int | None = None) -> ScheduleConfig:
    """Map slime's command-line flags onto a :class:`ScheduleConfig`.

    ``args`` is a command-line string such as ``"--global-batch-size 64
    --use-dynamic-batch-size --max-tokens-per-gpu 16384"``, a list of
    arguments, or an ``argparse.Namespace`` (any object with slime's attribute
    names). ``dp`` defaults to ``--dp-size`` or to ``actor_num_nodes *
    actor_num_gpus_per_node / (tensor * pipeline * context parallel size)``.
    ``--global-batch-size`` may be left to ``--num-steps-per-rollout`` with
    ``--rollout-batch-size`` (and ``--n-samples-per-prompt``), as slime
    derives it (:func:`derive_global_batch_size`).
    """
    if isinstance(args, (str, list, tuple)):
        args = parse_slime_flags(args)

    def get(name: str, default: Any = None) -> Any:
        v = getattr(args, name, default)
        return default if v is None else v

    gbs = derive_global_batch_size(get("global_batch_size"),
                                   rollout_batch_size=get("rollout_batch_size"),
                                   n_samples_per_prompt=get("n_samples_per_prompt"),
                                   num_steps_per_rollout=get("num_steps_per_rollout"))
    if gbs is None:
        raise ValueError("slime args lack --global-batch-size (rollouts per step), or "
                         "--num-steps-per-rollout with --rollout-batch-size to derive it")
    cp = int(get("context_parallel_size", 1))
    if dp is None:
        if get("dp_size") is not None:
            dp = int(get("dp_size"))
        else:
            world = int(get("actor_num_nodes", 1)) * int(get("actor_num_gpus_per_node", 1))
            per_replica = int(get("tensor_model_parallel_size", 1)) * int(
                get("pipeline_model_parallel_size", 1)) * cp
            if world % per_replica:
                raise ValueError(
                    f"{world} GPUs (actor_num_nodes*actor_num_gpus_per_node) are not "
                    f"divisible by tp*pp*cp = {per_replica}"
                )
            dp = world // per_replica
    dynamic = bool(get("use_dynamic_batch_size", False))
    by_flops = bool(get("balance_by_flops", False))
    if by_flops and not dynamic:
        raise ValueError("--balance-by-flops requires --use-dynamic-batch-size")
    balance = bool(get("balance_data", False)) or by_flops
    # the flag picks the packing; batching_fields (core.config) keeps that path's size
    packing = "flops_kk" if by_flops else ("first_fit" if dynamic else "static")
    if dynamic and get("max_tokens_per_gpu") is None:
        raise ValueError("--use-dynamic-batch-size needs --max-tokens-per-gpu (the token cap)")
    mbs, mtpg = get("micro_batch_size", 1), get("max_tokens_per_gpu")
    sizes = batching_fields(micro_batch_size=None if mbs is None else int(mbs),
                            max_tokens_per_gpu=None if mtpg is None else int(mtpg),
                            packing=packing)
    if dynamic and get("log_probs_max_tokens_per_gpu") is not None:  # read on this path only
        sizes["log_probs_max_tokens_per_gpu"] = int(get("log_probs_max_tokens_per_gpu"))
    return ScheduleConfig(
        dp=int(dp),
        cp=cp,
        vpp=int(get("virtual_pipeline_model_parallel_size", 1)),
        mb_group=int(get("microbatch_group_size_per_vp_stage")
                     or get("pipeline_model_parallel_size", 1)),
        global_batch_size=int(gbs),
        pp=int(get("pipeline_model_parallel_size", 1)),
        packing=packing,
        distribution="flops_kk" if balance else "strided",
        **sizes,
    )
