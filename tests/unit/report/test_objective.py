"""varbatch_kit.report.objective: hand-derived numbers, one small case per function,
and the invariants of the objective as hypothesis properties.

(The replay of slime's own vectors is ``tests/unit/compat/test_golden_objective.py``.)
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from varbatch_kit.report import objective as obj

F64 = torch.float64


def t(*xs, dtype=F64):
    return torch.tensor(xs, dtype=dtype)


def close(got, want, tol=1e-12):
    want = torch.as_tensor(want, dtype=got.dtype)
    assert torch.allclose(got, want, rtol=0, atol=tol), (got.tolist(), want.tolist())


# --------------------------------------------------------------------------- hand-derived


def test_approx_kl_by_hand():
    new, ref = t(0.0, -1.0), t(-1.0, 0.0)  # r = new - ref = [1, -1]
    close(obj.approx_kl(new, ref, "k1"), [1.0, -1.0])
    close(obj.approx_kl(new, ref, "k2"), [0.5, 0.5])
    close(obj.approx_kl(new, ref, "k3"), [math.exp(-1), math.e - 2], 1e-6)  # exp(-r) - 1 + r
    assert obj.approx_kl(new, ref, "k1").dtype == torch.float32  # computed in float32
    close(obj.approx_kl(new, ref, "k1", weight=t(2.0, 3.0)), [2.0, -3.0])  # float64 weight
    # low_var_kl = k3 clamped to [-10, 10] after the weight: r = 20 gives 19 + e^-20 -> 10
    close(obj.approx_kl(t(0.0), t(-20.0), "k3"), [19.0], 1e-5)
    close(obj.approx_kl(t(0.0), t(-20.0), "low_var_kl"), [10.0])
    close(obj.approx_kl(t(0.0), t(-1.0), "low_var_kl", weight=t(100.0)), [10.0])
    with pytest.raises(ValueError, match="k4"):
        obj.approx_kl(new, ref, "k4")


def test_sequence_kl_by_hand():
    new = [t(-1.0, -2.0, -3.0), t(-1.0)]
    old = [t(-0.5, -1.0, 0.0), t(0.0)]
    masks = [t(1, 1, 0, dtype=torch.int64), t(0.0)]
    got = obj.sequence_kl(new, old, masks)
    close(got[0], 0.75)  # ((0.5 + 1.0) / 2)
    close(got[1], 0.0)  # fully masked: 0 / max(0, 1)


def test_ppo_clip_loss_by_hand():
    ratio = t(1.5, 1.5, 0.5, 0.5)
    adv = t(1.0, -1.0, 1.0, -1.0)
    loss, frac = obj.ppo_clip_loss(-ratio.log(), adv, 0.2, 0.2)
    # A>0, r=1.5: max(-1.5, -1.2); A<0, r=1.5: max(1.5, 1.2); A>0, r=.5: max(-.5, -.8);
    # A<0, r=.5: max(.5, .8)
    close(loss, [-1.2, 1.5, -0.5, 0.8], 1e-12)
    close(frac, [1.0, 0.0, 0.0, 1.0])
    dual, _ = obj.ppo_clip_loss(-ratio.log(), adv, 0.2, 0.2, eps_clip_c=1.4)
    close(dual, [-1.2, 1.4, -0.5, 0.8], 1e-12)  # A<0 capped at -1.4*A
    with pytest.raises(ValueError, match="eps_clip_c"):
        obj.ppo_clip_loss(t(0.0), t(1.0), 0.2, 0.2, eps_clip_c=1.0)


def test_cispo_loss_by_hand():
    loss, frac = obj.cispo_loss(-t(1.5, 1.1).log(), t(-0.5, -0.5), t(2.0, 2.0), 0.2, 0.28)
    close(loss, [1.28, 1.1], 1e-12)  # -clip(r, .8, 1.28) * A * logp
    close(frac, [1.0, 0.0])


def test_opsm_keep_mask_by_hand():
    new = [t(-1.0, -1.0), t(-1.0, -1.0), t(-1.0)]
    old = [t(-0.5, -0.5), t(-0.5, -0.5), t(0.0)]  # sequence KL 0.5, 0.5, 0 (masked)
    adv = [t(-1.0, -1.0), t(1.0, 1.0), t(-1.0)]
    masks = [t(1.0, 1.0), t(1.0, 0.0), t(0.0)]
    keep, share = obj.opsm_keep_mask(new, old, adv, masks, delta=0.1)
    close(keep, [0.0, 0.0, 1.0, 1.0, 1.0])
    assert share.dtype == torch.float32 and share.item() == 1.0  # 2 dropped / 2 tokens


def test_advantages_by_hand():
    adv = obj.broadcast_advantages(t(0.5, -1.0), [t(0.0, 0.0), t(0.0)])
    close(adv[0], [0.5, 0.5])
    close(adv[1], [-1.0])
    close(obj.discounted_returns(t(1.0, 2.0, 4.0), 0.5), [3.0, 4.0, 4.0])
    # token rewards -0.5 * kl * mask = [-.05, -.1, 0]; +1 at the last unmasked token (1)
    (ret,) = obj.reinforce_pp_returns(t(1.0), [t(0.1, 0.2, 0.3)], [t(1.0, 1.0, 0.0)], 0.5, 0.5)
    close(ret, [0.4, 0.9, 0.0])
    with pytest.raises(ValueError, match="fully masked"):
        obj.reinforce_pp_returns(t(1.0), [t(0.1)], [t(0.0)], 0.5, 0.5)
    (base,) = obj.reinforce_pp_baseline_advantages(t(0.5), [t(0.2, 0.0)], 0.5)
    close(base, [0.4, 0.5])


def test_gae_by_hand():
    r, v = [t(0.0, 1.0)], [t(0.5, 0.25)]
    # delta = r + gamma*V_next - V = [0 + .25 - .5, 1 + 0 - .25] = [-.25, .75]
    (a,), (ret,) = obj.gae(r, v, 1.0, 1.0)
    close(a, [0.5, 0.75])
    close(ret, [1.0, 1.0])
    (a0,), _ = obj.gae(r, v, 1.0, 0.0)
    close(a0, [-0.25, 0.75])


def test_gae_refuses_tensors_that_are_not_one_response_each():
    with pytest.raises(ValueError, match="pass 1-D per-token tensors"):
        obj.gae([torch.zeros(2, 2)], [torch.zeros(2, 2)], 1.0, 1.0)


def test_estimate_advantages_adds_no_kl_penalty_unless_asked():
    # reinforce++ with a per-token KL of 0.5 and the default kl_coef (0): the returns are the
    # reward alone on every token; kl_coef=1 subtracts the KL, summed from each token on
    kl, masks = [t(0.5, 0.5)], [t(1.0, 1.0)]
    (adv,), _ = obj.estimate_advantages("reinforce_plus_plus", [1.0], kl, masks)
    close(adv, [1.0, 1.0])
    (pen,), _ = obj.estimate_advantages("reinforce_plus_plus", [1.0], kl, masks, kl_coef=1.0)
    close(pen, [0.0, 0.5])


def test_importance_weights_by_hand():
    new, rollout = t(0.0, 0.0, 0.0), t(math.log(4.0), 0.0, -math.log(4.0))  # ratio .25, 1, 4
    tis = obj.truncated_is_weights(new, rollout, 0.5, 2.0)
    close(tis["ratio"], [0.25, 1.0, 4.0], 1e-12)
    close(tis["weight"], [0.5, 1.0, 2.0], 1e-12)
    close(tis["clipfrac"], [1.0, 0.0, 1.0])
    close(tis["abs"], [0.75, 0.0, 3.0], 1e-12)
    ice = obj.icepop_weights(new, rollout, 0.5, 2.0)
    close(ice["weight"], [0.0, 1.0, 0.0], 1e-12)
    close(ice["clipfrac"], [1.0, 0.0, 1.0])


def test_normalize_group_rewards_by_hand():
    assert obj.normalize_group_rewards([1, 0, 1, 1], 2, divide_by_std=False) == [0.5, -0.5, 0, 0]
    got = obj.normalize_group_rewards([1, 0, 1, 1], 2, divide_by_std=True)
    s = math.sqrt(0.5)  # unbiased std of [.5, -.5]
    assert got == pytest.approx([0.5 / (s + 1e-6), -0.5 / (s + 1e-6), 0.0, 0.0], rel=1e-6)
    assert obj.normalize_group_rewards([1, 2, 3], None, divide_by_std=False) == [-1, 0, 1]
    assert math.isnan(obj.normalize_group_rewards([1.0], 1, divide_by_std=True)[0])
    with pytest.raises(ValueError, match="group_size"):
        obj.normalize_group_rewards([1, 2, 3], 2, divide_by_std=False)
    with pytest.raises(ValueError, match="group_size=0 does not divide"):
        obj.normalize_group_rewards([1, 2, 3], 0, divide_by_std=False)
    assert obj.normalize_group_rewards([], 2, divide_by_std=True) == []  # no samples, no groups


# --------------------------------------------------------------------------- properties

floats = st.floats(-5, 5, allow_nan=False, width=64)
vec = st.lists(floats, min_size=1, max_size=12)


def pair(n_min=1):
    return st.integers(n_min, 12).flatmap(
        lambda n: st.tuples(st.lists(floats, min_size=n, max_size=n),
                            st.lists(floats, min_size=n, max_size=n)))


@settings(max_examples=60, deadline=None)
@given(pair())
def test_k1_is_antisymmetric_and_k2_k3_are_non_negative(ab):
    a, b = t(*ab[0]), t(*ab[1])
    assert torch.equal(obj.approx_kl(a, b, "k1"), -obj.approx_kl(b, a, "k1"))
    assert bool((obj.approx_kl(a, b, "k2") >= 0).all())
    for kind in ("k3", "low_var_kl"):  # non-negative up to float32 rounding of exp near 1
        assert bool((obj.approx_kl(a, b, kind) >= -1e-6).all())
    low = obj.approx_kl(a, b, "low_var_kl")
    assert bool((low <= 10).all())
    k3 = obj.approx_kl(a, b, "k3")
    assert torch.equal(low, k3.clamp(max=10))


@settings(max_examples=60, deadline=None)
@given(vec, st.floats(0, 0.9), st.floats(0, 2), st.one_of(st.none(), st.floats(1.01, 10)))
def test_ratio_one_gives_minus_advantage(adv, eps, eps_high, eps_c):
    a = t(*adv)
    loss, frac = obj.ppo_clip_loss(torch.zeros_like(a), a, eps, eps_high, eps_c)
    want = -a if eps_c is None else torch.where(a < 0, torch.minimum(-eps_c * a, -a), -a)
    assert torch.equal(loss, want) and not frac.any()
    c_loss, c_frac = obj.cispo_loss(torch.zeros_like(a), torch.ones_like(a), a, eps, eps_high)
    assert torch.equal(c_loss, -a) and not c_frac.any()


@settings(max_examples=60, deadline=None)
@given(pair(), st.floats(0, 0.9), st.floats(0, 2), st.floats(1.01, 10))
def test_clipping_bounds(kl_adv, eps, eps_high, eps_c):
    kl, a = t(*kl_adv[0]) / 5, t(*kl_adv[1])
    ratio = torch.exp(-kl)
    loss, frac = obj.ppo_clip_loss(kl, a, eps, eps_high)
    assert bool((loss >= -a * ratio).all())  # the max never goes below the unclipped term
    pos = a > 0  # A > 0: the gain is capped at (1 + eps_high) * A
    assert bool((loss[pos] >= -a[pos] * (1 + eps_high) - 1e-12).all())
    assert torch.equal(frac.bool(), (-ratio.clamp(1 - eps, 1 + eps_high) * a) > -ratio * a)
    dual, _ = obj.ppo_clip_loss(kl, a, eps, eps_high, eps_c)
    neg = a < 0
    assert bool((dual[neg] <= -eps_c * a[neg]).all())
    assert torch.equal(dual[~neg], loss[~neg])


@settings(max_examples=40, deadline=None)
@given(vec, st.floats(0, 1))
def test_discounted_returns_extremes_and_gae_with_lambda_one(rewards, gamma):
    r = t(*rewards)
    close(obj.discounted_returns(r, 1.0), r.flip(0).cumsum(0).flip(0), 1e-9)
    assert torch.equal(obj.discounted_returns(r, 0.0), r)
    # lambda = 1: advantage + value telescopes to the Monte-Carlo return, whatever V is
    v = r.roll(1) * 0.5 + 0.25
    (adv,), (ret,) = obj.gae([r], [v], gamma, 1.0)
    close(ret, obj.discounted_returns(r, gamma), 1e-9)
    close(adv, ret - v)


@settings(max_examples=40, deadline=None)
@given(pair(), st.floats(0, 1), st.floats(1, 5))
def test_importance_weights_stay_in_bounds(ab, low, high):
    new, rollout = t(*ab[0]) / 4, t(*ab[1]) / 4
    tis = obj.truncated_is_weights(new, rollout, low, high)
    assert bool(((tis["weight"] >= low) & (tis["weight"] <= high)).all())
    ice = obj.icepop_weights(new, rollout, low, high)
    kept = ice["weight"] != 0
    assert torch.equal(ice["weight"][kept], ice["ratio"][kept])
    assert torch.equal(ice["clipfrac"].bool(), ~kept)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(2, 5), st.data())
def test_group_normalisation_centres_each_group(groups, size, data):
    raw = data.draw(st.lists(st.floats(-3, 3, width=32), min_size=groups * size,
                             max_size=groups * size))
    shift = data.draw(st.floats(-3, 3, width=32))
    out = torch.tensor(obj.normalize_group_rewards(raw, size, divide_by_std=False))
    assert out.reshape(groups, size).sum(-1).abs().max().item() <= 1e-5
    moved = obj.normalize_group_rewards([x + shift for x in raw], size, divide_by_std=False)
    assert torch.allclose(torch.tensor(moved), out, atol=1e-5)


def test_masked_whiten_by_hand():
    x, m = t(1.0, 2.0, 3.0, 100.0), t(1.0, 1.0, 1.0, 0.0)
    # mean 2, biased var 2/3, Bessel 3/2 -> 1: out = (x - 2) / sqrt(1 + eps); the statistics
    # are float32, so the scale is 1 to float32 precision
    close(obj.masked_whiten(x, m, eps=0.0), [-1.0, 0.0, 1.0, 98.0], 2e-5)
    close(obj.masked_whiten(x, m, eps=0.0, shift_mean=False), [1.0, 2.0, 3.0, 100.0], 2e-5)
    close(obj.masked_whiten(t(5.0), t(1.0), eps=1.0), [0.0])  # one token: no Bessel, var 0
    with pytest.raises(ValueError, match="mask sum"):
        obj.masked_whiten(x, torch.zeros(4))


def test_estimate_advantages_by_hand():
    kl = [torch.tensor([0.5, 0.5])]
    masks = [torch.tensor([1.0, 0.0])]
    adv, ret = obj.estimate_advantages("grpo", [2.0], kl, masks, kl_coef=0.5)
    close(adv[0], [2.0, 2.0])  # GRPO ignores the KL
    adv, _ = obj.estimate_advantages("reinforce_plus_plus_baseline", [2.0], kl, masks,
                                     kl_coef=0.5)
    close(adv[0], [1.75, 1.75])
    # REINFORCE++: [-0.25 + 2, 0] (last *unmasked* token), gamma 1
    adv, _ = obj.estimate_advantages("reinforce_plus_plus", [2.0], kl, masks, kl_coef=0.5)
    close(adv[0], [1.75, 0.0])
    # PPO: token rewards [-0.25, -0.25 + 1] (last token), V = 0: GAE(1, 1) = returns-to-go
    adv, ret = obj.estimate_advantages("ppo", [1.0], kl, masks, kl_coef=0.5,
                                       values=[torch.zeros(2)])
    close(adv[0], [0.5, 0.75])
    close(ret[0], [0.5, 0.75])
    with pytest.raises(ValueError, match="values"):
        obj.estimate_advantages("ppo", [1.0], kl, masks)
    with pytest.raises(ValueError, match="dpo"):
        obj.estimate_advantages("dpo", [1.0], kl, masks)


@settings(max_examples=30, deadline=None)
@given(st.lists(vec, min_size=1, max_size=5), st.floats(0, 1), st.floats(0, 1))
def test_batched_returns_equal_each_sample_alone(rows, gamma, lambd):
    """Padding the samples into one recurrence changes no bit of any sample's result."""
    r = [t(*x) for x in rows]
    v = [x.flip(0) * 0.5 for x in r]
    advs, rets = obj.gae(r, v, gamma, lambd)
    for i in range(len(r)):
        (a,), (g,) = obj.gae([r[i]], [v[i]], gamma, lambd)
        assert torch.equal(advs[i], a) and torch.equal(rets[i], g)
        assert torch.equal(obj.reinforce_pp_returns([1.0], [r[i]], [torch.ones_like(r[i])],
                                                    0.1, gamma)[0],
                           obj.discounted_returns(-0.1 * r[i] + torch.nn.functional.one_hot(
                               torch.tensor(len(r[i]) - 1), len(r[i])).to(F64), gamma))
