"""verl 0.9.1 (read from the released package; golden vectors in ``tests/golden/peers/``)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from varbatch_kit.policies.partition import karmarkar_karp
from varbatch_kit.policies.peers.base import (
    PeerPlan,
    PeerRefusal,
    make_plan,
    refuse_oversize,
    validate,
)

__all__ = ["verl", "verl_rank_micro_batches", "verl_workload"]


def verl_workload(lengths) -> np.ndarray:
    """verl's per-sample cost estimate ``24576 * L + L**2`` (int64; its 7B-model formula)."""
    lens = np.asarray(lengths, dtype=np.int64)
    return 24576 * lens + lens * lens


def verl(lengths, *, dp: int, cap: int, workload=None, kk: Callable | None = None) -> PeerPlan:
    """verl 0.9.1: workload-balanced ranks, then Karmarkar-Karp micro-batches under the cap.

    Read from verl 0.9.1 (``ray_trainer._balance_batch`` with its defaults and
    ``seqlen_balancing.rearrange_micro_batches``, dynamic batch size on):

    1. rank split: Karmarkar-Karp of the workloads ``24576 L + L^2`` into
       ``dp`` parts of equal sample count (verl needs ``n % dp == 0``; its
       trainer pads the batch, so we pad with zero-workload items and drop them);
       each rank's samples in order of workload, small at both ends
       (``p[::2] + p[1::2][::-1]``);
    2. per rank: ``k = min(n_rank, ceil(tokens_rank / cap))``, the maximum
       over ranks (``same_micro_num_in_dp``), Karmarkar-Karp of the workloads
       into ``k`` parts; while any part on any rank exceeds the cap, ``k += 1``
       (verl #7553); a sample over the cap is refused, as verl asserts;
    3. each rank's micro-batches by workload, descending, then small at both
       ends (``mbs[::2][::-1] + mbs[1::2]``).

    ``workload`` is ignored (verl always uses its formula). ``kk(values, k,
    equal_size)`` replaces the partitioner (the bench passes verl's own).
    """
    lens, dp, cap, _ = validate(lengths, dp, cap, workload)
    refuse_oversize("verl", lens, cap)
    part = kk or karmarkar_karp
    n = lens.size
    w = verl_workload(lens)
    pad = (-n) % dp
    wp = np.concatenate((w, np.zeros(pad, dtype=np.int64))).tolist()
    ranks = []
    for p in part(wp, dp, True):
        p = sorted((i for i in p if i < n), key=lambda i: (wp[i], i))
        ranks.append(p[::2] + p[1::2][::-1])
    if min(len(p) for p in ranks) == 0:
        raise PeerRefusal(f"verl needs at least one sample per rank: {n} samples, dp={dp}")
    local, raised = verl_rank_micro_batches([[int(lens[i]) for i in p] for p in ranks], cap,
                                            kk=part)
    out = [[[p[i] for i in q] for q in qs] for p, qs in zip(ranks, local)]
    notes = (f"micro-batch count raised {raised}x to respect the cap",) if raised else ()
    return make_plan(out, notes=notes)


def verl_rank_micro_batches(rank_lengths, cap: int, *, kk: Callable | None = None):
    """verl 0.9.1's ``rearrange_micro_batches`` on every rank at once (counts synced over DP).

    ``rank_lengths[r]``: rank r's token lengths in its batch order. Returns
    (per rank the micro-batches as positions into that rank's list, in
    training order; how many times the count was raised to respect the cap).
    With one rank this is ``rearrange_micro_batches`` without a process group.
    """
    part = kk or karmarkar_karp
    rank_len = [[int(v) for v in r] for r in rank_lengths]
    if max(max(t) for t in rank_len) > cap:
        raise PeerRefusal(f"verl refuses a sample longer than max_token_len {cap}")
    rank_w = [verl_workload(t).tolist() for t in rank_len]
    k = max(min(len(t), -(-sum(t) // cap)) for t in rank_len)
    fewest = min(len(t) for t in rank_len)
    raised = 0
    while True:
        if k > fewest:
            raise PeerRefusal(f"verl cannot keep micro-batches under cap {cap} with the same "
                              f"count on every rank: needs {k} but a rank has {fewest} samples")
        parts = [part(rw, k, False) for rw in rank_w]
        if all(sum(t[i] for i in q) <= cap for ps, t in zip(parts, rank_len) for q in ps):
            break
        k += 1
        raised += 1
    out = []
    for ps, rw in zip(parts, rank_w):
        ps = sorted(ps, key=lambda q: (sum(rw[i] for i in q), q[0] if q else 0), reverse=True)
        out.append([list(q) for q in ps[::2][::-1] + ps[1::2]])
    return out, raised
