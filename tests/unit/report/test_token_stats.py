"""Chunked, vocab-parallel token stats (:mod:`varbatch_kit.report.objective.token_stats`).

The oracle is the float64 path ``train.batch.response_token_stats`` ran
before (a float64 ``log_softmax`` over ``[R, V]``): values and gradients
within 1e-6. The vocab shards are combined here in one process from each
shard's partials; ``tests/integration/test_token_stats_distributed.py`` runs
them on two real gloo ranks.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from varbatch_kit.report.objective import chunked_token_stats
from varbatch_kit.report.objective import token_stats as ts_module

TOL = {"rtol": 1e-6, "atol": 1e-6}


def float64_reference(logits, targets, temperature, entropy_grad):
    """The float64 ``[R, V]`` path (what ``response_token_stats`` computed before)."""
    x = logits.double()
    if temperature != 1.0:
        x = x / temperature
    logp_all = torch.log_softmax(x, dim=-1)
    logprob = logp_all.gather(-1, targets[:, None])[:, 0]
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    correct = (logp_all.argmax(-1) == targets).double()
    return {"logprob": logprob, "entropy": entropy if entropy_grad else entropy.detach(),
            "correct": correct.detach()}


def _case(seed: int, n: int, v: int, scale: float, ties: bool):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g) * scale
    if ties:  # few distinct values: argmax ties, resolved to the first maximum
        logits = logits.round()
    targets = torch.randint(0, v, (n,), generator=g)
    if ties and n:  # some targets on a (tied) maximum
        targets[: n // 2] = logits[: n // 2].argmax(-1)
    w_lp = torch.rand(n, generator=g, dtype=torch.float64) * 2 - 1
    w_ent = torch.rand(n, generator=g, dtype=torch.float64) * 2 - 1
    return logits, targets, w_lp, w_ent


def _values_and_grad(fn, logits, targets, w_lp, w_ent, entropy_grad):
    x = logits.clone().requires_grad_(True)
    out = fn(x)
    loss = (out["logprob"] * w_lp).sum()
    if entropy_grad:
        loss = loss + (out["entropy"] * w_ent).sum()
    (grad,) = torch.autograd.grad(loss, x) if x.numel() else (torch.zeros_like(x),)
    return out, grad


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(0, 24), v=st.integers(1, 40),
       temperature=st.sampled_from([1.0, 0.5, 0.7, 1.3, 2.0]),
       chunk=st.one_of(st.none(), st.integers(1, 30)), scale=st.sampled_from([0.0, 1.0, 4.0]),
       ties=st.booleans(), entropy_grad=st.booleans())
def test_values_and_gradients_match_the_float64_path(seed, n, v, temperature, chunk, scale, ties,
                                                     entropy_grad):
    logits, targets, w_lp, w_ent = _case(seed, n, v, scale, ties)
    got, g_got = _values_and_grad(
        lambda x: chunked_token_stats(x, targets, temperature=temperature,
                                      entropy_grad=entropy_grad, chunk_tokens=chunk),
        logits, targets, w_lp, w_ent, entropy_grad)
    want, g_want = _values_and_grad(
        lambda x: float64_reference(x, targets, temperature, entropy_grad),
        logits, targets, w_lp, w_ent, entropy_grad)
    for key in ("logprob", "entropy"):
        assert got[key].dtype == torch.float64 and got[key].shape == (n,)
        torch.testing.assert_close(got[key], want[key], **TOL)
    assert torch.equal(got["correct"], want["correct"])
    assert g_got.dtype == logits.dtype
    torch.testing.assert_close(g_got, g_want, **TOL)


def test_gradient_flags_entropy_only_and_logprob_only():
    logits, targets, w_lp, w_ent = _case(1, 7, 11, 3.0, False)
    x = logits.clone().requires_grad_(True)
    out = chunked_token_stats(x, targets, temperature=0.8)
    assert out["logprob"].requires_grad
    assert not out["entropy"].requires_grad and not out["correct"].requires_grad
    out = chunked_token_stats(x, targets, temperature=0.8, entropy_grad=True, chunk_tokens=2)
    assert out["entropy"].requires_grad and not out["correct"].requires_grad
    (g_ent,) = torch.autograd.grad((out["entropy"] * w_ent).sum(), x)
    ref = float64_reference(x, targets, 0.8, True)
    (g_ref,) = torch.autograd.grad((ref["entropy"] * w_ent).sum(), x)
    torch.testing.assert_close(g_ent, g_ref, **TOL)
    with torch.no_grad():
        out = chunked_token_stats(x, targets)
    assert not out["logprob"].requires_grad


def test_float64_logits_pass_gradcheck():
    logits, targets, _, _ = _case(2, 5, 6, 2.0, False)
    x = logits.double().requires_grad_(True)

    def f(z):
        out = chunked_token_stats(z, targets, temperature=0.7, entropy_grad=True, chunk_tokens=2)
        return out["logprob"], out["entropy"]

    assert torch.autograd.gradcheck(f, (x,))


def test_bfloat16_logits_compute_in_float32():
    logits, targets, w_lp, _ = _case(3, 6, 9, 3.0, False)
    x = logits.bfloat16().requires_grad_(True)
    out = chunked_token_stats(x, targets, chunk_tokens=4)
    want = float64_reference(x.detach().float(), targets, 1.0, False)
    torch.testing.assert_close(out["logprob"], want["logprob"], **TOL)
    (g,) = torch.autograd.grad((out["logprob"] * w_lp).sum(), x)
    assert g.dtype == torch.bfloat16


def test_backward_saves_only_the_logits_and_per_token_scalars():
    logits, targets, w_lp, w_ent = _case(4, 64, 50, 2.0, False)
    x = logits.clone().requires_grad_(True)
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype, t.data_ptr()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = chunked_token_stats(x, targets, temperature=0.9, entropy_grad=True, chunk_tokens=8)
    big = [s for s in saved if len(s[0]) > 1]
    assert big == [((64, 50), torch.float32, x.data_ptr())]  # the logits themselves, no copy
    assert all(s[0] == (64,) for s in saved if len(s[0]) == 1)
    (out["logprob"] * w_lp + out["entropy"] * w_ent).sum().backward()


def test_vocab_shards_combine_to_the_single_shard_result():
    """Per-shard partials (each with its own shift) combined as the all_gather path does."""
    logits, targets, _, _ = _case(5, 13, 29, 4.0, True)
    logits[3, 2] = logits[3, 20] = logits[3].max() + 1  # a tie across shards: the first wins
    targets[3] = 20
    whole = chunked_token_stats(logits, targets, temperature=0.7)
    bounds = [(0, 10), (10, 21), (21, 29)]
    parts = torch.stack([ts_module._local_partials(logits[:, a:b], targets, 0.7, 4, a)
                         for a, b in bounds])
    _, _, logprob, entropy, correct = ts_module._combine(parts, targets, 0.7)
    torch.testing.assert_close(logprob, whole["logprob"], rtol=1e-12, atol=1e-7)
    torch.testing.assert_close(entropy, whole["entropy"], rtol=1e-12, atol=1e-7)
    assert torch.equal(correct, whole["correct"]) and correct[3] == 0.0
    assert torch.equal(parts[:, :, ts_module._OWN].sum(0), torch.ones(13, dtype=torch.float64))


def test_log_prob_step_peak_memory_falls_at_least_fourfold():
    """Peak live tensor bytes on meta tensors at a 152k vocabulary (``benchmarks.logprob_memory``).

    512 tokens here; the benchmark runs the full 16k. The float64 path's peak
    grows with ``R x V``; the chunked one's is the logits, their gradient and
    a fixed amount of chunk temporaries, so the 16k figure follows.
    """
    from benchmarks.logprob_memory import RESPONSE_TOKENS, VOCAB, traced_peak

    rows = 512
    before = traced_peak("float64", rows, VOCAB)
    after = traced_peak("chunked", rows, VOCAB)
    n = rows * VOCAB
    assert before["input_bytes"] == after["input_bytes"] == 4 * n + 8 * rows
    assert before["peak_bytes"] >= 36 * n  # logits, float64 copy, log-softmax, exp, product
    temporaries = after["peak_bytes"] - 8 * n  # beyond the logits and their gradient
    assert 0 < temporaries <= 3 * 4 * ts_module.DEFAULT_CHUNK_ELEMENTS
    assert before["peak_bytes"] / after["peak_bytes"] >= 3.5
    full = RESPONSE_TOKENS * VOCAB
    assert before["peak_bytes"] / n * full / (8 * full + temporaries) >= 4.0


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"temperature": 0.0}, "temperature=0.0"),
    ({"temperature": float("nan")}, "temperature=nan"),
    ({"chunk_tokens": 0}, "chunk_tokens"),
    ({"vocab_start": 3}, "vocab_start=3: a shard offset needs tp_group"),
    ({"vocab_start": -1}, "vocab_start"),
])
def test_bad_options_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        chunked_token_stats(torch.zeros(2, 5), torch.zeros(2, dtype=torch.long), **kwargs)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match=r"logits must be \[N, V\]"):
        chunked_token_stats(torch.zeros(5), torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="one token per logits row"):
        chunked_token_stats(torch.zeros(2, 5), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="integer token ids"):
        chunked_token_stats(torch.zeros(2, 5), torch.zeros(2))
    with pytest.raises(ValueError, match=r"token id 5 lies outside the vocabulary \[0, 5\)"):
        chunked_token_stats(torch.zeros(2, 5), torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="token id -1"):
        chunked_token_stats(torch.zeros(2, 5), torch.tensor([-1, 0]))


@pytest.mark.parametrize("v", [1, 511, 512, 513, 5000, 152_064])
def test_row_sums_are_float64_sums_of_float32_blocks(v):
    """The softmax sums: float32 within blocks, float64 across, within 1e-6 of the float64 sum
    of the same float32 terms at every vocabulary size (a block-sized vocabulary, one more, one
    less: the tail outside the blocks is summed too); float64 terms are summed in float64."""
    from varbatch_kit.report.objective.token_stats import _row_sums

    g = torch.Generator().manual_seed(v)
    t = torch.exp(torch.randn(3, v, generator=g) * 4 - 8)  # positive, a wide dynamic range
    got = _row_sums(t)
    want = t.double().sum(-1)
    assert got.dtype == torch.float64 and got.shape == (3,)
    assert float(((got - want) / want).abs().max()) < 1e-6
    t64 = t.double()
    assert torch.equal(_row_sums(t64), t64.sum(-1))


@pytest.mark.parametrize(("v", "ties"), [(1500, True), (4099, False)])
def test_large_vocabularies_match_the_float64_path(v, ties):
    """Vocabularies past the sum blocks (the property test's stay below them), with ties."""
    logits, targets, w_lp, w_ent = _case(v, 6, v, 4.0, ties)
    got, g_got = _values_and_grad(
        lambda x: chunked_token_stats(x, targets, temperature=0.7, entropy_grad=True,
                                      chunk_tokens=4),
        logits, targets, w_lp, w_ent, True)
    want, g_want = _values_and_grad(lambda x: float64_reference(x, targets, 0.7, True),
                                    logits, targets, w_lp, w_ent, True)
    for key in ("logprob", "entropy"):
        torch.testing.assert_close(got[key], want[key], **TOL)
    assert torch.equal(got["correct"], want["correct"])
    torch.testing.assert_close(g_got, g_want, **TOL)
