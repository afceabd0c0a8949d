"""Tensor parallelism's pure parts (varbatch_kit.train.parallel.tensor_parallel, attention per head
shard).

How a full tensor splits over TP ranks (megatron's own rule, the Hugging Face
loader's fused QKV and SwiGLU ``fc1``), the refusal of what cannot split, the
per-sample attention on a head shard, and the configuration. Two real ranks:
tests/integration/test_train_tensor_parallel.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from _fake_hf import fake_checkpoint, llama_like

from varbatch_kit.train import ModelConfig, TrainConfig
from varbatch_kit.train.config.model_config import resolve_model
from varbatch_kit.train.parallel.tensor_parallel import (
    check_tp_split,
    full_from_shards,
    full_parameter_count,
    gather_full_parameters,
    shard_of,
    tp_split_problems,
)

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


@pytest.mark.parametrize("dim, stride", [(0, 1), (0, 2), (1, 1)])
@pytest.mark.parametrize("size", [2, 4])
def test_shards_are_megatrons_cpu_initialisation_split(dim, stride, size):
    """shard_of cuts the full tensor as megatron's use_cpu_initialization does (so a toy
    GPT's initial weights equal tp 1's), and full_from_shards puts them back."""
    from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu

    full = torch.randn(16, 8)
    per = full.shape[dim] // size
    shards = []
    for rank in range(size):
        shape = list(full.shape)
        shape[dim] = per
        w = torch.nn.Parameter(torch.empty(shape))
        _initialize_affine_weight_cpu(w, 16, 8, per, dim, lambda t: t.copy_(full), stride=stride,
                                      rank=rank, world_size=size)
        assert torch.equal(shard_of(full, rank=rank, size=size, dim=dim, stride=stride), w.data)
        shards.append(w.data)
    assert torch.equal(full_from_shards(shards, dim=dim, stride=stride), full)
    with pytest.raises(ValueError, match="cannot be split into 3"):
        shard_of(full, rank=0, size=3, dim=0)


def test_the_fused_qkv_and_the_swiglu_fc1_split_by_query_group_and_by_half():
    """The loader's fused QKV (per KV group: its query heads, key, value) splits into whole
    query groups; [gate; up] with stride 2 gives rank r [gate_r; up_r]."""
    from varbatch_kit.train.model.hf_import import _fused_qkv

    d, heads, groups, h = 2, 4, 2, 6
    q, k, v = torch.randn(heads * d, h), torch.randn(groups * d, h), torch.randn(groups * d, h)
    fused = _fused_qkv(q, k, v, groups)
    for r in range(2):  # tp 2: one query group each
        mine = _fused_qkv(q[r * 2 * d:(r + 1) * 2 * d], k[r * d:(r + 1) * d],
                          v[r * d:(r + 1) * d], 1)
        assert torch.equal(shard_of(fused, rank=r, size=2, dim=0), mine)
    gate, up = torch.randn(8, h), torch.randn(8, h)
    fc1 = torch.cat([gate, up])
    for r in range(2):
        assert torch.equal(shard_of(fc1, rank=r, size=2, dim=0, stride=2),
                           torch.cat([gate[4 * r:4 * r + 4], up[4 * r:4 * r + 4]]))


def test_without_tensor_parallelism_the_gather_is_a_copy():
    lin = torch.nn.Linear(3, 2)
    got = gather_full_parameters(lin)
    assert got.keys() == {"weight", "bias"} and torch.equal(got["weight"], lin.weight.data)
    assert got["weight"].data_ptr() != lin.weight.data_ptr()
    grads = gather_full_parameters(lin, {"weight": torch.ones(2, 3), "bias": torch.zeros(2)})
    assert torch.equal(grads["weight"], torch.ones(2, 3))
    assert full_parameter_count(lin) == 8
    # copy=False (a caller that saves them before the next update): the parameters themselves
    views = gather_full_parameters(lin, copy=False)
    assert views["weight"].data_ptr() == lin.weight.data_ptr()
    assert not views["weight"].requires_grad


def test_what_tp_cannot_split_is_refused_naming_what_works(tmp_path):
    toy = resolve_model(ModelConfig(num_attention_heads=4, hidden_size=64, vocab_size=64))
    assert tp_split_problems(toy, 1) == tp_split_problems(toy, 2) == []
    (msg,) = tp_split_problems(toy, 3)
    assert msg.startswith("tp=3: the toy GPT cannot be split over 3 tensor-parallel ranks: "
                          "num_attention_heads=4, num_query_groups=4, ffn_hidden_size=256, "
                          "vocab_size=64 are not divisible by 3")
    assert msg.endswith("(1, 2, 4)")
    # SmolLM2-135M's attention: 9 query heads, 3 key/value groups
    config, tensors = llama_like(h=18, heads=9, kv=3, f=48, v=48)
    smol = resolve_model(ModelConfig(path=str(fake_checkpoint(tmp_path / "smol", config,
                                                              tensors))))
    with pytest.raises(ValueError, match=r"^tp=2: smol cannot be split over 2 tensor-parallel "
                                         r"ranks: num_attention_heads=9, num_query_groups=3 are "
                                         r"not divisible by 2; use tp=1 or a tp dividing all of "
                                         r"\[3, 9, 48\] \(1, 3\)$"):
        check_tp_split(smol, 2)
    check_tp_split(smol, 3)


def _attention_config(tp: int, heads: int = 4, groups: int = 2):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=heads,
                             num_query_groups=groups, tensor_model_parallel_size=tp,
                             attention_dropout=0.0, hidden_dropout=0.0,
                             use_cpu_initialization=True)


def test_per_sample_attention_runs_on_its_head_shard():
    """tp 2: each rank's module attends with its own query group (2 query heads, 1 KV head);
    the two shards' outputs are the full module's, head by head."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from varbatch_kit.train.model.attention import PerSampleAttention

    full = PerSampleAttention(_attention_config(1), 1, AttnMaskType.causal, "self")
    half = PerSampleAttention(_attention_config(2), 1, AttnMaskType.causal, "self")
    assert (full.num_heads, full.num_query_groups, half.num_heads, half.num_query_groups) == (
        4, 2, 2, 1)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=5, max_seqlen_kv=5)
    q, k, v = torch.randn(8, 4, 8), torch.randn(8, 2, 8), torch.randn(8, 2, 8)
    ref = full(q, k, v, None, packed_seq_params=params).reshape(8, 4, 8)
    for r in range(2):
        got = half(q[:, 2 * r:2 * r + 2], k[:, r:r + 1], v[:, r:r + 1], None,
                   packed_seq_params=params)
        torch.testing.assert_close(got.reshape(8, 2, 8), ref[:, 2 * r:2 * r + 2])
    with pytest.raises(ValueError, match="tensor_model_parallel_size=4 must divide "
                                         "num_attention_heads=4 and num_query_groups=2"):
        PerSampleAttention(_attention_config(4), 1, AttnMaskType.causal, "self")


def test_tp_is_a_layout_the_engine_runs():
    cfg = TrainConfig().with_(tp=2, dp=2)
    assert cfg.world_size == 4 and cfg.layout.unsupported() == []
    assert cfg.layout.describe() == "dp2 cp1 pp1 tp2 sp" and cfg.name.startswith("dp2 cp1 tp2 ")
    # checkpoints hold each TP rank's shard (tests/integration/test_train_fault.py)
    assert TrainConfig().with_(tp=2, save_every=2).checkpoint.save_every == 2
