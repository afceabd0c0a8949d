"""Expert parallelism: which experts a rank holds, and the whole model's experts gathered back.

megatron-core splits each MoE layer's ``E`` experts over the ``ep`` ranks of an expert-
parallel group (consecutive data-parallel ranks: megatron's order, ``tp-cp-ep-dp-pp``); rank
``r`` of a group holds experts ``r * E/ep ... (r + 1) * E/ep - 1`` as its
``local_experts.0 ... local_experts.{E/ep - 1}``, and the all-to-all token dispatcher sends each
token to the rank that holds its experts. Every expert-parallel group holds every expert once
(the groups are the expert-data-parallel replicas, their gradients all-reduced by megatron's
DDP over the expert-data-parallel group).

:func:`local_experts` gives a rank's experts (the checkpoint's loader reads those);
:func:`gather_all_experts` turns the tensors of one rank (parameters, gradients; names of
its own local experts) into the whole model's under the global expert numbers, on world rank
0 (a collective: every rank calls it), so that saved parameters, gradients and exports are
those of an ``ep = 1`` run.
"""

from __future__ import annotations

import re

import torch

__all__ = ["gather_all_experts", "global_expert_name", "local_experts", "sent_to_rank0"]

_LOCAL = re.compile(r"(\.local_experts\.)(\d+)(\.)")


def local_experts(num_experts: int, layout, world_rank: int) -> list[int]:
    """The checkpoint's expert indices ``world_rank`` holds, in its local order."""
    if num_experts % layout.ep:
        raise ValueError(f"ep={layout.ep} does not divide {num_experts} experts")
    per = num_experts // layout.ep
    first = layout.ep_rank(world_rank) * per
    return list(range(first, first + per))


def global_expert_name(name: str, first: int) -> str:
    """``name`` with its local expert number ``j`` replaced by ``first + j`` (unchanged for a
    parameter outside the experts)."""
    return _LOCAL.sub(lambda m: f"{m.group(1)}{first + int(m.group(2))}{m.group(3)}", name)


def sent_to_rank0(tensors: dict[str, torch.Tensor], layout, world_rank: int,
                  num_experts: int) -> dict[str, torch.Tensor]:
    """What ``world_rank`` contributes when the whole model's tensors are gathered to world
    rank 0 (one pipeline stage's, or all): pool rank 0 / tp rank 0 all of ``tensors`` (its
    experts are experts ``0 .. E/ep - 1``); under expert parallelism the other ranks of the
    first expert-parallel group (tp rank 0) their experts, renamed to the global numbers;
    every other rank nothing."""
    here = layout.coords(world_rank)
    if here.tp_rank != 0 or here.pool_rank >= layout.ep:
        return {}
    if here.pool_rank == 0:
        return tensors
    first = local_experts(num_experts, layout, world_rank)[0]
    return {global_expert_name(n, first): t for n, t in tensors.items() if _LOCAL.search(n)}


def gather_all_experts(tensors: dict[str, torch.Tensor] | None, layout, world_rank: int,
                       num_experts: int) -> dict[str, torch.Tensor] | None:
    """The whole model's tensors on world rank 0 (None elsewhere), from each rank's own
    (``tensors``: names of its local experts, e.g. ``named_parameters``; :func:`sent_to_rank0`
    says who sends what). A collective over the world: every rank calls it (with ``ep == 1``
    it returns ``tensors`` unchanged, no collective)."""
    if layout.ep == 1:
        return tensors
    from varbatch_kit.train.parallel.object_gather import gather_to_rank0

    parts = gather_to_rank0(sent_to_rank0(tensors or {}, layout, world_rank, num_experts))
    return None if parts is None else {k: v for part in parts for k, v in part.items()}
