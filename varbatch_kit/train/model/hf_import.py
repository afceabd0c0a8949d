"""Hugging Face checkpoints in megatron-core: read, validate, map the weights.

A local checkpoint directory (``config.json`` plus ``*.safetensors``) of the
Llama, Qwen2, Qwen3, Mistral, Qwen3-MoE or Mixtral family becomes a megatron-core ``GPTModel``
with the local (non-TransformerEngine) layer spec that computes the same
function as ``transformers``' own model (the tests compare logits):

- ``embed_tokens`` -> ``embedding.word_embeddings`` (no position embedding: rope);
- ``input_layernorm`` -> ``decoder.layers.i.input_layernorm`` (``torch.nn.RMSNorm``);
- ``q_proj``, ``k_proj``, ``v_proj`` (and their biases, Qwen2) ->
  ``self_attention.linear_qkv``, fused by query group: for each KV group, the
  group's query heads, then its key head, then its value head;
- ``q_norm``, ``k_norm`` (Qwen3) -> ``self_attention.q_layernorm``, ``k_layernorm``;
- ``o_proj`` -> ``self_attention.linear_proj``;
- ``post_attention_layernorm`` -> ``decoder.layers.i.pre_mlp_layernorm``;
- ``gate_proj``, ``up_proj`` -> ``mlp.linear_fc1`` = ``[gate; up]``
  (SwiGLU: ``silu(gate) * up``); ``down_proj`` -> ``mlp.linear_fc2``;
- a mixture of experts: the router (Qwen3-MoE's ``mlp.gate``, Mixtral's
  ``block_sparse_moe.gate``) -> ``mlp.router``, expert ``e``'s gate / up / down
  projections (``gate_proj`` / ``up_proj`` / ``down_proj``; Mixtral's ``w1`` / ``w3`` /
  ``w2``) -> ``mlp.experts.local_experts.e.linear_fc1`` = ``[gate; up]`` / ``linear_fc2``;
- ``norm`` -> ``decoder.final_layernorm``;
- ``lm_head`` -> ``output_layer`` (absent when the embeddings are tied).

The local spec keeps the pre-attention and pre-MLP norms as modules of their
own (``input_layernorm``, ``pre_mlp_layernorm``); TransformerEngine's spec
fuses them into ``linear_qkv.layer_norm_weight`` and
``linear_fc1.layer_norm_weight`` (only the sharded checkpoint keys say so).

Rotary embeddings at the per-sample ``position_ids`` are :mod:`~varbatch_kit.train.model.rope`'s.

Under tensor parallelism every TP rank reads the full tensors and keeps its
shard (:mod:`~varbatch_kit.train.parallel.tensor_parallel`): the fused QKV rows by whole query
groups,
``linear_fc1`` as ``[gate_r; up_r]``, the input dimension of ``linear_proj``
and ``linear_fc2``, and contiguous vocab ranges of the embeddings and ``lm_head``.

This module imports only the standard library at import time (reading and
validating a checkpoint needs neither torch nor safetensors); building and
loading import torch, megatron-core and ``safetensors`` when called.
"""

from __future__ import annotations

from typing import Any

from varbatch_kit.train.config.hf_checkpoint import HFModelSpec, hf_tensor_names

__all__ = ["load_hf_weights", "megatron_state_dict"]


def _load_tensors(spec: HFModelSpec, names: list[str]) -> dict[str, Any]:
    """The named tensors as float32 CPU tensors (safetensors reads only those)."""
    try:
        from safetensors import safe_open
    except ImportError:
        raise ImportError(
            "loading a Hugging Face checkpoint needs the safetensors package: "
            "pip install safetensors (or pip install 'varbatch_kit[train]')") from None
    import torch

    by_file: dict[str, list[str]] = {}
    for n in names:
        by_file.setdefault(spec.tensors[n][0], []).append(n)
    out = {}
    for file, members in by_file.items():
        with safe_open(str(spec.path / file), framework="pt", device="cpu") as f:
            for n in members:
                out[n] = f.get_tensor(n).to(torch.float32)
    return out


def _fused_qkv(q, k, v, groups: int):
    """megatron's ``linear_qkv`` rows: for each KV group its query heads, its key, its value."""
    import torch

    qg = q.reshape(groups, -1, *q.shape[1:])  # [g, heads_per_group * d, ...]
    kg = k.reshape(groups, -1, *k.shape[1:])  # [g, d, ...]
    vg = v.reshape(groups, -1, *v.shape[1:])
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *q.shape[1:])


