"""Tensor parallelism: which models split over ``tp`` ranks, and how a full tensor maps to a
rank's shard and back.

megatron-core's column- and row-parallel layers (the local spec's
``ColumnParallelLinear`` / ``RowParallelLinear``, ``VocabParallelEmbedding`` and the
column-parallel output layer) mark each split parameter with
``tensor_model_parallel=True``, its ``partition_dim`` and its ``partition_stride``.
A full (tp 1) tensor of ``n`` rows along ``partition_dim`` is cut into
``tp * stride`` equal contiguous pieces and TP rank ``r`` holds pieces
``r, r + tp, r + 2 tp, ...`` concatenated: exactly what megatron's
``use_cpu_initialization`` does with the master weight it draws
(``_initialize_affine_weight_cpu``), so the toy GPT's initial weights equal
tp 1's. That rule covers every split here:

- ``linear_qkv`` (stride 1): the fused rows are grouped by KV group (the
  group's query heads, its key, its value), so contiguous pieces are whole
  query groups;
- ``linear_fc1`` of a SwiGLU MLP (stride 2): ``[gate; up]`` becomes
  ``[gate_r; up_r]`` on rank ``r``;
- ``linear_proj`` / ``linear_fc2`` (row-parallel): the input dimension (``partition_dim=1``);
- the word embeddings and the output layer: contiguous vocab ranges.

:func:`shard_of` takes a rank's shard of a full tensor (:func:`tp_rank_shard`: this
rank's, for a given parameter; the Hugging Face loader uses it),
:func:`full_from_shards` puts the shards back together, and
:func:`gather_full_parameters` (a collective over the TP group) gives every parameter of a
model as its full tensor under tp 1's name (saved parameters and gradients; a pipeline
stage's caller gathers its own stage). :func:`tp_split_problems` /
:func:`check_tp_split` refuse, before any worker starts, a model whose heads, query
groups, FFN width or vocabulary ``tp`` does not divide. :func:`vocab_shard` tells the
log-prob code which vocab columns this rank's logits hold. Importing this module
imports neither torch nor megatron-core.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported when a function runs (planning a run needs none)
    import torch

__all__ = ["check_tp_split", "full_from_shards", "full_numel", "full_parameter_count",
           "gather_full_parameters", "shard_of", "tp_rank_shard", "tp_split_problems",
           "vocab_shard"]


# --------------------------------------------------------------------------- what splits
def tp_split_problems(model, tp: int) -> list[str]:
    """Why ``model`` (a :class:`~varbatch_kit.train.config.model_config.ResolvedModel`) cannot be
    split
    over ``tp`` tensor-parallel ranks, one line per reason (empty: it can)."""
    if tp == 1:
        return []
    sizes = {"num_attention_heads": model.num_attention_heads,
             "num_query_groups": (model.num_attention_heads if model.hf is None
                                  else model.hf.num_query_groups),
             "ffn_hidden_size": model.ffn_hidden_size, "vocab_size": model.vocab_size}
    bad = {k: v for k, v in sizes.items() if v % tp}
    if not bad:
        return []
    works = [t for t in range(2, 65) if all(v % t == 0 for v in sizes.values())]
    name = "the toy GPT" if model.hf is None else model.hf.name
    what = ", ".join(f"{k}={v}" for k, v in bad.items())
    fix = (f"use tp=1 or a tp dividing all of {sorted(set(sizes.values()))} "
           f"({', '.join(map(str, [1, *works]))})")
    return [f"tp={tp}: {name} cannot be split over {tp} tensor-parallel ranks: {what} "
            f"{'is' if len(bad) == 1 else 'are'} not divisible by {tp}; {fix}"]


def check_tp_split(model, tp: int) -> None:
    """Raise the ValueError of :func:`tp_split_problems`, if any."""
    for problem in tp_split_problems(model, tp):
        raise ValueError(problem)


# --------------------------------------------------------------------------- shards
def _split_attrs(param) -> tuple[int, int] | None:
    """``(partition_dim, stride)`` of a tensor-parallel parameter, None for a replicated one."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    return int(param.partition_dim), int(getattr(param, "partition_stride", 1))


