"""The expert-load watch on hand-made routing maps (no model)."""

from __future__ import annotations

import torch

from varbatch_kit.train.step.expert_load import ExpertLoadWatch, _max_over_mean


class _Router:
    class config:  # noqa: N801 - a stand-in for megatron's TransformerConfig
        num_moe_experts = 3


def test_tokens_per_expert_add_up_per_layer_and_micro_batch():
    watch = ExpertLoadWatch([_Router(), _Router()])  # two MoE layers
    layer0, layer1 = watch._hook(0), watch._hook(1)
    with torch.enable_grad():
        # micro-batch 1: two tokens; layer 0 sends both to expert 0, layer 1 one to each of 1, 2
        layer0(None, None, (None, torch.tensor([[1, 0, 0], [1, 0, 0]], dtype=torch.bool)))
        layer1(None, None, (None, torch.tensor([[0, 1, 0], [0, 0, 1]], dtype=torch.bool)))
        # micro-batch 2: one token, to expert 2 in both layers
        layer0(None, None, (None, torch.tensor([[0, 0, 1]], dtype=torch.bool)))
        layer1(None, None, (None, torch.tensor([[0, 0, 1]], dtype=torch.bool)))
    with torch.no_grad():  # a forward-only pass (log-probs): not counted
        layer0(None, None, (None, torch.tensor([[1, 1, 1]], dtype=torch.bool)))
    got = watch.gathered()
    assert got["expert_tokens"] == [[2, 0, 1], [0, 1, 2]]
    # layer 0: max 2 over mean 1 -> 2.0; layer 1: 2 / 1 -> 2.0
    assert got["expert_load_max_over_mean"] == 2.0
    # micro-batch 1: layer 0 [2, 0, 0] -> 3.0; micro-batch 2: [0, 0, 1] -> 3.0
    assert got["micro_batch_expert_max_over_mean"] == [3.0, 3.0]


def test_an_even_load_is_one_and_a_dense_model_records_nothing():
    assert _max_over_mean(torch.tensor([[2, 2, 2]])) == 1.0
    assert _max_over_mean(torch.tensor([[0, 0, 0]])) == 1.0
    assert ExpertLoadWatch([]).gathered() == {}


def test_the_expert_parallel_ranks_load_sums_their_experts():
    """ep 2 over 4 experts: rank 0 holds experts 0-1, rank 1 experts 2-3."""
    class _Four:
        class config:  # noqa: N801 - a stand-in for megatron's TransformerConfig
            num_moe_experts = 4

    watch = ExpertLoadWatch([_Four()], ep=2)
    with torch.enable_grad():
        # 3 tokens, top 2: experts (0, 1), (0, 2), (1, 3) -> [2, 2, 1, 1]; ranks [4, 2]
        watch._hook(0)(None, None, (None, torch.tensor(
            [[1, 1, 0, 0], [1, 0, 1, 0], [0, 1, 0, 1]], dtype=torch.bool)))
    got = watch.gathered()
    assert got["expert_tokens"] == [[2, 2, 1, 1]]
    assert got["expert_load_max_over_mean"] == 2 / 1.5
    assert got["expert_parallel_load_max_over_mean"] == 4 / 3
    # no token routed: even (1.0)
    assert ExpertLoadWatch([_Four()], ep=2).gathered()["expert_parallel_load_max_over_mean"] == 1.0
