"""Rotary position embeddings of a Hugging Face checkpoint, at the model input's ``position_ids``.

megatron's own rope counts ``0..s-1`` along the row, which for a packed row
would rotate a later sample by its offset; :func:`attach_position_ids_rope`
replaces it by a rotary module that follows ``position_ids``, so positions
restart per sample as in ``transformers``, on the dense-mask path and on the
``thd`` path alike. ``rope_type`` ``default``, ``linear`` and ``llama3`` are
supported, with the config's ``rope_theta`` (:func:`rope_inv_freq`).
Importing this module imports neither torch nor megatron-core.
"""

from __future__ import annotations

import functools
import math

from varbatch_kit.train.config.hf_checkpoint import HFModelSpec

__all__ = ["attach_position_ids_rope", "rope_inv_freq"]


def rope_inv_freq(spec: HFModelSpec):
    """The rotary inverse frequencies (float32, ``kv_channels // 2`` of them) of ``spec``'s rope."""
    import torch

    d = spec.kv_channels
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    params = spec.rope_parameters
    if spec.rope_type == "linear":
        inv = inv / float(params["factor"])
    elif spec.rope_type == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        context = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        # long wavelengths are slowed by `factor`, short ones kept, the band between blended
        scaled = torch.where(wavelen > context / low, inv / factor, inv)
        smooth = (context / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= context / high) & (wavelen <= context / low)
        inv = torch.where(medium, blended, scaled)
    return inv


@functools.cache
def _rotary_class():
    import torch
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    class PositionIdsRotary(RotaryEmbedding):
        """megatron's ``RotaryEmbedding`` at the positions of the model input's ``position_ids``.

        Returns ``[s, b, 1, d]`` (``emb[j, r]`` for the token ``j`` of row ``r``).
        On the ``thd`` path megatron then takes each sample's slice by its row
        offset (``freqs.size(0) == cu_seqlens[-1]``), so both attention paths
        see per-sample positions. Without ``position_ids`` it is ``0..s-1``.
        """

        position_ids = None  # set around each forward by attach_position_ids_rope

        def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False,
                    cp_group=None):
            inv = self.inv_freq
            pos = self.position_ids
            if pos is None:
                pos = torch.arange(max_seq_len, device=inv.device)[None] + offset
            if inv.device != pos.device:
                inv = self.inv_freq = inv.to(pos.device)
            freqs = pos.to(torch.float32)[..., None] * inv  # [b, s, d/2]
            emb = torch.cat([freqs, freqs], dim=-1)  # rotate-half layout, as transformers
            return emb.transpose(0, 1)[:, :, None, :]  # [s, b, 1, d]

    return PositionIdsRotary


def attach_position_ids_rope(gpt, spec: HFModelSpec) -> None:
    """Replace ``gpt``'s rotary embedding by :class:`PositionIdsRotary` for ``spec``'s rope.

    A forward pre-hook hands the forward's ``position_ids`` to the rotary
    module; a forward hook clears them afterwards.
    """
    old = gpt.rotary_pos_emb
    rope = _rotary_class()(kv_channels=spec.kv_channels, rotary_percent=1.0,
                           rotary_base=spec.rope_theta, use_cpu_initialization=True,
                           cp_group=old.cp_group)
    rope.inv_freq = rope_inv_freq(spec)
    gpt.rotary_pos_emb = rope

    def before(module, args, kwargs):
        rope.position_ids = kwargs["position_ids"] if "position_ids" in kwargs else (
            args[1] if len(args) > 1 else None)

    def after(module, args, kwargs, output):
        rope.position_ids = None

    gpt.register_forward_pre_hook(before, with_kwargs=True)
    gpt.register_forward_hook(after, with_kwargs=True, always_call=True)
