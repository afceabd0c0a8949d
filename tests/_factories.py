"""Test data many test files share: a tiny model shape, response-only rollouts, a small
synthetic batch. Plain values and functions; import them (``from _factories import TINY``,
``tests/`` is on ``sys.path``)."""

from __future__ import annotations

import asyncio

import numpy as np

from varbatch_kit.core.flops import ModelShape
from varbatch_kit.core.rollouts import Rollouts

#: a 2-layer model shape: FLOPs for the schedulers, the simulator and the figures
TINY = ModelShape(num_layers=2, hidden_size=16, num_attention_heads=2, num_query_groups=2,
                  vocab_size=32, ffn_hidden_size=64, kv_channels=8)

#: TINY as slime's model arguments (compat.slime's ``args`` namespace fields)
SLIME_MODEL_ARGS = dict(num_layers=2, hidden_size=16, num_attention_heads=2, num_query_groups=2,
                        kv_channels=8, ffn_hidden_size=64, vocab_size=32, num_experts=None)

#: the toy GPT of the training runs (``TrainConfig`` model fields)
TINY_GPT = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "vocab_size": 64}


def rollouts(lengths, rollout_id=None) -> Rollouts:
    """Samples with no prompt and these response ``lengths`` (one rollout each, or grouped
    by ``rollout_id``)."""
    lengths = np.asarray(lengths)
    return Rollouts(prompt_len=np.zeros_like(lengths), response_len=lengths,
                    rollout_id=rollout_id)


def synthetic_rollouts(seed: int = 3, n: int = 16, *, prompt_len=(4, 8), response_len=12,
                       response_sigma=0.5, max_response_len=24) -> Rollouts:
    """``n`` synthetic rollouts of 1-2 samples (16: 4 steps of ``global_batch_size=4``)."""
    return Rollouts.synthetic(n, samples_per_rollout=(1, 2), prompt_len=prompt_len,
                              response_len=response_len, response_sigma=response_sigma,
                              max_response_len=max_response_len, seed=seed)


def background_error(make_explorer, change):
    """An explorer built inside a running event loop (so it computes in the background), after
    ``change(explorer)``: waits up to 4 s for its error box to fill, closes it, returns it."""
    async def drive():
        ex = make_explorer()
        change(ex)
        for _ in range(200):
            await asyncio.sleep(0.02)
            if ex.last_error:
                break
        ex.close()
        return ex

    return asyncio.run(drive())
