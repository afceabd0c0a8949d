"""slime's scheduling, metric and RL-objective functions, with slime's signatures and results;
slime's command line mapped onto a ScheduleConfig or a TrainConfig; :func:`recommend`: which
slime scheduling flags to run on a trace (:mod:`.flag_search`).

Thin adapters over varbatch_kit's core, :mod:`varbatch_kit.report` and
:mod:`varbatch_kit.report.objective` (the behaviour is described in
``docs/reference_semantics.md``); slime's ``policy_loss_function`` and
``loss_function`` sit on the engine's per-token objective. Checked against vectors recorded from
slime's own code (``tests/golden/``, ``tests/golden/objective/``).
``build_dp_schedule`` also runs varbatch_kit's policies (``args.varbatch_packing``), and
:func:`install` puts them into a slime run (:mod:`.patch`). Every error
a caller can cause is a :class:`SlimeCompatError`, which is both a
``ValueError`` and an ``AssertionError`` (slime asserts), so code written
against slime keeps working.
"""

from varbatch_kit.compat.slime.errors import SlimeCompatError
from varbatch_kit.compat.slime.flag_search import Recommendation, recommend
from varbatch_kit.compat.slime.flags import (
    SLIME_FLAGS,
    parse_slime_flags,
    schedule_config_from_slime_args,
)
from varbatch_kit.compat.slime.loss import (
    loss_function,
    objective_options_from_args,
    policy_loss_function,
)
from varbatch_kit.compat.slime.metrics import (
    gather_and_reduce_log_dict,
    get_logits_and_tokens_offset_with_cp,
    get_sum_of_sample_mean,
    reduce_train_step_metrics,
    rollout_log_metric_contribution,
)
from varbatch_kit.compat.slime.model_flags import model_shape_from_slime_args
from varbatch_kit.compat.slime.objective import (
    chunked_discounted_returns,
    compute_advantages_and_returns,
    compute_approx_kl,
    compute_cispo_loss,
    compute_gspo_kl,
    compute_opsm_mask,
    compute_policy_loss,
    distributed_masked_whiten,
    get_advantages_and_returns_batch,
    get_grpo_returns,
    get_reinforce_plus_plus_baseline_advantages,
    get_reinforce_plus_plus_returns,
    icepop_function,
    post_process_rewards,
    vanilla_tis_function,
)
from varbatch_kit.compat.slime.patch import SlimeNotImportableError, install, installed_policy
from varbatch_kit.compat.slime.schedule import (
    POLICY_ATTRS,
    build_dp_schedule,
    calculate_fwd_flops,
    expand_bins_by_splitting,
    first_fit_pack,
    get_seqlen_balanced_partitions,
    karmarkar_karp,
    policy_from_args,
    to_slime,
)
from varbatch_kit.compat.slime.train_data import convert_samples_to_train_data
from varbatch_kit.compat.slime.train_flags import train_config_from_slime_args

__all__ = [
    "POLICY_ATTRS",
    "Recommendation",
    "SLIME_FLAGS",
    "SlimeCompatError",
    "SlimeNotImportableError",
    "build_dp_schedule",
    "calculate_fwd_flops",
    "chunked_discounted_returns",
    "compute_advantages_and_returns",
    "compute_approx_kl",
    "model_shape_from_slime_args",
    "compute_cispo_loss",
    "compute_gspo_kl",
    "compute_opsm_mask",
    "compute_policy_loss",
    "convert_samples_to_train_data",
    "distributed_masked_whiten",
    "expand_bins_by_splitting",
    "first_fit_pack",
    "gather_and_reduce_log_dict",
    "get_advantages_and_returns_batch",
    "get_grpo_returns",
    "get_logits_and_tokens_offset_with_cp",
    "get_reinforce_plus_plus_baseline_advantages",
    "get_reinforce_plus_plus_returns",
    "get_seqlen_balanced_partitions",
    "get_sum_of_sample_mean",
    "icepop_function",
    "install",
    "installed_policy",
    "karmarkar_karp",
    "loss_function",
    "objective_options_from_args",
    "parse_slime_flags",
    "policy_from_args",
    "policy_loss_function",
    "post_process_rewards",
    "recommend",
    "reduce_train_step_metrics",
    "rollout_log_metric_contribution",
    "schedule_config_from_slime_args",
    "to_slime",
    "train_config_from_slime_args",
    "vanilla_tis_function",
]
