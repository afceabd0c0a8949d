"""Synthetic batches shared by the dynamic-CP benchmarks (one definition, two users)."""

from __future__ import annotations

import numpy as np

from varbatch_kit import Rollouts

#: tokens per GPU of the dynamic-CP benchmarks
CAP = 16384


def tail_trace(n: int = 2048, seed: int = 0) -> Rollouts:
    """Many short samples and a few up to 64k tokens (one sample per rollout)."""
    rng = np.random.default_rng(seed)
    short = np.clip(np.ceil(rng.lognormal(np.log(1500), 0.8, n)), 64, CAP).astype(np.int64)
    long_ = rng.random(n) < 0.04
    lengths = np.where(long_, rng.integers(CAP, 4 * CAP + 1, n), short)
    return Rollouts(prompt_len=np.zeros(n, dtype=np.int64), response_len=lengths)
