"""The SmolLM2 rollouts the integration tests share: generated once, cached as a trace.

The fixtures ``smollm2_path`` and ``real_rollouts`` (tests/integration/conftest.py)
read these; notebook 06 section 5 asks the same cache for the same call.
"""

from __future__ import annotations

from _paths import REPO

CACHE = REPO / "build" / "cache"  # the notebooks run under nbval get it as VARBATCH_KIT_CACHE
# 3 questions x 4 rollouts x 2 turns = 24 samples; 6 rollouts a step -> 2 steps whose GRPO
# groups straddle the step boundary
GEN = dict(n_prompts=3, n_samples_per_prompt=4, turns=2, follow_up="always", max_new_tokens=8,
           temperature=0.7, seed=0)

#: the closed RL loop that tests/integration/test_train_rl_loop.py and notebook 07 share
#: (through the experiment cache): truncated SmolLM2, 2 iterations of 2 questions x 4 rollouts
RL_LOOP_CONFIG = dict(num_layers=2, lr=1e-4, min_lr=1e-4, lr_decay_style="constant",
                      global_batch_size=4, max_tokens_per_gpu=256, packing="first_fit",
                      rollout_temperature=0.8, timeout_s=600,
                      entropy_coef=0.01)  # the 2-layer model earns no reward: the entropy
# bonus moves the weights
RL_LOOP = dict(prompts=2, iterations=2, n_samples_per_prompt=4, max_new_tokens=6)
