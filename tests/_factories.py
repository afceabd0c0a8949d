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


def masked_rollouts(counts, *, seed: int, prompt=(3, 8), response=(5, 30), keep=0.85,
                    first_id: int = 0) -> Rollouts:
    """Rollouts of ``counts[k]`` samples each (ids from ``first_id``), prompts and responses
    drawn uniformly from the half-open ranges, each response token in the loss with
    probability ``keep`` (the first always)."""
    rng = np.random.default_rng(seed)
    rid = np.repeat(np.arange(first_id, first_id + len(counts)), counts)
    prompt_len = rng.integers(*prompt, rid.size)
    response_len = rng.integers(*response, rid.size)
    masks = [(rng.random(r) < keep).astype(int) for r in response_len]
    for m in masks:
        m[0] = 1
    return Rollouts(prompt_len, response_len, rid, masks)


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
