"""Log-probabilities and entropies of the sampled tokens, from the model's logits.

The forward pass of slime's ``get_log_probs_and_entropy`` without the tensor
parallelism: the logits are cast to float32 (or float64 on request) and divided by the rollout
temperature (when it is not 1), then per row ``log_prob = x[token] -
logsumexp(x)`` and ``entropy = logsumexp(x) - sum(softmax(x) * x)``. Both are
differentiable through autograd (the gradients are slime's closed forms:
``(onehot - softmax) * g`` and ``softmax * (E[x] - x) * g``).

:func:`response_log_probs_and_entropy` cuts each sample's response rows out of
a packed micro-batch: sample ``i`` occupies ``total_lengths[i]`` rows, and
the logits that predict its ``R`` response tokens are the ``R`` rows ending
one before its last row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["response_log_probs_and_entropy", "token_log_probs_and_entropy"]


def token_log_probs_and_entropy(logits: torch.Tensor, tokens: torch.Tensor,
                                temperature: float = 1.0, *, dtype: torch.dtype = torch.float32
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_probs [N], entropy [N])`` of ``tokens [N]`` under ``logits [N, V]`` / temperature.

    Computed in ``dtype`` whatever the logits' dtype: float32 is slime's;
    float64 keeps float32 rounding out of later layout-sensitive sums.
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    if tokens.shape != logits.shape[:1]:
        raise ValueError(f"tokens has shape {tuple(tokens.shape)}; pass one token per logits "
                         f"row ({logits.shape[0]})")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r}: must be > 0")
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype={dtype}: use torch.float32 (slime's) or torch.float64")
    x = logits.to(dtype)
    if temperature != 1.0:
        x = x / temperature
    if x.shape[0] == 0:
        return x.new_zeros(0), x.new_zeros(0)
    logz = torch.logsumexp(x, dim=-1)
    log_probs = x.gather(-1, tokens.long()[:, None])[:, 0] - logz
    entropy = logz - (torch.softmax(x, dim=-1) * x).sum(-1)
    return log_probs, entropy


def response_log_probs_and_entropy(
    logits: torch.Tensor, tokens: Sequence[torch.Tensor], total_lengths: Sequence[int],
    response_lengths: Sequence[int], temperature: float = 1.0, *,
    dtype: torch.dtype = torch.float32,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per sample, the response tokens' log-probs and entropies from packed ``logits [T, V]``.

    ``tokens[i]`` is sample ``i``'s prompt + response (its last
    ``response_lengths[i]`` entries are scored); rows past ``sum(total_lengths)``
    (padding) are not read. Every prompt must hold at least one token.
    """
    if not len(tokens) == len(total_lengths) == len(response_lengths):
        raise ValueError(f"tokens, total_lengths, response_lengths differ in length: "
                         f"{len(tokens)}, {len(total_lengths)}, {len(response_lengths)}")
    if logits.ndim != 2:
        raise ValueError(f"logits must be [T, V], got shape {tuple(logits.shape)}")
    if sum(total_lengths) > logits.shape[0]:
        raise ValueError(f"sum(total_lengths)={sum(total_lengths)} exceeds the "
                         f"{logits.shape[0]} logits rows")
    rows, targets, end = [], [], 0
    for i, (tok, total, resp) in enumerate(zip(tokens, total_lengths, response_lengths,
                                               strict=True)):
        if not 0 <= resp < total:
            raise ValueError(f"sample {i}: response_length={resp}, total_length={total}; "
                             "need 0 <= response_length < total_length (a prompt token)")
        end += total
        rows.append(torch.arange(end - resp - 1, end - 1))
        targets.append(tok[total - resp:total])
    index = torch.cat(rows).to(logits.device) if rows else torch.zeros(0, dtype=torch.long)
    target = torch.cat(targets).to(logits.device) if targets else index
    log_probs, entropy = token_log_probs_and_entropy(logits[index], target, temperature,
                                                     dtype=dtype)
    sizes = list(response_lengths)
    return list(log_probs.split(sizes)), list(entropy.split(sizes))
