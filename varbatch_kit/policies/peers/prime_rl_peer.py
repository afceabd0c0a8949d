"""prime-rl (a transcription of its documented packer; no package to check against)."""

from __future__ import annotations

import numpy as np

from varbatch_kit.policies.packers import PackInput, first_fit_decreasing
from varbatch_kit.policies.partition import karmarkar_karp
from varbatch_kit.policies.peers.base import PeerPlan, lpt_split, make_plan, validate

__all__ = ["prime_rl"]


def prime_rl(lengths, *, dp: int, cap: int, workload=None, max_swaps: int = 1_000) -> PeerPlan:
    """prime-rl (transcription of its documented packer; no package to check against).

    1. first-fit decreasing by tokens under the cap;
    2. while the bin count is not a multiple of ``dp``: split the bin of the
       largest workload that holds two or more samples in two (heaviest sample
       first, each to the lighter half); with no such bin left, add an empty
       micro-batch (prime-rl pads a rank with a fake sample);
    3. bins to ranks by equal-size Karmarkar-Karp on bin workloads (each rank
       the same count);
    4. pairwise-swap refinement: while swapping one bin of the busiest rank with
       a lighter bin of the idlest rank lowers the larger of the two loads,
       make the best such swap (at most ``max_swaps``).

    ``workload`` defaults to the token count (prime-rl balances tokens when
    no cost is given); the bench passes FLOPs. Our choices where the
    documentation is silent: the split rule, the swap rule (best swap
    between busiest and idlest), the empty micro-batch when nothing splits.
    """
    lens, dp, cap, w = validate(lengths, dp, cap, workload)
    w = lens.astype(np.float64) if w is None else w
    bins = first_fit_decreasing(PackInput(lengths=lens, cap=cap))
    notes = []
    padded = 0
    while len(bins) % dp:
        loads = [(float(w[b].sum()) if len(b) > 1 else -1.0, -j) for j, b in enumerate(bins)]
        best, neg_j = max(loads)
        if best < 0:
            bins.append([])
            padded += 1
            continue
        j = -neg_j
        a, b = lpt_split(bins[j], w)
        bins[j] = a
        bins.insert(j + 1, b)
    if padded:
        notes.append(f"{padded} empty micro-batch(es) to reach a multiple of dp")
    bw = [float(w[b].sum()) if b else 0.0 for b in bins]
    parts = [list(p) for p in karmarkar_karp(bw, dp, True)]
    loads = [sum(bw[j] for j in p) for p in parts]
    swaps = 0
    while swaps < max_swaps:
        hi = max(range(dp), key=lambda r: (loads[r], -r))
        lo = min(range(dp), key=lambda r: (loads[r], r))
        gap = loads[hi] - loads[lo]
        wx = np.asarray([bw[x] for x in parts[hi]])
        wy = np.asarray([bw[y] for y in parts[lo]])
        d = wx[:, None] - wy[None, :]
        new_max = np.where((d > 0) & (d < gap),
                           np.maximum(loads[hi] - d, loads[lo] + d), np.inf)
        if new_max.size == 0 or not float(new_max.min()) < loads[hi]:
            break
        a, b = np.unravel_index(int(np.argmin(new_max)), new_max.shape)
        x, y, d = parts[hi][a], parts[lo][b], float(d[a, b])
        parts[hi][parts[hi].index(x)] = y
        parts[lo][parts[lo].index(y)] = x
        loads[hi] -= d
        loads[lo] += d
        swaps += 1
    if swaps:
        notes.append(f"{swaps} pairwise swap(s)")
    return make_plan([[bins[j] for j in sorted(p)] for p in parts], notes=notes)
