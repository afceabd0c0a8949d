"""The word embedding's gradient routed into main_grad (train/model/embedding_grad.py): the
same gradient as torch's dense embedding backward, tied to an output layer, over several
micro-batches, in float64; nothing changes without main_grad or without gradients."""

from __future__ import annotations

import pytest
import torch
from _megatron import single_process_megatron

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def _embedding(vocab=50, hidden=6):
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    torch.manual_seed(0)
    cfg = ModelParallelConfig(params_dtype=torch.float64, use_cpu_initialization=True)
    return VocabParallelEmbedding(vocab, hidden, init_method=torch.nn.init.normal_, config=cfg)


def _train(emb, batches, *, ddp_like: bool):
    """Each micro-batch: embed, a tied output projection, a loss; backward. ``ddp_like``: the
    parameter carries main_grad and, as megatron's DDP hook does, whatever autograd leaves in
    .grad is added into it after each backward. Returns the accumulated gradient."""
    w = emb.weight
    if ddp_like:
        w.main_grad = torch.zeros_like(w)
    for ids in batches:
        h = emb(ids)
        logits = h @ w.t()  # the tied output layer
        (logits.logsumexp(-1).sum() + (h ** 2).sum()).backward()
        if ddp_like and w.grad is not None:
            w.main_grad.add_(w.grad)
            w.grad = None
    return w.main_grad.clone() if ddp_like else w.grad.clone()


def test_rows_into_main_grad_equal_the_dense_backward():
    from varbatch_kit.train.model.embedding_grad import route_embedding_grads

    batches = [torch.tensor([[3, 7, 7, 1]]), torch.tensor([[0, 49, 3]]), torch.tensor([[7]])]
    with single_process_megatron("cpu"):
        plain = _train(_embedding(), batches, ddp_like=False)
        emb = _embedding()
        assert route_embedding_grads([emb]) == 1
        routed = _train(emb, batches, ddp_like=True)
        torch.testing.assert_close(routed, plain, rtol=1e-13, atol=1e-13)
        # rows no micro-batch used get only the output layer's share, as in the dense path
        assert torch.equal(routed[10] == 0, plain[10] == 0)
        # without gradients (the log-prob pass) and without main_grad: torch's own embedding
        with torch.no_grad():
            assert torch.equal(emb(batches[0]), emb.weight[batches[0]])
        bare = _embedding()
        route_embedding_grads([bare])
        assert torch.equal(_train(bare, batches, ddp_like=False), plain)


def test_a_dropped_row_gradient_is_caught():
    """The test above bites: an embedding backward that forgot its rows differs."""
    from varbatch_kit.train.model import embedding_grad

    batches = [torch.tensor([[3, 7, 7, 1]])]
    with single_process_megatron("cpu"):
        plain = _train(_embedding(), batches, ddp_like=False)
        emb = _embedding()
        embedding_grad.route_embedding_grads([emb])
        original = embedding_grad._EmbeddingIntoMainGrad.backward
        try:
            embedding_grad._EmbeddingIntoMainGrad.backward = staticmethod(
                lambda ctx, grad: (None, None))
            broken = _train(emb, batches, ddp_like=True)
        finally:
            embedding_grad._EmbeddingIntoMainGrad.backward = original
        assert not torch.allclose(broken, plain)
