"""The tiny GPT: megatron-core ``GPTModel`` with the local (non-TransformerEngine) layer spec.

Requires megatron-core's parallel state to be initialised (the training loop
does it). On CPU, activate :mod:`varbatch_kit.train.cpu_shim` first.
"""

from __future__ import annotations

import torch

from varbatch_kit.train.config import TrainConfig

__all__ = ["build_gpt", "transformer_config"]


def transformer_config(cfg: TrainConfig, *, per_token_loss: bool = False):
    """The megatron-core ``TransformerConfig`` of ``cfg``'s model.

    No dropout (training must be deterministic and layout-independent), float32,
    CPU initialisation (so the initial weights are the same on CPU and GPU for a
    given seed). ``per_token_loss`` sets ``calculate_per_token_loss`` (Megatron's
    per-token path, used by the ``per_token`` report mode).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        ffn_hidden_size=cfg.ffn,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        calculate_per_token_loss=per_token_loss,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )


def build_gpt(cfg: TrainConfig, *, max_seq_len: int, per_token_loss: bool = False):
    """A ``GPTModel`` for ``cfg``, initialised from the current torch CPU RNG state.

    Call ``torch.manual_seed(seed)`` first for reproducible weights.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    return GPTModel(
        config=transformer_config(cfg, per_token_loss=per_token_loss),
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=cfg.vocab_size,
        max_sequence_length=max_seq_len,
        position_embedding_type="learned_absolute",
        share_embeddings_and_output_weights=False,
        parallel_output=True,
    )
