"""Fake Hugging Face checkpoint directories: a ``config.json`` and safetensors *headers*
(zero data), for tests of reading and validating checkpoints without real weights."""

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
