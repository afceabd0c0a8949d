"""A tiny random mixture-of-experts checkpoint (Qwen3-MoE), made by ``transformers``.

For the notebooks and examples that show the engine's MoE path without a download: 4
experts, top 2 (renormalised, as Qwen3-MoE routes), QK-norm, untied embeddings, 3 layers of
hidden size 48; random weights from a fixed seed, saved with ``save_pretrained`` (float32,
well under a megabyte). Point ``ModelConfig(path=...)`` at the folder as at any checkpoint.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["tiny_moe_checkpoint"]


def tiny_moe_checkpoint(out_dir, *, seed: int = 0, num_layers: int = 3) -> Path:
    """Write a tiny random Qwen3-MoE checkpoint into ``out_dir`` (created) and return it.

    The same ``seed`` gives the same weights. ``num_layers``: its decoder layers (each a
    mixture of experts).
    """
    import torch
    import transformers

    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers={num_layers!r}: give a positive int")
    config = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=48, intermediate_size=96, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=24, norm_topk_prob=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    return out
