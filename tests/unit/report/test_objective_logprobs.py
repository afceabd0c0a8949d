"""The log-prob pass from logits (:mod:`varbatch_kit.report.objective.logprobs`).

Checked end to end against slime's ``get_log_probs_and_entropy`` (through
``policy_loss_function``'s logged entropy and logits gradient) in
``tests/unit/compat/test_golden_loss.py``; here against float64 definitions.
"""

from __future__ import annotations

import math

import pytest
import torch

from varbatch_kit.report.objective import (
    response_log_probs_and_entropy,
    token_log_probs_and_entropy,
)


def reference(logits: torch.Tensor, tokens: torch.Tensor, temperature: float):
    x = logits.double() / temperature
    logp = torch.log_softmax(x, dim=-1)
    return logp.gather(1, tokens[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_values_and_gradients_match_float64(temperature):
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(9, 13, generator=g) * 3).requires_grad_(True)
    tokens = torch.randint(0, 13, (9,), generator=g)
    lp, ent = token_log_probs_and_entropy(logits, tokens, temperature)
    assert lp.dtype == ent.dtype == torch.float32
    want_lp, want_ent = reference(logits.detach(), tokens, temperature)
    # float32 with logits up to ~20: a few ulp of 20 (entropy = logsumexp - E[x] cancels)
    torch.testing.assert_close(lp.double(), want_lp, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(ent.double(), want_ent, rtol=1e-6, atol=1e-5)
    (lp.sum() + 0.3 * ent.sum()).backward()
    x = logits.detach().double().requires_grad_(True)
    a, b = reference(x, tokens, temperature)
    (a.sum() + 0.3 * b.sum()).backward()
    torch.testing.assert_close(logits.grad.double(), x.grad, rtol=1e-5, atol=1e-6)


def test_float64_on_request():
    g = torch.Generator().manual_seed(5)
    logits, tokens = torch.randn(4, 7, generator=g), torch.randint(0, 7, (4,), generator=g)
    lp, ent = token_log_probs_and_entropy(logits, tokens, 0.8, dtype=torch.float64)
    assert lp.dtype == ent.dtype == torch.float64
    want_lp, want_ent = reference(logits, tokens, 0.8)
    torch.testing.assert_close(lp, want_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, want_ent, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="dtype"):
        token_log_probs_and_entropy(logits, tokens, dtype=torch.float16)


def test_uniform_logits_give_log_v():
    lp, ent = token_log_probs_and_entropy(torch.zeros(2, 8), torch.tensor([0, 7]))
    assert lp.tolist() == pytest.approx([-math.log(8)] * 2)
    assert ent.tolist() == pytest.approx([math.log(8)] * 2)


def test_half_precision_logits_are_computed_in_float32():
    logits = torch.randn(3, 5).to(torch.bfloat16)
    lp, _ = token_log_probs_and_entropy(logits, torch.tensor([1, 2, 3]))
    assert lp.dtype == torch.float32
    want, _ = reference(logits.float(), torch.tensor([1, 2, 3]), 1.0)
    torch.testing.assert_close(lp.double(), want, rtol=1e-6, atol=1e-6)


def test_response_rows_of_a_packed_micro_batch():
    """Sample i's response token t is predicted by the row before it; padding is not read."""
    g = torch.Generator().manual_seed(0)
    totals, responses = [3, 4, 2], [2, 1, 1]
    logits = torch.randn(sum(totals) + 2, 6, generator=g)
    tokens = [torch.randint(0, 6, (n,), generator=g) for n in totals]
    lps, ents = response_log_probs_and_entropy(logits, tokens, totals, responses)
    assert [len(x) for x in lps] == [len(x) for x in ents] == responses
    start = 0
    for tok, total, resp, lp in zip(tokens, totals, responses, lps, strict=True):
        rows = logits[start + total - resp - 1:start + total - 1]
        want, _ = token_log_probs_and_entropy(rows, tok[-resp:])
        assert torch.equal(lp, want)
        start += total


def test_a_sample_without_response_tokens_scores_nothing():
    """A prompt-only sample (response 0) between two others gets empty tensors and moves the
    next sample's rows by its length."""
    g = torch.Generator().manual_seed(1)
    totals, responses = [3, 2, 3], [1, 0, 2]
    logits = torch.randn(sum(totals), 5, generator=g)
    tokens = [torch.randint(0, 5, (n,), generator=g) for n in totals]
    lps, ents = response_log_probs_and_entropy(logits, tokens, totals, responses)
    assert [len(x) for x in lps] == [len(x) for x in ents] == [1, 0, 2]
    want, _ = token_log_probs_and_entropy(logits[5:7], tokens[2][1:])
    assert torch.equal(lps[2], want)
    assert response_log_probs_and_entropy(logits, [], [], [])[0] == []


@pytest.mark.parametrize("kwargs, match", [
    ({"total_lengths": [3, 4]}, "differ in length"),
    ({"response_lengths": [3, 1, 1]}, "response_length=3"),
    ({"total_lengths": [3, 4, 9]}, "exceeds"),
])
def test_bad_packing_raises(kwargs, match):
    args = {"logits": torch.zeros(9, 4), "tokens": [torch.zeros(n, dtype=torch.long)
                                                     for n in (3, 4, 2)],
            "total_lengths": [3, 4, 2], "response_lengths": [2, 1, 1], **kwargs}
    with pytest.raises(ValueError, match=match):
        response_log_probs_and_entropy(**args)


def test_bad_shapes_and_temperature_raise():
    with pytest.raises(ValueError, match="temperature"):
        token_log_probs_and_entropy(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), 0.0)
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        token_log_probs_and_entropy(torch.zeros(3), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="one token per logits row"):
        token_log_probs_and_entropy(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long))
