"""slime's scheduling functions with slime's signatures, on top of the core.

Same inputs, same outputs as slime (SLIME_SEMANTICS §2-4), but a user error
raises ``ValueError`` with a readable message where slime asserts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from varbatch_kit.config import ScheduleConfig
from varbatch_kit.flops import ModelShape
from varbatch_kit.packing import PackInput, first_fit, split_to_target
from varbatch_kit.partition import karmarkar_karp
from varbatch_kit.rollouts import Rollouts
from varbatch_kit.schedule import build_schedule

__all__ = [
    "build_dp_schedule",
    "first_fit_pack",
    "expand_bins_by_splitting",
    "get_seqlen_balanced_partitions",
    "calculate_fwd_flops",
]


def get_seqlen_balanced_partitions(
    seqlen_list: Sequence[float], k_partitions: int, equal_size: bool
) -> list[list[int]]:
    """Karmarkar-Karp partition of item indices into ``k_partitions`` parts."""
    return karmarkar_karp(list(seqlen_list), k_partitions, equal_size)


def first_fit_pack(seq_lens: Sequence[int], max_tokens: int) -> list[list[int]]:
    """First-fit in arrival order under ``max_tokens`` per bin."""
    if max_tokens is None or int(max_tokens) < 1:
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    return first_fit(PackInput(lengths=np.asarray(seq_lens, dtype=np.int64), cap=int(max_tokens)))


def expand_bins_by_splitting(
    bins: Sequence[Sequence[int]], seq_lens: Sequence[int], target: int
) -> list[list[int]]:
    """Split the heaviest multi-sample bins until there are ``target`` bins."""
    return split_to_target([list(b) for b in bins], np.asarray(seq_lens), int(target))


def calculate_fwd_flops(seqlens: Sequence[int], args: Any) -> list[float]:
    """Forward FLOPs per sequence length, model shape read from ``args``."""
    return ModelShape.from_args(args).forward_flops(np.asarray(seqlens)).tolist()


def _config_from(args: Any, tpc: Mapping[str, int], global_batch_size: int) -> ScheduleConfig:
    def need(key: str) -> int:
        if key not in tpc:
            raise ValueError(f"train_parallel_config lacks {key!r}")
        return int(tpc[key])

    dynamic = bool(getattr(args, "use_dynamic_batch_size", False))
    by_flops = bool(getattr(args, "balance_by_flops", False))
    if by_flops and not dynamic:
        raise ValueError("balance_by_flops requires use_dynamic_batch_size")
    sizes: dict[str, Any]
    if dynamic:
        mtpg = getattr(args, "max_tokens_per_gpu", None)
        if mtpg is None:
            raise ValueError("use_dynamic_batch_size needs max_tokens_per_gpu (the token cap)")
        sizes = dict(max_tokens_per_gpu=int(mtpg))
    else:
        sizes = dict(micro_batch_size=int(getattr(args, "micro_batch_size", 1) or 1))
    balance = bool(getattr(args, "balance_data", False)) or by_flops
    return ScheduleConfig(
        dp=need("dp_size"),
        cp=need("cp_size"),
        vpp=int(tpc.get("vpp_size", 1) or 1),
        mb_group=int(tpc.get("microbatch_group_size_per_vp_stage", 1) or 1),
        global_batch_size=global_batch_size,
        packing="flops_kk" if by_flops else ("first_fit" if dynamic else "static"),
        distribution="flops_kk" if balance else "strided",
        **sizes,
    )


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
    """
    config = _config_from(args, train_parallel_config, global_batch_size)
    lengths = np.asarray(total_lengths)
    if lengths.ndim != 1 or lengths.size == 0:
        raise ValueError("total_lengths must be a non-empty list of per-sample token counts")
    if not np.issubdtype(lengths.dtype, np.integer) or (lengths < 1).any():
        raise ValueError(
            f"total_lengths must hold positive integers, got {lengths[:8].tolist()}..."
        )
    if lengths.size != len(rollout_indices):
        raise ValueError(
            f"total_lengths has {lengths.size} entries but rollout_indices has "
            f"{len(rollout_indices)}: pass one rollout index per sample"
        )
    rollouts = Rollouts(
        prompt_len=np.zeros(lengths.size, dtype=np.int64),
        response_len=lengths,
        rollout_id=np.asarray(rollout_indices),
    )
    model = ModelShape.from_args(args) if config.distribution == "flops_kk" else None
    return build_schedule(rollouts, config, model).to_slime()