def shard_of(full: torch.Tensor, *, rank: int, size: int, dim: int, stride: int = 1
             ) -> torch.Tensor:
    """TP rank ``rank``'s shard (of ``size``) of the full tensor ``full``, split along ``dim``
    with megatron's ``stride`` (see the module docstring)."""
    import torch

    n = full.shape[dim]
    if n % (size * stride):
        raise ValueError(f"a tensor of {n} rows along dim {dim} cannot be split into "
                         f"{size} x stride {stride} equal pieces")
    pieces = torch.split(full, n // (size * stride), dim=dim)
    return torch.cat(pieces[rank::size], dim=dim)


def tp_rank_shard(full: torch.Tensor, param, *, tp_rank: int, tp_size: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s shard (of ``tp_size``: the run's layout) of ``full`` for ``param``
    (by its split attributes); ``full`` itself for a replicated parameter or at tp 1."""
    attrs = _split_attrs(param)
    if attrs is None or tp_size == 1:
        return full
    dim, stride = attrs
    return shard_of(full, rank=tp_rank, size=tp_size, dim=dim, stride=stride)


def full_from_shards(shards: list[torch.Tensor], *, dim: int, stride: int = 1) -> torch.Tensor:
    """The full tensor from every TP rank's shard (rank order): :func:`shard_of` inverted."""
    import torch

    size = len(shards)
    per = [s.chunk(stride, dim=dim) for s in shards]  # per[r][k] = piece r + k * size
    return torch.cat([per[r][k] for k in range(stride) for r in range(size)], dim=dim)


def gather_full_parameters(module, tensors: Mapping[str, torch.Tensor] | None = None,
                           group=None, *, copy: bool = True) -> dict[str, torch.Tensor]:
    """Every parameter of ``module`` as its full (tp 1) CPU tensor, by tp 1's name.

    ``tensors`` (name -> a tensor shaped like that parameter's shard, e.g. its gradient):
    gather those instead of the parameters. A collective: every rank of the TP ``group``
    (default: megatron's tensor-parallel group) calls it with the same names. Without
    tensor parallelism it is a plain copy; ``copy=False``: a CPU tensor that is not split
    comes back as itself, detached (for a caller that only reads it before the next update,
    e.g. to save it: no copy of every parameter, hundreds of MB on a float64 SmolLM2).
    """
    import torch
    import torch.distributed as dist

    params = dict(module.named_parameters())
    values = {n: p.detach() for n, p in params.items()} if tensors is None else dict(tensors)
    if group is None and dist.is_initialized():
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            group = parallel_state.get_tensor_model_parallel_group()
    size = 1 if group is None else dist.get_world_size(group)
    out = {}
    for name, value in values.items():
        value = value.detach()
        attrs = _split_attrs(params[name])
        if size == 1 or attrs is None:
            out[name] = value.cpu().clone() if copy or value.device.type != "cpu" else value
            continue
        dim, stride = attrs
        shards = [torch.empty_like(value) for _ in range(size)]
        dist.all_gather(shards, value.contiguous(), group=group)
        out[name] = full_from_shards([s.cpu() for s in shards], dim=dim, stride=stride)
    return out


def full_numel(param, tp_size: int = 1) -> int:
    """``param``'s elements at tp 1: a split parameter counts ``tp_size`` times its shard."""
    return param.numel() * (tp_size if _split_attrs(param) else 1)


def full_parameter_count(module, tp_size: int = 1) -> int:
    """The parameters of ``module`` counted at tp 1 (a split parameter counts ``tp_size`` times
    its shard); no communication."""
    return sum(full_numel(p, tp_size) for p in module.parameters())


def vocab_shard(logits: torch.Tensor, *, tp_rank: int = 0, tp_size: int = 1) -> dict:
    """``{"tp_group": ..., "vocab_start": ...}`` of TP rank ``tp_rank``'s vocab-parallel
    ``logits`` (``[..., V / tp_size]``, megatron's contiguous vocab ranges; rank and size from
    the run's layout) for
    :func:`~varbatch_kit.train.step.packed_batch.response_token_stats`; ``tp_group=None`` at
    tp 1. The group is megatron's tensor-parallel process group (a communicator: its size is
    the layout's)."""
    if tp_size == 1:
        return {"tp_group": None, "vocab_start": 0}
    from megatron.core import parallel_state

    return {"tp_group": parallel_state.get_tensor_model_parallel_group(),
            "vocab_start": tp_rank * int(logits.shape[-1])}
