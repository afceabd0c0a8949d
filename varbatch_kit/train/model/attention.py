"""Per-sample core attention: a packed row costs ``sum(L_i^2)``, not ``(sum L_i)^2``.

megatron-core's local (non-TransformerEngine) ``DotProductAttention`` takes a
dense ``[b, 1, s, s]`` mask, so a packed row of ``T = sum(L_i)`` tokens always
costs ``T^2`` in attention, however it is packed, while FLOPs balancing counts
``sum(L_i^2)``. :class:`PerSampleAttention` is a drop-in replacement in the
local layer spec (:func:`local_layer_spec`) that attends within each sample
only.

How the segment boundaries get here (megatron's own path)
---------------------------------------------------------
The training step passes ``GPTModel(..., attention_mask=None,
packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=...,
cu_seqlens_kv=..., max_seqlen_q=..., max_seqlen_kv=...))``
(:attr:`varbatch_kit.train.step.packed_batch.PackedBatch.packed_seq_params`). megatron
hands ``packed_seq_params`` down GPTModel -> TransformerBlock ->
TransformerLayer -> SelfAttention, which for ``qkv_format == "thd"``

- squeezes the dummy batch dimension: query ``[T, h, d]``, key/value
  ``[T, g, d]`` (``g = num_query_groups``);
- applies rotary embeddings per segment (positions restart at 0 in every
  sample, ``_apply_rotary_pos_emb_thd``), so rope models see each sample
  exactly as if it ran alone;
- calls core attention with ``packed_seq_params`` and reshapes its
  ``[T, h, d]`` (or ``[T, h*d]``) output to ``[T, 1, h*d]``.

Here every segment runs ``torch.nn.functional.scaled_dot_product_attention``
with ``is_causal=True``; segments of equal length are stacked into one call
(one call per distinct length), key/value groups are shared with
``enable_gqa``. The scale is megatron's (``softmax_scale`` or
``1/sqrt(kv_channels)``; ``apply_query_key_layer_scaling`` divides and
multiplies by the same factor in megatron, so it does not change the
result). No dropout: a non-zero attention dropout is refused.

Without ``packed_seq_params`` the module computes exactly what megatron's
``DotProductAttention`` computes (``[s, b, h, d]`` in, ``[s, b, h*d]`` out;
the mask is ``True`` where attention is blocked, filled with -10000 before
the softmax; no mask means causal), so a model built with this spec also
runs the dense reference path.

Under all-gather context parallelism (:mod:`~varbatch_kit.train.parallel.cp_attention`) the row is
a CP
rank's zigzag share and :func:`~varbatch_kit.train.parallel.cp_attention.current_share`
is set around the forward: the packed path then runs
:func:`~varbatch_kit.train.parallel.cp_attention.cp_core_attention` (K/V gathered over
the CP group) instead of :func:`segment_attention`.

``torch.nn.attention.flex_attention`` with a document mask would be the other
candidate; in torch 2.13 it has no backward on CPU (eager or compiled), so it
cannot train here.

Tensor parallelism: megatron's column-parallel ``linear_qkv`` hands each TP
rank whole query groups (``h / tp`` query heads, ``g / tp`` key/value heads);
the module attends with those, as it would with the full set, and the
row-parallel ``linear_proj`` sums the ranks' outputs.

Importing this module imports megatron-core (the model builders do, lazily).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from varbatch_kit.train.parallel.cp_attention import cp_core_attention, current_share

__all__ = ["PerSampleAttention", "local_layer_spec", "segment_attention"]


def segment_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      lengths: list[int] | tuple[int, ...], scale: float) -> torch.Tensor:
    """Causal attention within each segment of a packed ``thd`` row.

    ``query`` is ``[T, h, d]``, ``key`` and ``value`` are ``[T, g, d]`` with
    ``h % g == 0`` (query head ``i`` reads key/value group ``i // (h // g)``,
    as megatron's ``repeat_interleave``); ``lengths`` sum to ``T``. Returns
    ``[T, h, d]``. Segments of equal length run as one batched call.
    """
    lengths = [int(n) for n in lengths]
    if sum(lengths) != query.size(0):
        raise ValueError(f"segment lengths sum to {sum(lengths)}, the row has {query.size(0)} "
                         "tokens; cu_seqlens must cover the packed row exactly")
    gqa = query.size(1) != key.size(1)
    if len(lengths) == 1:  # one segment: no splitting, no copies
        # 4-d [1, heads, T, d]: torch's CPU SDPA takes its fused kernel only for batched input
        # (3-d [heads, T, d] falls back to the math path, several times slower at T ~ 4096)
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1)[None], key.transpose(0, 1)[None], value.transpose(0, 1)[None],
            is_causal=True, scale=scale, enable_gqa=gqa)
        return out[0].transpose(0, 1)
    qs, ks, vs = (t.split(lengths, dim=0) for t in (query, key, value))
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(n, []).append(i)
    outs: list[torch.Tensor | None] = [None] * len(lengths)
    for members in groups.values():
        # [n, L, heads, d] -> [n, heads, L, d]
        q = torch.stack([qs[i] for i in members]).transpose(1, 2)
        k = torch.stack([ks[i] for i in members]).transpose(1, 2)
        v = torch.stack([vs[i] for i in members]).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        for i, seg in zip(members, o.transpose(1, 2).unbind(0)):
            outs[i] = seg
    return torch.cat(outs, dim=0)


def _dense_attention(query, key, value, attention_mask, scale, causal: bool) -> torch.Tensor:
    """megatron's ``DotProductAttention`` math: ``[s, b, h, d]`` in, ``[s, b, h*d]`` out."""
    sq, b, h, d = query.shape
    rep = h // key.size(2)
    if rep > 1:
        key = key.repeat_interleave(rep, dim=2)
        value = value.repeat_interleave(rep, dim=2)
    q = query.permute(1, 2, 0, 3)  # [b, h, sq, d]
    k = key.permute(1, 2, 0, 3)
    v = value.permute(1, 2, 0, 3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [b, h, sq, sk]
    mask = attention_mask
    if mask is None and causal and sq > 1:
        mask = torch.ones(sq, key.size(0), dtype=torch.bool, device=query.device).triu(1)
    if mask is not None:
        scores = scores.masked_fill(mask.to(torch.bool), -10000.0)
    probs = torch.softmax(scores, dim=-1)
    ctx = torch.matmul(probs, v)  # [b, h, sq, d]
    return ctx.permute(2, 0, 1, 3).reshape(sq, b, h * d)


class PerSampleAttention(MegatronModule):
    """Core attention for megatron-core's local spec; per sample with ``thd`` packed params.

    Same constructor and ``forward`` signature as megatron's
    ``DotProductAttention`` (see the module docstring for the two paths). No
    parameters, so state dicts equal those of ``DotProductAttention``.
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None) -> None:
        super().__init__(config=config)
        from megatron.core.transformer.enums import AttnMaskType
        from megatron.core.transformer.utils import is_layer_window_attention

        if config.context_parallel_size != 1:
            raise ValueError(f"context_parallel_size={config.context_parallel_size}: "
                             "PerSampleAttention needs 1 (the engine runs its own CP groups: "
                             "train/parallel/cp_attention.py)")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"attention_dropout={dropout}: PerSampleAttention has no dropout; "
                             "use 0.0 (training must be deterministic)")
        if config.softmax_type != "vanilla":
            raise ValueError(f"softmax_type={config.softmax_type!r}: PerSampleAttention supports "
                             "'vanilla'")
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                     layer_number):
            raise ValueError(f"window_size={config.window_size}: sliding-window attention is not "
                             "supported by PerSampleAttention")
        heads, groups = config.num_attention_heads, config.num_query_groups
        if groups is None or heads % groups:
            raise ValueError(f"num_query_groups={groups} must divide num_attention_heads={heads}")
        tp = config.tensor_model_parallel_size
        if heads % tp or groups % tp:  # each TP rank attends with its own heads / query groups
            raise ValueError(f"tensor_model_parallel_size={tp} must divide num_attention_heads="
                             f"{heads} and num_query_groups={groups}")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.causal = attn_mask_type == AttnMaskType.causal
        self.attention_type = attention_type
        # this TP rank's share: megatron's column-parallel linear_qkv gives it whole query
        # groups (their heads, key and value), so attention runs per head shard unchanged
        self.num_heads = heads // tp
        self.num_query_groups = groups // tp
        self.head_dim = config.kv_channels
        # megatron divides by layer_number here and its softmax multiplies it back: net the same
        self.softmax_scale = (1.0 / math.sqrt(self.head_dim) if softmax_scale is None
                              else float(softmax_scale))

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type=None,
                attention_bias: torch.Tensor | None = None, packed_seq_params=None
                ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by PerSampleAttention")
        if packed_seq_params is None:
            return _dense_attention(query, key, value, attention_mask, self.softmax_scale,
                                    causal=self.causal)
        if not self.causal:
            raise ValueError(f"attn_mask_type={self.attn_mask_type}: per-sample packed attention "
                             "is causal")
        lengths = _segment_lengths(packed_seq_params, query.size(0))
        if query.dim() != 3:
            raise ValueError(f"packed query of shape {tuple(query.shape)}: the 'thd' format "
                             "gives [T, heads, head_dim]")
        share = current_share()  # all-gather CP: this rank's zigzag share (train/cp_attention)
        if share is not None:
            n = sum(share.local_lengths())  # then a pad segment (sequence parallelism), alone
            out = cp_core_attention(query[:n], key[:n], value[:n], share, self.softmax_scale)
            if query.size(0) > n:
                out = torch.cat([out, segment_attention(query[n:], key[n:], value[n:],
                                                        lengths[-1:], self.softmax_scale)])
        else:
            out = segment_attention(query, key, value, lengths, self.softmax_scale)
        return out.reshape(out.size(0), -1)  # [T, h*d]; megatron adds the batch dim of 1


def _segment_lengths(params, total: int) -> list[int]:
    """Segment lengths from a ``thd`` ``PackedSeqParams`` (self-attention, no padding)."""
    fmt = getattr(params, "qkv_format", None)
    if fmt != "thd":
        raise ValueError(f"packed_seq_params.qkv_format={fmt!r}: PerSampleAttention reads "
                         "'thd' packed rows (see varbatch_kit.train.step.packed_batch.PackedBatch)")
    cu = params.cu_seqlens_q
    if cu is None:
        raise ValueError("packed_seq_params.cu_seqlens_q is None")
    for name in ("cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        other = getattr(params, name, None)
        if other is not None and other is not cu and not torch.equal(other.to(cu.device), cu):
            raise ValueError(f"packed_seq_params.{name} differs from cu_seqlens_q: "
                             "PerSampleAttention supports unpadded self-attention only")
    bounds = [int(x) for x in cu.tolist()]
    if bounds[0] != 0 or bounds[-1] != total or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens_q={bounds}: must rise from 0 to the row length {total}")
    return [b - a for a, b in zip(bounds, bounds[1:]) if b > a]


def local_layer_spec(*, qk_layernorm: bool = False, per_sample: bool = True,
                     normalization: str = "LayerNorm", **kwargs: Any):
    """megatron-core's local GPT layer spec, core attention replaced by :class:`PerSampleAttention`
    and the norms by :class:`~varbatch_kit.train.model.norms.TorchNorm` (the same torch modules,
    usable under sequence parallelism).

    ``qk_layernorm`` and ``normalization`` (``"LayerNorm"`` or ``"RMSNorm"``;
    the ``TransformerConfig`` must say the same) and any other keyword go to
    ``get_gpt_layer_local_spec``. ``per_sample=False`` returns megatron's spec
    unchanged (``DotProductAttention``, dense mask): the reference. Works for
    ``learned_absolute`` and ``rope`` models (rope restarts per sample on the
    ``thd`` path).
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityOp

    from varbatch_kit.train.model.norms import TorchNorm

    if normalization not in ("LayerNorm", "RMSNorm"):
        raise ValueError(f"normalization={normalization!r}: use 'LayerNorm' or 'RMSNorm'")
    if kwargs.get("multi_latent_attention"):
        raise ValueError("multi_latent_attention=True: PerSampleAttention supports standard "
                         "self-attention only")
    spec = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization=normalization,
                                    **kwargs)
    if not per_sample:
        return spec
    spec = copy.deepcopy(spec)
    layer = spec.submodules
    attention = layer.self_attention.submodules
    attention.core_attention = PerSampleAttention
    # torch's norms, marked for sequence parallelism (megatron's WrappedTorchNorm refuses it)
    layer.input_layernorm = layer.pre_mlp_layernorm = TorchNorm
    for name in ("q_layernorm", "k_layernorm"):
        if getattr(attention, name) is not IdentityOp:
            setattr(attention, name, TorchNorm)
    return spec
