"""Pipeline parallelism: a run's model split over ``pp`` stages (``vpp`` chunks each), trained
with megatron-core's own 1F1B schedule.

Layout (:class:`~varbatch_kit.train.config.parallel_layout.ParallelLayout`): world rank ``w`` is on
stage
``pp_rank``; every stage holds the same pool of ``dp * cp`` ranks, and pool rank ``r`` trains
the micro-batches of ``step.rank_program(r)`` on every stage, in the schedule's
``microbatch_order``.

- **Layers** (:func:`stage_layers`): ``num_layers`` is cut into ``pp * vpp`` equal chunks;
  chunk ``v`` of stage ``p`` holds the global layers ``(v * pp + p) * L .. + L`` (megatron's
  interleaved numbering, ``L = num_layers / (pp * vpp)``); the embeddings are on the first
  chunk of the first stage, the final norm and the output layer on the last chunk of the last
  stage. With tied embeddings the last stage keeps a copy of the word embeddings as its output
  layer; megatron all-reduces their gradients over the embedding group.
- **Weights** (:func:`build_chunks`): every chunk starts from the dp 1 model's weights: the toy
  GPT is built whole from the seed (exactly as dp 1 builds it) and each chunk takes its
  layers; a Hugging Face checkpoint is read for the stage's layers only
  (:func:`varbatch_kit.train.model.hf_import.megatron_state_dict` ``layers=``).
  :func:`stage_tensors` maps
  the full model's names to a chunk's, :func:`full_name` back (saved parameters compare with
  dp 1's by name).
- **Schedule** (:mod:`varbatch_kit.train.step.pipeline_schedule`): megatron's
  ``forward_backward_pipelining_without_interleaving`` (1F1B) or, with ``vpp > 1``,
  ``..._with_interleaving`` (micro-batches in groups of ``mb_group`` per virtual stage);
  ``variable_seq_lengths=True`` (packed rows of different lengths: p2p sends the shapes
  first) and ``pipeline_dtype=float32``. Losses exist on the last stage only: the report is
  reduced there over its DP group, as slime does, and handed to world rank 0
  (:func:`from_last_stage`).
- **Timing** (:class:`~varbatch_kit.train.step.microbatch_timer.MicroBatchTimer`): every forward and
  backward of every chunk; the rest of the schedule's span is the stage's idle time.

What cannot run is refused before any worker starts: the layout's own rules by
:meth:`~varbatch_kit.train.config.parallel_layout.ParallelLayout.check`, the model's depth
(:func:`~varbatch_kit.train.config.pipeline_checks.pipeline_depth_problem`) by ``plan_runs``.
"""

from __future__ import annotations

import contextlib
import re
from functools import partial

from varbatch_kit.train.config.pipeline_checks import pipeline_depth_problem

__all__ = ["Chunks", "build_chunks", "from_last_stage", "full_name", "gather_full_params",
           "gather_grads", "stage_layers", "stage_tensors"]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


# --------------------------------------------------------------------------- pure parts




def stage_layers(num_layers: int, pp: int, vpp: int, pp_rank: int, vp_stage: int = 0) -> range:
    """The global (0-based) layer indices of chunk ``vp_stage`` of stage ``pp_rank``."""
    problem = pipeline_depth_problem(num_layers=num_layers, pp=pp, vpp=vpp)
    if problem:
        raise ValueError(problem)
    if not (0 <= pp_rank < pp and 0 <= vp_stage < vpp):
        raise ValueError(f"pp_rank={pp_rank}, vp_stage={vp_stage}: give a stage in [0, {pp}) "
                         f"and a chunk in [0, {vpp})")
    per = num_layers // (pp * vpp)
    start = (vp_stage * pp + pp_rank) * per
    return range(start, start + per)


def _chunk_flags(pp: int, vpp: int, pp_rank: int, vp_stage: int) -> tuple[bool, bool]:
    """(holds the embeddings, holds the final norm and output layer)."""
    return pp_rank == 0 and vp_stage == 0, pp_rank == pp - 1 and vp_stage == vpp - 1


def stage_tensors(full: dict, layers: range, *, pre_process: bool, post_process: bool,
                  tied: bool) -> dict:
    """A chunk's parameters (its own names) from the full model's ``full`` (dp 1's names).

    Layer ``i`` of ``layers`` becomes local layer ``i - layers.start``; the embeddings go to
    the first chunk, the final norm and output layer to the last; with ``tied`` embeddings a
    last chunk without the embeddings gets them as its output layer.
    """
    out = {}
    for name, t in full.items():
        m = _LAYER.match(name)
        if m:
            i = int(m.group(1))
            if i in layers:
                out[f"decoder.layers.{i - layers.start}.{name[m.end():]}"] = t
        elif name.startswith("embedding."):
            if pre_process:
                out[name] = t
        elif post_process:
            out[name] = t
    if tied and post_process and not pre_process:
        out["output_layer.weight"] = full["embedding.word_embeddings.weight"]
    return out