def megatron_state_dict(spec: HFModelSpec, num_layers: int | None = None, *,
                        layers=None, experts=None) -> dict[str, Any]:
    """The megatron-core (local spec) parameters of the first ``num_layers`` layers, float32.

    Keys are ``GPTModel.named_parameters()`` names; see the module docstring for the mapping.
    ``layers`` (global layer indices, default all ``num_layers``): read and map only these
    layers (a pipeline stage's, :mod:`varbatch_kit.train.model.pipeline_stages`), keeping their
    global
    numbers in the keys; the embeddings, final norm and output layer always come.
    ``experts`` (a mixture of experts; default all): the checkpoint's expert indices this rank
    holds, in its local order (an expert-parallel rank's ``local_experts.{j}`` is expert
    ``experts[j]``).
    """
    import torch

    n = spec.num_layers if num_layers is None else int(num_layers)
    if not 1 <= n <= spec.num_layers:
        raise ValueError(f"num_layers={n}: the checkpoint has {spec.num_layers} layers")
    keep = range(n) if layers is None else sorted(int(i) for i in layers)
    if any(not 0 <= i < n for i in keep):
        raise ValueError(f"layers={list(keep)}: give layer indices in [0, {n})")
    p, g = spec.prefix, spec.num_query_groups
    skip = tuple(f"{p}layers.{i}." for i in set(range(n)) - set(keep))
    hf = _load_tensors(spec, [t for t in hf_tensor_names(spec, n) if not t.startswith(skip)])
    sd = {
        "embedding.word_embeddings.weight": hf[f"{p}embed_tokens.weight"],
        "decoder.final_layernorm.weight": hf[f"{p}norm.weight"],
    }
    if not spec.tie_word_embeddings:
        sd["output_layer.weight"] = hf["lm_head.weight"]
    for i in keep:
        src, dst = f"{p}layers.{i}.", f"decoder.layers.{i}."
        att = src + "self_attn."
        sd[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        sd[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        sd[dst + "self_attention.linear_qkv.weight"] = _fused_qkv(
            hf[att + "q_proj.weight"], hf[att + "k_proj.weight"], hf[att + "v_proj.weight"], g)
        if spec.qkv_bias:
            sd[dst + "self_attention.linear_qkv.bias"] = _fused_qkv(
                hf[att + "q_proj.bias"], hf[att + "k_proj.bias"], hf[att + "v_proj.bias"], g)
        if spec.qk_norm:
            sd[dst + "self_attention.q_layernorm.weight"] = hf[att + "q_norm.weight"]
            sd[dst + "self_attention.k_layernorm.weight"] = hf[att + "k_norm.weight"]
        sd[dst + "self_attention.linear_proj.weight"] = hf[att + "o_proj.weight"]
        if spec.is_moe:  # the router, then each expert as a SwiGLU MLP of its own
            sd[dst + "mlp.router.weight"] = hf[spec.moe_tensor(i, "router")]
            for j, e in enumerate(range(spec.num_experts) if experts is None else experts):
                into = f"{dst}mlp.experts.local_experts.{j}."
                sd[into + "linear_fc1.weight"] = torch.cat(
                    [hf[spec.moe_tensor(i, "gate", e)], hf[spec.moe_tensor(i, "up", e)]], dim=0)
                sd[into + "linear_fc2.weight"] = hf[spec.moe_tensor(i, "down", e)]
            continue
        sd[dst + "mlp.linear_fc1.weight"] = torch.cat(
            [hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]], dim=0)
        sd[dst + "mlp.linear_fc2.weight"] = hf[src + "mlp.down_proj.weight"]
    return sd


def load_hf_weights(gpt, spec: HFModelSpec, num_layers: int | None = None, *, tp_rank: int = 0,
                    tp_size: int = 1, experts=None) -> None:
    """Copy the checkpoint's weights into ``gpt`` (a GPTModel built for ``spec``), in place.

    Every parameter of ``gpt`` must receive a tensor of its exact shape, and
    every mapped tensor must find its parameter; anything else raises. Under
    tensor parallelism (``tp_size`` ranks) each parameter receives TP rank ``tp_rank``'s shard
    of the full tensor (:func:`varbatch_kit.train.parallel.tensor_parallel.shard_of`, by the layer's
    own split: fused QKV by query group, ``[gate; up]`` per rank, row-parallel
    input dimensions, vocab ranges). ``experts``: an expert-parallel rank's experts
    (:func:`megatron_state_dict`).
    """
    import torch

    from varbatch_kit.train.parallel.tensor_parallel import tp_rank_shard

    sd = megatron_state_dict(spec, num_layers, experts=experts)
    params = dict(gpt.named_parameters())
    unfilled = sorted(set(params) - set(sd))
    unused = sorted(set(sd) - set(params))
    if unfilled or unused:
        raise RuntimeError(
            f"{spec.name}: the megatron model and the checkpoint mapping disagree; parameters "
            f"without a tensor: {unfilled[:5]}, tensors without a parameter: {unused[:5]}")
    with torch.no_grad():
        for name, tensor in sd.items():
            param = params[name]
            tensor = tp_rank_shard(tensor, param, tp_rank=tp_rank, tp_size=tp_size)
            if tuple(param.shape) != tuple(tensor.shape):
                raise RuntimeError(f"{spec.name}: {name} has shape {list(param.shape)}, the "
                                   f"checkpoint gives {list(tensor.shape)}")
            param.copy_(tensor.to(device=param.device, dtype=param.dtype))
