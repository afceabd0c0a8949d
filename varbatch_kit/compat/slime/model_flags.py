"""slime's model flags (Megatron's) → :class:`~varbatch_kit.core.flops.ModelShape`.

slime computes a step's FLOPs from the model flags of its command line
(``--num-layers 36 --hidden-size 4096 --ffn-hidden-size 12288
--num-attention-heads 32 --group-query-attention --num-query-groups 8
--kv-channels 128 --vocab-size 151936``, the ``MODEL_ARGS`` of its model scripts), so
:func:`model_shape_from_slime_args` reads the same flags into the shape the schedule,
the step-time model and :func:`~varbatch_kit.compat.slime.recommend` use:

======================================  =======================================
slime flag                              ModelShape field
======================================  =======================================
``--num-layers``                        ``num_layers``
``--hidden-size``                       ``hidden_size``
``--ffn-hidden-size``                   ``ffn_hidden_size`` (Megatron's default
                                        ``4 * hidden_size`` when absent)
``--num-attention-heads``               ``num_attention_heads``
``--num-query-groups``                  ``num_query_groups`` (with
                                        ``--group-query-attention``; without it
                                        every head is its own group)
``--kv-channels``                       ``kv_channels``
``--vocab-size``                        ``vocab_size``
``--num-experts``                       ``num_experts``
``--moe-ffn-hidden-size``               ``moe_ffn_hidden_size``
``--moe-router-topk``                   ``moe_router_topk``
``--moe-shared-expert-intermediate-     ``moe_shared_expert_intermediate_size``
size``
``--multi-latent-attention``, ``--q-    the multi-latent attention fields
lora-rank``, ``--kv-lora-rank``,
``--qk-head-dim``,
``--qk-pos-emb-head-dim``,
``--v-head-dim``
======================================  =======================================

The flags that set the layer's make-up change the memory model
(:mod:`varbatch_kit.core.memory`: the tensors a layer saves, its parameter count), not
the FLOPs; they are read with Megatron's defaults for an absent flag, as slime runs them:

===============================================  ==========================================
slime flag                                       ModelShape field (Megatron's default)
===============================================  ==========================================
``--swiglu``                                     ``gated_mlp`` (a plain GeLU MLP)
``--normalization RMSNorm|LayerNorm``            ``norm`` (``LayerNorm``)
``--disable-bias-linear``                        ``linear_bias`` (biases on)
``--add-qkv-bias``                               ``qkv_bias`` (on with the linear biases)
``--qk-layernorm``                               ``qk_norm`` (off)
``--untie-embeddings-and-output-weights``        ``tied_embeddings`` (tied)
``--position-embedding-type``,                   ``position_embedding`` (``learned_absolute``:
``--use-rotary-position-embeddings``             a learned table), ``learned_positions``:
                                                 ``--max-position-embeddings``, else
                                                 ``--seq-length``, else 0 (unknown)
===============================================  ==========================================

Flags that change neither (``--norm-epsilon``, ``--rotary-base``, ...) are not read.
A command line without
``--num-layers`` holds no model (None); one with some of the required flags but not all
(``--num-layers``, ``--hidden-size``, ``--num-attention-heads``, ``--vocab-size``) is a
``ValueError`` naming the missing ones.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Sequence
from typing import Any

from varbatch_kit.compat.slime.flags import flag_dest, positive_int
from varbatch_kit.core.flops import ModelShape

__all__ = ["MODEL_FLAG_TABLE", "model_shape_from_slime_args"]

_INTS = ("--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
         "--num-query-groups", "--kv-channels", "--vocab-size", "--num-experts",
         "--moe-ffn-hidden-size", "--moe-router-topk", "--moe-shared-expert-intermediate-size",
         "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim",
         "--v-head-dim")
_SWITCHES = ("--group-query-attention", "--multi-latent-attention", "--swiglu",
             "--disable-bias-linear", "--add-qkv-bias", "--qk-layernorm",
             "--untie-embeddings-and-output-weights", "--use-rotary-position-embeddings")
#: Megatron's choices (``--normalization``, ``--position-embedding-type``)
NORMALIZATIONS = {"LayerNorm": "layernorm", "RMSNorm": "rmsnorm"}
POSITION_EMBEDDINGS = ("learned_absolute", "rope", "mrope", "relative", "none")
#: the model flags, as ``(flag, argparse keyword arguments)`` rows of slime's parser
MODEL_FLAG_TABLE: tuple[tuple[str, dict[str, Any]], ...] = (
    tuple((f, {"type": positive_int}) for f in _INTS)
    + tuple((f, {"type": positive_int}) for f in ("--max-position-embeddings",
                                                   "--seq-length"))
    + tuple((f, {"action": "store_true"}) for f in _SWITCHES)
    + (("--normalization", {"choices": tuple(NORMALIZATIONS)}),
       ("--position-embedding-type", {"choices": POSITION_EMBEDDINGS})))
_REQUIRED = ("--num-layers", "--hidden-size", "--num-attention-heads", "--vocab-size")


def model_shape_from_slime_args(flags: str | Sequence[str] | argparse.Namespace
                                ) -> ModelShape | None:
    """The model the slime command line (or a namespace with slime's attribute names)
    describes, None when it gives no ``--num-layers`` (see the module docstring)."""
    if isinstance(flags, argparse.Namespace):
        ns = flags
    else:
        tokens = shlex.split(flags) if isinstance(flags, str) else list(flags)
        parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        for flag, kwargs in MODEL_FLAG_TABLE:
            parser.add_argument(flag, **kwargs)
        ns, _ = parser.parse_known_args(tokens)
    get = {f: getattr(ns, flag_dest(f, {}), None) for f, _ in MODEL_FLAG_TABLE}
    if get["--num-layers"] is None:
        return None
    missing = [f for f in _REQUIRED if get[f] is None]
    if missing:
        raise ValueError(f"slime's model flags are incomplete: {', '.join(missing)} missing "
                         f"(the FLOPs need all of {', '.join(_REQUIRED)})")
    hidden = get["--hidden-size"]
    return ModelShape(
        num_layers=get["--num-layers"], hidden_size=hidden,
        num_attention_heads=get["--num-attention-heads"],
        ffn_hidden_size=get["--ffn-hidden-size"] or 4 * hidden,
        vocab_size=get["--vocab-size"],
        num_query_groups=get["--num-query-groups"] if get["--group-query-attention"] else None,
        kv_channels=get["--kv-channels"], num_experts=get["--num-experts"],
        moe_ffn_hidden_size=get["--moe-ffn-hidden-size"],
        moe_router_topk=get["--moe-router-topk"] or 1,
        moe_shared_expert_intermediate_size=get["--moe-shared-expert-intermediate-size"],
        multi_latent_attention=bool(get["--multi-latent-attention"]),
        q_lora_rank=get["--q-lora-rank"], kv_lora_rank=get["--kv-lora-rank"],
        qk_head_dim=get["--qk-head-dim"], qk_pos_emb_head_dim=get["--qk-pos-emb-head-dim"],
        v_head_dim=get["--v-head-dim"], name="slime flags", **_make_up(get))


def _make_up(get: dict[str, Any]) -> dict[str, Any]:
    """The layer's make-up fields of :class:`ModelShape` (the second table of the module
    docstring), Megatron's defaults where a flag is absent."""
    position = get["--position-embedding-type"] or (
        "rope" if get["--use-rotary-position-embeddings"] else "learned_absolute")
    learned = position == "learned_absolute"
    bias = not get["--disable-bias-linear"]
    return dict(
        gated_mlp=bool(get["--swiglu"]),
        norm=NORMALIZATIONS[get["--normalization"] or "LayerNorm"],
        linear_bias=bias, qkv_bias=bias or bool(get["--add-qkv-bias"]),
        qk_norm=bool(get["--qk-layernorm"]),
        tied_embeddings=not get["--untie-embeddings-and-output-weights"],
        # rotary, multimodal rotary, relative or no positions: no table of parameters
        position_embedding="learned" if learned else "rope",
        learned_positions=(get["--max-position-embeddings"] or get["--seq-length"] or 0)
        if learned else 0)
