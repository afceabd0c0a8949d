"""Packed micro-batches: several samples in one row, each attending only to itself.

A micro-batch of samples with token sequences ``t_1, ..., t_k`` (prompt +
response each) becomes one row of ``sum(len(t_i))`` tokens:

- ``tokens``: the sequences concatenated, shape ``[1, T]``;
- ``position_ids``: ``0..len(t_i)-1`` for each sample (learned absolute
  positions restart per sample, so a sample's positions do not depend on
  where it sits in the row);
- ``attention_mask``: block-diagonal causal, shape ``[1, 1, T, T]``, ``True``
  where attention is *blocked* (megatron-core's convention): token ``q`` of a
  sample sees tokens ``k <= q`` of the same sample only.

Together these make every sample's logits equal (to float rounding) to
running it alone, which the tests check. This is the CPU replacement for the
``thd`` packed format (which needs TransformerEngine).

The logit at row position ``j`` predicts the token at ``j + 1``; for a sample
of prompt length ``P`` and response length ``R`` at row offset ``o``, its
response tokens ``[o+P, o+P+R)`` are predicted by the logits at
``[o+P-1, o+P+R-1)`` (see :meth:`PackedBatch.response_positions`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["PackedBatch", "block_causal_mask", "pack", "response_token_stats"]


def block_causal_mask(lengths: Sequence[int], device=None) -> torch.Tensor:
    """``[1, 1, T, T]`` bool mask, True = blocked: causal within each block, nothing across."""
    lengths = [int(n) for n in lengths]
    total = sum(lengths)
    seg = torch.repeat_interleave(
        torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device)
    )
    pos = torch.arange(total, device=device)
    allowed = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    return (~allowed)[None, None]


@dataclass(frozen=True)
class PackedBatch:
    """One packed micro-batch (see the module docstring).

    ``sample_indices`` are the samples' global indices (Rollouts order), in
    packing order; ``lengths``, ``prompt_lens`` and ``offsets`` follow it.
    """

    sample_indices: np.ndarray
    tokens: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    lengths: tuple[int, ...]
    prompt_lens: tuple[int, ...]
    offsets: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def response_lens(self) -> tuple[int, ...]:
        return tuple(t - p for t, p in zip(self.lengths, self.prompt_lens))

    def response_positions(self) -> torch.Tensor:
        """Row positions of the logits that predict each response token (samples concatenated)."""
        pos = [
            torch.arange(o + p - 1, o + t - 1)
            for o, p, t in zip(self.offsets, self.prompt_lens, self.lengths)
        ]
        return torch.cat(pos).to(self.tokens.device)

    def to(self, device) -> PackedBatch:
        return PackedBatch(
            self.sample_indices,
            self.tokens.to(device),
            self.position_ids.to(device),
            self.attention_mask.to(device),
            self.lengths,
            self.prompt_lens,
            self.offsets,
        )


def pack(
    sequences: Sequence[np.ndarray],
    prompt_lens: Sequence[int],
    sample_indices: Sequence[int] | None = None,
    device=None,
) -> PackedBatch:
    """Pack token sequences (prompt + response each) into one row.

    Every sample needs a prompt of at least one token (the first response
    token is predicted from the last prompt token).
    """
    if len(sequences) == 0:
        raise ValueError("pack() needs at least one sequence")
    lengths = tuple(len(s) for s in sequences)
    prompts = tuple(int(p) for p in prompt_lens)
    if len(prompts) != len(lengths):
        raise ValueError(f"{len(prompts)} prompt lengths for {len(lengths)} sequences")
    for i, (t, p) in enumerate(zip(lengths, prompts)):
        if not 1 <= p < t:
            raise ValueError(
                f"sample {i}: prompt_len={p}, total length {t}; packing needs 1 <= prompt_len < "
                "total length (a response token is predicted from the token before it)"
            )
    offsets = tuple(int(o) for o in np.concatenate([[0], np.cumsum(lengths)[:-1]]))
    tokens = torch.from_numpy(np.concatenate([np.asarray(s, dtype=np.int64) for s in sequences]))
    position_ids = torch.cat([torch.arange(n) for n in lengths])
    idx = np.arange(len(lengths)) if sample_indices is None else np.asarray(sample_indices)
    return PackedBatch(
        sample_indices=idx.astype(np.int64),
        tokens=tokens[None].to(device),
        position_ids=position_ids[None].to(device),
        attention_mask=block_causal_mask(lengths, device=device),
        lengths=lengths,
        prompt_lens=prompts,
        offsets=offsets,
    )


def response_token_stats(logits: torch.Tensor, batch: PackedBatch) -> dict[str, torch.Tensor]:
    """Per-response-token values of a packed batch, samples concatenated (float64).

    ``logits`` has shape ``[1, T, V]`` (or ``[T, V]``). The log-softmax runs in
    float64: the loss and report sums that follow add many signed terms whose
    float32 rounding would otherwise show at the 1e-5 level when packing
    changes the summation order. Returns

    - ``logprob``: log-probability of each response token (differentiable),
    - ``entropy``: entropy of the predicting distribution (detached),
    - ``correct``: 1.0 where the argmax equals the response token (detached).
    """
    if logits.dim() == 3:
        logits = logits[0]
    pos = batch.response_positions()
    targets = batch.tokens[0, pos + 1]
    logp_all = torch.log_softmax(logits[pos].double(), dim=-1)
    logprob = logp_all.gather(-1, targets[:, None])[:, 0]
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        correct = (logp_all.argmax(-1) == targets).double()
    return {"logprob": logprob, "entropy": entropy, "correct": correct}