def full_name(local: str, layers: range, *, pre_process: bool, tied: bool) -> str | None:
    """The full model's name of a chunk parameter ``local`` (None: the tied output layer's
    copy of the embeddings, which dp 1 does not have as a parameter of its own)."""
    if tied and not pre_process and local == "output_layer.weight":
        return None
    m = _LAYER.match(local)
    if m:
        return f"decoder.layers.{int(m.group(1)) + layers.start}.{local[m.end():]}"
    return local


# --------------------------------------------------------------------------- the model
class Chunks:
    """One rank's model chunks (``GPTModel`` each) and where they sit in the full model."""

    def __init__(self, chunks: list, layers: list[range], flags: list[tuple[bool, bool]],
                 tied: bool):
        import torch

        self.chunks, self.layers, self.flags, self.tied = chunks, layers, flags, tied
        #: the chunks as one module (``named_parameters`` / ``state_dict`` of the stage)
        self.module = torch.nn.ModuleList(chunks)

    def full_params(self) -> dict:
        """This rank's parameters under the full model's names, each gathered over the
        tensor-parallel group to its full tensor (a collective over that group; without TP
        the parameters themselves, detached: read them before the next update)."""
        from varbatch_kit.train.parallel.tensor_parallel import gather_full_parameters

        out = {}
        for chunk, layers, (pre, _post) in zip(self.chunks, self.layers, self.flags):
            for n, t in gather_full_parameters(chunk, copy=False).items():
                name = full_name(n, layers, pre_process=pre, tied=self.tied)
                if name is not None:
                    out[name] = t
        return out

    def full_name_of(self, chunk_index: int, local: str) -> str | None:
        pre = self.flags[chunk_index][0]
        return full_name(local, self.layers[chunk_index], pre_process=pre, tied=self.tied)


