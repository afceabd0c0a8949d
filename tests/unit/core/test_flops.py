"""Forward-FLOPs model: hand-computed values (docs/reference_semantics.md §4) and config parsing."""

import numpy as np
import pytest

from varbatch_kit import ModelShape
from varbatch_kit.core.flops import MODELS_DIR


def test_dense_mha_by_hand():
    m = ModelShape(num_layers=2, hidden_size=16, num_attention_heads=2, num_query_groups=2,
                   kv_channels=8, ffn_hidden_size=64, vocab_size=32)
    # L=10: qkv 5120+10240, attn 1600+1600, proj 5120, mlp 61440 -> 85120/layer; head 10240
    assert m.forward_flops(10) == 2 * 85120 + 10240


def test_gqa_by_hand():
    m = ModelShape(num_layers=1, hidden_size=16, num_attention_heads=4, num_query_groups=1,
                   kv_channels=4, ffn_hidden_size=32, vocab_size=10)
    # L=3: qkv 1536+768, attn 144+144, proj 1536, mlp 9216; head 960
    assert m.forward_flops([3]).tolist() == [13344 + 960]


MOE = dict(num_layers=3, hidden_size=8, num_attention_heads=2, num_query_groups=2, kv_channels=4,
           ffn_hidden_size=16, vocab_size=5, num_experts=4, moe_ffn_hidden_size=4,
           moe_router_topk=2, moe_shared_expert_intermediate_size=6)


@pytest.mark.parametrize("freq,expected", [
    (2, 2624 + 2 * 2432 + 160),  # layers 0 and 2 are MoE
    ([0, 1, 1], 2624 + 2 * 2432 + 160),
    (None, 3 * 2432 + 160),  # all layers MoE
])
def test_moe_by_hand(freq, expected):
    # L=2: attention part 768+64+256 = 1088; dense mlp 1536; moe mlp (4*2+6=14) 1344
    m = ModelShape(**MOE, moe_layer_freq=freq)
    assert m.forward_flops(2) == expected


MLA = dict(num_layers=1, hidden_size=8, num_attention_heads=2, ffn_hidden_size=10, vocab_size=5,
           multi_latent_attention=True, kv_lora_rank=3, qk_head_dim=4, qk_pos_emb_head_dim=2,
           v_head_dim=3)


def test_mla_by_hand():
    # L=2, qd=6, vd=3: q 320 (q_lora 4), kv 328, attn 72, proj 256, mlp 960, head 160
    assert ModelShape(**MLA, q_lora_rank=4).forward_flops(2) == 2096
    # without q_lora: q = 2*L*h*a*qd = 384
    assert ModelShape(**MLA).forward_flops(2) == 2160


def test_vectorised_and_no_overflow():
    m = ModelShape.preset("llama-3.1-70b")
    L = np.array([1, 1000, 131072, 10**6])
    f = m.forward_flops(L)
    assert f.dtype == np.float64 and f.shape == (4,)
    assert all(f[i] == m.forward_flops(int(L[i])) for i in range(4))
    assert np.all(np.diff(f) > 0)


def test_quadratic_coefficients_qwen3_8b():
    m = ModelShape.preset("qwen3-8b")
    h, a, g, d, f, V, n = 4096, 32, 8, 128, 12288, 151936, 36
    c1 = n * (2 * h * a * d + 4 * h * g * d + 2 * h * h + 6 * h * f) + 2 * h * V
    c2 = n * (a * d + a * d)
    assert m.flops_coefficients() == (pytest.approx(c1), pytest.approx(c2))
    assert m.forward_flops(4096) == c1 * 4096 + c2 * 4096**2


def test_presets_from_stored_configs():
    qwen2 = ModelShape.preset("qwen2.5-0.5b")
    assert (qwen2.num_layers, qwen2.hidden_size, qwen2.num_query_groups, qwen2.kv_channels) == (
        24, 896, 2, 64)
    qwen3 = ModelShape.preset("qwen3-8b")
    assert (qwen3.kv_channels, qwen3.num_query_groups, qwen3.ffn_hidden_size) == (128, 8, 12288)
    llama = ModelShape.preset("llama-3.1-70b")
    assert (llama.num_layers, llama.vocab_size, llama.kv_channels) == (80, 128256, 128)
    ds = ModelShape.preset("deepseek-v3")
    assert ds.multi_latent_attention and ds.q_lora_rank == 1536 and ds.kv_lora_rank == 512
    assert ds.moe_layers().sum() == 58 and not ds.moe_layers()[:3].any()
    assert ds.moe_ffn_width() == 2048 * 8 + 2048
    assert ds.name == "deepseek-v3"


def test_from_hf_config_mistral_dict():
    cfg = {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
           "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
           "vocab_size": 32768, "head_dim": 128}
    m = ModelShape.from_hf_config(cfg)
    assert (m.num_query_groups, m.kv_channels, m.num_experts) == (8, 128, None)
    assert m.name == "mistral"


def test_from_hf_config_qwen_moe_sparse_step():
    cfg = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
           "num_hidden_layers": 4, "vocab_size": 100, "num_experts": 8,
           "moe_intermediate_size": 32, "num_experts_per_tok": 2,
           "shared_expert_intermediate_size": 48, "decoder_sparse_step": 2}
    m = ModelShape.from_hf_config(cfg)
    assert m.moe_layers().tolist() == [True, False, True, False]
    assert m.moe_ffn_width() == 32 * 2 + 48


def test_from_hf_config_errors(tmp_path):
    with pytest.raises(ValueError, match="lacks 'hidden_size'"):
        ModelShape.from_hf_config({"num_attention_heads": 2})
    bad = tmp_path / "config.json"
    bad.write_text("{nope")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelShape.from_hf_config(bad)
    with pytest.raises(ValueError, match="does not exist"):
        ModelShape.from_hf_config(tmp_path / "missing.json")


def test_from_args_namespace():
    from types import SimpleNamespace

    ns = SimpleNamespace(num_layers=2, hidden_size=16, num_attention_heads=2,
                         num_query_groups=2, kv_channels=8, ffn_hidden_size=64,
                         vocab_size=32, group_query_attention=True)
    assert ModelShape.from_args(ns).forward_flops(10) == 2 * 85120 + 10240
    assert sorted(p.stem for p in MODELS_DIR.glob("*.json")) == [
        "deepseek-v3", "llama-3.1-70b", "qwen2.5-0.5b", "qwen3-8b"]
