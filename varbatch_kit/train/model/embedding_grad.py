"""CPU runs: the word embedding's gradient added into megatron's ``main_grad`` row by row.

torch's embedding backward builds a dense gradient of the whole table (vocabulary x hidden)
for the few rows a micro-batch uses; megatron's DDP hook then adds that table into the
parameter's ``main_grad``. With tied embeddings (SmolLM2) autograd first sums it with the
output layer's dense weight gradient. On a float64 SmolLM2 (49152 x 576) that is three passes
over 226 MB per micro-batch for a handful of rows (measured: 0.05 s for the backward and
0.04 s for each sum, one thread).

:func:`route_embedding_grads` makes each word embedding of a model wrapped by megatron's
DDP add its rows' gradients straight into ``main_grad`` (``index_add_``) and hand autograd no
gradient for the table; a tied output layer's gradient still reaches ``main_grad`` through
the hook. The sum is the same, added in another order (rounding only). Applied to CPU runs
whose parameters and ``main_grad`` share a dtype (fp32, fp64); without gradients (the log-prob
pass) or without ``main_grad`` the embedding is torch's own.
"""

from __future__ import annotations

import torch

__all__ = ["route_embedding_grads"]


class _EmbeddingIntoMainGrad(torch.autograd.Function):
    """``F.embedding(ids, weight)``; backward: ``weight.main_grad[ids] += grad`` only."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return torch.nn.functional.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        main = ctx.weight.main_grad
        main.index_add_(0, ids.reshape(-1), grad.reshape(-1, grad.shape[-1]).to(main.dtype))
        return None, None


def _embedding(ids, weight, *args, **kwargs):
    main = getattr(weight, "main_grad", None)
    if (args or kwargs or main is None or not torch.is_grad_enabled()
            or not weight.requires_grad or main.dtype != weight.dtype):
        return torch.nn.functional.embedding(ids, weight, *args, **kwargs)
    return _EmbeddingIntoMainGrad.apply(ids, weight)


class _FunctionalWithEmbedding:
    """``torch.nn.functional`` as one embedding module sees it: :func:`_embedding`."""

    embedding = staticmethod(_embedding)

    def __getattr__(self, name):
        return getattr(torch.nn.functional, name)


def route_embedding_grads(modules) -> int:
    """Every megatron ``VocabParallelEmbedding`` in ``modules`` adds its gradient into
    ``main_grad`` (module docstring); returns how many. Call after DDP gave the parameters
    their ``main_grad``."""
    import importlib

    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    layers = importlib.import_module(VocabParallelEmbedding.__module__)  # its F, to rebind
    count = 0
    for module in modules:
        for m in module.modules():
            if isinstance(m, VocabParallelEmbedding) and not m.deterministic_mode:
                m.forward = _bound_forward(m, layers)
                count += 1
    return count


def _bound_forward(module, layers):
    """``module.forward`` with ``F.embedding`` read as :func:`_embedding` (megatron's own
    forward otherwise: the TP mask, the reduction)."""
    functional = _FunctionalWithEmbedding()
    original = type(module).forward

    def forward(input_):
        saved = layers.F
        layers.F = functional
        try:
            return original(module, input_)
        finally:
            layers.F = saved

    return forward
