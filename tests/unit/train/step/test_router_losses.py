"""Per-sample router losses (train/step/router_losses.py): by hand, against megatron-core's own
loss functions and router, and the packing invariance that the per-row loss lacks."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from varbatch_kit.train.step.router_losses import per_token_values, sample_router_losses


def test_two_experts_top1_by_hand():
    # one sample of 2 tokens, 2 experts, k = 1: token 0 logits (0, ln 3) -> p = (1/4, 3/4),
    # routed to expert 1; token 1 logits (0, 0) -> p = (1/2, 1/2), ties go to expert 0
    # (torch.topk's first index). f = (1/2, 1/2), P = (3/8, 5/8): aux = 2 * (3/16 + 5/16) = 1
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]], dtype=torch.float64)
    aux, z = sample_router_losses([logits], [2], topk=1)
    assert aux.tolist() == pytest.approx([1.0], abs=1e-15)
    # z: mean of logsumexp^2 = (ln 4)^2 / 2 + (ln 2)^2 / 2
    assert z.tolist() == pytest.approx([(math.log(4) ** 2 + math.log(2) ** 2) / 2], abs=1e-15)


def test_layers_are_averaged():
    a = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]], dtype=torch.float64)
    b = torch.tensor([[5.0, 0.0], [4.0, 0.0]], dtype=torch.float64)
    both, _ = sample_router_losses([a, b], [2], topk=1)
    one_a, _ = sample_router_losses([a], [2], topk=1)
    one_b, _ = sample_router_losses([b], [2], topk=1)
    assert both.item() == pytest.approx((one_a.item() + one_b.item()) / 2, abs=1e-15)


def test_equals_megatron_loss_functions_on_each_sample_alone():
    """megatron-core's switch_load_balancing_loss_func (coefficient 1) and z_loss_func on a
    sample's tokens alone, with the routing map of its compute_routing_scores_for_aux_loss."""
    from megatron.core.transformer.moe.moe_utils import (
        compute_routing_scores_for_aux_loss,
        switch_load_balancing_loss_func,
        z_loss_func,
    )

    g = torch.Generator().manual_seed(0)
    lengths, experts, topk = [5, 1, 9, 3], 6, 2
    layers = [torch.randn(sum(lengths), experts, generator=g) for _ in range(3)]
    aux, z = sample_router_losses(layers, lengths, topk)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    for s, (a, n) in enumerate(zip(starts, lengths)):
        ref_aux = ref_z = 0.0
        for logits in layers:
            piece = logits[a:a + n]
            routing_map, scores = compute_routing_scores_for_aux_loss(piece, topk, "softmax")
            ref_aux += float(switch_load_balancing_loss_func(
                scores, routing_map.sum(dim=0), n, topk, experts, 1.0))
            ref_z += float(z_loss_func(piece, 1.0))
        assert aux[s].item() == pytest.approx(ref_aux / len(layers), rel=1e-6)
        assert z[s].item() == pytest.approx(ref_z / len(layers), rel=1e-6)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 7), min_size=1, max_size=6), seed=st.integers(0, 2**16),
       topk=st.integers(1, 3))
def test_a_samples_losses_do_not_depend_on_what_else_is_in_its_row(lengths, seed, topk):
    """The invariant: a sample alone, or packed with others in any order, has the same
    losses (float64: equal to rounding), and its gradient is its own."""
    g = torch.Generator().manual_seed(seed)
    experts = 4
    alone = [torch.randn(n, experts, generator=g, dtype=torch.float64) for n in lengths]
    order = torch.randperm(len(lengths), generator=g).tolist()
    row = torch.cat([alone[i] for i in order]).requires_grad_()
    aux, z = sample_router_losses([row], [lengths[i] for i in order], topk)
    for place, i in enumerate(order):
        a, zz = sample_router_losses([alone[i]], [lengths[i]], topk)
        assert aux[place].item() == pytest.approx(a.item(), rel=1e-12, abs=1e-15)
        assert zz.item() == pytest.approx(z[place].item(), rel=1e-12, abs=1e-15)
    # the gradient of one sample's loss is zero on every other sample's rows
    (grad,) = torch.autograd.grad(aux[0], row)
    if len(order) > 1:
        assert grad[lengths[order[0]]:].abs().max().item() == 0.0


def test_the_per_row_loss_moves_with_the_packing():
    """megatron's per-micro-batch loss: the same two samples, packed together or apart, give
    another loss (what FaultConfig.moe_aux_per_row injects)."""
    a = torch.tensor([[3.0, 0.0], [2.0, 0.0]], dtype=torch.float64)  # both to expert 0
    b = torch.tensor([[0.0, 3.0]], dtype=torch.float64)  # to expert 1
    apart = [sample_router_losses([x], [len(x)], 1)[0].item() for x in (a, b)]
    together = sample_router_losses([torch.cat([a, b])], [3], 1)[0].item()
    assert together < min(apart)  # the row looks balanced; each sample alone does not


def test_gradient_flows_to_the_logits_and_the_row_must_match():
    logits = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    aux, z = sample_router_losses([logits], [1, 3], topk=1)
    (aux.sum() + z.sum()).backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="4 tokens for samples of 5"):
        sample_router_losses([logits], [2, 3], topk=1)
    with pytest.raises(ValueError, match="no router logits"):
        sample_router_losses([], [2], topk=1)


