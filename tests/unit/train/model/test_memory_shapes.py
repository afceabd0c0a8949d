"""The memory model's parameter counts are the engine's models' own (megatron-core, built
here in one process) and, for checkpoints, transformers' (tied embeddings once)."""

from __future__ import annotations

import pytest
import torch
from _fake_hf import TINY_FAMILIES, tiny_hf_checkpoint
from _megatron import single_process_megatron

from varbatch_kit.core.memory import MemoryLayout, parameter_count
from varbatch_kit.train import ModelConfig
from varbatch_kit.train.config.model_config import resolve_model
from varbatch_kit.train.model.gpt import build_gpt

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


@pytest.mark.parametrize("family", [None, *TINY_FAMILIES])
def test_parameter_count_is_the_engines_and_transformers(family, tmp_path):
    import transformers

    path = None if family is None else tiny_hf_checkpoint(family, tmp_path / family)
    spec = resolve_model(ModelConfig(path=None if path is None else str(path),
                                     max_seq_len=None if path else 128))
    shape = spec.shape
    with single_process_megatron("cpu"):
        torch.manual_seed(0)
        gpt = build_gpt(spec, max_seq_len=128)
        engine = sum(p.numel() for p in gpt.parameters())
    assert parameter_count(shape, MemoryLayout()) == engine
    if path is not None:
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path))
        assert parameter_count(shape, MemoryLayout()) == hf.num_parameters()
