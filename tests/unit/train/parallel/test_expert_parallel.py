"""Expert parallelism's bookkeeping: a rank's experts, their global names, ep 1 untouched."""

from __future__ import annotations

import pytest
import torch

from varbatch_kit.train.config.parallel_layout import ParallelLayout
from varbatch_kit.train.parallel.expert_parallel import (
    gather_all_experts,
    global_expert_name,
    local_experts,
    sent_to_rank0,
)


def test_each_expert_parallel_rank_holds_a_consecutive_share():
    lay = ParallelLayout(dp=4, ep=2)
    assert [local_experts(8, lay, w) for w in range(4)] == [[0, 1, 2, 3], [4, 5, 6, 7]] * 2
    assert [local_experts(4, ParallelLayout(dp=4, ep=4), w) for w in range(4)] == [
        [0], [1], [2], [3]]
    with pytest.raises(ValueError, match="ep=4 does not divide 6 experts"):
        local_experts(6, ParallelLayout(dp=4, ep=4), 0)


def test_global_names_renumber_the_local_experts_only():
    name = "decoder.layers.2.mlp.experts.local_experts.1.linear_fc1.weight"
    assert global_expert_name(name, 4) == (
        "decoder.layers.2.mlp.experts.local_experts.5.linear_fc1.weight")
    assert global_expert_name("decoder.layers.12.mlp.router.weight", 4) == (
        "decoder.layers.12.mlp.router.weight")


def test_without_expert_parallelism_the_tensors_are_returned_as_they_are():
    tensors = {"a.local_experts.0.w": torch.ones(1)}
    assert gather_all_experts(tensors, ParallelLayout(dp=2), 1, 4) is tensors


def test_who_sends_what_to_rank_0():
    """dp 4, ep 2: pool rank 0 sends everything, pool rank 1 its experts under their global
    numbers, the second expert-parallel group nothing (it holds the same experts again)."""
    lay = ParallelLayout(dp=4, ep=2)
    tensors = {"mlp.router.weight": torch.ones(1),
               "mlp.experts.local_experts.1.linear_fc2.weight": torch.zeros(1)}
    assert sent_to_rank0(tensors, lay, 0, 4) is tensors
    assert list(sent_to_rank0(tensors, lay, 1, 4)) == [
        "mlp.experts.local_experts.3.linear_fc2.weight"]
    assert sent_to_rank0(tensors, lay, 2, 4) == {} == sent_to_rank0(tensors, lay, 3, 4)
    # tensor parallelism: only tp rank 0 of a pool rank sends (its full tensors)
    tp = ParallelLayout(dp=2, tp=2, ep=2)
    assert sent_to_rank0(tensors, tp, 1, 4) == {}  # pool rank 0, tp rank 1
    assert list(sent_to_rank0(tensors, tp, 2, 4)) == [
        "mlp.experts.local_experts.3.linear_fc2.weight"]
