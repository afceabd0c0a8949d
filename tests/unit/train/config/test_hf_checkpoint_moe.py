"""Mixture-of-experts checkpoints read and checked without torch (headers only): the fields
the engine builds, the tensors each family names, and the features it refuses by name."""

from __future__ import annotations

import pytest
from _fake_hf import fake_checkpoint, llama_like

from varbatch_kit.train.config.hf_checkpoint import hf_tensor_names, read_hf_model


def qwen3_moe(experts=4, topk=2, width=6, **extra):
    """``(config, tensors)`` of a one-layer Qwen3-MoE (hidden 8, 2 heads of 4, 1 KV group)."""
    config, tensors = llama_like(layers=1)
    config = {**config, "model_type": "qwen3_moe", "num_experts": experts,
              "num_experts_per_tok": topk, "moe_intermediate_size": width, **extra}
    for w in ("gate", "up", "down"):
        del tensors[f"model.layers.0.mlp.{w}_proj.weight"]
    tensors["model.layers.0.self_attn.q_norm.weight"] = (4,)
    tensors["model.layers.0.self_attn.k_norm.weight"] = (4,)
    tensors["model.layers.0.mlp.gate.weight"] = (experts, 8)
    for e in range(experts):
        tensors[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] = (width, 8)
        tensors[f"model.layers.0.mlp.experts.{e}.up_proj.weight"] = (width, 8)
        tensors[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] = (8, width)
    return config, tensors


def test_a_qwen3_moe_checkpoint_is_read_with_its_experts(tmp_path):
    spec = read_hf_model(fake_checkpoint(tmp_path / "m", *qwen3_moe()))
    assert (spec.family, spec.num_experts, spec.moe_router_topk, spec.moe_ffn_hidden_size,
            spec.moe_norm_topk_prob, spec.qk_norm) == ("Qwen3-MoE", 4, 2, 6, True, True)
    names = hf_tensor_names(spec)
    assert "model.layers.0.mlp.gate.weight" in names
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in names
    assert not any(n.endswith("mlp.up_proj.weight") for n in names)  # no dense MLP


def test_moe_features_the_engine_does_not_build_are_refused_by_name(tmp_path):
    def read(name, config, tensors):
        return read_hf_model(fake_checkpoint(tmp_path / name, config, tensors))

    config, tensors = qwen3_moe()
    with pytest.raises(ValueError, match=r"decoder_sparse_step=2.*every layer"):
        read("sparse", {**config, "decoder_sparse_step": 2}, tensors)
    with pytest.raises(ValueError, match=r"mlp_only_layers=\[0\]"):
        read("dense", {**config, "mlp_only_layers": [0]}, tensors)
    with pytest.raises(ValueError, match=r"num_experts_per_tok=5 exceeds the 4 experts"):
        read("topk", {**config, "num_experts_per_tok": 5}, tensors)
    with pytest.raises(ValueError, match=r"router_jitter_noise=0.1"):
        read("noise", {**config, "router_jitter_noise": 0.1}, tensors)
    short = {k: v for k, v in tensors.items() if "experts.3.up_proj" not in k}
    with pytest.raises(ValueError, match=r"lack 1 tensor.*experts\.3\.up_proj"):
        read("short", config, short)
    wrong = {**tensors, "model.layers.0.mlp.experts.1.down_proj.weight": (8, 5)}
    with pytest.raises(ValueError, match=r"experts\.1\.down_proj\.weight has shape \[8, 5\]"):
        read("wrong", config, wrong)
    deepseek = {**llama_like(layers=1)[0], "n_routed_experts": 8}
    with pytest.raises(ValueError, match=r"mixture-of-experts 'llama'.*Qwen3-MoE and Mixtral"):
        read("deepseek", deepseek, llama_like(layers=1)[1])
