"""The SmolLM2 rollouts the integration tests share: generated once, cached as a trace.

The fixtures ``smollm2_path`` and ``real_rollouts`` (tests/integration/conftest.py)
read these; notebook 04 section 5 asks the same cache for the same call.
"""

from __future__ import annotations

from _paths import REPO

CACHE = REPO / "build" / "cache"  # the notebooks run under nbval get it as VARBATCH_KIT_CACHE
# 3 questions x 4 rollouts x 2 turns = 24 samples; 6 rollouts a step -> 2 steps whose GRPO
# groups straddle the step boundary
GEN = dict(n_prompts=3, n_samples_per_prompt=4, turns=2, follow_up="always", max_new_tokens=8,
           temperature=0.7, seed=0)
