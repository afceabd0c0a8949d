"""Worker of tests/integration/test_train_tensor_parallel.py: one gloo rank of a world of 2.

Builds the toy GPT and a small Qwen2-style checkpoint model (GQA, q/k/v biases,
SwiGLU, untied embeddings) twice, under tp 2 and then tp 1 (dp 2), and saves per
rank: the full parameters gathered from the tp 2 shards, the tp 2 logits gathered
over the vocab shards, the vocab-parallel log-probs, and the same from tp 1.
"""

from __future__ import annotations

import os
import traceback

import numpy as np
import torch

SEQS = [np.array([1, 5, 7, 3, 2, 9, 4]), np.array([3, 8, 1, 6, 2])]
PROMPTS = [3, 2]


def _forward(spec, tp: int) -> dict:
    import torch.distributed as dist
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from varbatch_kit.train.config.parallel_layout import ParallelLayout
    from varbatch_kit.train.model.gpt import build_gpt
    from varbatch_kit.train.parallel.process_setup import use_layout
    from varbatch_kit.train.parallel.tensor_parallel import (
        full_parameter_count,
        gather_full_parameters,
        vocab_shard,
    )
    from varbatch_kit.train.step.packed_batch import pack, response_logits, response_token_stats

    layout = ParallelLayout(dp=2 // tp, tp=tp)
    use_layout(layout)  # megatron's groups; the sizes and this rank's shard come from layout
    here = layout.coords(dist.get_rank())
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0, inference_rng_tracker=True, force_reset_rng=True)
    gpt = build_gpt(spec, max_seq_len=16, layout=layout, world_rank=dist.get_rank())
    batch = pack(SEQS, PROMPTS)
    logits = response_logits(gpt, batch)[0]  # [R, V / tp]
    stats = response_token_stats(logits, batch, at_response_rows=True,
                                 **vocab_shard(logits, tp_rank=here.tp_rank, tp_size=tp))
    stats["logprob"].sum().backward()
    grads = {n: p.grad for n, p in gpt.named_parameters()}
    if tp > 1:
        from megatron.core import parallel_state

        shards = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(shards, logits.detach().contiguous(),
                        group=parallel_state.get_tensor_model_parallel_group())
        logits = torch.cat(shards, dim=-1)
    return {"params": gather_full_parameters(gpt), "grads": gather_full_parameters(gpt, grads),
            "logits": logits.detach(), "logprob": stats["logprob"].detach(),
            "count": full_parameter_count(gpt, tp)}


def run(rank: int, world: int, port: int, out: str, hf_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    result: dict = {}
    try:
        from varbatch_kit.train.config.model_config import ModelConfig, resolve_model
        from varbatch_kit.train.parallel.process_setup import setup_process

        setup_process("cpu")
        toy = resolve_model(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                        vocab_size=32))
        hf = resolve_model(ModelConfig(path=hf_dir))
        for name, spec in (("toy", toy), ("hf", hf)):
            result[name] = {tp: _forward(spec, tp) for tp in (2, 1)}
    except Exception:  # noqa: BLE001 - reported to the test
        result["error"] = traceback.format_exc()
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()  # a gloo world left up hangs the exit
    if dist.is_initialized():
        dist.destroy_process_group()
