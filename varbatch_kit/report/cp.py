"""Zigzag context-parallel (CP) slicing: which tokens of a sample each CP rank sees.

Under zigzag CP a sequence of ``T`` tokens is cut into ``2 * cp_size`` chunks of
``chunk_size = ceil(T / (2 * cp_size))`` tokens (the last ones may run past ``T``:
that is padding). CP rank ``r`` owns chunk ``r`` and chunk ``2 * cp_size - 1 - r``,
so every rank holds one early and one late chunk and the causal-attention work is
balanced.

A language model's logit at position ``j`` predicts token ``j + 1``. With prompt
length ``P = T - R`` the response tokens sit at positions ``[P, T)`` and are
predicted by the logits at ``[P - 1, T - 1)``. For each owned chunk ``[c0, c1)``
the rank therefore scores

- the logits range ``[max(c0, P - 1), min(c1, T - 1))`` (empty when start >= end),
- the token range, that range shifted by ``+1``,
- the response positions ``token - P``: a contiguous piece of the response.

The owned pieces of all CP ranks tile ``[0, R)`` exactly once, so any per-token
sum computed on CP-local slices adds up over the CP group to the full-sequence
sum. This is what makes the reporting math in :mod:`varbatch_kit.report`
CP-invariant.

Everything here is pure: integers in, integers (or sliced tensors) out. The CP
rank and size are always arguments; nothing asks a process group for them.

Per-sample CP degrees (dynamic CP)
----------------------------------
Under dynamic CP every micro-batch runs on its own group of ``c`` ranks, so
each sample has its own degree. The flat-tensor functions below accept
``cp_size`` (and ``cp_rank``) either as one int for every sample, or as a
sequence with one entry per sample: sample ``i`` is then cut by the zigzag rule
of its own degree ``cp_size[i]`` and seen from its own rank ``cp_rank[i]``.
The int path is unchanged. :func:`per_sample_cp` broadcasts either form and
:func:`reference_cp_size` gives the one degree ``K`` (the least common multiple
of the degrees) that the per-token count uses (see
:meth:`varbatch_kit.report.ReportMode.count_slot`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from varbatch_kit.report.validation import as_int

__all__ = [
    "ZigzagSlice",
    "cp_local_response_length",
    "cp_local_response_lengths",
    "per_sample_cp",
    "reference_cp_size",
    "slice_flat_responses_for_cp",
    "slice_response_for_cp",
    "validate_cp",
    "zigzag_chunk_size",
    "zigzag_slice",
]

Range = tuple[int, int]
EMPTY: Range = (0, 0)


@dataclass(frozen=True)
class ZigzagSlice:
    """What CP rank ``cp_rank`` of ``cp_size`` sees of one sample.

    Ranges are half-open ``(start, end)`` pairs. ``chunks``, ``logits_ranges``
    and ``token_ranges`` count from the beginning of the prompt;
    ``response_ranges`` count from the first response token. An empty range is
    ``(0, 0)`` (the convention slime uses).
    """

    total_length: int
    response_length: int
    cp_rank: int
    cp_size: int
    chunk_size: int
    chunks: tuple[Range, Range]
    logits_ranges: tuple[Range, Range]
    token_ranges: tuple[Range, Range]
    response_ranges: tuple[Range, Range]

    @property
    def prompt_length(self) -> int:
        return self.total_length - self.response_length

    @property
    def local_response_length(self) -> int:
        """Number of response tokens (and loss-mask entries) this rank sees."""
        return sum(end - start for start, end in self.response_ranges)


def validate_cp(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """Check ``cp_size >= 1`` and ``0 <= cp_rank < cp_size``; return both as ints.

    Raises ``ValueError`` naming the bad value otherwise.
    """
    cp_size = as_int("cp_size", cp_size)
    cp_rank = as_int("cp_rank", cp_rank)
    if cp_size < 1:
        raise ValueError(f"cp_size={cp_size!r} is invalid; it must be an integer >= 1")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(
            f"cp_rank={cp_rank!r} is outside [0, cp_size) = [0, {cp_size}); "
            f"pass an integer 0..{cp_size - 1}"
        )
    return cp_rank, cp_size


CpSizes = int | Sequence[int]


def _is_sequence(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() == 1
    return isinstance(value, Sequence) or (
        hasattr(value, "__len__") and hasattr(value, "__getitem__") and not isinstance(value, str)
    )


def per_sample_cp(
    cp_rank: int | Sequence[int], cp_size: CpSizes, num_samples: int
) -> tuple[list[int], list[int]] | None:
    """Per-sample ``(cp_ranks, cp_sizes)`` when either argument is a sequence, else ``None``.

    An int is broadcast to every sample; a sequence must have ``num_samples``
    entries; every pair is checked by :func:`validate_cp`. ``None`` means both
    are ints (the uniform path, which callers keep unchanged).
    """
    rank_seq, size_seq = _is_sequence(cp_rank), _is_sequence(cp_size)
    if not rank_seq and not size_seq:
        return None
    out = []
    for name, value, is_seq in (("cp_rank", cp_rank, rank_seq), ("cp_size", cp_size, size_seq)):
        if is_seq:
            items = value.tolist() if isinstance(value, torch.Tensor) else list(value)
            if len(items) != num_samples:
                raise ValueError(
                    f"{name} has {len(items)} entries but there are {num_samples} samples; "
                    f"pass one int for every sample or one entry per sample"
                )
            out.append([as_int(f"{name}[{i}]", v) for i, v in enumerate(items)])
        else:
            out.append([as_int(name, value)] * num_samples)
    ranks, sizes = out
    for i, (r, c) in enumerate(zip(ranks, sizes)):
        try:
            validate_cp(r, c)
        except ValueError as err:
            raise ValueError(f"sample {i}: {err}") from None
    return ranks, sizes


def reference_cp_size(cp_size: CpSizes) -> int:
    """The step's reference CP degree ``K``: ``cp_size`` itself, or the lcm of per-sample degrees.

    Every degree divides ``K``, so a sample of degree ``c`` counted ``K / c``
    times by each of its ``c`` ranks is counted ``K`` times over the group: the
    fixed-CP rule (every rank counts in full, ``K = cp``) generalised.

    >>> reference_cp_size(4), reference_cp_size([1, 2, 4, 2]), reference_cp_size([2, 3])
    (4, 4, 6)
    """
    if not _is_sequence(cp_size):
        return validate_cp(0, cp_size)[1]  # type: ignore[arg-type]
    items = cp_size.tolist() if isinstance(cp_size, torch.Tensor) else list(cp_size)
    if not items:
        raise ValueError("cp_size is an empty sequence; pass an int or one degree per sample")
    k = 1
    for i, c in enumerate(items):
        k = math.lcm(k, validate_cp(0, as_int(f"cp_size[{i}]", c))[1])
    return k


def _check_response_fits(total_length: int, response_length: int) -> None:
    if response_length > total_length:
        raise ValueError(
            f"response_length={response_length} > total_length={total_length}; the response "
            f"is part of the sequence, so response_length must be <= total_length"
        )


def _validate_lengths(total_length: int, response_length: int) -> tuple[int, int]:
    total_length = as_int("total_length", total_length)
    response_length = as_int("response_length", response_length)
    if total_length < 1:
        raise ValueError(f"total_length={total_length!r} is invalid; it must be an integer >= 1")
    if response_length < 0:
        raise ValueError(
            f"response_length={response_length!r} is invalid; it must be an integer >= 0"
        )
    _check_response_fits(total_length, response_length)
    if response_length > 0 and response_length == total_length:
        raise ValueError(
            f"response_length={response_length} == total_length={total_length} (no prompt): "
            f"the first response token is predicted by the last prompt token's logit, so CP "
            f"slicing needs total_length >= response_length + 1"
        )
    return total_length, response_length


def zigzag_chunk_size(total_length: int, cp_size: int) -> int:
    """``ceil(total_length / (2 * cp_size))``: the length of each of the ``2*cp`` chunks."""
    _, cp_size = validate_cp(0, cp_size)
    total_length = as_int("total_length", total_length)
    if total_length < 1:
        raise ValueError(f"total_length={total_length!r} is invalid; it must be an integer >= 1")
    return -(-total_length // (2 * cp_size))


def zigzag_slice(
    total_length: int, response_length: int, *, cp_rank: int, cp_size: int
) -> ZigzagSlice:
    """The chunks, logits ranges, token ranges and response ranges CP rank ``cp_rank`` owns.

    >>> s = zigzag_slice(12, 8, cp_rank=0, cp_size=2)   # P = 4, chunks of 3
    >>> s.chunks, s.logits_ranges, s.response_ranges
    (((0, 3), (9, 12)), ((0, 0), (9, 11)), ((0, 0), (6, 8)))
    """
    cp_rank, cp_size = validate_cp(cp_rank, cp_size)
    total_length, response_length = _validate_lengths(total_length, response_length)
    prompt_length = total_length - response_length
    chunk_size = zigzag_chunk_size(total_length, cp_size)
    chunk_ids = (cp_rank, 2 * cp_size - 1 - cp_rank)
    chunks = tuple((k * chunk_size, (k + 1) * chunk_size) for k in chunk_ids)
    logits, tokens, responses = [], [], []
    for c0, c1 in chunks:
        start, end = max(c0, prompt_length - 1), min(c1, total_length - 1)
        if start < end:
            logits.append((start, end))
            tokens.append((start + 1, end + 1))
            responses.append((start + 1 - prompt_length, end + 1 - prompt_length))
        else:
            logits.append(EMPTY)
            tokens.append(EMPTY)
            responses.append(EMPTY)
    return ZigzagSlice(
        total_length=total_length,
        response_length=response_length,
        cp_rank=cp_rank,
        cp_size=cp_size,
        chunk_size=chunk_size,
        chunks=chunks,  # type: ignore[arg-type]
        logits_ranges=tuple(logits),  # type: ignore[arg-type]
        token_ranges=tuple(tokens),  # type: ignore[arg-type]
        response_ranges=tuple(responses),  # type: ignore[arg-type]
    )


def cp_local_response_length(
    total_length: int, response_length: int, *, cp_rank: int, cp_size: int
) -> int:
    """How many response tokens CP rank ``cp_rank`` sees (``response_length`` when cp=1)."""
    cp_rank, cp_size = validate_cp(cp_rank, cp_size)
    if cp_size == 1:
        total_length = as_int("total_length", total_length)
        response_length = as_int("response_length", response_length)
        _check_response_fits(total_length, response_length)
        return response_length
    return zigzag_slice(
        total_length, response_length, cp_rank=cp_rank, cp_size=cp_size
    ).local_response_length


def cp_local_response_lengths(
    total_lengths: Sequence[int],
    response_lengths: Sequence[int],
    *,
    cp_rank: int | Sequence[int],
    cp_size: CpSizes,
) -> list[int]:
    """:func:`cp_local_response_length` for each sample (rank and size: int or per sample)."""
    if len(total_lengths) != len(response_lengths):
        raise ValueError(
            f"len(total_lengths)={len(total_lengths)} != len(response_lengths)="
            f"{len(response_lengths)}; pass one entry per sample in both"
        )
    per_sample = per_sample_cp(cp_rank, cp_size, len(total_lengths))
    if per_sample is not None:
        return [
            cp_local_response_length(int(t), int(r), cp_rank=k, cp_size=c)
            for t, r, k, c in zip(total_lengths, response_lengths, *per_sample)
        ]
    return [
        cp_local_response_length(int(t), int(r), cp_rank=cp_rank, cp_size=cp_size)
        for t, r in zip(total_lengths, response_lengths)
    ]


def slice_response_for_cp(
    values: torch.Tensor, total_length: int, *, cp_rank: int, cp_size: int
) -> torch.Tensor:
    """The part of a per-response-token tensor that CP rank ``cp_rank`` sees.

    ``values`` has the sample's full response along dim 0 (a loss mask, log
    probs, advantages...). Returns the concatenation of the rank's two response
    pieces (a view-backed copy; gradients flow). With ``cp_size == 1`` the
    tensor is returned unchanged.
    """
    response_length = int(values.shape[0])
    cp_rank, cp_size = validate_cp(cp_rank, cp_size)
    if cp_size == 1:
        _check_response_fits(as_int("total_length", total_length), response_length)
        return values
    s = zigzag_slice(total_length, response_length, cp_rank=cp_rank, cp_size=cp_size)
    (a0, a1), (b0, b1) = s.response_ranges
    return torch.cat([values[a0:a1], values[b0:b1]], dim=0)


def slice_flat_responses_for_cp(
    flat_values: torch.Tensor,
    total_lengths: Sequence[int],
    response_lengths: Sequence[int],
    *,
    cp_rank: int | Sequence[int],
    cp_size: CpSizes,
) -> torch.Tensor:
    """Slice a flat tensor of full responses (samples concatenated) to CP rank ``cp_rank``.

    The result is the samples' CP-local pieces, concatenated in sample order:
    the layout :mod:`varbatch_kit.report` expects on a CP rank. ``cp_rank`` and
    ``cp_size`` may be per-sample sequences (dynamic CP: each sample cut by its
    own degree).
    """
    expected = sum(int(r) for r in response_lengths)
    if flat_values.shape[0] != expected:
        raise ValueError(
            f"flat_values has length {flat_values.shape[0]} but sum(response_lengths) = "
            f"{expected}; pass the samples' full responses concatenated"
        )
    if len(total_lengths) != len(response_lengths):
        raise ValueError(
            f"len(total_lengths)={len(total_lengths)} != len(response_lengths)="
            f"{len(response_lengths)}; pass one entry per sample in both"
        )
    per_sample = per_sample_cp(cp_rank, cp_size, len(total_lengths))
    if per_sample is not None:  # one degree (and rank) per sample: dynamic CP
        pieces = flat_values.split([int(r) for r in response_lengths], dim=0)
        return torch.cat(
            [
                slice_response_for_cp(p, int(t), cp_rank=r, cp_size=c)
                for p, t, r, c in zip(pieces, total_lengths, *per_sample)
            ]
            or [flat_values[:0]],
            dim=0,
        )
    cp_rank, cp_size = validate_cp(cp_rank, cp_size)
    if cp_size == 1:
        for t, r in zip(total_lengths, response_lengths):
            _check_response_fits(int(t), int(r))
        return flat_values
    pieces = flat_values.split([int(r) for r in response_lengths], dim=0)
    return torch.cat(
        [
            slice_response_for_cp(p, int(t), cp_rank=cp_rank, cp_size=cp_size)
            for p, t in zip(pieces, total_lengths)
        ]
        or [flat_values[:0]],
        dim=0,
    )
