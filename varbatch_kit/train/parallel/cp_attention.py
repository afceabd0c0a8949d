"""All-gather context parallelism: each CP rank runs the model on its zigzag share only.

A micro-batch of degree ``c > 1`` runs on a group of ``c`` ranks
(:mod:`~varbatch_kit.train.parallel.cp_groups`). Every sample of length ``T`` is cut into ``2c``
chunks of
``ceil(T / 2c)`` tokens (the last ones clipped at ``T``), and CP rank ``r``
keeps chunks ``r`` and ``2c - 1 - r`` (:mod:`varbatch_kit.report.cp`'s rule):
its *share*. The rank's packed row is its shares of the samples, in sample
order, with their original position ids. Then:

- **core attention** (:func:`cp_core_attention`, reached from
  :class:`~varbatch_kit.train.model.attention.PerSampleAttention` while a share is
  active, :func:`cp_share_active`): K and V of the local row are all-gathered
  over the group (:class:`_AllGather`: all-gather forward, reduce-scatter of
  the gradient backward; K and V in one call per layer), reassembled per
  sample in original token order, and each local chunk of queries
  ``[c0, c1)`` attends causally to its sample's keys ``[0, c1)``: the query at
  original position ``p`` sees keys ``<= p`` of its own sample. Per sample and
  per chunk, so a micro-batch still costs ``sum(L_i^2) / c`` per rank.
- **logits** (:func:`cp_response_logits`): the output layer runs on the local
  rows whose logit predicts a response token (a logit at position ``j``
  predicts token ``j + 1``): exactly the response tokens zigzag slicing gives
  the rank (:func:`varbatch_kit.report.cp.zigzag_slice`).
- **per-token values** (:func:`~varbatch_kit.train.step.cp_response.cp_response_stats`):
  the local log-probs, entropies and argmax hits (the chunked kernel, as without CP) are
  all-gathered over the group (with autograd)
  into every full response, so sequence-level terms (GSPO, OPSM, sequence KL)
  see whole responses and the loss function runs as on one rank; the sums then
  keep the local slice, as emulated CP does.

The share layout, the group and the rank reach the attention through
:func:`cp_share_active`, a context manager around one micro-batch's forward
(a ``ContextVar``: nothing leaks past it).

Fault injection (tests only): a share with ``swap_chunks_of=r``
(``FaultConfig(cp_swap_chunks_rank=r)`` in a training run) reassembles K/V
reading CP rank ``r``'s share with its two chunks in swapped order: a wrong
exchange, which the CP invariance tests must catch.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

__all__ = ["CPShare", "all_gather_rows", "cp_core_attention",
           "cp_share_active", "current_share",
           "zigzag_chunks"]

Range = tuple[int, int]


def zigzag_chunks(total_length: int, cp_rank: int, cp_size: int) -> tuple[Range, Range]:
    """The two chunks ``[start, end)`` CP rank ``cp_rank`` keeps of a sample (clipped at
    ``total_length``; an empty chunk is ``(T, T)``-like with ``start == end``)."""
    from varbatch_kit.report.cp import validate_cp, zigzag_chunk_size

    cp_rank, cp_size = validate_cp(cp_rank, cp_size)
    size = zigzag_chunk_size(total_length, cp_size)
    out = []
    for k in (cp_rank, 2 * cp_size - 1 - cp_rank):
        a, b = min(k * size, total_length), min((k + 1) * size, total_length)
        out.append((a, b))
    return tuple(out)  # type: ignore[return-value]


@dataclass(frozen=True, eq=False)
class CPShare:
    """What CP rank ``rank`` of a ``size``-rank group holds of one packed micro-batch.

    ``lengths`` / ``prompt_lens``: the samples' full lengths and prompt lengths;
    ``slot_ranks[g]``: the CP rank of the group's ``g``-th process-group rank (the
    all-gather order; torch orders a group by world rank); ``group``: the process group
    (None only in single-process use, ``size == 1``); ``swap_chunks_of``: fault injection
    for tests (see the module docstring), None in real use.
    """

    group: object
    rank: int
    size: int
    lengths: tuple[int, ...]
    prompt_lens: tuple[int, ...]
    slot_ranks: tuple[int, ...]
    swap_chunks_of: int | None = None

    # ---------------------------------------------------------------- layout
    def chunks(self, cp_rank: int | None = None) -> list[tuple[Range, Range]]:
        """Per sample, the two chunks ``cp_rank`` (default: this rank) keeps."""
        r = self.rank if cp_rank is None else cp_rank
        return [zigzag_chunks(t, r, self.size) for t in self.lengths]

    def local_lengths(self, cp_rank: int | None = None) -> list[int]:
        """Per sample, how many tokens ``cp_rank`` holds."""
        return [(a1 - a0) + (b1 - b0) for (a0, a1), (b0, b1) in self.chunks(cp_rank)]

    @cached_property
    def offsets(self) -> list[int]:
        """Each sample's start in the full packed row."""
        out, o = [], 0
        for t in self.lengths:
            out.append(o)
            o += t
        return out

    @cached_property
    def local_row(self) -> torch.Tensor:
        """Full-row positions of this rank's local row (samples in order, two chunks each)."""
        idx = [torch.arange(o + a, o + b) for o, ch in zip(self.offsets, self.chunks())
               for a, b in ch]
        return torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long)

    @cached_property
    def max_local(self) -> int:
        """The longest local row of the group (every rank pads to it for the all-gather)."""
        return max(sum(self.local_lengths(r)) for r in range(self.size))

    @cached_property
    def kv_index(self) -> torch.Tensor:
        """For each full-row position, its row in the gathered ``[size * max_local]`` tensor."""
        fault = self.swap_chunks_of
        index = torch.empty(sum(self.lengths), dtype=torch.long)
        for slot, r in enumerate(self.slot_ranks):
            base = slot * self.max_local
            for o, ch in zip(self.offsets, self.chunks(r)):
                order = (1, 0) if fault == r else (0, 1)  # fault injection: chunks swapped
                for k in order:
                    a, b = ch[k]
                    index[o + a:o + b] = torch.arange(base, base + b - a)
                    base += b - a
        return index

    @cached_property
    def response_rows(self) -> list[list[tuple[int, int, int]]]:
        """Per CP rank: ``(local_row, sample, response_pos)`` of every logit it scores (a logit
        at position ``j`` of a sample predicts token ``j + 1``), in zigzag-slice order."""
        out = []
        for r in range(self.size):
            rows, base = [], 0
            for i, (ch, t, p) in enumerate(zip(self.chunks(r), self.lengths, self.prompt_lens)):
                for a, b in ch:
                    for j in range(max(a, p - 1), min(b, t - 1)):
                        rows.append((base + j - a, i, j + 1 - p))
                    base += b - a
            out.append(rows)
        return out

    @cached_property
    def local_response_rows(self) -> torch.Tensor:
        """This rank's local rows whose logits predict response tokens."""
        return torch.tensor([row for row, _, _ in self.response_rows[self.rank]],
                            dtype=torch.long)

    @cached_property
    def response_index(self) -> torch.Tensor:
        """For each response token (samples concatenated), its row in the gathered response
        values (``[size * max_response_rows]``)."""
        width = max(len(rows) for rows in self.response_rows)
        starts = [0]
        for t, p in zip(self.lengths, self.prompt_lens):
            starts.append(starts[-1] + t - p)
        index = torch.empty(starts[-1], dtype=torch.long)
        for slot, r in enumerate(self.slot_ranks):
            for k, (_, i, q) in enumerate(self.response_rows[r]):
                index[starts[i] + q] = slot * width + k
        return index

    @property
    def max_response_rows(self) -> int:
        return max(len(rows) for rows in self.response_rows)


