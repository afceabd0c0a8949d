"""Packed micro-batches: several samples in one row, each attending only to itself.

A micro-batch of samples with token sequences ``t_1, ..., t_k`` (prompt +
response each) becomes one row of ``T = sum(len(t_i))`` tokens:

- ``tokens``: the sequences concatenated, shape ``[1, T]``;
- ``position_ids``: ``0..len(t_i)-1`` for each sample (learned absolute
  positions restart per sample, so a sample's positions do not depend on
  where it sits in the row);
- ``cu_seqlens``: the segment boundaries ``[0, L_1, L_1 + L_2, ..., T]``
  (int32), megatron's ``thd`` convention.

Two attention paths (``pack(..., attention=...)``):

- ``"per_sample"`` (default): no mask is built. The model gets
  ``attention_mask=None`` and :attr:`PackedBatch.packed_seq_params`, a
  megatron ``PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, ...)``
  that megatron passes down to core attention; with the local layer spec of
  :func:`varbatch_kit.train.model.attention.local_layer_spec` every sample attends
  causally to itself only, costing ``sum(L_i^2)``. Rotary embeddings restart
  per sample on this path (megatron's ``thd`` rope).
- ``"dense"``: the reference. ``attention_mask`` is block-diagonal causal,
  shape ``[1, 1, T, T]``, ``True`` where attention is *blocked*
  (megatron-core's convention): token ``q`` of a sample sees tokens ``k <= q``
  of the same sample only. Costs ``T^2`` however the row is packed. Works with
  megatron's own ``DotProductAttention`` too.

:meth:`PackedBatch.model_inputs` gives the attention arguments of the batch's
path for ``GPTModel.forward``. On the per-sample path ``attention_mask`` is
still available, built on request (for the reference and for callers that
pass a mask themselves).

Both paths make every sample's logits equal (to float rounding) to running
it alone, which the tests check. This is the CPU replacement for the ``thd``
packed format of TransformerEngine.

The logit at row position ``j`` predicts the token at ``j + 1``; for a sample
of prompt length ``P`` and response length ``R`` at row offset ``o``, its
response tokens ``[o+P, o+P+R)`` are predicted by the logits at
``[o+P-1, o+P+R-1)`` (see :meth:`PackedBatch.response_positions`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from varbatch_kit.report.objective.token_stats import chunked_token_stats

__all__ = ["ATTENTION_PATHS", "PackedBatch", "block_causal_mask", "pack", "response_token_stats"]

#: the attention paths of :func:`pack`
ATTENTION_PATHS = ("per_sample", "dense")


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


def _cu_seqlens(lengths: Sequence[int], device=None) -> torch.Tensor:
    cu = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    return torch.tensor(cu, dtype=torch.int32, device=device)


@dataclass(frozen=True)
class PackedBatch:
    """One packed micro-batch (see the module docstring).

    ``sample_indices`` are the samples' global indices (Rollouts order), in
    packing order; ``lengths``, ``prompt_lens`` and ``offsets`` follow it.
    ``dense_mask`` is the ``[1, 1, T, T]`` mask on the ``"dense"`` path and
    ``None`` on the ``"per_sample"`` path.
    """

    sample_indices: np.ndarray
    tokens: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    lengths: tuple[int, ...]
    prompt_lens: tuple[int, ...]
    offsets: tuple[int, ...]
    attention: str = "per_sample"
    dense_mask: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def response_lens(self) -> tuple[int, ...]:
        return tuple(t - p for t, p in zip(self.lengths, self.prompt_lens))

    @property
    def attention_mask(self) -> torch.Tensor:
        """The block-diagonal causal ``[1, 1, T, T]`` mask (built now on the per-sample path)."""
        if self.dense_mask is not None:
            return self.dense_mask
        return block_causal_mask(self.lengths, device=self.tokens.device)

    @property
    def packed_seq_params(self):
        """megatron's ``PackedSeqParams`` (``thd``) on the per-sample path, else ``None``."""
        if self.attention != "per_sample":
            return None
        from megatron.core.packed_seq_params import PackedSeqParams

        longest = max(self.lengths)
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens,
                               cu_seqlens_kv=self.cu_seqlens, max_seqlen_q=longest,
                               max_seqlen_kv=longest)

    def model_inputs(self) -> dict:
        """``attention_mask`` and ``packed_seq_params`` for ``GPTModel.forward`` on this path."""
        if self.attention == "per_sample":
            return {"attention_mask": None, "packed_seq_params": self.packed_seq_params}
        return {"attention_mask": self.dense_mask, "packed_seq_params": None}

    def model_args(self, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """``(input_ids, position_ids, kwargs)`` for ``GPTModel.forward``; the row padded to a
        multiple of ``multiple`` (sequence parallelism:
        :func:`~varbatch_kit.train.step.sequence_parallel.padded_row`, a pad segment of its own
        that no response row reads)."""
        from varbatch_kit.train.step.sequence_parallel import padded_row, thd_params

        ids, pos, lengths = padded_row(self.tokens, self.position_ids, self.lengths, multiple)
        if len(lengths) == len(self.lengths):
            return self.tokens, self.position_ids, self.model_inputs()
        if self.attention == "per_sample":
            return ids, pos, {"attention_mask": None,
                              "packed_seq_params": thd_params(lengths, self.tokens.device)}
        return ids, pos, {"attention_mask": block_causal_mask(lengths, self.tokens.device),
                          "packed_seq_params": None}

    def response_positions(self) -> torch.Tensor:
        """Row positions of the logits that predict each response token (samples concatenated)."""
        pos = [
            torch.arange(o + p - 1, o + t - 1)
            for o, p, t in zip(self.offsets, self.prompt_lens, self.lengths)
        ]
        return torch.cat(pos).to(self.tokens.device)

    def to(self, device) -> PackedBatch:
        return replace(
            self,
            tokens=self.tokens.to(device),
            position_ids=self.position_ids.to(device),
            cu_seqlens=self.cu_seqlens.to(device),
            dense_mask=None if self.dense_mask is None else self.dense_mask.to(device),
        )


def pack(
    sequences: Sequence[np.ndarray],
    prompt_lens: Sequence[int],
    sample_indices: Sequence[int] | None = None,
    device=None,
    attention: str = "per_sample",
) -> PackedBatch:
    """Pack token sequences (prompt + response each) into one row.

    Every sample needs a prompt of at least one token (the first response
    token is predicted from the last prompt token). ``attention`` is
    ``"per_sample"`` (segment boundaries only, no ``[T, T]`` mask) or
    ``"dense"`` (the block-diagonal mask, the reference).
    """
    if attention not in ATTENTION_PATHS:
        raise ValueError(f"attention={attention!r}: use one of {', '.join(ATTENTION_PATHS)}")
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
        cu_seqlens=_cu_seqlens(lengths, device=device),
        lengths=lengths,
        prompt_lens=prompts,
        offsets=offsets,
        attention=attention,
        dense_mask=block_causal_mask(lengths, device=device) if attention == "dense" else None,
    )


