"""Hugging Face checkpoint directories for tests.

- :func:`fake_checkpoint`: a ``config.json`` and safetensors *headers* (zero data), for
  tests of reading and validating checkpoints without real weights;
- :func:`tiny_hf_checkpoint`: a tiny random model of each family the loader supports,
  saved by ``transformers`` itself (tests of the weight mapping both ways).
"""

from __future__ import annotations

import json
import math
from pathlib import Path


def fake_checkpoint(out: Path, config: dict, tensors: dict[str, tuple[int, ...]]) -> Path:
    """A checkpoint directory with the given config and tensor *headers* (zero data)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    header, offset = {}, 0
    for name, shape in tensors.items():
        n = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    with open(out / "model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + b"\0" * offset)
    return out


def llama_like(layers=1, h=8, heads=2, kv=1, f=16, v=32):
    """``(config, tensors)`` of a tiny Llama with tied embeddings."""
    config = {"model_type": "llama", "hidden_size": h, "num_attention_heads": heads,
              "num_key_value_heads": kv, "intermediate_size": f, "num_hidden_layers": layers,
              "vocab_size": v, "tie_word_embeddings": True}
    d = h // heads
    tensors = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({p + "input_layernorm.weight": (h,),
                        p + "post_attention_layernorm.weight": (h,),
                        p + "self_attn.q_proj.weight": (heads * d, h),
                        p + "self_attn.k_proj.weight": (kv * d, h),
                        p + "self_attn.v_proj.weight": (kv * d, h),
                        p + "self_attn.o_proj.weight": (h, heads * d),
                        p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                        p + "mlp.down_proj.weight": (h, f)})
    return config, tensors


# --------------------------------------------------------------------------- real tiny models
#: the shape of the tiny random checkpoints :func:`tiny_hf_checkpoint` writes
TINY_HF = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
               num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
               initializer_range=0.15, rms_norm_eps=1e-6)
#: one per feature of the mapping: llama3 rope (untied), q/k/v biases (tied), QK-norm with
#: head_dim != hidden/heads (untied), Mistral (untied)
TINY_FAMILIES = ["llama_rope3_untied", "qwen2_bias_tied", "qwen3_qknorm", "mistral_untied"]
#: mixture-of-experts families (kept apart: the memory model refuses MoE shapes)
TINY_MOE_FAMILIES = ["qwen3_moe", "mixtral_untied"]


def randomise_hf(model, seed: int) -> None:
    """Random norm weights and biases too (transformers initialises them to 1 and 0)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


def tiny_hf_checkpoint(family: str, out: Path) -> Path:
    """A tiny random ``transformers`` checkpoint of ``family`` (one of :data:`TINY_FAMILIES`),
    saved with ``save_pretrained`` into ``out`` (float32, a few hundred KB)."""
    import torch
    import transformers as T

    if family == "llama_rope3_untied":
        cfg = T.LlamaConfig(**TINY_HF, tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    elif family == "qwen2_bias_tied":
        cfg = T.Qwen2Config(**TINY_HF, tie_word_embeddings=True,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    elif family == "qwen3_qknorm":
        cfg = T.Qwen3Config(**TINY_HF, head_dim=12, tie_word_embeddings=False,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    elif family == "qwen3_moe":  # 4 experts, top 2, renormalised; QK-norm, untied
        cfg = T.Qwen3MoeConfig(**TINY_HF, head_dim=12, tie_word_embeddings=False,
                               num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                               norm_topk_prob=True,
                               rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    elif family == "mixtral_untied":  # 4 experts of intermediate_size, top 2; no QK-norm
        cfg = T.MixtralConfig(**TINY_HF, tie_word_embeddings=False, sliding_window=None,
                              num_local_experts=4, num_experts_per_tok=2,
                              rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    elif family == "mistral_untied":
        cfg = T.MistralConfig(**TINY_HF, tie_word_embeddings=False, sliding_window=None,
                              rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    else:
        raise ValueError(f"family={family!r}; one of {TINY_FAMILIES + TINY_MOE_FAMILIES}")
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomise_hf(model, 1)
    model.save_pretrained(str(out))
    return out
