"""Tensor parallelism on two real gloo ranks: tp 2 computes what tp 1 computes.

For the toy GPT (random initial weights: megatron draws the full master weight
and keeps each rank's shard) and a small Qwen2-style checkpoint (grouped-query
attention with q/k/v biases, SwiGLU, untied embeddings: the Hugging Face loader
splits it per TP rank), each rank builds the model under tp 2 and then tp 1; the
full parameters gathered from the shards, the logits gathered over the vocab
shards, the vocab-parallel log-probs and the gathered gradients of their sum
equal tp 1's. One spawn of two processes (~30 s on a loaded 2-core machine).
"""


import numpy as np
import pytest
import torch
from _fake_hf import llama_like
from _spawn import run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

WORKER_TIMEOUT_S = 150



def qwen2_checkpoint(out):
    """A 2-layer Qwen2-style checkpoint with random weights: 4 heads, 2 KV groups, biases."""
    import json

    from safetensors.torch import save_file

    config, shapes = llama_like(layers=2, h=16, heads=4, kv=2, f=24, v=32)
    config.update(model_type="qwen2", tie_word_embeddings=False)
    shapes["lm_head.weight"] = (32, 16)
    for i in range(2):
        for x, n in (("q", 16), ("k", 8), ("v", 8)):
            shapes[f"model.layers.{i}.self_attn.{x}_proj.bias"] = (n,)
    g = torch.Generator().manual_seed(3)
    tensors = {k: (torch.randn(s, generator=g) * 0.3).contiguous() for k, s in shapes.items()}
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(out / "model.safetensors"))
    return out


def test_tp2_equals_tp1_for_the_toy_gpt_and_a_checkpoint(tmp_path):
    import _tp_dist_worker as worker

    hf_dir = qwen2_checkpoint(tmp_path / "qwen2")
    ranks = run_ranks(worker.run, 2, tmp_path, str(hf_dir), timeout_s=WORKER_TIMEOUT_S)
    from varbatch_kit.train.config.hf_checkpoint import read_hf_model
    from varbatch_kit.train.model.hf_import import megatron_state_dict

    hf_full = megatron_state_dict(read_hf_model(hf_dir))
    for rank, got in enumerate(ranks):
        assert "error" not in got, got.get("error")
        for model in ("toy", "hf"):
            tp2, tp1 = got[model][2], got[model][1]
            where = f"rank {rank}, {model}"
            assert tp2["params"].keys() == tp1["params"].keys(), where
            assert tp2["count"] == tp1["count"] == sum(t.numel() for t in tp1["params"].values())
            for name, full in tp1["params"].items():
                assert torch.equal(tp2["params"][name], full), (where, name)
                torch.testing.assert_close(tp2["grads"][name], tp1["grads"][name], rtol=1e-5,
                                           atol=1e-6, msg=f"{where}: grad {name}")
            torch.testing.assert_close(tp2["logits"], tp1["logits"], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(tp2["logprob"], tp1["logprob"], rtol=1e-6, atol=1e-7)
            assert tp2["logits"].shape == (sum(len(s) - p for s, p in
                                               zip(worker.SEQS, worker.PROMPTS)), 32)
        # the loader's tp 2 shards put back together are the checkpoint's tensors
        for name, full in hf_full.items():
            assert torch.equal(got["hf"][2]["params"][name], full), name
    # both TP ranks computed the same (vocab-parallel) log-probs
    np.testing.assert_array_equal(ranks[0]["hf"][2]["logprob"], ranks[1]["hf"][2]["logprob"])
