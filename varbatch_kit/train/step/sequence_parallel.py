"""Sequence parallelism, the step side: a packed row that splits evenly over the TP ranks,
and the response rows picked from the gathered sequence.

Under megatron's sequence parallelism (``TransformerConfig.sequence_parallel``, the run's
``layout.sp``) the embedding's output is scattered along the sequence over the ``tp``
ranks, so a packed row's length must be a multiple of ``tp``. :func:`padded_row` appends a
*pad segment* of fewer than ``tp`` tokens (token 0, positions from 0): per-sample attention
keeps it to itself, no response row reads it, so it changes no logit the loss uses and adds
exactly nothing to any gradient.

The output layer runs on the rows that predict response tokens only
(:func:`keep_rows_at_output`). Under sequence parallelism its input is this rank's slice
of the sequence: the hook gathers the slices (backward: this rank's slice of the gradient,
which the output layer's own backward has already summed over the TP ranks), selects the
rows, and runs the output layer as a plain column-parallel layer on them (its
``sequence_parallel`` off for that call: the input copied to the TP region, its gradient
all-reduced).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

__all__ = ["keep_rows_at_output", "pad_multiple", "padded_row", "thd_params"]


def pad_multiple(model) -> int:
    """The multiple a packed row's length must be for ``model`` (a GPT, a pipeline chunk or
    a wrapper of one): its tensor-parallel size under sequence parallelism, else 1."""
    from varbatch_kit.train.model.gpt import unwrap_model

    config = unwrap_model(model).config
    return int(config.tensor_model_parallel_size) if config.sequence_parallel else 1


def padded_row(input_ids: torch.Tensor, position_ids: torch.Tensor, lengths, multiple: int):
    """``(input_ids, position_ids, lengths)`` of a ``[1, T]`` row with a pad segment of
    ``(-T) % multiple`` tokens appended (none when ``T`` is a multiple already)."""
    lengths = [int(n) for n in lengths]
    pad = -sum(lengths) % int(multiple)
    if not pad:
        return input_ids, position_ids, lengths
    ids = torch.cat([input_ids, input_ids.new_zeros((1, pad))], dim=1)
    pos = torch.cat([position_ids, torch.arange(pad, device=position_ids.device)[None]], dim=1)
    return ids, pos, [*lengths, pad]


def thd_params(lengths, device=None):
    """megatron's ``PackedSeqParams`` (``thd``) of a row of segments of ``lengths``."""
    from megatron.core.packed_seq_params import PackedSeqParams

    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + int(n))
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    longest = max(int(n) for n in lengths)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


@contextmanager
def keep_rows_at_output(model, rows: torch.Tensor):
    """Within the block, ``model``'s output layer runs on the decoder's rows ``rows`` only
    (``[T, 1, H]`` -> ``[len(rows), 1, H]``); under sequence parallelism after gathering the
    sequence (see the module docstring)."""
    from varbatch_kit.train.model.gpt import unwrap_model

    layer = unwrap_model(model).output_layer
    sp = bool(getattr(layer, "sequence_parallel", False))

    def select(_module, args, kwargs):
        hidden = args[0]
        if sp:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden,
                                                          tensor_parallel_output_grad=False)
            layer.sequence_parallel = False
        return (hidden.index_select(0, rows), *args[1:]), kwargs

    def restore(_module, _args, _output):
        layer.sequence_parallel = sp

    handles = [layer.register_forward_pre_hook(select, with_kwargs=True),
               layer.register_forward_hook(restore)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        layer.sequence_parallel = sp
