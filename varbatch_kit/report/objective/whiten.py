"""Masked whitening of per-token advantages with statistics over a process group.

The statistics are the masked sum, sum of squares and token count, summed
over ``group`` (one all-reduce) and held in float32, as slime holds them:
``mean = S/N``, ``var = S2/N - mean**2`` times ``N/(N-1)`` when ``N >= 2``
(Bessel), ``out = (x - mean) / sqrt(var + eps)`` (``+ mean`` again when
``shift_mean`` is false). A rank with no tokens still joins the all-reduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["masked_whiten"]


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, *, group=None,
                  shift_mean: bool = True, eps: float = 1e-8,
                  all_reduce: bool | None = None) -> torch.Tensor:
    """Whiten ``values`` with the masked mean and unbiased variance of all ranks of ``group``.

    ``all_reduce``: sum the statistics over ``group`` (default: when
    ``torch.distributed`` is initialised and ``group`` is given). No unmasked
    token anywhere is a ValueError.
    """
    stats = torch.stack([(values * mask).sum(), (values**2 * mask).sum(), mask.sum()]
                        ).to(torch.float32)
    if all_reduce is None:
        all_reduce = group is not None and dist.is_available() and dist.is_initialized()
    if all_reduce:
        dist.all_reduce(stats, group=group)
    total, total_sq, count = stats
    if count.item() == 0:
        raise ValueError("The global mask sum across all participating GPUs is zero. "
                         "(mask has no nonzero entry on any rank; whitening needs at least one "
                         "token)")
    mean = total / count
    var = total_sq / count - mean**2
    if count.item() >= 2:
        var = var * (count / (count - 1))
    out = (values - mean) * torch.rsqrt(var + eps)
    return out if shift_mean else out + mean
