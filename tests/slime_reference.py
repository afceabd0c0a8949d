"""An independent, deliberately plain transcription of SLIME_SEMANTICS §2.

Lists and loops only, no numpy, no shared code with varbatch_kit except the
Karmarkar-Karp partitioner (tested on its own) and the FLOPs model. Used as
the slow reference that the fast core must match exactly.
"""

import math


def _first_fit(lengths, cap):
    bins, sums = [], []
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


def _split(bins, lengths, target):
    bins = [list(b) for b in bins]
    while len(bins) < target:
        cands = [j for j, b in enumerate(bins) if len(b) > 1]
        assert cands, "stall"
        best = max(cands, key=lambda j: (sum(lengths[i] for i in bins[j]), j))
        order = sorted(bins[best], key=lambda i: -lengths[i])
        h0, h1, s0, s1 = [], [], 0, 0
        for i in order:
            if s0 <= s1:
                h0.append(i)
                s0 += lengths[i]
            else:
                h1.append(i)
                s1 += lengths[i]
        bins[best] = h0
        bins.append(h1)
    return bins


def reference_schedule(lengths, rollout_ids, *, dp, gbs, mbs=None, cap=None, align=None,
                       by_flops=False, balance=False, flops=None):
    from varbatch_kit.partition import karmarkar_karp

    align = align or dp
    order, groups = [], {}
    for i, r in enumerate(rollout_ids):
        if r not in groups:
            order.append(r)
            groups[r] = []
        groups[r].append(i)
    num_steps = len(order) // gbs
    parts = [[] for _ in range(dp)]
    mbi = [[] for _ in range(dp)]
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
                bins = karmarkar_karp([flops[i] for i in samples], k, False)
        else:
            bins = _first_fit(lens, cap)
        target = max(math.ceil(len(bins) / align) * align, align)
        if mbs is None:
            bins = _split(bins, lens, target)
        else:
            assert len(bins) == target
        if balance:
            w = [sum(flops[samples[j]] for j in b) for b in bins]
            assign = karmarkar_karp(w, dp, True)
        else:
            assign = [list(range(r, len(bins), dp)) for r in range(dp)]
        nmb.append(len(bins) // dp)
        for r in range(dp):
            for b in assign[r]:
                start = len(parts[r])
                parts[r].extend(samples[j] for j in bins[b])
                mbi[r].append(list(range(start, len(parts[r]))))
    return parts, mbi, nmb, [gbs] * num_steps
