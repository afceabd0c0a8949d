"""The ``balanced`` packing/distribution: configuration, local search, properties."""

import numpy as np
import pytest
from _factories import TINY
from hypothesis import example, given
from hypothesis import strategies as st

from varbatch_kit import Rollouts, ScheduleConfig, build_schedule
from varbatch_kit.policies.balance import (
    SearchStats,
    balanced_distribution,
    balanced_pack,
    local_search,
    refine_balanced,
)
from varbatch_kit.policies.distributions import BinWeights
from varbatch_kit.policies.packers import PackInput, first_fit


# ----------------------------------------------------------------------------- configuration
def test_balanced_packing_defaults_to_balanced_distribution():
    c = ScheduleConfig(dp=2, global_batch_size=4, max_tokens_per_gpu=100, packing="balanced")
    assert (c.packing, c.distribution) == ("balanced", "balanced")
    assert ScheduleConfig(dp=2, max_tokens_per_gpu=100).distribution == "strided"
    assert ScheduleConfig(dp=2, micro_batch_size=1, distribution="balanced").distribution == \
        "balanced"


@pytest.mark.parametrize("kwargs,match", [
    ({"max_tokens_per_gpu": 100, "packing": "balanced", "distribution": "flops_kk"},
     "needs distribution='balanced'"),
    ({"max_tokens_per_gpu": 100, "packing": "balanced", "distribution": "strided"},
     "pick another packing such as 'ffd'"),
    ({"micro_batch_size": 2, "packing": "balanced"}, "packs under a token cap"),
    ({"max_tokens_per_gpu": 100, "distribution": "balance"}, "unknown distribution 'balance'"),
])
def test_bad_combinations(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ScheduleConfig(dp=2, **kwargs)


def test_balanced_needs_a_model():
    r = Rollouts(prompt_len=[1] * 4, response_len=[5, 6, 7, 8])
    cfg = ScheduleConfig(dp=2, global_batch_size=4, max_tokens_per_gpu=20, packing="balanced")
    with pytest.raises(ValueError, match="needs a model shape"):
        build_schedule(r, cfg)


# ----------------------------------------------------------------------------- local search
def test_local_search_move_hand_derived():
    # rank 0: one micro-batch {5, 4}; rank 1: {1}; FLOPs = tokens, cap 10, bound 5.
    # Moving the 4 gives loads 5/5 (moving the 5 would give 4/6).
    stats = SearchStats()
    out = local_search([5, 4, 1], [5.0, 4.0, 1.0], 10, [0, 0, 1], [[0], [1]], stats=stats)
    assert out.tolist() == [0, 1, 1]
    assert (stats.moves, stats.swaps, stats.before, stats.after, stats.bound) == (1, 0, 9, 5, 5)


def test_local_search_swap_hand_derived():
    # rank 0: {3, 3} (6 tokens, cap 6), rank 1: {2, 1}. No move helps (3 -> rank 1 gives 3/6);
    # swapping a 3 for the 2 gives 5/4 (the first of the two best swaps), then nothing helps.
    stats = SearchStats()
    out = local_search([3, 3, 2, 1], [3.0, 3.0, 2.0, 1.0], 6, [0, 0, 1, 1], [[0], [1]],
                       stats=stats)
    assert out.tolist() == [1, 0, 0, 1]
    assert (stats.moves, stats.swaps, stats.after) == (0, 1, 5)


def test_a_paired_round_balances_disjoint_pairs_at_once():
    # four ranks, one micro-batch each (cap 100, FLOPs = tokens): ranks 0 and 1 hold {6, 4},
    # ranks 2 and 3 {1, 1}; bound 24 / 4 = 6. The busiest ranks (1, then 0) pair with the
    # least busy (2, then 3); each pair's best operation moves its 4 across (loads 6 / 6),
    # both in the same round: one round, two moves, every rank at the bound.
    stats = SearchStats()
    out = local_search([6, 4, 6, 4, 1, 1, 1, 1], [6.0, 4, 6, 4, 1, 1, 1, 1], 100,
                       [0, 0, 1, 1, 2, 2, 3, 3], [[0], [1], [2], [3]], stats=stats)
    assert out.tolist() == [0, 3, 1, 2, 2, 2, 3, 3]
    assert (stats.rounds, stats.moves, stats.swaps, stats.after) == (1, 2, 0, 6.0)


def test_the_search_stops_when_its_rounds_stop_gaining_tol():
    # rank 0: {50, 40 samples of 0.0005}, rank 1: {50}; bound 50.01. Only the small samples
    # can move, one per round, 0.0005 each. At tol 1e-4 (threshold 50.015) four rounds gain
    # 0.002 < tol x bound = 0.005: the paired rounds stall after 4 moves, the busiest-rank
    # rounds after 4 more, short of the threshold; at tol 1e-6 they go on to the bound.
    from varbatch_kit.policies.balance import STALL_ROUNDS

    n = 41
    lengths, flops = [1] * (n + 1), [50.0] + [0.0005] * (n - 1) + [50.0]
    bin_of, rb = [0] * n + [1], [[0], [1]]
    stats = SearchStats()
    local_search(lengths, flops, 1000, bin_of, rb, tol=1e-4, stats=stats)
    assert (stats.rounds, stats.moves) == (2 * STALL_ROUNDS, 2 * STALL_ROUNDS)
    assert stats.after > stats.bound * (1 + 1e-4)
    fine = SearchStats()
    local_search(lengths, flops, 1000, bin_of, rb, tol=1e-6, stats=fine)
    assert fine.moves == 20 and fine.after == pytest.approx(fine.bound, rel=1e-6)


def test_a_second_start_grouping_the_samples_alike_is_not_searched(monkeypatch):
    # tokens 17, 9, 6, 16 (FLOPs their squares), cap 40, dp 2: the packed start holds
    # {17, 6} and {9, 16} and stops 1.8 % above the bound, so a second start is made; the
    # rank-by-rank fill groups the samples the same way (ranks swapped), so it is not searched
    from varbatch_kit.policies import balance

    lengths = np.array([17, 9, 6, 16])
    inp = PackInput(lengths, lengths.astype(float) ** 2, cap=40, align=2)
    searched = []
    real = balance.local_search
    monkeypatch.setattr(balance, "local_search",
                        lambda *a, **k: searched.append(1) or real(*a, **k))
    bins, ranks = refine_balanced(inp, [[0, 2], [1, 3]], [[1], [0]])
    assert len(searched) == 1
    assert (bins, ranks) == ([[0, 2], [1, 3]], [[1], [0]])


def test_local_search_respects_the_cap():
    # rank 0: {5, 4} (9 tokens, FLOPs 5 + 4), rank 1: {7} (FLOPs 1), cap 10. Without the cap,
    # moving the 4 or swapping the 5 for the 7 would give 5/5; every such micro-batch would
    # exceed 10 tokens with two samples, so nothing may change.
    out = local_search([5, 4, 7], [5.0, 4.0, 1.0], 10, [0, 0, 1], [[0], [1]])
    assert out.tolist() == [0, 0, 1]


@given(st.lists(st.integers(1, 60), min_size=4, max_size=60), st.integers(2, 4),
       st.integers(1, 3), st.integers(30, 90), st.randoms(use_true_random=False))
def test_local_search_properties(lengths, dp, m, cap, rnd):
    n = len(lengths)
    k = dp * m
    if n < k:
        return
    L = np.array(lengths)
    f = L.astype(float) ** 1.5
    # a valid start: one sample per micro-batch, the rest first-fit, over-cap samples alone
    order = list(range(n))
    rnd.shuffle(order)
    bin_of = np.full(n, -1)
    tok = np.zeros(k, dtype=int)
    for b, i in enumerate(order[:k]):
        bin_of[i], tok[b] = b, L[i]
    for i in order[k:]:
        fits = [b for b in range(k) if tok[b] + L[i] <= cap and not (tok[b] > cap)]
        if not fits:
            return
        bin_of[i] = fits[0]
        tok[fits[0]] += L[i]
    rb = np.arange(k).reshape(dp, m)
    before = np.bincount(bin_of // m, weights=f, minlength=dp).max()
    out = local_search(L, f, cap, bin_of, rb)
    cnt = np.bincount(out, minlength=k)
    toks = np.bincount(out, weights=L, minlength=k)
    assert (cnt >= 1).all()
    assert ((cnt == 1) | (toks <= cap)).all()
    after = np.bincount(out // m, weights=f, minlength=dp).max()
    assert after <= before + 1e-9


# ----------------------------------------------------------------------------- stages
def test_balanced_pack_count_and_cap():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(7, 1.0, 300).astype(int), 1, 9000)
    flops = TINY.forward_flops(lengths)
    inp = PackInput(lengths, flops, cap=4096, align=8)
    bins = balanced_pack(inp)
    assert len(bins) % 8 == 0
    assert len(bins) <= -(-len(first_fit(inp)) // 8) * 8
    assert sorted(i for b in bins for i in b) == list(range(300))
    assert all(len(b) == 1 or lengths[b].sum() <= 4096 for b in bins)
    bins2, rb2 = refine_balanced(inp, bins, balanced_distribution(
        BinWeights(np.array([lengths[b].sum() for b in bins]),
                   np.array([flops[b].sum() for b in bins])), 8))
    assert [len(r) for r in rb2] == [len(bins) // 8] * 8
    assert all(len(b) == 1 or lengths[b].sum() <= 4096 for b in bins2)


def test_balanced_distribution_never_worse_than_kk():
    r = Rollouts.synthetic(256, seed=11)
    base = ScheduleConfig(dp=8, global_batch_size=64, max_tokens_per_gpu=16384,
                          distribution="flops_kk")
    kk = build_schedule(r, base, TINY).check()
    bal = build_schedule(r, base.with_(distribution="balanced"), TINY).check()
    f = kk.sample_flops
    for a, b in zip(kk.steps, bal.steps):
        assert [mb.tolist() for mb in a.micro_batches] == [mb.tolist() for mb in b.micro_batches]
        worst = [max(sum(f[mb].sum() for mb in rank) for rank in s.ranks) for s in (a, b)]
        assert worst[1] <= worst[0] * (1 + 1e-12)


# ----------------------------------------------------------------------------- properties
@st.composite
def batches(draw):
    n_roll = draw(st.integers(1, 24))
    counts = draw(st.lists(st.integers(1, 4), min_size=n_roll, max_size=n_roll))
    rid = np.repeat(np.arange(n_roll), counts)
    lengths = draw(st.lists(st.integers(1, 3000), min_size=len(rid), max_size=len(rid)))
    return np.asarray(lengths), rid


#: first-fit needs 18 micro-batches in step 1 (a multiple of dp * mb_group = 9) of 17 samples
#: and is refused; balanced packs the step into fewer and is not (found by hypothesis in CI)
FIRST_FIT_REFUSED = ((np.array([1] * 16 + [474] + [520] * 9),
                      np.array([0, 1, 2, 3, 4, 5, 6, 6, 6, 7, 8, 9, 10, 10, 11, 11, 11, 11, 12,
                                12, 12, 12, 13, 13, 13, 13])), 3, 7, 2, 3, 2, 500)


@given(batches(), st.integers(1, 4), st.integers(1, 8), st.sampled_from([1, 2]),
       st.integers(1, 3), st.integers(1, 2), st.sampled_from([500, 1500, 4000]))
@example(*FIRST_FIT_REFUSED)
def test_balanced_schedule_properties(batch, dp, gbs, vpp, mb_group, cp, max_tokens):
    lengths, rid = batch
    r = Rollouts(prompt_len=np.zeros_like(lengths), response_len=lengths, rollout_id=rid)
    cfg = ScheduleConfig(dp=dp, global_batch_size=gbs, vpp=vpp, mb_group=mb_group, cp=cp,
                         max_tokens_per_gpu=max_tokens, packing="balanced")
    ff_cfg = cfg.with_(packing="first_fit", distribution="strided")
    try:
        ff = build_schedule(r, ff_cfg)
    except ValueError:
        # first fit packs more micro-batches than balanced: its alignment can fail where
        # balanced's holds, so balanced may schedule the batch or refuse it too
        ff = None
    try:
        s = build_schedule(r, cfg, TINY).check()
    except ValueError:
        assert ff is None, "balanced refused a batch first fit schedules"
        return
    cap = cfg.cap
    for b in s.steps:
        assert {len(bins) for bins in b.rank_bins} == {len(b.micro_batches) // dp}
        for mb in b.micro_batches:
            assert mb.size == 1 or int(r.total_len[mb].sum()) <= cap
    for a, b in zip(ff.steps if ff is not None else [], s.steps):
        assert np.array_equal(a.sample_indices, b.sample_indices)  # rollout grouping kept
        assert len(b.micro_batches) <= len(a.micro_batches)
    again = build_schedule(r, cfg, TINY)
    assert again.rank_layout() == s.rank_layout()  # deterministic


def test_balanced_schedules_a_batch_whose_first_fit_packing_cannot_align():
    (lengths, rid), dp, gbs, vpp, mb_group, cp, max_tokens = FIRST_FIT_REFUSED
    r = Rollouts(prompt_len=np.zeros_like(lengths), response_len=lengths, rollout_id=rid)
    cfg = ScheduleConfig(dp=dp, global_batch_size=gbs, vpp=vpp, mb_group=mb_group, cp=cp,
                         max_tokens_per_gpu=max_tokens, packing="balanced")
    with pytest.raises(ValueError, match=r"step 1 holds 17 samples but the layout needs 18"):
        build_schedule(r, cfg.with_(packing="first_fit", distribution="strided"))
    s = build_schedule(r, cfg, TINY).check()
    assert len(s.steps[1].micro_batches) == 9  # one per rank and mb_group slot
