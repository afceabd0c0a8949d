"""slime's scheduling functions with slime's signatures, on top of the core.

Same inputs, same outputs as slime's ``seqlen_balancing``, ``flops_utils``
and ``dp_schedule`` modules (``docs/reference_semantics.md``, sections 2-4),
checked against vectors recorded from slime's code. Where slime asserts, these
raise :class:`~varbatch_kit.compat.slime.errors.SlimeCompatError` with slime's
wording first.

:func:`build_dp_schedule` also runs the project's policies: set
``args.varbatch_packing`` (a registered packing, e.g. ``"balanced"``) and/or
``args.varbatch_distribution`` (a registered distribution) on slime's args
namespace (:data:`POLICY_ATTRS`). Absent or ``None`` (the default) is slime's
own schedule, unchanged. :func:`varbatch_kit.compat.slime.install` puts this
function into a slime run.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableSequence, Sequence
from typing import Any

import numpy as np

from varbatch_kit.checks import positive_int
from varbatch_kit.compat.slime.errors import SlimeCompatError, raises_slime_errors
from varbatch_kit.core.build import build_schedule
from varbatch_kit.core.config import ScheduleConfig
from varbatch_kit.core.flops import ModelShape
from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.core.schedule import Schedule
from varbatch_kit.policies.packers import PackInput, first_fit, split_to_target
from varbatch_kit.policies.partition import karmarkar_karp as _kk
from varbatch_kit.policies.partition import karmarkar_karp_reference as _kk_reference
from varbatch_kit.policies.registry import DISTRIBUTIONS, PACKERS, get_distribution, get_packer

__all__ = [
    "POLICY_ATTRS",
    "build_dp_schedule",
    "policy_from_args",
    "to_slime",
    "calculate_fwd_flops",
    "expand_bins_by_splitting",
    "first_fit_pack",
    "get_seqlen_balanced_partitions",
    "karmarkar_karp",
]


def _k_partitions(k: Any) -> int:
    """``k_partitions`` as an int (a whole float accepted, as slime's callers pass)."""
    try:
        return positive_int("k_partitions", k, whole_floats=True)
    except ValueError as e:
        raise SlimeCompatError(str(e)) from None


def _check_partition_args(seqlen_list: Sequence[float], k_partitions: int,
                          equal_size: bool) -> None:
    n = len(seqlen_list)
    _k_partitions(k_partitions)
    if n < k_partitions:
        raise SlimeCompatError(
            f"number of items:[{n}] < k_partitions:[{k_partitions}]: every part needs an item"
        )
    if equal_size and n % k_partitions:
        raise SlimeCompatError(
            f"{n} % {k_partitions} != 0: equal_size needs the item count divisible by "
            "k_partitions"
        )


def karmarkar_karp(seqlen_list: Sequence[float], k_partitions: int,
                   equal_size: bool) -> list[list[int]]:
    """Largest differencing into ``k_partitions`` parts; each part in merge order (unsorted).

    Like slime's raw ``karmarkar_karp`` (before :func:`get_seqlen_balanced_partitions`
    checks the result), fewer items than parts is allowed without ``equal_size``: the
    ``k - n`` surplus parts come back empty, after the ``n`` singletons.
    """
    n = len(seqlen_list)
    k = _k_partitions(k_partitions)
    if n == 0:
        raise SlimeCompatError("seqlen_list is empty: Karmarkar-Karp needs at least one item")
    if equal_size and n % k:
        raise SlimeCompatError(
            f"{n} % {k} != 0: equal_size needs the item count divisible by k_partitions")
    if n < k:
        # k - n parts stay empty: the plain transcription returns the final state as it is
        return _kk_reference(list(seqlen_list), k, False, sort_parts=False, allow_empty=True)
    return _kk(list(seqlen_list), k, equal_size, sort_parts=False)


def get_seqlen_balanced_partitions(seqlen_list: Sequence[float], k_partitions: int,
                                   equal_size: bool) -> list[list[int]]:
    """Karmarkar-Karp partition of item indices; each part sorted ascending."""
    _check_partition_args(seqlen_list, k_partitions, equal_size)
    return _kk(list(seqlen_list), int(k_partitions), equal_size)


@raises_slime_errors
def first_fit_pack(total_lengths: Sequence[int], max_tokens_per_bin: int) -> list[list[int]]:
    """First-fit in arrival order under ``max_tokens_per_bin`` tokens per bin.

    A sample longer than the cap lands alone in a new bin.
    """
    if max_tokens_per_bin is None or int(max_tokens_per_bin) < 1:
        raise SlimeCompatError(
            f"max_tokens_per_bin must be a positive integer, got {max_tokens_per_bin!r}")
    if len(total_lengths) == 0:
        return []
    return first_fit(PackInput(lengths=np.asarray(total_lengths, dtype=np.int64),
                               cap=int(max_tokens_per_bin)))


def expand_bins_by_splitting(bins: MutableSequence[list[int]], target_count: int,
                             lengths: Sequence[int]) -> None:
    """Grow ``bins`` **in place** to ``target_count`` by splitting the largest multi-sample bin.

    Stops early (no error) when only singletons are left, as slime does; the
    caller checks the count.
    """
    target = int(target_count)
    if len(bins) >= target:
        return
    n_split = sum(1 for b in bins if len(b) > 1)
    reachable = len(bins) + sum(len(b) - 1 for b in bins)
    goal = min(target, reachable)
    if n_split and goal > len(bins):
        bins[:] = split_to_target([list(b) for b in bins], np.asarray(lengths), goal)


def calculate_fwd_flops(seqlens: Sequence[int], args: Any) -> float:
    """Total forward FLOPs of all ``seqlens`` (one float), model shape read from ``args``.

    Summed sample by sample (dense layers, MoE layers, LM head), as slime
    accumulates it, so the float is the same to the last bit.
    """
    shape = _shape_from_args(args)
    dense, moe, head = shape.forward_flops_terms(np.asarray(list(seqlens), dtype=np.int64))
    total = 0
    for d, m, h in zip(dense.tolist(), moe.tolist(), head.tolist()):
        total += d
        total += m
        total += h
    return total


@raises_slime_errors
def _shape_from_args(args: Any) -> ModelShape:
    return ModelShape.from_args(args)


#: the attributes of slime's args namespace that pick a varbatch_kit policy (None: slime's own)
POLICY_ATTRS = ("varbatch_packing", "varbatch_distribution")


def _check_policy_name(attr: str, name: Any, table: Mapping[str, Any], kind: str) -> None:
    if not isinstance(name, str) or name not in table:
        raise SlimeCompatError(
            f"args.{attr}={name!r} is not a registered {kind}; choose one of {sorted(table)} "
            f"(or leave {attr} unset / None for slime's own schedule)")


def policy_from_args(args: Any) -> tuple[str | None, str | None]:
    """``(args.varbatch_packing, args.varbatch_distribution)``, each checked; None when unset.

    A name that is not registered (:data:`~varbatch_kit.policies.registry.PACKERS`,
    :data:`~varbatch_kit.policies.registry.DISTRIBUTIONS`) is a
    :class:`SlimeCompatError` listing the registered names.
    """
    packing = getattr(args, "varbatch_packing", None)
    distribution = getattr(args, "varbatch_distribution", None)
    if packing is not None:
        _check_policy_name("varbatch_packing", packing, PACKERS, "packing")
    if distribution is not None:
        _check_policy_name("varbatch_distribution", distribution, DISTRIBUTIONS, "distribution")
    return packing, distribution


def _need_tpc(tpc: Mapping[str, int], key: str) -> int:
    if key not in tpc:
        raise SlimeCompatError(
            f"train_parallel_config lacks {key!r}; it needs dp_size, cp_size, vpp_size and "
            "microbatch_group_size_per_vp_stage")
    return int(tpc[key])


def _layout(tpc: Mapping[str, int], global_batch_size: int) -> dict[str, int]:
    return dict(dp=_need_tpc(tpc, "dp_size"), cp=_need_tpc(tpc, "cp_size"),
                vpp=_need_tpc(tpc, "vpp_size"),
                mb_group=_need_tpc(tpc, "microbatch_group_size_per_vp_stage"),
                global_batch_size=global_batch_size)


def _config_from(args: Any, tpc: Mapping[str, int], global_batch_size: int) -> ScheduleConfig:
    packing, distribution = policy_from_args(args)
    if packing is not None or distribution is not None:
        return _policy_config(args, tpc, global_batch_size, packing, distribution)
    layout = _layout(tpc, global_batch_size)
    dynamic = bool(getattr(args, "use_dynamic_batch_size", False))
    by_flops = bool(getattr(args, "balance_by_flops", False))
    if by_flops and not dynamic:
        raise SlimeCompatError("balance_by_flops requires use_dynamic_batch_size")
    sizes: dict[str, Any]
    if dynamic:
        mtpg = getattr(args, "max_tokens_per_gpu", None)
        if mtpg is None:
            raise SlimeCompatError(
                "max_tokens_per_gpu is None: use_dynamic_batch_size needs the token cap")
        sizes = dict(max_tokens_per_gpu=int(mtpg))
    else:
        mbs = getattr(args, "micro_batch_size", None)
        if mbs is None:
            raise SlimeCompatError(
                "micro_batch_size is None: the static path (use_dynamic_batch_size=False) "
                "needs it")
        sizes = dict(micro_batch_size=int(mbs))
    balance = bool(getattr(args, "balance_data", False)) or by_flops
    return ScheduleConfig(
        **layout,
        packing="flops_kk" if by_flops else ("first_fit" if dynamic else "static"),
        distribution="flops_kk" if balance else "strided",
        **sizes,
    )


def _policy_config(args: Any, tpc: Mapping[str, int], global_batch_size: int,
                   packing: str | None, distribution: str | None) -> ScheduleConfig:
    """The config of a varbatch_kit policy; what is not named comes from slime's flags.

    No ``varbatch_packing``: slime's packing (``flops_kk`` with
    ``balance_by_flops``, ``first_fit`` with ``use_dynamic_batch_size``, else
    ``static``). No ``varbatch_distribution``: the one the packing requires
    (``balanced`` for ``balanced``), else slime's (``flops_kk`` with
    ``balance_data`` or ``balance_by_flops``, else ``strided``). The packing
    reads the size of its own path: ``max_tokens_per_gpu`` for a dynamic
    packing, ``micro_batch_size`` for ``static``.
    """
    layout = _layout(tpc, global_batch_size)
    dynamic = bool(getattr(args, "use_dynamic_batch_size", False))
    by_flops = bool(getattr(args, "balance_by_flops", False))
    if packing is None:
        packing = "flops_kk" if (by_flops and dynamic) else ("first_fit" if dynamic else "static")
    spec = get_packer(packing)
    if distribution is None:
        balance = bool(getattr(args, "balance_data", False)) or by_flops
        distribution = spec.requires_distribution or ("flops_kk" if balance else "strided")
    mbs, mtpg = getattr(args, "micro_batch_size", None), getattr(args, "max_tokens_per_gpu", None)
    if spec.dynamic:
        if mtpg is None:
            raise SlimeCompatError(
                f"max_tokens_per_gpu is None: varbatch_packing={packing!r} packs under the "
                "token cap; set --max-tokens-per-gpu (with --use-dynamic-batch-size)")
        sizes = dict(max_tokens_per_gpu=int(mtpg))
    else:
        if mbs is None:
            raise SlimeCompatError(
                f"micro_batch_size is None: varbatch_packing={packing!r} cuts fixed-size "
                "micro-batches; set --micro-batch-size")
        sizes = dict(micro_batch_size=int(mbs))
    return ScheduleConfig(**layout, packing=packing, distribution=distribution, **sizes)


def _needs_model(config: ScheduleConfig) -> bool:
    return (get_packer(config.packing).needs_flops
            or get_distribution(config.distribution).needs_flops)


def _precheck(rollout_indices: Sequence[int], global_batch_size: int) -> None:
    """slime's first check, with slime's wording; the per-step checks follow in the core.

    The core checks each step in order (too few samples for ``dp_size``, then the
    alignment), as slime does, so the first failing step decides the error.
    """
    num_rollouts = len(dict.fromkeys(rollout_indices))
    if num_rollouts // global_batch_size < 1:
        raise SlimeCompatError(
            f"num_rollouts ({num_rollouts}) < global_batch_size ({global_batch_size}); need at "
            f"least one rollout per step: use global_batch_size <= {num_rollouts}"
        )


@raises_slime_errors
def build_dp_schedule(
    args: Any,
    train_parallel_config: Mapping[str, int],
    total_lengths: Sequence[int],
    *,
    global_batch_size: int,
    rollout_indices: Sequence[int],
):
    """slime's ``(partitions, micro_batch_indices, num_microbatches, global_batch_sizes)``.

    ``partitions[r]`` lists rank r's global sample indices, micro-batch
    after micro-batch, over all steps; ``micro_batch_indices[r]`` gives each
    micro-batch's positions inside ``partitions[r]``.

    ``args.varbatch_packing`` / ``args.varbatch_distribution`` (:data:`POLICY_ATTRS`),
    when set, name a registered varbatch_kit policy (:func:`policy_from_args`); unset, the
    schedule is slime's own.
    """
    config = _config_from(args, train_parallel_config, global_batch_size)
    lengths = np.asarray(total_lengths)
    if lengths.ndim != 1 or lengths.size == 0:
        raise SlimeCompatError(
            "total_lengths must be a non-empty list of per-sample token counts")
    if not np.issubdtype(lengths.dtype, np.integer) or (lengths < 1).any():
        raise SlimeCompatError(
            f"total_lengths must hold positive integers, got {lengths[:8].tolist()}...")
    if lengths.size != len(rollout_indices):
        raise SlimeCompatError(
            f"total_lengths has {lengths.size} entries but rollout_indices has "
            f"{len(rollout_indices)}: pass one rollout index per sample"
        )
    _precheck(rollout_indices, int(global_batch_size))
    rollouts = Rollouts(
        prompt_len=np.zeros(lengths.size, dtype=np.int64),
        response_len=lengths,
        rollout_id=np.asarray(rollout_indices),
    )
    model = _shape_from_args(args) if _needs_model(config) else None
    return to_slime(build_schedule(rollouts, config, model))


def to_slime(schedule: Schedule) -> tuple[list, list, list, list]:
    """slime's ``(partitions, micro_batch_indices, num_microbatches, global_batch_sizes)``.

    The 4-tuple ``build_dp_schedule`` returns, for any :class:`~varbatch_kit.Schedule`
    (also one built with a packing slime does not have).
    """
    return tuple(schedule.rank_layout())
