"""The norms of every model built here: torch's ``LayerNorm`` / ``RMSNorm``, usable under
sequence parallelism.

megatron-core's local layer spec builds its norms with ``WrappedTorchNorm`` when neither
TransformerEngine nor apex is installed (as here), and that wrapper refuses
``sequence_parallel``. Under sequence parallelism a norm runs on each tensor-parallel
rank's slice of the sequence, so its replicated weight gets a partial gradient on every
rank; megatron sums such gradients over the TP group in ``finalize_model_grads`` for the
parameters that carry ``sequence_parallel=True``. :class:`TorchNorm` builds the same torch
module as ``WrappedTorchNorm`` and sets that attribute (``config.sequence_parallel``) on
its parameters, as megatron's apex and TransformerEngine norms do.
"""

from __future__ import annotations

import torch

__all__ = ["TorchNorm", "mark_sequence_parallel"]


def mark_sequence_parallel(module: torch.nn.Module, value: bool) -> torch.nn.Module:
    """Set ``sequence_parallel=value`` on every parameter of ``module``; returns it."""
    for p in module.parameters():
        p.sequence_parallel = bool(value)
    return module


class TorchNorm:
    """megatron's norm factory signature, torch's modules: ``TorchNorm(config, hidden_size,
    eps)`` is a ``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` (``config.normalization``)
    whose parameters are marked ``sequence_parallel`` as the config says."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5,
                persist_layer_norm: bool = False, zero_centered_gamma: bool = False,
                normalization: str = "LayerNorm"):
        if config.layernorm_zero_centered_gamma or zero_centered_gamma:
            raise ValueError("layernorm_zero_centered_gamma=True: the torch norms have no "
                             "zero-centred gamma; use False")
        kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in kinds:
            raise ValueError(f"normalization={config.normalization!r}: use one of "
                             f"{', '.join(kinds)}")
        norm = kinds[config.normalization](normalized_shape=hidden_size, eps=eps)
        return mark_sequence_parallel(norm, config.sequence_parallel)
