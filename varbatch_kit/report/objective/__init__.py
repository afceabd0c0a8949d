"""The RL objective, pure: rewards to advantages, KL estimates, per-token policy losses.

Tensors in, tensors out, a process group only as an argument: reduce the per-token results
with the step reducers of :mod:`varbatch_kit.report` (the per-rollout or
per-token denominators). slime's names and tuples are in
:mod:`varbatch_kit.compat.slime.objective`, checked against vectors recorded
from slime's own functions (``tests/golden/objective/``).

- :mod:`.rewards`: group normalisation of per-sample rewards;
- :mod:`.advantages`: GRPO broadcast, REINFORCE++ (discounted) returns and its
  baseline variant, GAE, and :func:`estimate_advantages` (one call per estimator);
- :mod:`.whiten`: masked whitening over a process group (``--normalize-advantages``);
- :mod:`.kl`: per-token KL estimators (k1, k2, k3, low_var_kl) and the
  per-sequence masked KL (GSPO);
- :mod:`.logprobs`: the sampled tokens' log-probs and entropies from (packed)
  logits, at the rollout temperature;
- :mod:`.token_stats`: :func:`chunked_token_stats`, the same per token (and the
  argmax hit) without a full-vocabulary log-softmax: float32 chunks of tokens,
  softmax recomputed in backward, vocab-parallel over a group passed in;
- :mod:`.policy_loss`: PPO clip (with dual clip), CISPO, OPSM masking, TIS and
  ICEPOP weights;
- :mod:`.terms`: :func:`policy_objective`, every per-token term of slime's policy
  loss for one micro-batch (what the training step and ``compat.slime``'s
  ``policy_loss_function`` reduce).
"""

from varbatch_kit.report.objective.advantages import (
    ESTIMATORS,
    broadcast_advantages,
    discounted_returns,
    estimate_advantages,
    gae,
    reinforce_pp_baseline_advantages,
    reinforce_pp_returns,
)
from varbatch_kit.report.objective.kl import KL_TYPES, approx_kl, sequence_kl
from varbatch_kit.report.objective.logprobs import (
    response_log_probs_and_entropy,
    token_log_probs_and_entropy,
)
from varbatch_kit.report.objective.policy_loss import (
    cispo_loss,
    icepop_weights,
    opsm_keep_mask,
    ppo_clip_loss,
    truncated_is_weights,
)
from varbatch_kit.report.objective.rewards import (
    GROUP_NORMALIZED_ESTIMATORS,
    STD_NORMALIZED_ESTIMATORS,
    normalize_group_rewards,
)
from varbatch_kit.report.objective.terms import (
    OBJECTIVE_ESTIMATORS,
    ObjectiveOptions,
    metric_keys,
    policy_objective,
)
from varbatch_kit.report.objective.token_stats import chunked_token_stats
from varbatch_kit.report.objective.whiten import masked_whiten

__all__ = [
    "ESTIMATORS",
    "GROUP_NORMALIZED_ESTIMATORS",
    "KL_TYPES",
    "OBJECTIVE_ESTIMATORS",
    "ObjectiveOptions",
    "STD_NORMALIZED_ESTIMATORS",
    "approx_kl",
    "broadcast_advantages",
    "chunked_token_stats",
    "cispo_loss",
    "discounted_returns",
    "estimate_advantages",
    "gae",
    "icepop_weights",
    "masked_whiten",
    "metric_keys",
    "normalize_group_rewards",
    "opsm_keep_mask",
    "policy_objective",
    "ppo_clip_loss",
    "reinforce_pp_baseline_advantages",
    "reinforce_pp_returns",
    "response_log_probs_and_entropy",
    "sequence_kl",
    "token_log_probs_and_entropy",
    "truncated_is_weights",
]