def test_per_token_values_repeat_each_sample_over_its_response():
    got = per_token_values(torch.tensor([1.0, 2.0, 3.0]), [2, 0, 3])
    assert got.tolist() == [1.0, 1.0, 3.0, 3.0, 3.0]


def _router(layer_number: int, aux_type: str):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2,
                               num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=8,
                               moe_router_load_balancing_type=aux_type, moe_aux_loss_coeff=0.5,
                               moe_z_loss_coeff=0.25, params_dtype=torch.float32,
                               use_cpu_initialization=True, moe_token_dispatcher_type="alltoall")
    groups = ProcessGroupCollection.use_mpu_process_groups()
    router = TopKRouter(config=config, pg_collection=groups)
    router.set_layer_number(layer_number)
    torch.nn.init.normal_(router.weight, std=1.0)
    return router.train()


def test_one_sample_rows_agree_with_megatrons_router_and_its_packed_row_does_not():
    """megatron-core's TopKRouter, run for real (its aux_loss and z-loss, the values its
    tracker logs), against RouterLosses' hook on the same router: on a row that holds one
    sample the two agree; on a packed row of two samples megatron's seq_aux_loss is the row's
    (Megatron-LM #5996, what RouterLosses(per_row=True) injects), ours the samples' own."""
    from _megatron import single_process_megatron
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
    )

    from varbatch_kit.train.parallel.megatron_import import moe_without_transformer_engine
    from varbatch_kit.train.step.router_losses import RouterLosses

    def token_mean(values):  # every token a loss token, one rollout: the mean over tokens
        return values.sum() / values.numel()

    moe_without_transformer_engine()  # as the engine's MoE models (no TransformerEngine here)
    with single_process_megatron("cpu"):
        g = torch.Generator().manual_seed(3)
        one, two = torch.randn(7, 1, 8, generator=g), torch.randn(5, 1, 8, generator=g)
        for aux_type, key in (("aux_loss", "load_balancing_loss"),
                              ("seq_aux_loss", "seq_load_balancing_loss")):
            router = _router(1, aux_type)
            for row, lengths in ((one, [7]), (torch.cat([one, two]), [7, 5])):
                got = {}
                for per_row in (False, True):
                    clear_aux_losses_tracker()
                    losses = RouterLosses([router], per_row=per_row)
                    with losses.attached():
                        losses.micro_batch(lengths, lengths, loss_sum=token_mean, weight=1.0,
                                           scale=1.0)
                        router(row)
                    got[per_row] = losses.report().tolist()
                tracker = get_moe_layer_wise_logging_tracker()
                theirs = float(tracker[key]["values"][0])
                theirs_z = float(tracker["z_loss"]["values"][0])
                assert got[True][0] == pytest.approx(theirs, rel=1e-5), aux_type
                assert got[True][1] == pytest.approx(theirs_z, rel=1e-5)
                if len(lengths) == 1:
                    assert got[False] == pytest.approx(got[True], rel=1e-12)
                else:  # the packed row is not the samples' (token-weighted) mean
                    assert abs(got[False][0] - theirs) > 1e-3 * theirs
        clear_aux_losses_tracker()


def test_the_attached_loss_trains_with_the_schedules_scale():
    """The router's output carries weight * (aux_coeff * aux + z_coeff * z): its gradient is
    that term's, times ``scale``; an idle round (weight 0) neither trains nor reports."""
    from varbatch_kit.train.step.router_losses import RouterLosses

    class _Gate(torch.nn.Module):
        topk = 1

        class config:  # noqa: N801 - megatron's TransformerConfig, as far as it is read
            sequence_parallel = False

        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.tensor([[1.0, -1.0], [0.5, 2.0]],
                                                          dtype=torch.float64))

        def gating(self, x):
            return x @ self.weight.T

        def forward(self, x):
            logits = self.gating(x)
            return torch.softmax(logits, -1), logits > 0

    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    for weight, counted in ((0.5, True), (0.0, False)):
        gate = _Gate()
        losses = RouterLosses([gate], aux_coeff=0.3, z_coeff=0.2)
        with losses.attached():
            losses.micro_batch([2, 1], [2, 1], loss_sum=torch.sum, weight=weight, scale=0.25,
                               counted=counted)
            probs, _ = gate(x)
            probs.sum().backward()  # the main loss: its gradient on the probs is 1
        got = gate.weight.grad.clone()
        ref = _Gate()
        probs, _ = ref(x)
        aux, z = sample_router_losses([ref.gating(x)], [2, 1], topk=1)
        main = probs.sum()
        term = weight * (0.3 * per_token_values(aux, [2, 1]).sum()
                         + 0.2 * per_token_values(z, [2, 1]).sum())
        (main + 0.25 * term).backward()
        assert torch.allclose(got, ref.weight.grad, rtol=1e-13, atol=1e-15), weight
        reported = losses.report()
        if counted:
            assert reported[0].item() == pytest.approx(per_token_values(aux, [2, 1]).sum()
                                                       .item(), rel=1e-13)
        else:
            assert reported.tolist() == [0.0, 0.0]
