"""Per-sample packed attention (varbatch_kit.train.model.attention) against the dense block mask.

Single process (gloo, world 1). Two models, each built twice from the same
weights: with megatron's own ``DotProductAttention`` and the dense
``[1, 1, T, T]`` mask (the reference), and with ``PerSampleAttention`` fed
``thd`` ``PackedSeqParams``:

- the toy GPT of the training engine (learned absolute positions, LayerNorm);
- a rope + GQA model in the style of Hugging Face checkpoints (RMSNorm,
  QK-norm, SwiGLU, no biases, ``num_query_groups < num_attention_heads``).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from _megatron import single_process_megatron
from hypothesis import example, given
from hypothesis import strategies as st

from varbatch_kit.train import ModelConfig
from varbatch_kit.train.config.model_config import resolve_model
from varbatch_kit.train.parallel import cpu_shim
from varbatch_kit.train.step.packed_batch import block_causal_mask, pack, response_token_stats

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

TOL = 1e-5
VOCAB = 64


# --------------------------------------------------------------------------- helpers
def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 when both are 0)."""
    scale = float(b.abs().max())
    return float((a - b).abs().max()) / scale if scale else float((a - b).abs().max())


#: a parameter's gradient that cancels to below this share of the model's largest gradient
#: entry is judged at that scale, not its own: on a row of 2 tokens the q/k norms' weight
#: gradients of the RoPE model cancel to 1e-9 of it (26 here), and both attention paths give
#: float32 noise there, relative differences up to 29 (measured over 1500 rows of 1-5 tokens:
#: the noise is at most 1.8e-9 of the largest entry, the check's bound 1e-7 of it)
GRAD_FLOOR = 1e-2


def _grads_rel(a: dict, b: dict) -> dict[str, float]:
    """Per parameter, ``max |a - b|`` over ``max(max |b|, GRAD_FLOOR * the largest |b| entry
    of all parameters)``: relative for every gradient of some size, absolute at the model's
    scale for one that cancels to ~0."""
    top = max(float(g.abs().max()) for g in b.values())
    return {n: float((a[n] - b[n]).abs().max()) / max(float(b[n].abs().max()), GRAD_FLOOR * top)
            for n in b}


def _reference_attention(q, k, v, lengths, scale):
    """Block-diagonal causal attention over the whole row, the dense way ([T, h, d] in and out)."""
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(block_causal_mask(lengths)[0], -10000.0)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


# --------------------------------------------------------------------------- the kernel alone
@given(lengths=st.lists(st.integers(1, 20), min_size=1, max_size=8),
       groups=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**16))
def test_segment_attention_equals_the_dense_block_mask(lengths, groups, seed):
    """Any segment lengths (length 1 included), GQA: outputs and input gradients match."""
    from varbatch_kit.train.model.attention import segment_attention

    g = torch.Generator().manual_seed(seed)
    total, heads, dim = sum(lengths), 4, 8
    q = torch.randn(total, heads, dim, generator=g, requires_grad=True)
    k = torch.randn(total, groups, dim, generator=g, requires_grad=True)
    v = torch.randn(total, groups, dim, generator=g, requires_grad=True)
    w = torch.randn(total, heads, dim, generator=g)
    scale = 1 / dim**0.5
    got = segment_attention(q, k, v, lengths, scale)
    ref = _reference_attention(q, k, v, lengths, scale)
    assert got.shape == (total, heads, dim)
    assert _max_rel(got, ref) < TOL
    g_got = torch.autograd.grad((got * w).sum(), (q, k, v))
    g_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(g_got, g_ref):
        assert _max_rel(a, b) < TOL


def test_segment_attention_checks_the_lengths():
    from varbatch_kit.train.model.attention import segment_attention

    x = torch.zeros(5, 2, 4)
    with pytest.raises(ValueError, match="sum to 4"):
        segment_attention(x, x, x, [2, 2], 0.5)