def response_logits(model, batch: PackedBatch) -> torch.Tensor:
    """``model``'s logits at the rows that predict response tokens only: ``[1, R, V]``.

    The loss reads the logits of response tokens alone, so the output layer
    (``hidden x vocab`` per token: the largest matmul of a small model with a
    large vocabulary, e.g. SmolLM2's 576 x 49152) runs on those rows only: a
    forward pre-hook on megatron-core's ``output_layer`` selects them from the
    decoder's ``[T, 1, H]`` hidden states. Each row's logits are the same
    computation as in the full forward; prompt rows are skipped. Under sequence parallelism
    the row is padded to a multiple of tp and the rows are picked from the gathered sequence
    (:mod:`~varbatch_kit.train.step.sequence_parallel`).
    """
    from varbatch_kit.train.step.sequence_parallel import keep_rows_at_output, pad_multiple

    input_ids, position_ids, kwargs = batch.model_args(pad_multiple(model))
    with keep_rows_at_output(model, batch.response_positions()):
        return model(input_ids, position_ids, **kwargs)


def response_token_stats(logits: torch.Tensor, batch: PackedBatch, *,
                         at_response_rows: bool = False, temperature: float = 1.0,
                         entropy_grad: bool = False, tp_group=None,
                         vocab_start: int = 0) -> dict[str, torch.Tensor]:
    """Per-response-token values of a packed batch, samples concatenated (float64).

    ``logits`` has shape ``[1, T, V]`` (or ``[T, V]``); with
    ``at_response_rows=True`` only the rows that predict response tokens, as
    :func:`response_logits` gives them (``[1, R, V]``). The logits are divided
    by ``temperature`` (the rollouts' sampling temperature, as slime does).
    :func:`~varbatch_kit.report.objective.token_stats.chunked_token_stats`
    computes the values: the ``[R, V]`` work in float32 chunks of tokens (never
    a float64 ``[R, V]`` nor a full log-softmax; the softmax is recomputed per
    chunk in backward), the per-token sums in float64. The results are float64 ``[R]``: the loss and
    report sums that follow add many signed terms whose float32 rounding
    would otherwise show at the 1e-5 level when packing changes the summation
    order. With tensor parallelism the logits are this rank's vocab shard
    (megatron's ``parallel_output=True``): ``tp_group`` is the tensor-parallel
    group and ``vocab_start`` the shard's first token id
    (:func:`varbatch_kit.train.parallel.tensor_parallel.vocab_shard` gives both); the
    values are computed vocab-parallel, no full-vocab gather, and every rank of
    the group gets the same. Returns

    - ``logprob``: log-probability of each response token (differentiable),
    - ``entropy``: entropy of the predicting distribution (differentiable with
      ``entropy_grad``, for an entropy bonus; else detached),
    - ``correct``: 1.0 where the argmax equals the response token (detached).
    """
    if logits.dim() == 3:
        logits = logits[0]
    pos = batch.response_positions()
    targets = batch.tokens[0, pos + 1]
    if at_response_rows:
        if logits.shape[0] != pos.numel():
            raise ValueError(f"{logits.shape[0]} logit rows for {pos.numel()} response tokens")
    else:
        logits = logits[pos]
    return chunked_token_stats(logits, targets, temperature=temperature, entropy_grad=entropy_grad,
                               tp_group=tp_group, vocab_start=vocab_start)
