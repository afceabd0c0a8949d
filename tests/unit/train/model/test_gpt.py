"""gpt: the model builders take the run's layout; megatron's parallel state does not decide."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from varbatch_kit.train.config.model_config import ModelConfig, resolve_model
from varbatch_kit.train.config.parallel_layout import ParallelLayout

pytest.importorskip("megatron.core")


def test_the_tensor_parallel_size_is_the_layouts():
    from megatron.core import parallel_state

    from varbatch_kit.train.model.gpt import transformer_config

    assert not parallel_state.model_parallel_is_initialized()  # nothing to read back
    toy = resolve_model(ModelConfig(num_attention_heads=4, hidden_size=64, vocab_size=64))
    assert transformer_config(toy).tensor_model_parallel_size == 1
    assert transformer_config(toy, layout=ParallelLayout(tp=2)).tensor_model_parallel_size == 2
    assert transformer_config(toy, layout=ParallelLayout(dp=2, tp=1)).tensor_model_parallel_size \
        == 1


def test_no_engine_module_reads_the_layout_back_from_megatron():
    """The layout object is passed explicitly (torchtitan's parallel dims): a size or rank read
    from megatron's global parallel state would be a second owner of the layout."""
    package = Path(__file__).resolve().parents[4] / "varbatch_kit"
    pattern = re.compile(r"get_(tensor|pipeline|data|context)_model_parallel_(world_size|rank)\(")
    readers = [str(p.relative_to(package)) for p in package.rglob("*.py")
               if pattern.search(p.read_text())]
    assert readers == [], readers