# --------------------------------------------------------------------------- packing
def test_pack_per_sample_path_has_boundaries_and_no_mask(monkeypatch):
    seqs = [np.array([5, 6, 7]), np.array([1, 2, 3, 4]), np.array([9, 9])]
    dense = pack(seqs, prompt_lens=[1, 2, 1], attention="dense")
    import varbatch_kit.train.step.packed_batch as batch_mod

    def no_mask(*a, **k):
        raise AssertionError("the per-sample path built a [T, T] mask")

    monkeypatch.setattr(batch_mod, "block_causal_mask", no_mask)
    b = pack(seqs, prompt_lens=[1, 2, 1])  # per_sample is the default
    assert b.attention == "per_sample" and b.dense_mask is None
    assert b.cu_seqlens.tolist() == [0, 3, 7, 9] and b.cu_seqlens.dtype == torch.int32
    p = b.packed_seq_params
    assert p.qkv_format == "thd" and p.cu_seqlens_q is b.cu_seqlens
    assert p.cu_seqlens_kv is b.cu_seqlens and (p.max_seqlen_q, p.max_seqlen_kv) == (4, 4)
    inputs = b.model_inputs()
    assert inputs["attention_mask"] is None and inputs["packed_seq_params"].qkv_format == "thd"
    assert b.tokens.tolist() == dense.tokens.tolist()
    assert b.position_ids.tolist() == dense.position_ids.tolist()
    assert b.response_positions().tolist() == dense.response_positions().tolist()
    assert b.to("cpu").cu_seqlens.tolist() == [0, 3, 7, 9]
    monkeypatch.undo()
    # the dense path: the mask, no packed params; the per-sample batch builds it on request
    assert dense.packed_seq_params is None and dense.model_inputs()["packed_seq_params"] is None
    assert torch.equal(dense.model_inputs()["attention_mask"], block_causal_mask([3, 4, 2]))
    assert torch.equal(b.attention_mask, dense.attention_mask)
    assert dense.to("cpu").dense_mask.shape == (1, 1, 9, 9)
    with pytest.raises(ValueError, match="attention='flash'"):
        pack(seqs, prompt_lens=[1, 2, 1], attention="flash")


# --------------------------------------------------------------------------- models
@pytest.fixture(scope="module")
def megatron_process():
    """torch.distributed (gloo, world 1) + megatron parallel state, torn down after the module.

    On CPU, megatron's rotary embedding moves its frequencies to
    ``torch.cuda.current_device()``; unless the CPU shim already covers that
    module, it gets the shim's CPU view of torch for the module's duration.
    """
    import megatron.core.models.common.embeddings.rotary_pos_embedding as rope_mod

    rope_torch = rope_mod.torch
    with single_process_megatron() as device:
        if cpu_shim.active() and rope_torch is torch:
            rope_mod.torch = cpu_shim._TorchOnCpu()
        try:
            yield device
        finally:
            rope_mod.torch = rope_torch


def _seed(seed: int) -> None:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)


