"""Fixtures the integration tests share: the SmolLM2 checkpoint and its cached rollouts."""

from __future__ import annotations

from pathlib import Path

import pytest
from _paths import REPO
from _smollm2 import CACHE, GEN

from varbatch_kit import Rollouts


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    pytest.importorskip("transformers")
    from varbatch_kit.train.model.smollm2 import SmolLM2Unavailable, smollm2_checkpoint

    try:
        return smollm2_checkpoint(REPO / "build" / "models")
    except SmolLM2Unavailable as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def real_rollouts(smollm2_path) -> Rollouts:
    """SmolLM2's generations, made once and cached as a JSONL trace (read back from it);
    notebook 06 section 5 asks the same cache for the same call."""
    from varbatch_kit.cli.experiment_cache import cached_rollouts
    from varbatch_kit.train.rl.generate import GenerationStats

    stats = GenerationStats()
    r = cached_rollouts(smollm2_path, cache_dir=CACHE, stats=stats, device="cpu", **GEN)
    print(f"\ngenerated {stats.samples} samples, {stats.generated_tokens} tokens in "
          f"{stats.wall_s:.1f} s ({stats.tokens_per_s:.1f} tokens/s)")
    return r
