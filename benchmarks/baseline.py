"""The in-project baseline: slime's scheduler as plain Python (lists and loops).

A transcription of docs/reference_semantics.md §2-3 with the straightforward algorithms
slime runs: first-fit scans every open bin for each sample, the alignment
split scans every bin for the largest, Karmarkar-Karp keeps ``k`` Python set
objects per state (:func:`varbatch_kit.policies.partition.karmarkar_karp_reference`),
bin FLOPs are summed in Python. Its results are identical to varbatch_kit's
fast core (the benchmark checks that); only the cost differs.
"""

from __future__ import annotations

import math

from varbatch_kit.policies.partition import karmarkar_karp_reference


def first_fit(lengths: list[int], cap: int) -> list[list[int]]:
    """First-fit in arrival order, scanning the open bins."""
    bins: list[list[int]] = []
    sums: list[int] = []
    for i, n in enumerate(lengths):
        for b in range(len(bins)):
            if sums[b] + n <= cap:
                bins[b].append(i)
                sums[b] += n
                break
        else:
            bins.append([i])
            sums.append(n)
    return bins


def split(bins: list[list[int]], lengths: list[int], target: int) -> list[list[int]]:
    """Split the largest multi-sample bin (ties: highest position) until ``target`` bins."""
    bins = [list(b) for b in bins]
    sums = [sum(lengths[i] for i in b) for b in bins]
    while len(bins) < target:
        best = -1
        for j, b in enumerate(bins):
            if len(b) > 1 and (best < 0 or sums[j] >= sums[best]):
                best = j
        if best < 0:
            raise ValueError(f"cannot split into {target} bins")
        h0: list[int] = []
        h1: list[int] = []
        s0 = s1 = 0
        for i in sorted(bins[best], key=lambda i: -lengths[i]):
            if s0 <= s1:
                h0.append(i)
                s0 += lengths[i]
            else:
                h1.append(i)
                s1 += lengths[i]
        bins[best], sums[best] = h0, s0
        bins.append(h1)
        sums.append(s1)
    return bins


def build_dp_schedule(lengths, rollout_ids, flops, *, dp: int, gbs: int, cap: int | None = None,
                      mbs: int | None = None, align: int | None = None, by_flops: bool = False,
                      balance: bool = False):
    """slime's ``(partitions, micro_batch_indices, num_microbatches, global_batch_sizes)``."""
    lengths = [int(x) for x in lengths]
    flops = None if flops is None else [float(x) for x in flops]
    align = align or dp
    order: list = []
    groups: dict = {}
    for i, r in enumerate(rollout_ids):
        if r not in groups:
            order.append(r)
            groups[r] = []
        groups[r].append(i)
    num_steps = len(order) // gbs
    parts: list[list[int]] = [[] for _ in range(dp)]
    mbi: list[list[list[int]]] = [[] for _ in range(dp)]
    nmb = []
    for s in range(num_steps):
        samples = [i for r in order[s * gbs:(s + 1) * gbs] for i in groups[r]]
        lens = [lengths[i] for i in samples]
        if mbs is not None:
            bins = [list(range(j, min(j + mbs, len(samples)))) for j in range(0, len(samples), mbs)]
        elif by_flops:
            k = max(1, math.ceil(sum(lens) / cap))
            if k >= len(samples):
                bins = [[j] for j in range(len(samples))]
            else:
                bins = karmarkar_karp_reference([flops[i] for i in samples], k, False)
        else:
            bins = first_fit(lens, cap)
        target = max(math.ceil(len(bins) / align) * align, align)
        if mbs is None:
            bins = split(bins, lens, target)
        if balance:
            w = [sum(flops[samples[j]] for j in b) for b in bins]
            assign = karmarkar_karp_reference(w, dp, True)
        else:
            assign = [list(range(r, len(bins), dp)) for r in range(dp)]
        nmb.append(len(bins) // dp)
        for r in range(dp):
            for b in assign[r]:
                start = len(parts[r])
                parts[r].extend(samples[j] for j in bins[b])
                mbi[r].append(list(range(start, len(parts[r]))))
    return parts, mbi, nmb, [gbs] * num_steps
