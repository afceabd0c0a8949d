"""policy_objective: the per-token terms of slime's policy loss, on hand-derived numbers.

(The same function against vectors recorded from slime's own policy_loss_function /
loss_function: tests/unit/compat/test_golden_loss.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from varbatch_kit.report import get_report_mode
from varbatch_kit.report.objective import ObjectiveOptions, metric_keys, policy_objective

F64 = torch.float64


def _t(*values, grad=False):
    return torch.tensor(values, dtype=F64, requires_grad=grad)


def _terms(options, log_probs, advantages, *, old=None, entropy=None, masks=None, **kw):
    n = len(log_probs)
    entropy = entropy or [torch.zeros_like(lp) for lp in log_probs]
    masks = masks or [torch.ones_like(lp) for lp in log_probs]
    adv = [torch.full_like(lp.detach(), a) for lp, a in zip(log_probs, advantages)]
    assert len(adv) == n
    return policy_objective(options, log_probs, entropy, adv, masks, old_log_probs=old, **kw)


def test_the_options_default_to_the_training_configs_and_so_to_slimes():
    """``ObjectiveOptions()`` (a direct call of :func:`policy_objective`) has the defaults of
    ``LossConfig`` (which tests/unit/compat/test_train_flags.py holds to slime's): PPO clip 0.2
    both sides, no entropy bonus, no KL loss, TIS clip 2."""
    pytest.importorskip("varbatch_kit.train.config.sub_configs")
    from varbatch_kit.train.config.sub_configs import LossConfig

    assert ObjectiveOptions() == LossConfig().objective_options()
    assert (ObjectiveOptions().eps_clip, ObjectiveOptions().eps_clip_high) == (0.2, 0.2)


def test_on_policy_value_is_minus_advantage_and_gradient_minus_advantage_dlogp():
    """No old log-probs: old = current (detached), ratio 1: value -A, gradient -A d log p."""
    lp = _t(-1.0, -2.0, -0.5, grad=True)
    out = _terms(ObjectiveOptions(), [lp[:2], lp[2:]], [1.0, -2.0])
    assert out["pg_loss"].tolist() == [-1.0, -1.0, 2.0]
    assert out["ppo_kl"].tolist() == [0.0, 0.0, 0.0]
    assert out["pg_clipfrac"].tolist() == [0.0, 0.0, 0.0]
    out["loss"].sum().backward()
    assert lp.grad.tolist() == [-1.0, -1.0, 2.0]


def test_ppo_clipping_cases_by_hand_symmetric_and_asymmetric():
    """ratio r = exp(new - old); loss = max(-A r, -A clip(r, 1 - lo, 1 + hi)); clipped tokens
    have no gradient; pg_clipfrac flags them."""
    ratio = _t(1.5, 0.5, 1.5, 0.5)
    lp = ratio.log().clone().requires_grad_(True)
    parts, old = list(lp.split(1)), [torch.zeros(1, dtype=F64)] * 4
    out = _terms(ObjectiveOptions(eps_clip=0.2, eps_clip_high=0.2), parts, [2.0, 2.0, -2.0, -2.0],
                 old=old)
    # A > 0, r above 1 + eps: clipped at 1.2;   A > 0, r below 1 - eps: unclipped 0.5
    # A < 0, r above 1 + eps: unclipped 1.5;    A < 0, r below 1 - eps: clipped at 0.8
    assert out["pg_loss"].tolist() == pytest.approx([-2.4, -1.0, 3.0, 1.6], abs=1e-12)
    assert out["pg_clipfrac"].tolist() == [1.0, 0.0, 0.0, 1.0]
    out["loss"].sum().backward()
    assert lp.grad.tolist() == pytest.approx([0.0, -1.0, 3.0, 0.0], abs=1e-12)
    # eps_clip_high = 0.6: r = 1.5 < 1.6 is inside for A > 0 now
    lp2 = ratio.log().clone().requires_grad_(True)
    out = _terms(ObjectiveOptions(eps_clip=0.2, eps_clip_high=0.6), list(lp2.split(1)),
                 [2.0, 2.0, -2.0, -2.0], old=old)
    assert out["pg_loss"].tolist() == pytest.approx([-3.0, -1.0, 3.0, 1.6], abs=1e-12)


def test_dual_clip_caps_the_loss_of_negative_advantage_tokens():
    # A = -2, r = 5: the PPO loss max(10, 2.4) = 10 is capped at eps_clip_c * |A| = 3 * 2 = 6
    lp = _t(math.log(5.0), grad=True)
    out = _terms(ObjectiveOptions(eps_clip_c=3.0), [lp], [-2.0], old=[torch.zeros(1, dtype=F64)])
    assert out["pg_loss"].tolist() == pytest.approx([6.0])
    out["loss"].sum().backward()
    assert lp.grad.tolist() == [0.0]
    with pytest.raises(ValueError, match="greater than 1.0"):
        _terms(ObjectiveOptions(eps_clip_c=1.0), [lp], [-2.0])


def test_entropy_bonus_and_kl_loss_enter_the_per_token_loss():
    """loss_t = pg_t - entropy_coef * H_t + kl_loss_coef * KL_t, KL the chosen estimator."""
    lp = _t(-1.0, -2.0, grad=True)
    ent = _t(0.5, 1.5, grad=True)
    ref = [_t(-1.5, -1.0)]
    opts = ObjectiveOptions(entropy_coef=0.1, use_kl_loss=True, kl_loss_coef=0.5,
                            kl_loss_type="k3")
    out = _terms(opts, [lp], [1.0], entropy=[ent], ref_log_probs=ref)
    r = [-1.0 + 1.5, -2.0 + 1.0]  # new - ref
    k3 = [math.exp(-x) - 1 + x for x in r]
    assert out["kl_loss"].tolist() == pytest.approx(k3, rel=1e-6)  # float32, as slime
    want = [-1.0 - 0.1 * 0.5 + 0.5 * k3[0], -1.0 - 0.1 * 1.5 + 0.5 * k3[1]]
    assert out["loss"].tolist() == pytest.approx(want, rel=1e-6)
    assert list(out) == list(metric_keys(opts, has_rollout_log_probs=False))
    out["loss"].sum().backward()
    assert ent.grad.tolist() == pytest.approx([-0.1, -0.1])
    with pytest.raises(ValueError, match="ref_log_probs"):
        _terms(opts, [lp], [1.0])


def test_tis_weights_the_surrogate_by_the_clamped_old_over_rollout_ratio():
    lp = _t(-1.0, -1.0, grad=True)
    old = [_t(-1.0, -1.0)]
    rollout = [_t(-1.0 - math.log(3.0), -1.0 + math.log(2.0))]  # old/rollout = 3 and 0.5
    opts = ObjectiveOptions(use_tis=True, tis_clip=2.0, tis_clip_low=0.0)
    out = _terms(opts, [lp], [1.0], old=old, rollout_log_probs=rollout)
    assert out["tis"].tolist() == pytest.approx([3.0, 0.5])
    assert out["tis_clipfrac"].tolist() == [1.0, 0.0]
    assert out["pg_loss"].tolist() == pytest.approx([-2.0, -0.5])  # -A * 1 * min(w, 2)
    assert out["train_rollout_logprob_abs_diff"].tolist() == pytest.approx(
        [math.log(3.0), math.log(2.0)])
    icepop = _terms(ObjectiveOptions(use_tis=True, tis_function="icepop", tis_clip=2.0), [lp],
                    [1.0], old=old, rollout_log_probs=rollout)
    assert icepop["pg_loss"].tolist() == pytest.approx([0.0, -0.5])  # outside [0, 2]: 0
    with pytest.raises(ValueError, match="rollout_log_probs"):
        _terms(opts, [lp], [1.0], old=old)


def test_gspo_uses_each_samples_masked_mean_of_old_minus_new():
    lp = _t(-1.0, -2.0, -4.0, grad=True)
    old = [_t(-1.5, -1.0, -3.0)]
    mask = [_t(1.0, 1.0, 0.0)]
    out = _terms(ObjectiveOptions(advantage_estimator="gspo"), [lp], [1.0], old=old, masks=mask)
    mean = ((-1.5 + 1.0) + (-1.0 + 2.0)) / 2  # masked mean of old - new: 0.25
    assert out["ppo_kl"].tolist() == pytest.approx([mean] * 3)


def test_cispo_keeps_the_gradient_through_log_probs_with_a_clipped_weight():
    lp = _t(math.log(1.5), grad=True)
    out = _terms(ObjectiveOptions(advantage_estimator="cispo", eps_clip_high=0.2), [lp], [2.0],
                 old=[torch.zeros(1, dtype=F64)])
    # -sg(clip(1.5, 0.8, 1.2)) * A * log p
    assert out["pg_loss"].tolist() == pytest.approx([-1.2 * 2.0 * math.log(1.5)])
    out["loss"].sum().backward()
    assert lp.grad.tolist() == pytest.approx([-1.2 * 2.0])


def test_reduced_by_a_report_mode_the_terms_give_slimes_step_values_by_hand():
    """sample A: log-probs [-1, -2], advantage 1; sample B: [-0.5], advantage -2; on-policy.
    per_rollout_mean over two rollouts: pg_loss = (-1 + 2) / 2 = 0.5 ((-2/2 + 2/1) / 2)."""
    mode = get_report_mode("per_rollout_mean")
    lp = [_t(-1.0, -2.0), _t(-0.5)]
    masks = [torch.ones(2, dtype=F64), torch.ones(1, dtype=F64)]
    out = _terms(ObjectiveOptions(), lp, [1.0, -2.0], masks=masks)
    norm = mode.step_normalizers([0, 1], masks)
    total = mode.microbatch_loss_sum(out["pg_loss"], total_lengths=[3, 2], response_lengths=[2, 1],
                                     loss_masks=masks, sample_denominators=norm.denominators_for(
                                         [0, 1]))
    assert float(total) / norm.report_divisor == pytest.approx(0.5)