def _twin(build, device):
    """(per-sample model, dense reference model) with the same weights."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from varbatch_kit.train.model.attention import PerSampleAttention

    _seed(0)
    fast = build(True).to(device)
    ref = build(False).to(device)
    ref.load_state_dict(fast.state_dict(), strict=True)
    for layer in fast.decoder.layers:
        assert type(layer.self_attention.core_attention) is PerSampleAttention
    for layer in ref.decoder.layers:
        assert type(layer.self_attention.core_attention) is DotProductAttention
    return fast, ref


def _toy(per_sample: bool):
    from megatron.core.models.gpt.gpt_model import GPTModel

    from varbatch_kit.train.model.attention import local_layer_spec
    from varbatch_kit.train.model.gpt import build_gpt, transformer_config

    cfg = resolve_model(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                    vocab_size=VOCAB))
    if per_sample:
        return build_gpt(cfg, max_seq_len=160)  # the engine's own builder: per-sample default
    return GPTModel(config=transformer_config(cfg), transformer_layer_spec=local_layer_spec(
        per_sample=False), vocab_size=VOCAB, max_sequence_length=160,
        position_embedding_type="learned_absolute", share_embeddings_and_output_weights=False,
        parallel_output=True)


def _rope_gqa(per_sample: bool):
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from varbatch_kit.train.model.attention import local_layer_spec

    config = TransformerConfig(
        num_layers=2, hidden_size=48, num_attention_heads=6, num_query_groups=2,
        kv_channels=16, ffn_hidden_size=96, normalization="RMSNorm", qk_layernorm=True,
        add_bias_linear=False, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
        use_cpu_initialization=True, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, persist_layer_norm=False)
    return GPTModel(config=config, transformer_layer_spec=local_layer_spec(
        qk_layernorm=True, normalization="RMSNorm", per_sample=per_sample), vocab_size=VOCAB,
        max_sequence_length=160, position_embedding_type="rope", rotary_base=10000,
        share_embeddings_and_output_weights=False, parallel_output=True)


@pytest.fixture(scope="module", params=["toy", "rope_gqa"])
def twin(request, megatron_process):
    build = {"toy": _toy, "rope_gqa": _rope_gqa}[request.param]
    fast, ref = _twin(build, megatron_process)
    return request.param, fast, ref, megatron_process


def _logprobs(model, batch):
    return response_token_stats(model(batch.tokens, batch.position_ids, **batch.model_inputs()),
                                batch)["logprob"]


def _grads(model, batch, weights):
    model.zero_grad(set_to_none=True)
    (_logprobs(model, batch) * weights).sum().backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_per_sample_equals_dense_and_each_sample_alone(twin):
    """Log-probs (1e-5) and every parameter gradient (1e-5) of a packed micro-batch."""
    name, fast, ref, device = twin
    rng = np.random.default_rng(1)
    lengths, prompts = [9, 17, 2, 5, 12, 31], [3, 6, 1, 1, 4, 10]
    seqs = [rng.integers(0, VOCAB, n) for n in lengths]
    packed = pack(seqs, prompts, device=device)
    dense = pack(seqs, prompts, device=device, attention="dense")
    with torch.no_grad():
        got, want = _logprobs(fast, packed), _logprobs(ref, dense)
        assert float((got - want).abs().max()) < TOL, name
        # each sample alone (per-sample path, one segment) equals its slice of the packed row
        for seq, p, part in zip(seqs, prompts, got.split(list(packed.response_lens))):
            alone = _logprobs(fast, pack([seq], [p], device=device))
            assert float((part - alone).abs().max()) < TOL, name
        # and the path matters: without the boundaries the row leaks across samples
        leaky = response_token_stats(fast(packed.tokens, packed.position_ids, None), packed)
        assert float((leaky["logprob"] - want).abs().max()) > 1e-4
    w = torch.as_tensor(rng.normal(size=got.numel()), device=device)
    g_fast, g_ref = _grads(fast, packed, w), _grads(ref, dense, w)
    assert g_fast.keys() == g_ref.keys()
    for n, rel in _grads_rel(g_fast, g_ref).items():
        assert rel < TOL, (name, n, rel)


@given(lengths=st.lists(st.integers(1, 24), min_size=1, max_size=6), seed=st.integers(0, 999))
@example(lengths=[2], seed=233)  # the q/k norms' gradients cancel to 1e-9 (GRAD_FLOOR)
def test_random_segments_logits_and_gradients(twin, lengths, seed):
    """Random segment lengths, length-1 segments included, straight through GPTModel."""
    from megatron.core.packed_seq_params import PackedSeqParams

    name, fast, ref, device = twin
    rng = np.random.default_rng(seed)
    tokens = torch.as_tensor(rng.integers(0, VOCAB, sum(lengths)), device=device)[None]
    pos = torch.cat([torch.arange(n) for n in lengths]).to(device)[None]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32,
                      device=device)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    w = torch.as_tensor(rng.normal(size=(1, sum(lengths), VOCAB)), dtype=torch.float32,
                        device=device)
    outs, grads = [], []
    for model, kwargs in ((fast, {"attention_mask": None, "packed_seq_params": params}),
                          (ref, {"attention_mask": block_causal_mask(lengths, device=device)})):
        model.zero_grad(set_to_none=True)
        logits = model(tokens, pos, **kwargs)
        (logits * w).sum().backward()
        outs.append(logits.detach())
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    assert _max_rel(outs[0], outs[1]) < TOL, (name, lengths)
    for n, rel in _grads_rel(grads[0], grads[1]).items():
        assert rel < TOL, (name, lengths, n, rel)


def test_per_sample_path_never_builds_a_row_by_row_tensor(twin):
    """No op of the forward or backward produces a [.., T, T] tensor on the per-sample path."""
    from torch.utils._python_dispatch import TorchDispatchMode

    name, fast, _ref, device = twin
    lengths = [10] * 8  # T = 80, different from the vocabulary (64) and every other size
    total = sum(lengths)
    rng = np.random.default_rng(0)
    batch = pack([rng.integers(0, VOCAB, n) for n in lengths], [3] * 8, device=device)
    shapes = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    shapes.append(tuple(t.shape))
            return out

    fast.zero_grad(set_to_none=True)
    with Record():
        _logprobs(fast, batch).sum().backward()
    assert shapes and not [s for s in shapes if s[-2:] == (total, total)], name


# --------------------------------------------------------------------------- the spec
def test_local_layer_spec_and_its_refusals(megatron_process):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from varbatch_kit.train.model.attention import PerSampleAttention, local_layer_spec
    from varbatch_kit.train.model.gpt import transformer_config

    spec = local_layer_spec()
    assert spec.submodules.self_attention.submodules.core_attention is PerSampleAttention
    dense = local_layer_spec(per_sample=False)
    assert dense.submodules.self_attention.submodules.core_attention is DotProductAttention
    rms = local_layer_spec(normalization="RMSNorm", qk_layernorm=True)
    stock = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True)
    # every norm megatron's spec has is torch's, through TorchNorm (sequence-parallel marks)
    from megatron.core.transformer.identity_op import IdentityOp

    from varbatch_kit.train.model.norms import TorchNorm

    for built, theirs in ((rms, stock), (spec, get_gpt_layer_local_spec())):
        for name in ("input_layernorm", "pre_mlp_layernorm"):
            assert getattr(built.submodules, name) is TorchNorm
        for name in ("q_layernorm", "k_layernorm"):
            ours = getattr(built.submodules.self_attention.submodules, name)
            stock_norm = getattr(theirs.submodules.self_attention.submodules, name)
            assert ours is (IdentityOp if stock_norm is IdentityOp else TorchNorm)
    assert rms.submodules.self_attention.submodules.q_layernorm is TorchNorm
    # megatron's own spec is not modified by ours
    assert get_gpt_layer_local_spec().submodules.self_attention.submodules.core_attention \
        is DotProductAttention
    with pytest.raises(ValueError, match="normalization='BatchNorm'"):
        local_layer_spec(normalization="BatchNorm")
    cfg = transformer_config(resolve_model(ModelConfig(num_layers=1, hidden_size=32,
                                                       num_attention_heads=4)))
    from megatron.core.transformer.enums import AttnMaskType

    attn = PerSampleAttention(cfg, 1, AttnMaskType.causal, "self")
    assert attn.softmax_scale == pytest.approx(1 / 8**0.5)
    assert PerSampleAttention(cfg, 1, AttnMaskType.causal, "self",
                              softmax_scale=0.3).softmax_scale == 0.3
    with pytest.raises(ValueError, match="attention_dropout=0.1"):
        PerSampleAttention(cfg, 1, AttnMaskType.causal, "self", attention_dropout=0.1)
    x = torch.zeros(4, 4, 8)
    bad = type("P", (), {"qkv_format": "sbhd", "cu_seqlens_q": torch.tensor([0, 4])})()
    with pytest.raises(ValueError, match="qkv_format='sbhd'"):
        attn(x, x, x, None, packed_seq_params=bad)


def test_response_logits_are_the_full_logits_at_response_rows(twin):
    """The engine's output layer on response rows only (:func:`response_logits`) gives the
    full forward's logits at those rows, and the same log-probs and gradients."""
    from varbatch_kit.train.step.packed_batch import response_logits

    name, fast, _, device = twin
    rng = np.random.default_rng(4)
    lengths, prompts = [9, 17, 2, 5], [3, 6, 1, 4]
    batch = pack([rng.integers(0, VOCAB, n) for n in lengths], prompts, device=device)
    full = fast(batch.tokens, batch.position_ids, **batch.model_inputs())
    rows = response_logits(fast, batch)
    assert rows.shape == (1, int(sum(batch.response_lens)), VOCAB)
    assert torch.allclose(rows[0], full[0, batch.response_positions()], rtol=1e-6, atol=1e-6)
    # the hook is gone afterwards: a plain forward gives every row again
    assert fast(batch.tokens, batch.position_ids, **batch.model_inputs()).shape == full.shape
    w = torch.as_tensor(rng.normal(size=rows.shape[1]), device=device)
    g_rows = _grads_of(fast, lambda: (response_token_stats(
        response_logits(fast, batch), batch, at_response_rows=True)["logprob"] * w).sum())
    g_full = _grads_of(fast, lambda: (_logprobs(fast, batch) * w).sum())
    for n in g_full:
        assert _max_rel(g_rows[n], g_full[n]) < TOL, (name, n)
    with pytest.raises(ValueError, match="logit rows"):
        response_token_stats(full, batch, at_response_rows=True)


def _grads_of(model, loss_fn):
    model.zero_grad(set_to_none=True)
    loss_fn().backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}
