"""One CP rank's share of a packed micro-batch: its inputs, the logits of the response tokens
it holds and their log-prob / entropy statistics.
"""

from __future__ import annotations

import torch

from varbatch_kit.train.parallel.cp_attention import CPShare, all_gather_rows, cp_share_active

__all__ = ['chunk_output', 'chunk_stats', 'cp_response_logits', 'cp_response_stats',
           'cp_stage_forward', 'local_inputs']


def local_inputs(batch, share: CPShare, multiple: int = 1) -> dict:
    """The local row's ``input_ids``, ``position_ids`` (original positions) and
    ``packed_seq_params`` (per-sample local lengths); under sequence parallelism
    (``multiple``: tp) a pad segment after them
    (:func:`~varbatch_kit.train.step.sequence_parallel.padded_row`)."""
    from varbatch_kit.train.step.sequence_parallel import padded_row, thd_params

    rows = share.local_row.to(batch.tokens.device)
    ids, pos, lens = padded_row(batch.tokens[:, rows], batch.position_ids[:, rows],
                                share.local_lengths(), multiple)
    return {"input_ids": ids, "position_ids": pos, "attention_mask": None,
            "packed_seq_params": thd_params(lens, batch.tokens.device)}


def cp_response_logits(model, batch, share: CPShare) -> torch.Tensor:
    """``model`` on this rank's share of ``batch``: logits ``[1, n, V]`` of the local rows
    that predict response tokens (see :attr:`CPShare.response_rows`)."""
    from varbatch_kit.train.step.sequence_parallel import keep_rows_at_output

    with keep_rows_at_output(model, share.local_response_rows.to(batch.tokens.device)):
        return cp_stage_forward(model, batch, share)


def cp_stage_forward(model, batch, share: CPShare) -> torch.Tensor:
    """``model`` (a whole model, or a pipeline stage whose input arrives from the previous
    stage) on this rank's share of ``batch``: the output of the local rows."""
    from varbatch_kit.train.step.sequence_parallel import pad_multiple

    inputs = local_inputs(batch, share, pad_multiple(model))
    with cp_share_active(share):
        return model(inputs.pop("input_ids"), inputs.pop("position_ids"), **inputs)


def chunk_output(model, batch, share: CPShare | None, *, post_process: bool = True):
    """What ``model`` (a whole model or a pipeline chunk) gives for ``batch``: with
    ``post_process`` the logits at the rows that predict response tokens, else the hidden
    states for the next stage; of the whole row, or (``share``, all-gather CP) of this rank's
    share."""
    from varbatch_kit.train.step.packed_batch import response_logits

    if post_process:
        return (response_logits(model, batch) if share is None
                else cp_response_logits(model, batch, share))
    if share is None:
        from varbatch_kit.train.step.sequence_parallel import pad_multiple

        input_ids, position_ids, kwargs = batch.model_args(pad_multiple(model))
        return model(input_ids, position_ids, **kwargs)
    return cp_stage_forward(model, batch, share)


def cp_response_stats(logits: torch.Tensor, batch, share: CPShare, *, temperature: float = 1.0,
                      entropy_grad: bool = False, tp_group=None,
                      vocab_start: int = 0) -> dict[str, torch.Tensor]:
    """:func:`~varbatch_kit.train.step.packed_batch.response_token_stats` of the *full*
    responses from this rank's local logits: the local values computed by the same chunked
    kernel as without CP (:func:`~varbatch_kit.report.objective.token_stats.chunked_token_stats`:
    float32 chunks of tokens, or the logits' dtype when wider, per-token sums in float64; no
    float64 ``[R, V]`` tensor, no full log-softmax kept for backward), then all-gathered over
    the group (autograd). ``tp_group``, ``vocab_start``: vocab-parallel logits (tp > 1, see
    :func:`~varbatch_kit.train.parallel.tensor_parallel.vocab_shard`): the kernel combines the
    TP ranks' shards per token before the CP exchange."""
    from varbatch_kit.report.objective.token_stats import chunked_token_stats

    if logits.dim() == 3:
        logits = logits[0]
    rows = share.response_rows[share.rank]
    full_pos = [share.offsets[i] + share.prompt_lens[i] - 1 + q for _, i, q in rows]
    pos = torch.tensor(full_pos, dtype=torch.long, device=batch.tokens.device)
    targets = batch.tokens[0, pos + 1]
    if logits.shape[0] != pos.numel():
        raise ValueError(f"{logits.shape[0]} logit rows for {pos.numel()} local response tokens")
    stats = chunked_token_stats(logits, targets, temperature=temperature,
                                entropy_grad=entropy_grad, tp_group=tp_group,
                                vocab_start=vocab_start)
    entropy = stats["entropy"] if entropy_grad else stats["entropy"].detach()
    # one exchange for all three
    local = torch.stack([stats["logprob"], entropy, stats["correct"].detach()], dim=1)
    full = all_gather_rows(local, share, share.max_response_rows, share.response_index)
    return {"logprob": full[:, 0], "entropy": full[:, 1] if entropy_grad else full[:, 1].detach(),
            "correct": full[:, 2].detach()}


def chunk_stats(logits: torch.Tensor, batch, share: CPShare | None, *, tp_rank: int = 0,
                tp_size: int = 1, temperature: float = 1.0,
                entropy_grad: bool = False) -> dict[str, torch.Tensor]:
    """The response tokens' statistics from :func:`chunk_output`'s logits: of the whole row
    (:func:`~varbatch_kit.train.step.packed_batch.response_token_stats`), or (``share``,
    all-gather CP) of the full responses gathered from the group's shares
    (:func:`cp_response_stats`); vocab-parallel over the ``tp_size`` TP ranks."""
    from varbatch_kit.train.parallel.tensor_parallel import vocab_shard
    from varbatch_kit.train.step.packed_batch import response_token_stats

    kw = dict(temperature=temperature, entropy_grad=entropy_grad,
              **vocab_shard(logits, tp_rank=tp_rank, tp_size=tp_size))
    if share is None:
        return response_token_stats(logits, batch, at_response_rows=True, **kw)
    return cp_response_stats(logits, batch, share, **kw)
