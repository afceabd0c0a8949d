"""Packed micro-batches (train/step/packed_batch.py): masks, positions, response-token statistics,
packed losses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _megatron import single_process_megatron

from varbatch_kit.train import ModelConfig
from varbatch_kit.train.config.model_config import resolve_model
from varbatch_kit.train.step.packed_batch import block_causal_mask, pack, response_token_stats


@pytest.fixture(scope="module")
def megatron_single_process():
    """torch.distributed (gloo, world 1) + megatron parallel state here, torn down after."""
    with single_process_megatron() as device:
        yield device


def test_block_causal_mask_hand_example():
    m = block_causal_mask([2, 3])[0, 0]
    allowed = (~m).int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 1, 1, 1],
    ]


def test_pack_positions_and_response_positions():
    b = pack([np.array([5, 6, 7]), np.array([1, 2, 3, 4])], prompt_lens=[1, 2])
    assert b.tokens.tolist() == [[5, 6, 7, 1, 2, 3, 4]]
    assert b.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3]]
    assert b.offsets == (0, 3) and b.response_lens == (2, 2)
    # sample 0 responses (tokens 6, 7) predicted at 0, 1; sample 1 (3, 4) at 4, 5
    assert b.response_positions().tolist() == [0, 1, 4, 5]
    with pytest.raises(ValueError, match="prompt_len"):
        pack([np.array([1, 2])], prompt_lens=[0])


@pytest.mark.parametrize("at_response_rows", [False, True])
def test_response_token_stats_equal_the_float64_log_softmax(at_response_rows):
    """The chunked token stats against a float64 log-softmax over the response rows."""
    g = torch.Generator().manual_seed(0)
    batch = pack([np.arange(9) % 7, np.arange(6) % 5], [3, 2])
    pos = batch.response_positions()
    full = (torch.randn(batch.num_tokens, 7, generator=g) * 3).requires_grad_(True)
    logits = full[pos] if at_response_rows else full
    got = response_token_stats(logits[None], batch, at_response_rows=at_response_rows,
                               temperature=0.8, entropy_grad=True)
    targets = batch.tokens[0, pos + 1]
    logp = torch.log_softmax(full[pos].double() / 0.8, dim=-1)
    want = {"logprob": logp.gather(-1, targets[:, None])[:, 0],
            "entropy": -(logp.exp() * logp).sum(-1)}
    for key, value in want.items():
        assert got[key].dtype == torch.float64 and got[key].shape == (pos.numel(),)
        torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-6)
    assert torch.equal(got["correct"], (logp.argmax(-1) == targets).double())
    w = torch.linspace(-1, 1, pos.numel(), dtype=torch.float64)
    (g_got,) = torch.autograd.grad((got["logprob"] * w + got["entropy"] * w.flip(0)).sum(), full)
    (g_want,) = torch.autograd.grad((want["logprob"] * w + want["entropy"] * w.flip(0)).sum(),
                                    full)
    torch.testing.assert_close(g_got, g_want, rtol=1e-6, atol=1e-6)


def test_packed_losses_equal_each_sample_alone(megatron_single_process):
    """Packing is real: per-sample log-probs of a packed row == running each sample alone."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from varbatch_kit.train.model.gpt import build_gpt

    device = megatron_single_process
    cfg = resolve_model(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                    vocab_size=64))
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0, inference_rng_tracker=True, force_reset_rng=True)
    gpt = build_gpt(cfg, max_seq_len=32).to(device).eval()
    rng = np.random.default_rng(0)
    lengths, prompts = [9, 17, 5, 12], [3, 6, 1, 4]
    seqs = [rng.integers(0, 64, n) for n in lengths]
    with torch.no_grad():
        packed = pack(seqs, prompts, device=device)
        out = response_token_stats(gpt(packed.tokens, packed.position_ids,
                                       packed.attention_mask), packed)["logprob"]
        per_sample = out.split(list(packed.response_lens))
        for seq, p, got in zip(seqs, prompts, per_sample):
            alone = pack([seq], [p], device=device)
            ref = response_token_stats(gpt(alone.tokens, alone.position_ids,
                                           alone.attention_mask), alone)["logprob"]
            rel = (got - ref).abs().max() / ref.abs().max()
            assert rel < 1e-5, rel
        # the mask matters: plain causal attention over the row leaks across samples
        causal = block_causal_mask([packed.num_tokens], device=device)
        leaky = response_token_stats(gpt(packed.tokens, packed.position_ids, causal),
                                     packed)["logprob"].split(list(packed.response_lens))
        assert (leaky[1] - per_sample[1]).abs().max() > 1e-4


def test_a_row_padded_for_sequence_parallelism_gets_a_pad_segment_of_its_own():
    """43 tokens padded to a multiple of 4: one pad token, a segment of its own (cu_seqlens
    and the dense mask), positions from 0; a multiple already met adds nothing."""
    lengths, prompts = [9, 17, 5, 12], [3, 6, 1, 4]
    seqs = [np.arange(n) % 7 + 1 for n in lengths]
    batch = pack(seqs, prompts)
    assert batch.model_args(1)[0] is batch.tokens and batch.model_args(43)[0] is batch.tokens
    ids, pos, kw = batch.model_args(4)
    assert ids.shape == (1, 44) and int(ids[0, -1]) == 0 and int(pos[0, -1]) == 0
    assert torch.equal(ids[:, :43], batch.tokens) and torch.equal(pos[:, :43], batch.position_ids)
    assert kw["packed_seq_params"].cu_seqlens_q.tolist() == [0, 9, 26, 31, 43, 44]
    ids, pos, kw = pack(seqs, prompts, attention="dense").model_args(5)
    assert ids.shape == (1, 45) and torch.equal(pos[0, 43:], torch.arange(2))
    assert torch.equal(kw["attention_mask"], block_causal_mask([*lengths, 2]))


@pytest.mark.parametrize("cp", [False, True])
def test_the_pad_segment_changes_no_response_logit(megatron_single_process, cp):
    """The model on a padded row (multiples 2..5) gives the response rows' logits of the row
    without padding, also on a CP share (its pad segment attends alone, after the share's
    K/V attention)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from varbatch_kit.train.model.gpt import build_gpt
    from varbatch_kit.train.parallel.cp_attention import CPShare, cp_share_active
    from varbatch_kit.train.step.cp_response import local_inputs

    device = megatron_single_process
    cfg = resolve_model(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                    vocab_size=64))
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0, inference_rng_tracker=True, force_reset_rng=True)
    gpt = build_gpt(cfg, max_seq_len=32).to(device).eval().double()
    rng = np.random.default_rng(0)
    lengths, prompts = [9, 17, 5, 12], [3, 6, 1, 4]
    batch = pack([rng.integers(1, 64, n) for n in lengths], prompts, device=device)
    share = CPShare(group=None, rank=0, size=1, lengths=tuple(lengths),
                    prompt_lens=tuple(prompts), slot_ranks=(0,))

    def logits(multiple):
        if not cp:
            ids, pos, kw = batch.model_args(multiple)
            return gpt(ids, pos, **kw)[0, batch.response_positions()]
        kw = local_inputs(batch, share, multiple)
        with cp_share_active(share):
            out = gpt(kw.pop("input_ids"), kw.pop("position_ids"), **kw)
        return out[0, share.local_response_rows]

    with torch.no_grad():
        ref = logits(1)
        for multiple in (2, 3, 4, 5):
            got = logits(multiple)
            assert got.shape == ref.shape and float((got - ref).abs().max()) < 1e-12, multiple