# ------------------------------------------------------------------ the exchange
def _gather(dist):  # torch 2.13 renames all_gather_into_tensor (deprecated there)
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _scatter(dist):  # and reduce_scatter_tensor
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _AllGather(torch.autograd.Function):
    """All-gather along dim 0 over ``group`` (equal sizes); backward: reduce-scatter (sum)."""

    @staticmethod
    def forward(ctx, x, group, size):
        import torch.distributed as dist

        ctx.group, ctx.size = group, size
        x = x.contiguous()
        out = x.new_empty((size * x.size(0), *x.shape[1:]))
        _gather(dist)(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous()
        out = grad.new_empty((grad.size(0) // ctx.size, *grad.shape[1:]))
        _scatter(dist)(out, grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None, None


def all_gather_rows(x: torch.Tensor, share: CPShare, rows: int,
                    index: torch.Tensor) -> torch.Tensor:
    """``x`` (this rank's rows) padded to ``rows``, all-gathered over the share's group
    (autograd: reduce-scatter backward), then ``index``-selected into full order."""
    pad = rows - x.size(0)
    if pad:
        x = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])
    full = _AllGather.apply(x, share.group, share.size)
    return full.index_select(0, index.to(full.device))


# ------------------------------------------------------------------ the share in force
_share: contextvars.ContextVar[CPShare | None] = contextvars.ContextVar("cp_share", default=None)


def current_share() -> CPShare | None:
    """The share of the micro-batch whose forward is running (None: no all-gather CP)."""
    return _share.get()


@contextlib.contextmanager
def cp_share_active(share: CPShare | None):
    """Within the block, core attention runs all-gather CP on ``share`` (None: as usual)."""
    token = _share.set(share)
    try:
        yield share
    finally:
        _share.reset(token)


def _lower_right_causal(q, k, v, *, scale: float, gqa: bool) -> torch.Tensor:
    """Causal attention of the last ``m`` of ``n`` positions (``q``: ``[1, h, m, d]``, ``k`` and
    ``v``: ``[1, g, n, d]``): query ``i`` sees keys ``j <= n - m + i``.

    A dense ``[m, n]`` mask would cost ``m * n`` floats per layer (kept for the backward);
    here the additive mask is a strided view of one ``m + n - 1`` vector: with the queries
    in reverse order, reversed query ``i'`` sees key ``j`` iff ``i' + j <= n - 1``, so
    ``mask[i', j] = g[i' + j]`` (strides ``(1, 1)``). torch's fused CPU kernel reads it as
    is (no ``[m, n]`` copy, no ``[h, m, n]`` scores)."""
    m, n = q.size(2), k.size(2)
    g = torch.zeros(m + n - 1, dtype=q.dtype, device=q.device)
    g[n:] = float("-inf")
    mask = g.as_strided((m, n), (1, 1))
    out = F.scaled_dot_product_attention(q.flip(2), k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=gqa)
    return out.flip(2)


def cp_core_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      share: CPShare, scale: float) -> torch.Tensor:
    """Local queries ``[n, h, d]`` against the group's K/V (``[n, g, d]`` each, gathered);
    returns ``[n, h, d]``. Per sample and per chunk: chunk ``[c0, c1)`` of a sample
    attends to that sample's keys ``[0, c1)``, the query at position ``p`` to keys ``<= p``."""
    n, g = key.size(0), key.size(1)
    if n != sum(share.local_lengths()):
        raise ValueError(f"{n} local tokens, the CP share holds {sum(share.local_lengths())}")
    kv = all_gather_rows(torch.cat([key, value], dim=1), share, share.max_local,
                         share.kv_index)
    k_full, v_full = kv[:, :g], kv[:, g:]
    gqa = query.size(1) != g
    outs, base = [], 0
    for o, ch in zip(share.offsets, share.chunks()):
        for a, b in ch:
            if b <= a:
                continue
            q = query[base:base + b - a].transpose(0, 1)[None]  # [1, h, m, d]
            k = k_full[o:o + b].transpose(0, 1)[None]  # [1, g, b, d]
            v = v_full[o:o + b].transpose(0, 1)[None]
            if a == 0:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                     enable_gqa=gqa)
            else:  # query at a + i sees keys j <= a + i
                out = _lower_right_causal(q, k, v, scale=scale, gqa=gqa)
            outs.append(out[0].transpose(0, 1))
            base += b - a
    return torch.cat(outs, dim=0) if outs else query.new_zeros(query.shape)


# ------------------------------------------------------------------ model and loss