@contextlib.contextmanager
def _no_embedding_init_sync():
    """Building a last chunk with tied embeddings: skip megatron's initial all-reduce of the
    duplicate (its ``weight.data.cuda()`` fails on CPU); the loader writes the first stage's
    tensor into both copies instead."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    saved = LanguageModule._is_in_embd_group
    LanguageModule._is_in_embd_group = lambda self: False
    try:
        yield
    finally:
        LanguageModule._is_in_embd_group = saved


def build_chunks(model_spec, layout, world_rank: int, *, max_seq_len: int,
                 per_token_loss: bool = False, precision: str = "fp32") -> Chunks:
    """This rank's model chunks, holding the dp 1 model's weights of their layers.

    ``layout`` (the run's :class:`~varbatch_kit.train.config.parallel_layout.ParallelLayout`,
    checked when it was built; the depth by ``plan_runs``) gives the stages, chunks,
    ``mb_group`` and this rank's tensor-parallel shard. The toy GPT is built whole first, from
    the current torch RNG state (so its weights are those dp 1 builds), and each chunk copies
    its share; a checkpoint's stage layers are read from its files. Needs megatron's parallel
    state for ``layout``.
    """
    import dataclasses

    import torch
    from megatron.core import parallel_state

    from varbatch_kit.train.model.gpt import build_gpt, transformer_config

    pp, vpp = layout.pp, layout.vpp
    n = model_spec.num_layers
    pp_rank = layout.coords(world_rank).pp_rank
    base = transformer_config(model_spec, layout=layout, per_token_loss=per_token_loss,
                              precision=precision)
    mb_group = layout.mb_group
    config = dataclasses.replace(
        base, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        microbatch_group_size_per_vp_stage=max(mb_group, pp) if vpp > 1 else None,
        variable_seq_lengths=True, perform_initialization=layout.tp > 1,  # TP: marks the splits
        # the activations that cross stages: the parameters' dtype (Float16Module's under bf16)
        pipeline_dtype={"bf16": torch.bfloat16, "fp64": torch.float64}.get(precision,
                                                                        torch.float32),
        moe_token_dispatcher_type="alltoall")  # no MoE; its default refuses variable lengths
    full = None
    tied = False
    if model_spec.is_toy:  # the whole model from the seed, as dp 1 builds it (its TP shards)
        whole = build_gpt(model_spec, max_seq_len=max_seq_len, per_token_loss=per_token_loss,
                          layout=layout, world_rank=world_rank)
        full = {k: v.detach().clone() for k, v in whole.named_parameters()}
        del whole
    else:
        tied = bool(model_spec.hf.tie_word_embeddings)
    chunks, ranges, flags = [], [], []
    for v in range(vpp):
        if vpp > 1:
            parallel_state.set_virtual_pipeline_model_parallel_rank(v)
        layers = stage_layers(n, pp, vpp, pp_rank, v)
        pre, post = _chunk_flags(pp, vpp, pp_rank, v)
        with _no_embedding_init_sync():
            chunk = build_gpt(model_spec, max_seq_len=max_seq_len, config=config,
                              stage={"pre_process": pre, "post_process": post,
                                     "vp_stage": v if vpp > 1 else None})
        if full is not None:
            sd = full
        else:
            from varbatch_kit.train.model.hf_import import megatron_state_dict

            experts = None
            if model_spec.is_moe and layout.ep > 1:  # this expert-parallel rank's share
                from varbatch_kit.train.parallel.expert_parallel import local_experts

                experts = local_experts(model_spec.hf.num_experts, layout, world_rank)
            sd = megatron_state_dict(model_spec.hf, n, layers=layers, experts=experts)
        _load(chunk, stage_tensors(sd, layers, pre_process=pre, post_process=post, tied=tied),
              tp_rank=layout.coords(world_rank).tp_rank, tp_size=layout.tp)
        chunk.full_name_of = partial(full_name, layers=layers, pre_process=pre, tied=tied)
        chunks.append(chunk)
        ranges.append(layers)
        flags.append((pre, post))
    if vpp > 1:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    return Chunks(chunks, ranges, flags, tied)


def _load(chunk, tensors: dict, *, tp_rank: int, tp_size: int) -> None:
    import torch

    params = dict(chunk.named_parameters())
    missing, extra = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
    if missing or extra:
        raise RuntimeError(f"pipeline chunk and its weights disagree: parameters without a "
                           f"tensor {missing[:5]}, tensors without a parameter {extra[:5]}")
    from varbatch_kit.train.parallel.tensor_parallel import tp_rank_shard

    with torch.no_grad():
        for name, t in tensors.items():
            p = params[name]
            if tuple(p.shape) != tuple(t.shape):  # a checkpoint's full tensor: this TP shard
                t = tp_rank_shard(t, p, tp_rank=tp_rank, tp_size=tp_size)
            if tuple(p.shape) != tuple(t.shape):
                raise RuntimeError(f"{name}: chunk shape {list(p.shape)}, weights "
                                   f"{list(t.shape)}")
            p.copy_(t.to(device=p.device, dtype=p.dtype))


# --------------------------------------------------------------------------- gathering
def from_last_stage(obj, layout):
    """``obj`` of world rank :attr:`ParallelLayout.last_stage_world_rank` on every rank (a
    collective): the last stage's losses and report, handed to rank 0 which writes the step."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=layout.last_stage_world_rank)
    return box[0]


def _merged_on_rank0(mine: dict) -> dict | None:
    """Every rank's ``name -> tensor`` dict merged on world rank 0 (None elsewhere), the
    tensors sent point to point (:func:`~varbatch_kit.train.parallel.object_gather.
    gather_to_rank0`). A collective of every rank."""
    from varbatch_kit.train.parallel.object_gather import gather_to_rank0

    parts = gather_to_rank0(mine)
    return None if parts is None else {k: v for part in parts for k, v in part.items()}


def gather_full_params(chunks: Chunks, layout, num_experts: int = 0) -> dict | None:
    """Every stage's parameters under the full model's names, on world rank 0 (None
    elsewhere); the stages' pool rank 0 / tp rank 0 copies, and under expert parallelism
    (``num_experts``: the model's) every expert once (a collective)."""
    import torch.distributed as dist

    from varbatch_kit.train.parallel.expert_parallel import sent_to_rank0

    full = chunks.full_params()  # every TP rank of the stage takes part in the gather
    return _merged_on_rank0(sent_to_rank0(full, layout, dist.get_rank(), num_experts))


def gather_grads(grads: dict, layout, num_experts: int = 0) -> dict | None:
    """Every stage's gradients (full model names, :func:`full_name`) on world rank 0."""
    import torch.distributed as dist

    from varbatch_kit.train.parallel.expert_parallel import sent_to_rank0

    return _merged_on_rank0(sent_to_rank0(grads, layout, dist.get_rank(), num_experts))
