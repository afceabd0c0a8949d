"""The schedulers of other RL frameworks, side by side with ours, on plain arrays.

Every peer answers the same question as :func:`varbatch_kit.build_schedule` does
for one step: given the step's per-sample token lengths, the number of DP
ranks and the token cap per micro-batch, which samples does each rank train,
micro-batch after micro-batch? The answer is a :class:`PeerPlan`.

The functions are our own code, written from each peer's released code or
documentation (never copied). Two kinds:

- **read from the released package** (the module docstring of each function
  names the version): ``verl`` 0.9.1 (``verl.utils.seqlen_balancing`` and the
  trainer's ``_balance_batch``), ``areal`` / ``areal_kk`` 1.0.4
  (``areal.utils.seqpack``, ``areal.utils.data.allocate_balanced_mbs_synced``,
  the train controller's dispatch), ``openrlhf`` 0.11.2
  (``openrlhf.utils.seqlen_balancing``, ``balance_experiences``, the replay
  buffer's dynamic batch). ``tests/golden/peers/`` holds outputs of those
  packages, recorded by ``scripts/record_peer_golden.py``; the unit tests check
  that these functions reproduce them.
- **transcriptions of a documented algorithm** (no package on the index to
  check against): ``prime_rl``, ``nemo_rl``, ``torchtitan``. Their docstrings
  say what was transcribed and where we had to choose.

The Karmarkar-Karp the three packaged peers use is verl's (OpenRLHF and AReaL
carry copies of it); it is the same largest-differencing method with the same
tie-breaking as slime's, so :func:`varbatch_kit.policies.partition.karmarkar_karp`
computes it (the golden vectors check that too).

``PEER_SCHEDULERS`` lists every peer explicitly; nothing registers itself.
Each scheduler is ``fn(lengths, *, dp, cap, workload=None) -> PeerPlan``, where
``workload`` is an optional per-sample cost (e.g. FLOPs) that peers balancing
by a cost use in place of their own estimate when the peer has no formula of
its own (prime-rl); peers with a fixed formula (verl) or balancing tokens
(OpenRLHF, AReaL, NeMo-RL, torchtitan) ignore it, as the real ones do.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from varbatch_kit.policies.packers import PackInput, first_fit, first_fit_decreasing
from varbatch_kit.policies.partition import karmarkar_karp

__all__ = [
    "PEER_SCHEDULERS",
    "PeerPlan",
    "PeerRefusal",
    "areal",
    "areal_balanced_greedy",
    "areal_ffd_allocate",
    "areal_kk",
    "areal_kk_allocate",
    "nemo_rl",
    "openrlhf",
    "openrlhf_interleave",
    "prime_rl",
    "torchtitan",
    "verl",
    "verl_rank_micro_batches",
    "verl_workload",
]


class PeerRefusal(ValueError):
    """The peer itself would refuse this input (e.g. a sample longer than its cap)."""


@dataclass(frozen=True)
class PeerPlan:
    """One step as a peer schedules it.

    ``rank_micro_batches[r][j]``: sample indices (into the step's arrays) of
    rank r's j-th micro-batch, in training order. Ranks may hold different
    micro-batch counts when the peer allows it (torchtitan). ``notes`` says
    what the peer did that the numbers alone do not show (e.g. a fallback).
    """

    rank_micro_batches: list[list[np.ndarray]]
    notes: tuple[str, ...] = field(default=())

    @property
    def dp(self) -> int:
        return len(self.rank_micro_batches)

    @property
    def micro_batches(self) -> list[np.ndarray]:
        """All micro-batches, rank after rank."""
        return [mb for rank in self.rank_micro_batches for mb in rank]

    def check(self, n: int) -> PeerPlan:
        """Raise ``AssertionError`` unless every sample ``0..n-1`` appears exactly once."""
        flat = (np.concatenate(self.micro_batches) if self.micro_batches
                else np.zeros(0, dtype=np.int64))
        counts = np.bincount(flat.astype(np.int64), minlength=n) if flat.size else np.zeros(n)
        assert flat.size == n and counts.size == n and bool(np.all(counts == 1)), \
            "a peer plan must hold every sample exactly once"
        return self


def _plan(rank_lists, index=None, notes=()) -> PeerPlan:
    """Build a plan from per-rank lists of index lists, mapped through ``index``."""
    out = []
    for rank in rank_lists:
        mbs = []
        for mb in rank:
            a = np.asarray(mb, dtype=np.int64)
            mbs.append(a if index is None else index[a])
        out.append(mbs)
    return PeerPlan(out, tuple(notes))


def _validate(lengths, dp, cap, workload=None):
    lens = np.asarray(lengths)
    if lens.ndim != 1 or lens.size == 0:
        raise ValueError(f"lengths must be a non-empty 1-D array of token counts, got shape "
                         f"{lens.shape}")
    if not np.issubdtype(lens.dtype, np.integer):
        if not np.all(lens == np.floor(lens)):
            raise ValueError("lengths must be whole token counts")
        lens = lens.astype(np.int64)
    lens = lens.astype(np.int64)
    if np.any(lens < 1):
        raise ValueError("lengths must be >= 1 token each")
    if isinstance(dp, bool) or int(dp) != dp or dp < 1:
        raise ValueError(f"dp must be a positive integer, got {dp!r}")
    if isinstance(cap, bool) or int(cap) != cap or cap < 1:
        raise ValueError(f"cap must be a positive integer token count, got {cap!r}")
    w = None
    if workload is not None:
        w = np.asarray(workload, dtype=np.float64)
        if w.shape != lens.shape or np.any(~np.isfinite(w)) or np.any(w < 0):
            raise ValueError("workload must be finite, non-negative and one per sample")
    return lens, int(dp), int(cap), w


def _refuse_oversize(peer: str, lens: np.ndarray, cap: int) -> None:
    if int(lens.max()) > cap:
        raise PeerRefusal(f"{peer} refuses a sample of {int(lens.max())} tokens > cap {cap} "
                          "(it cannot split a sample); raise the cap or drop the sample")


# ===================================================================================== verl
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
    lens, dp, cap, _ = _validate(lengths, dp, cap, workload)
    _refuse_oversize("verl", lens, cap)
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
    return _plan(out, notes=notes)


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


# ================================================================================= prime-rl
def _lpt_split(items: list[int], w: np.ndarray) -> tuple[list[int], list[int]]:
    """Split a bin's items in two by workload: heaviest first, each to the lighter half."""
    a, b, wa, wb = [], [], 0.0, 0.0
    for i in sorted(items, key=lambda i: (-w[i], i)):
        if wa <= wb:
            a.append(i)
            wa += w[i]
        else:
            b.append(i)
            wb += w[i]
    return sorted(a), sorted(b)


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
    lens, dp, cap, w = _validate(lengths, dp, cap, workload)
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
        a, b = _lpt_split(bins[j], w)
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
    return _plan([[bins[j] for j in sorted(p)] for p in parts], notes=notes)


# ================================================================================== NeMo-RL
def _mffd(lens: np.ndarray, cap: int) -> list[list[int]]:
    """Modified first-fit decreasing (Johnson & Garey 1985), as NeMo-RL names its packer.

    Items: large ``> cap/2``, medium ``(cap/3, cap/2]``, small ``(cap/6, cap/3]``,
    tiny the rest (and over-cap samples, each alone, first).
    1. every large item opens a bin (decreasing);
    2. forward over the large bins: add the largest medium item that fits;
    3. backward over large bins without a medium item: if the two smallest
       small items fit, add the smallest small item, then the largest small
       item that still fits;
    4. forward over all bins: while the smallest remaining item fits, add the
       largest remaining item that fits;
    5. the rest by first-fit decreasing into new bins.
    """
    n = lens.size
    order = np.argsort(-lens, kind="stable").tolist()
    L = lens.tolist()
    big = [i for i in order if L[i] * 2 > cap]
    med = [i for i in order if L[i] * 3 > cap >= L[i] * 2]
    small = [i for i in order if L[i] * 6 > cap >= L[i] * 3]
    rest = [i for i in order if L[i] * 6 <= cap]
    bins = [[i] for i in big]
    room = [cap - L[i] for i in big]
    has_med = [False] * len(bins)

    def take_largest_fitting(pool_keys, pool, r):
        # pool sorted ascending by (length, -index): largest fitting = rightmost <= r
        j = bisect.bisect_right(pool_keys, (r, 1))
        if j == 0:
            return None
        pool_keys.pop(j - 1)
        return pool.pop(j - 1)

    def ascending(ids):
        ids = sorted(ids, key=lambda i: (L[i], -i))
        return [(L[i], -i) for i in ids], ids

    mk, mp = ascending(med)
    for b in range(len(bins)):
        if mp and mk[0][0] <= room[b]:
            i = take_largest_fitting(mk, mp, room[b])
            bins[b].append(i)
            room[b] -= L[i]
            has_med[b] = True
    sk, sp = ascending(small)
    for b in range(len(bins) - 1, -1, -1):
        if has_med[b] or len(sp) < 2 or sk[0][0] + sk[1][0] > room[b]:
            continue
        sk.pop(0)
        i = sp.pop(0)
        bins[b].append(i)
        room[b] -= L[i]
        i = take_largest_fitting(sk, sp, room[b])
        if i is not None:
            bins[b].append(i)
            room[b] -= L[i]
    pool = mp + sp + rest
    pk, pp = ascending(pool)
    for b in range(len(bins)):
        while pp and pk[0][0] <= room[b]:
            i = take_largest_fitting(pk, pp, room[b])
            bins[b].append(i)
            room[b] -= L[i]
    left = sorted(pp, key=lambda i: (-L[i], i))
    if left:
        sub = np.asarray([L[i] for i in left], dtype=np.int64)
        for b in first_fit_decreasing(PackInput(lengths=sub, cap=cap)):
            bins.append([left[j] for j in b])
    assert sorted(i for b in bins for i in b) == list(range(n))
    return [sorted(b) for b in bins]


def nemo_rl(lengths, *, dp: int, cap: int, workload=None) -> PeerPlan:
    """NeMo-RL (transcription of its documented sequence packing; no package to check against).

    Modified first-fit decreasing under the cap (:func:`_mffd`); the bin count
    is raised to a multiple of ``dp`` by splitting the fullest bin of two or
    more samples in two (longest first, each to the lighter half), or with
    empty micro-batches when nothing splits; bin ``j`` goes to rank ``j % dp``
    (dealt round-robin). Balances tokens; ``workload`` is ignored.
    """
    lens, dp, cap, _ = _validate(lengths, dp, cap, workload)
    bins = _mffd(lens, cap)
    w = lens.astype(np.float64)
    notes = []
    while len(bins) % dp:
        cand = [(int(lens[b].sum()), -j) for j, b in enumerate(bins) if len(b) > 1]
        if not cand:
            notes.append("empty micro-batches to reach a multiple of dp")
            bins.append([])
            continue
        j = -max(cand)[1]
        a, b = _lpt_split(bins[j], w)
        bins[j] = a
        bins.insert(j + 1, b)
    return _plan([[bins[j] for j in range(r, len(bins), dp)] for r in range(dp)], notes=notes)


# ==================================================================================== AReaL
def areal_balanced_greedy(nums, k: int) -> list[list[int]]:
    """AReaL 1.0.4's DP dispatch (``balanced_greedy_partition``): equal counts, greedy sums.

    Items by value, descending (ties: index); each to the group of smallest sum
    that is not yet full (ties: lowest group). Needs ``len(nums) % k == 0``.
    """
    vals = [int(v) for v in nums]
    n = len(vals)
    if n < k or n % k:
        raise ValueError(f"AReaL's dispatch needs a multiple of k={k} items, got {n}")
    m = n // k
    groups: list[list[int]] = [[] for _ in range(k)]
    heap = [(0, g) for g in range(k)]
    for i in sorted(range(n), key=lambda i: -vals[i]):
        s, g = heapq.heappop(heap)
        groups[g].append(i)
        if len(groups[g]) < m:
            heapq.heappush(heap, (s + vals[i], g))
    return groups


def _areal_ffd_once(values: np.ndarray, cap: int, min_groups: int) -> list[list[int]]:
    order = np.argsort(-values)  # numpy's default sort, as AReaL calls it
    groups: list[list[int]] = []
    keys: list[tuple[float, int]] = []  # (load, group) ascending
    n = len(values)
    for idx in order.tolist():
        v = values[idx]
        if len(keys) < min_groups or keys[0][0] + v > cap:
            bisect.insort(keys, (float(v), len(groups)))
            groups.append([idx])
            continue
        j_end = bisect.bisect_right(keys, (cap - v, n))
        best = min(range(j_end), key=lambda j: len(groups[keys[j][1]]))
        load, g = keys.pop(best)
        bisect.insort(keys, (float(v + load), g))
        groups[g].append(idx)
    return groups


def areal_ffd_allocate(values, cap: int, min_groups: int = 1, divisor: int = 1):
    """AReaL 1.0.4's ``ffd_allocate``: first-fit decreasing into the least-populated bin that fits.

    The first ``min_groups`` items each open a bin; then each item (longest
    first) goes to the bin with the fewest items among those it fits in
    (ties: the lightest), else opens a bin; repeated with more ``min_groups``
    until the count is a multiple of ``divisor``.
    """
    vals = np.asarray(values, dtype=np.int64)
    min_groups = max(min_groups or 0, divisor)
    if int(vals.max()) > cap:
        raise PeerRefusal(f"AReaL refuses a sample of {int(vals.max())} tokens > cap {cap}")
    if vals.size < min_groups:
        raise PeerRefusal(f"AReaL needs at least {min_groups} samples, got {vals.size}")
    while True:
        res = _areal_ffd_once(vals, cap, min_groups)
        min_groups += divisor - min_groups % divisor
        if len(res) % divisor == 0:
            return res
        if vals.size < min_groups:
            raise PeerRefusal(f"AReaL cannot reach a multiple of {divisor} micro-batches")


def areal_kk_allocate(values, cap: int, min_groups: int = 1, divisor: int = 1):
    """AReaL 1.0.4's ``kk_allocate``: Karmarkar-Karp into ``max(min_groups, ceil(total/cap))``.

    Rounded up to a multiple of ``divisor``, at most one group per item; if a
    group exceeds the cap, the whole allocation falls back to :func:`areal_ffd_allocate`.
    """
    return _areal_kk(values, cap, min_groups, divisor)[0]


def _areal_kk(values, cap, min_groups, divisor):
    """:func:`areal_kk_allocate` and whether it fell back to first-fit decreasing."""
    vals = np.asarray(values, dtype=np.int64)
    min_groups = max(min_groups or 0, divisor)
    if int(vals.max()) > cap:
        raise PeerRefusal(f"AReaL refuses a sample of {int(vals.max())} tokens > cap {cap}")
    if vals.size < min_groups:
        raise PeerRefusal(f"AReaL needs at least {min_groups} samples, got {vals.size}")
    k = max(min_groups, math.ceil(int(vals.sum()) / cap))
    k = min(math.ceil(k / divisor) * divisor, vals.size)
    parts = karmarkar_karp(vals.tolist(), k, False, sort_parts=False)
    if any(int(vals[p].sum()) > cap for p in parts):
        return areal_ffd_allocate(vals, cap, min_groups, divisor), True
    return parts, False


def _areal(lengths, dp, cap, workload, algorithm, kernels):
    lens, dp, cap, _ = _validate(lengths, dp, cap, workload)
    _refuse_oversize("AReaL", lens, cap)
    kernels = kernels or {}
    dispatch = kernels.get("dispatch", areal_balanced_greedy)
    n = lens.size
    pad = (-n) % dp
    padded = np.concatenate((lens, np.zeros(pad, dtype=np.int64)))
    ranks = [[i for i in g if i < n] for g in dispatch(padded.tolist(), dp)]
    if min(len(r) for r in ranks) == 0:
        raise PeerRefusal(f"AReaL needs at least one sample per rank: {n} samples, dp={dp}")
    n_mbs = 1
    fallbacks = 0
    while True:  # allocate_balanced_mbs_synced: redo with the largest count until all agree
        out, fallbacks = [], 0
        for r in ranks:
            v = lens[r]
            if "allocate" in kernels:  # the package's own allocator (fallback not counted)
                parts = kernels["allocate"](v.tolist(), cap, n_mbs, 1)
            elif algorithm == "kk":
                parts, fell = _areal_kk(v, cap, n_mbs, 1)
                fallbacks += fell
            else:
                parts = areal_ffd_allocate(v, cap, n_mbs)
            out.append(sorted(sorted(p) for p in parts))
        counts = {len(p) for p in out}
        if len(counts) == 1:
            break
        n_mbs = max(counts)
    notes = (f"KK broke the cap on {fallbacks} rank(s): FFD fallback",) if fallbacks else ()
    return _plan([[[r[i] for i in p] for p in parts] for r, parts in zip(ranks, out)],
                 notes=notes)


def areal(lengths, *, dp: int, cap: int, workload=None, kernels=None) -> PeerPlan:
    """AReaL 1.0.4, default packing (``ffd``).

    Read from AReaL 1.0.4: the train controller deals samples to DP ranks by
    :func:`areal_balanced_greedy` on token counts (padding to a multiple of
    ``dp`` with empty items, which we drop); each rank packs its samples by
    :func:`areal_ffd_allocate` under the cap; if ranks disagree on the count,
    all repack with the largest as ``min_groups``
    (``allocate_balanced_mbs_synced``). Micro-batches sorted by first index.
    A sample over the cap is refused, as AReaL raises. Balances tokens.
    ``kernels`` (``dispatch``, ``allocate``) replace the two kernels by the
    package's own (the bench passes them).
    """
    return _areal(lengths, dp, cap, workload, "ffd", kernels)


def areal_kk(lengths, *, dp: int, cap: int, workload=None, kernels=None) -> PeerPlan:
    """AReaL 1.0.4, ``packing_algorithm="kk"``: :func:`areal` with :func:`areal_kk_allocate`."""
    return _areal(lengths, dp, cap, workload, "kk", kernels)


# ================================================================================= OpenRLHF
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
    lens, dp, cap, _ = _validate(lengths, dp, cap, workload)
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
    return _plan(out)


# =============================================================================== torchtitan
def torchtitan(lengths, *, dp: int, cap: int, workload=None) -> PeerPlan:
    """torchtitan (transcription of its documented greedy next-fit packing; no package checked).

    The dataset is sharded by rank (contiguous shards, as ``split_dataset_by_node``
    does for a map-style dataset); each rank packs its shard in arrival order
    by next-fit: a micro-batch is closed as soon as the next sample does not
    fit. Ranks may end with different micro-batch counts; an over-cap sample
    sits alone. Balances nothing.
    """
    lens, dp, cap, _ = _validate(lengths, dp, cap, workload)
    n = lens.size
    bounds = [n * r // dp for r in range(dp + 1)]
    out = []
    for r in range(dp):
        mbs, cur, room = [], [], cap
        for i in range(bounds[r], bounds[r + 1]):
            if cur and lens[i] > room:
                mbs.append(cur)
                cur, room = [], cap
            cur.append(i)
            room -= int(lens[i])
        if cur:
            mbs.append(cur)
        out.append(mbs)
    return _plan(out)


#: Every peer, by name: ``fn(lengths, *, dp, cap, workload=None) -> PeerPlan``.
PEER_SCHEDULERS: dict[str, Callable[..., PeerPlan]] = {
    "verl": verl,
    "prime_rl": prime_rl,
    "nemo_rl": nemo_rl,
    "areal": areal,
    "areal_kk": areal_kk,
    "openrlhf": openrlhf,
    "torchtitan": torchtitan,
}

#: How each peer was written: ``"package"`` (read from, and checked against, its
#: released package) or ``"transcription"`` (its documented algorithm only).
PEER_SOURCES: dict[str, str] = {
    "verl": "package verl==0.9.1",
    "prime_rl": "transcription",
    "nemo_rl": "transcription",
    "areal": "package areal==1.0.4",
    "areal_kk": "package areal==1.0.4",
    "openrlhf": "package openrlhf==0.11.2",
    "torchtitan": "transcription",
}

#: Peers that promise every micro-batch of two or more samples stays under the cap.
RESPECTS_CAP = {"verl", "prime_rl", "nemo_rl", "areal", "areal_kk", "torchtitan"}
#: Peers that give every rank the same micro-batch count.
EQUAL_COUNTS = {"verl", "prime_rl", "nemo_rl", "areal", "areal_kk", "openrlhf"}
