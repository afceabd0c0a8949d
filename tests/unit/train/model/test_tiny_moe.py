"""The tiny random Qwen3-MoE the notebooks use: a checkpoint the engine reads as MoE."""

from __future__ import annotations

import pytest

from varbatch_kit.train.config.model_config import ModelConfig, resolve_model
from varbatch_kit.train.model.tiny_moe import tiny_moe_checkpoint


def test_the_tiny_checkpoint_is_a_mixture_of_experts_and_reproducible(tmp_path):
    a = tiny_moe_checkpoint(tmp_path / "a", num_layers=2)
    b = tiny_moe_checkpoint(tmp_path / "b", num_layers=2)
    model = resolve_model(ModelConfig(path=str(a)))
    assert model.is_moe and model.num_layers == 2
    assert (model.hf.num_experts, model.hf.moe_router_topk) == (4, 2)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="num_layers=0"):
        tiny_moe_checkpoint(tmp_path / "c", num_layers=0)
