"""OpenRLHF 0.11.2 (read from the released package; golden vectors in ``tests/golden/peers/``)."""

from __future__ import annotations

import numpy as np

from varbatch_kit.policies.packers import PackInput, first_fit
from varbatch_kit.policies.partition import karmarkar_karp
from varbatch_kit.policies.peers.base import PeerPlan, PeerRefusal, make_plan, validate

__all__ = ["openrlhf", "openrlhf_interleave"]


def openrlhf_interleave(lengths, dp: int) -> list[list[int]]:
    """OpenRLHF 0.11.2's ``balance_experiences``: samples dealt to ranks long-short interleaved.

    Samples by length, descending (stable), cut into chunks of ``dp``; the
    first half of the chunks as is, the second half each reversed, taken
    alternately from the front of the first half and the back of the second;
    rank r gets the r-th sample of every chunk in that order.
    """
    L = [int(v) for v in lengths]
    order = sorted(range(len(L)), key=lambda i: L[i], reverse=True)
    chunks = [order[i:i + dp] for i in range(0, len(order), dp)]
    half = len(chunks) // 2
    first = chunks[:half]
    last = [c[::-1] for c in chunks[half:]]
    seq = []
    for i in range(half):
        seq.append(first[i])
        seq.append(last[-(i + 1)])
    if len(last) > len(first):
        seq.append(last[0])
    return [[c[r] for c in seq if r < len(c)] for r in range(dp)]


def openrlhf(lengths, *, dp: int, cap: int, workload=None, kernels=None) -> PeerPlan:
    """OpenRLHF 0.11.2 with ``--use_dynamic_batch``.

    Read from OpenRLHF 0.11.2: samples to ranks by :func:`openrlhf_interleave`;
    per rank, first-fit in arrival order counts the bins
    (``get_minimum_num_micro_batch_size``), the maximum over ranks is the
    micro-batch count, and Karmarkar-Karp on token sums fills that many
    micro-batches (``equal_size=False``). The cap is not enforced after
    Karmarkar-Karp: micro-batches may exceed it. Balances tokens. ``kernels``
    (``count(lengths, cap)``, ``kk(values, k, equal_size)``) replace ours by
    the package's own.
    """
    lens, dp, cap, _ = validate(lengths, dp, cap, workload)
    kernels = kernels or {}
    count = kernels.get("count", lambda v, c: len(first_fit(PackInput(lengths=np.asarray(v),
                                                                      cap=c))))
    kk = kernels.get("kk", karmarkar_karp)
    ranks = openrlhf_interleave(lens, dp)
    if min(len(r) for r in ranks) == 0:
        raise PeerRefusal(f"OpenRLHF needs at least one sample per rank: {lens.size} samples, "
                          f"dp={dp}")
    k = max(count(lens[r].tolist(), cap) for r in ranks)
    fewest = min(len(r) for r in ranks)
    if k > fewest:
        raise PeerRefusal(f"OpenRLHF asks for {k} micro-batches but a rank has {fewest} samples")
    out = [[[r[i] for i in p] for p in kk(lens[r].tolist(), k, False)] for r in ranks]
    return make_plan(out)
