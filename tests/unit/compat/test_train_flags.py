"""slime's command line onto TrainConfig: every flag, strictly, base's other fields kept."""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import textwrap
import warnings
from types import SimpleNamespace

import pytest
from _paths import REPO

from varbatch_kit.compat.slime import schedule_config_from_slime_args, train_config_from_slime_args
from varbatch_kit.compat.slime.train_flags import (
    TIS_FUNCTION_PATHS,
    TRAIN_FLAGS,
    UNSUPPORTED_TRAIN_FLAGS,
)
from varbatch_kit.core.config import ScheduleConfig
from varbatch_kit.train.config.model_config import ModelConfig
from varbatch_kit.train.config.sub_configs import DataConfig, LossConfig, OptimConfig, RunConfig
from varbatch_kit.train.config.train_config import TrainConfig

ICEPOP = "slime.backends.megatron_utils.loss.icepop_function"
VANILLA = "slime.backends.megatron_utils.loss.vanilla_tis_function"

#: a base that differs from TrainConfig() wherever a flag could land, so "kept" is visible
BASE = TrainConfig(
    schedule=ScheduleConfig(dp=2, global_batch_size=8, max_tokens_per_gpu=512,
                            packing="first_fit"),
    mode="per_sample_mean",
    model=ModelConfig(num_layers=3, hidden_size=32),
    optim=OptimConfig(lr=1e-3, min_lr=1e-5, lr_decay_style="linear", weight_decay=0.1),
    loss=LossConfig(eps_clip=0.1, eps_clip_high=0.3, reward_key="acc", tis_clip=3.0),
    data=DataConfig(seed=7, n_samples_per_prompt=8, rollout_batch_size=2),
    run=RunConfig(max_steps=3, label="base run"),
)


def _quiet(flags, base=BASE):
    """The config, failing on any warning (the flags given are all read)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return train_config_from_slime_args(flags, base=base)


def _get(cfg: TrainConfig, where: str):
    section, _, name = where.partition(".")
    return getattr(cfg, section) if not name else getattr(getattr(cfg, section), name)


#: (flag string, TrainConfig field, its value): every mapped flag
MAPPED = [
    ("--advantage-estimator gspo", "loss.advantage_estimator", "gspo"),
    ("--advantage-estimator reinforce_plus_plus_baseline", "loss.advantage_estimator",
     "reinforce_plus_plus_baseline"),
    ("--eps-clip 0.25", "loss.eps_clip", 0.25),
    ("--eps-clip-high 0.28", "loss.eps_clip_high", 0.28),
    ("--eps-clip-c 3", "loss.eps_clip_c", 3.0),
    ("--use-kl-loss", "loss.use_kl_loss", True),
    ("--kl-loss-coef 0.01", "loss.kl_loss_coef", 0.01),
    ("--kl-loss-type low_var_kl", "loss.kl_loss_type", "low_var_kl"),
    ("--kl-loss-type k2", "loss.kl_loss_type", "k2"),
    ("--use-unbiased-kl", "loss.use_unbiased_kl", True),
    ("--kl-coef 0.05", "loss.kl_coef", 0.05),
    ("--entropy-coef 0.001", "loss.entropy_coef", 0.001),
    ("--gamma 0.99", "loss.gamma", 0.99),
    ("--normalize-advantages", "loss.normalize_advantages", True),
    ("--disable-rewards-normalization", "loss.rewards_normalization", False),
    ("--disable-grpo-std-normalization", "loss.grpo_std_normalization", False),
    ("--use-tis", "loss.use_tis", True),
    (f"--custom-tis-function-path {ICEPOP}", "loss.tis_function", "icepop"),
    (f"--custom-tis-function-path {VANILLA}", "loss.tis_function", "vanilla"),
    ("--tis-clip 1.5", "loss.tis_clip", 1.5),
    ("--tis-clip-low 0.5", "loss.tis_clip_low", 0.5),
    ("--use-rollout-logprobs", "loss.use_rollout_logprobs", True),
    ("--reward-key score", "loss.reward_key", "score"),
    ("--seed 42", "data.seed", 42),
    ("--n-samples-per-prompt 16", "data.n_samples_per_prompt", 16),
    ("--rollout-batch-size 32", "data.rollout_batch_size", 32),
    ("--num-steps-per-rollout 3", "data.num_steps_per_rollout", 3),
    ("--rollout-temperature 0.7", "loss.rollout_temperature", 0.7),
    ("--moe-aux-loss-coeff 0.001", "loss.moe_aux_loss_coeff", 0.001),
    ("--moe-z-loss-coeff 0.0001", "loss.moe_z_loss_coeff", 0.0001),
    ("--lr 2e-3", "optim.lr", 2e-3),
    ("--min-lr 1e-6", "optim.min_lr", 1e-6),
    ("--lr-decay-style cosine", "optim.lr_decay_style", "cosine"),
    ("--lr-decay-style constant", "optim.lr_decay_style", "constant"),
    ("--lr-warmup-fraction 0.1", "optim.lr_warmup_fraction", 0.1),
    ("--weight-decay 0.01", "optim.weight_decay", 0.01),
    ("--adam-beta1 0.8", "optim.adam_beta1", 0.8),
    ("--adam-beta2 0.98", "optim.adam_beta2", 0.98),
    ("--adam-eps 1e-6", "optim.adam_eps", 1e-6),
    ("--clip-grad 0.5", "optim.clip_grad", 0.5),
    ("--use-distributed-optimizer", "optim.distributed", True),
    ("--calculate-per-token-loss", "mode", "per_token"),
]


@pytest.mark.parametrize("cmd,where,value", MAPPED)
def test_every_flag_sets_its_field_and_nothing_else(cmd, where, value):
    cfg = _quiet(cmd)
    got = _get(cfg, where)
    assert got == value and type(got) is type(value), (got, value)
    assert cfg == BASE.with_(**{where: value})  # only that field moved: the rest is base's
    assert _quiet(shlex.split(cmd)) == cfg  # an argv list reads the same


def test_the_table_covers_every_mapped_flag():
    tested = {shlex.split(c)[0] for c, _, _ in MAPPED}
    assert tested == {m.flag for m in TRAIN_FLAGS if m.section != "layout"}  # below


def test_the_issues_example():
    base = TrainConfig(schedule=ScheduleConfig(dp=2, global_batch_size=4, max_tokens_per_gpu=256),
                       model=ModelConfig(num_layers=2), run=RunConfig(max_steps=5))
    cfg = _quiet("--advantage-estimator grpo --eps-clip 0.2 --eps-clip-high 0.28 --use-kl-loss "
                 "--kl-loss-coef 0.01 --kl-loss-type low_var_kl --entropy-coef 0.001 "
                 "--n-samples-per-prompt 4", base=base)
    assert cfg.loss == LossConfig(advantage_estimator="grpo", eps_clip=0.2, eps_clip_high=0.28,
                                  use_kl_loss=True, kl_loss_coef=0.01, kl_loss_type="low_var_kl",
                                  entropy_coef=0.001)
    assert cfg.loss.clip_high == 0.28
    assert cfg.data.n_samples_per_prompt == 4
    assert (cfg.schedule, cfg.model, cfg.run, cfg.optim, cfg.mode) == (
        base.schedule, base.model, base.run, base.optim, base.mode)


def test_no_flags_is_base_and_no_base_is_trainconfig_defaults():
    assert _quiet("") == BASE
    assert _quiet([]) == BASE
    assert _quiet("", base=None) == TrainConfig()


def test_loss_defaults_are_slimes_defaults():
    """base=None keeps TrainConfig()'s objective: slime's defaults (slime/utils/arguments.py)."""
    slime_defaults = dict(
        advantage_estimator="grpo", eps_clip=0.2, eps_clip_high=None, eps_clip_c=None,
        use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="k1", use_unbiased_kl=False,
        kl_coef=0.0, entropy_coef=0.0, gamma=1.0, normalize_advantages=False,
        rewards_normalization=True, grpo_std_normalization=True, use_tis=False, tis_clip=2.0,
        tis_clip_low=0.0, use_rollout_logprobs=False, reward_key=None)
    loss = train_config_from_slime_args("", base=None).loss
    assert {k: getattr(loss, k) for k in slime_defaults} == slime_defaults
    assert loss.tis_function == "vanilla"  # slime's --custom-tis-function-path None
    assert train_config_from_slime_args("").data.seed == 1234  # slime's --seed
    assert train_config_from_slime_args("").mode == "per_rollout_mean"


def test_negative_flags_turn_normalisation_off_and_absent_keeps_base():
    base = BASE.with_(rewards_normalization=False, grpo_std_normalization=False)
    assert _quiet("--eps-clip 0.2", base=base).loss.rewards_normalization is False
    cfg = _quiet("--disable-rewards-normalization --disable-grpo-std-normalization")
    assert (cfg.loss.rewards_normalization, cfg.loss.grpo_std_normalization) == (False, False)


def test_without_per_token_flag_the_mode_is_bases():
    assert _quiet("--eps-clip 0.2").mode == "per_sample_mean"
    assert _quiet("--eps-clip 0.2", base=None).mode == "per_rollout_mean"


def test_schedule_flags_replace_bases_schedule_whole():
    flags = ("--global-batch-size 16 --use-dynamic-batch-size --max-tokens-per-gpu 1024 "
             "--balance-data --actor-num-gpus-per-node 4 --context-parallel-size 2 "
             "--use-kl-loss --kl-loss-coef 0.02")
    cfg = _quiet(flags)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        expected = schedule_config_from_slime_args(
            "--global-batch-size 16 --use-dynamic-batch-size --max-tokens-per-gpu 1024 "
            "--balance-data --actor-num-gpus-per-node 4 --context-parallel-size 2")
    assert cfg.schedule == expected
    assert (cfg.dp, cfg.cp, cfg.schedule.packing, cfg.schedule.distribution) == (
        2, 2, "first_fit", "flops_kk")
    assert (cfg.loss.use_kl_loss, cfg.loss.kl_loss_coef) == (True, 0.02)
    assert (cfg.model, cfg.run, cfg.data) == (BASE.model, BASE.run, BASE.data)


def test_a_schedule_flag_without_global_batch_size_is_an_error():
    with pytest.raises(ValueError, match="lack --global-batch-size"):
        train_config_from_slime_args("--micro-batch-size 2 --eps-clip 0.2", base=BASE)


def test_pipeline_parallelism_from_the_flags_runs_or_is_refused_for_its_layers():
    flags = "--global-batch-size 4 --pipeline-model-parallel-size 2 --actor-num-gpus-per-node 2"
    # BASE's 3 layers cannot be cut into 2 equal stages: refused, naming the fix
    with pytest.raises(ValueError, match=r"slime flags: num_layers=3 does not split into "
                                         r"pp\*vpp=2 equal pipeline chunks"):
        train_config_from_slime_args(flags, base=BASE)
    cfg = train_config_from_slime_args(flags, base=BASE.with_(num_layers=4))
    assert (cfg.schedule.pp, cfg.dp, cfg.world_size) == (2, 1, 2)
    assert cfg.layout.describe() == "dp1 cp1 pp2 tp1"
    vpp = train_config_from_slime_args(flags + " --virtual-pipeline-model-parallel-size 2",
                                       base=BASE.with_(num_layers=4))
    assert (vpp.schedule.pp, vpp.schedule.vpp, vpp.world_size) == (2, 2, 2)
    assert vpp.schedule.mb_group >= 2  # megatron's interleaved groups hold >= pp micro-batches


def test_tensor_parallelism_from_the_flags_reaches_the_engine():
    cfg = train_config_from_slime_args("--global-batch-size 4 --tensor-model-parallel-size 2 "
                                       "--actor-num-gpus-per-node 4", base=BASE)
    assert (cfg.tp, cfg.dp, cfg.world_size) == (2, 2, 4)
    assert train_config_from_slime_args("--global-batch-size 4", base=BASE).tp == 1


def test_expert_parallelism_from_the_flags_is_carved_out_of_dp():
    """megatron's --expert-model-parallel-size takes no GPUs of its own: dp stays GPUs / tp."""
    cfg = train_config_from_slime_args("--global-batch-size 4 --expert-model-parallel-size 2 "
                                       "--actor-num-gpus-per-node 4", base=BASE)
    assert (cfg.ep, cfg.dp, cfg.world_size) == (2, 4, 4)
    assert train_config_from_slime_args("--global-batch-size 4", base=BASE).ep == 1
    with pytest.raises(ValueError, match="ep=3 does not divide dp\\*cp=4"):
        train_config_from_slime_args("--global-batch-size 4 --expert-model-parallel-size 3 "
                                     "--actor-num-gpus-per-node 4", base=BASE)


@pytest.mark.parametrize("cmd,sp", [
    ("--global-batch-size 4 --actor-num-gpus-per-node 2 --tensor-model-parallel-size 2 "
     "--sequence-parallel", True),
    ("--global-batch-size 4 --actor-num-gpus-per-node 2 --tensor-model-parallel-size 2",
     False),  # slime without the flag
    ("--global-batch-size 4 --tensor-model-parallel-size 1 --sequence-parallel", False),
    ("--sequence-parallel", False),  # base's tp 1: megatron turns it off
    ("--global-batch-size 4", None),  # neither flag: base's
])
def test_sequence_parallelism_from_the_flags_follows_megatrons_rule(cmd, sp):
    """``--sequence-parallel`` runs sequence parallelism with tp > 1; megatron turns it off at
    tp 1; a slime command line that sets tp without the flag runs tp without it."""
    cfg = _quiet(cmd)
    assert cfg.sequence_parallel is sp
    assert cfg.layout.sp is (cfg.tp > 1 if sp is None else sp)
    on = TrainConfig(tp=2)
    assert _quiet("--sequence-parallel", base=on).layout.sp


@pytest.mark.parametrize("cmd,match", [
    ("--eps-clip abc", "argument --eps-clip: invalid float value: 'abc'"),
    ("--eps-clip 1.5", r"--eps-clip 1.5: loss.eps_clip=1.5: give a number in \[0, 1\)"),
    ("--eps-clip-c 0.5", r"--eps-clip-c 0.5: loss.eps_clip_c=0.5"),
    ("--kl-loss-coef -1", r"--kl-loss-coef -1.0: loss.kl_loss_coef=-1.0"),
    ("--kl-loss-type k4", "argument --kl-loss-type: invalid choice: 'k4'"),
    ("--advantage-estimator dpo", "argument --advantage-estimator: invalid choice: 'dpo'"),
    ("--n-samples-per-prompt 0", "argument --n-samples-per-prompt: expected a positive"),
    ("--seed -1", r"--seed -1: data.seed=-1"),
    ("--seed 1.5", "argument --seed: invalid int value: '1.5'"),
    ("--lr-decay-style WSD", r"--lr-decay-style 'WSD': optim.lr_decay_style='WSD': choose"),
    ("--adam-beta1 1", r"--adam-beta1 1.0: optim.adam_beta1=1.0"),
    ("--tis-clip-low 5", r"--tis-clip-low 5.0: loss.tis_clip_low=5.0"),
])
def test_a_bad_value_is_a_value_error_naming_the_flag(cmd, match, capsys):
    with pytest.raises(ValueError, match=match):
        train_config_from_slime_args(cmd, base=BASE)
    assert capsys.readouterr().err == ""  # no argparse usage printed


def test_a_value_conflicting_with_a_field_kept_from_base_names_both():
    with pytest.raises(ValueError, match=r"slime flags --lr: optim.min_lr=1e-05: .*\(optim.min_lr "
                                         r"is base's value: give --min-lr too\)"):
        train_config_from_slime_args("--lr 1e-6", base=BASE)
    assert _quiet("--lr 1e-6 --min-lr 0").optim.lr == 1e-6


@pytest.mark.parametrize("path", ["slime.backends.megatron_utils.loss.my_tis",
                                  "examples/train_infer_mismatch_helper/mis.py:compute_mis"])
def test_another_tis_function_is_refused(path):
    with pytest.raises(ValueError, match="--custom-tis-function-path.*only slime's two TIS "
                                         "functions are supported"):
        train_config_from_slime_args(f"--use-tis --custom-tis-function-path {path}", base=BASE)


@pytest.mark.parametrize("cmd", ["--use-kl", "--eps-clip-hi 0.3", "--disable-rewards", "--use-ti",
                                 "--global-batch 4", "--n-samples 4"])
def test_abbreviations_are_refused(cmd):
    with pytest.raises(ValueError, match="abbreviations are not accepted: did you mean --"):
        train_config_from_slime_args(cmd, base=BASE)


def test_ignored_flags_are_listed_in_one_warning():
    with pytest.warns(UserWarning) as rec:
        cfg = train_config_from_slime_args(
            "--hf-checkpoint /m --global-batch-size 4 --num-rollout 3 --lambd 0.9 --eps-clip 0.3 "
            "--not-a-slime-flag x --opsm-delta 1e-3 --balance-data", base=BASE)
    assert len(rec) == 1
    assert str(rec[0].message) == (
        "slime flags that the training config does not read were ignored: --hf-checkpoint, "
        "--num-rollout, --lambd, --not-a-slime-flag, --opsm-delta")
    assert rec[0].filename == __file__  # points at the caller
    assert (cfg.loss.eps_clip, cfg.schedule.distribution, cfg.schedule.global_batch_size) == (
        0.3, "flops_kk", 4)


def test_unknown_flags_behave_as_in_the_schedule_function():
    """A flag slime does not have is ignored and listed by both, never an error."""
    with pytest.warns(UserWarning, match="ignored: --frobnicate$"):
        schedule_config_from_slime_args("--global-batch-size 4 --frobnicate 3")
    with pytest.warns(UserWarning, match="ignored: --frobnicate$"):
        train_config_from_slime_args("--global-batch-size 4 --frobnicate 3", base=BASE)


@pytest.mark.parametrize("cmd,match", [
    ("--advantage-estimator ppo", "--advantage-estimator ppo \\(PPO needs a critic"),
    ("--use-opsm", "--use-opsm \\(off-policy sequence masking\\)"),
    ("--use-opsm --opsm-delta 1e-3", "--use-opsm"),
    ("--use-opd --opd-type sglang", "--use-opd \\(on-policy distillation\\)"),
    ("--keep-old-actor", "--keep-old-actor"),
    ("--use-routing-replay", "--use-routing-replay"),
    ("--use-rollout-routing-replay", "--use-rollout-routing-replay"),
    ("--reset-optimizer-states", "--reset-optimizer-states"),
    ("--use-stateless-adam", "--use-stateless-adam"),
    ("--disable-compute-advantages-and-returns", "--disable-compute-advantages-and-returns"),
    ("--loss-type sft_loss", "--loss-type 'sft_loss'"),
    ("--custom-advantage-function-path m.f", "--custom-advantage-function-path 'm.f'"),
    ("--custom-pg-loss-reducer-function-path m.f", "--custom-pg-loss-reducer-function-path"),
    ("--ref-update-interval 4", "--ref-update-interval 4 \\(reference-model updates"),
    ("--optimizer sgd", "--optimizer 'sgd'"),
    ("--lr-warmup-iters 10", "--lr-warmup-iters 10 .*use --lr-warmup-fraction"),
    ("--lr-warmup-samples 10", "--lr-warmup-samples 10"),
    ("--lr-warmup-init 1e-7", "--lr-warmup-init 1e-07"),
    ("--lr-decay-iters 100", "--lr-decay-iters 100"),
    ("--lr-decay-samples 100", "--lr-decay-samples 100"),
    ("--weight-decay-incr-style linear", "--weight-decay-incr-style 'linear'"),
    ("--start-weight-decay 0.1", "--start-weight-decay 0.1"),
    ("--moe-router-load-balancing-type sinkhorn", "--moe-router-load-balancing-type 'sinkhorn'"),
    ("--moe-router-load-balancing-type global_aux_loss", "global_aux_loss"),
])
def test_flags_the_engine_does_not_implement_are_refused(cmd, match):
    with warnings.catch_warnings(), pytest.raises(
            ValueError, match="slime flags the training engine does not implement: .*" + match):
        warnings.simplefilter("ignore")  # --opsm-delta, --opd-type: read by nothing here
        train_config_from_slime_args(cmd + " --eps-clip 0.2", base=BASE)


def test_every_unsupported_flag_is_tested_and_all_are_named_at_once():
    tested = {"--use-opsm", "--use-opd", "--keep-old-actor", "--use-routing-replay",
              "--use-rollout-routing-replay", "--reset-optimizer-states", "--use-stateless-adam",
              "--disable-compute-advantages-and-returns", "--loss-type",
              "--custom-advantage-function-path", "--custom-pg-loss-reducer-function-path",
              "--ref-update-interval", "--optimizer", "--lr-warmup-iters", "--lr-warmup-samples",
              "--lr-warmup-init", "--lr-decay-iters", "--lr-decay-samples",
              "--weight-decay-incr-style", "--start-weight-decay", "--end-weight-decay",
              "--moe-router-load-balancing-type"}
    assert tested == {u.flag for u in UNSUPPORTED_TRAIN_FLAGS}
    with pytest.raises(ValueError, match="ppo .*; --use-opsm .*; --loss-type 'custom_loss'"):
        train_config_from_slime_args("--use-opsm --advantage-estimator ppo --loss-type "
                                     "custom_loss", base=BASE)


@pytest.mark.parametrize("cmd", ["--loss-type policy_loss", "--optimizer adam",
                                 "--lr-warmup-iters 0", "--lr-warmup-init 0",
                                 "--weight-decay-incr-style constant",
                                 "--moe-router-load-balancing-type aux_loss",
                                 "--moe-router-load-balancing-type seq_aux_loss"])
def test_an_unsupported_flag_at_its_no_op_value_is_read(cmd):
    assert _quiet(cmd) == BASE


def _slime_namespace(**changes):
    """A namespace as slime's parser leaves it: every attribute at slime's default."""
    ns = dict(
        advantage_estimator="grpo", eps_clip=0.2, eps_clip_high=None, eps_clip_c=None,
        use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="k1", use_unbiased_kl=False,
        kl_coef=0.0, entropy_coef=0.0, gamma=1.0, lambd=1.0, normalize_advantages=False,
        rewards_normalization=True, grpo_std_normalization=True, use_tis=False,
        custom_tis_function_path=None, tis_clip=2.0, tis_clip_low=0, use_rollout_logprobs=False,
        reward_key=None, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None,
        moe_router_load_balancing_type="aux_loss", seed=1234, n_samples_per_prompt=1,
        rollout_batch_size=4,
        lr=1e-6, min_lr=0.0, lr_decay_style="linear", lr_warmup_fraction=None,
        weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, clip_grad=1.0,
        calculate_per_token_loss=False, use_opsm=False, opsm_delta=1e-4, use_opd=False,
        keep_old_actor=False, use_routing_replay=False, use_rollout_routing_replay=False,
        reset_optimizer_states=False, use_stateless_adam=False,
        compute_advantages_and_returns=True, loss_type="policy_loss",
        custom_advantage_function_path=None, custom_pg_loss_reducer_function_path=None,
        ref_update_interval=None, optimizer="adam", lr_warmup_iters=0, lr_warmup_samples=0,
        lr_warmup_init=0.0, lr_decay_iters=None, lr_decay_samples=None,
        weight_decay_incr_style="constant", start_weight_decay=0.01, end_weight_decay=0.01,
        global_batch_size=4, micro_batch_size=1, use_dynamic_batch_size=False,
        max_tokens_per_gpu=None, balance_data=False, balance_by_flops=False,
        actor_num_nodes=1, actor_num_gpus_per_node=1, tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1, context_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, hf_checkpoint="/m")
    ns.update(changes)
    return argparse.Namespace(**ns)


def test_a_full_slime_namespace_sets_every_field_it_carries():
    cfg = _quiet(_slime_namespace(eps_clip_high=0.28, use_kl_loss=True, kl_loss_coef=0.01,
                                  custom_tis_function_path=ICEPOP,
                                  calculate_per_token_loss=True))
    # None is the value for eps_clip_c and reward_key (slime's default), not base's 'acc'
    assert cfg.loss == LossConfig(eps_clip_high=0.28, use_kl_loss=True, kl_loss_coef=0.01,
                                  tis_function="icepop", advantage_grouping="slime")
    assert cfg.data == DataConfig(seed=1234, n_samples_per_prompt=1, rollout_batch_size=4)
    # lr_warmup_fraction None = unset: base's value stays
    assert cfg.optim == OptimConfig(lr=1e-6, min_lr=0.0, lr_decay_style="linear",
                                    weight_decay=0.01)
    assert cfg.mode == "per_token"
    assert cfg.schedule == ScheduleConfig(dp=1, global_batch_size=4, micro_batch_size=1)
    assert (cfg.model, cfg.run) == (BASE.model, BASE.run)


def test_a_namespace_reads_like_its_command_line():
    cmd = ("--advantage-estimator cispo --eps-clip 0.3 --use-kl-loss --kl-loss-coef 0.1 "
           "--disable-grpo-std-normalization --seed 3 --lr 1e-4 --min-lr 1e-5")
    ns = SimpleNamespace(advantage_estimator="cispo", eps_clip=0.3, use_kl_loss=True,
                         kl_loss_coef=0.1, grpo_std_normalization=False, seed=3, lr=1e-4,
                         min_lr=1e-5)
    assert _quiet(ns) == _quiet(cmd)
    assert _quiet(SimpleNamespace()) == BASE
    assert _quiet(SimpleNamespace(calculate_per_token_loss=False)).mode == BASE.mode


@pytest.mark.parametrize("changes,match", [
    (dict(use_opsm=True), "--use-opsm"),
    (dict(advantage_estimator="ppo"), "needs a critic"),
    (dict(start_weight_decay=0.1), "--start-weight-decay 0.1"),
    (dict(custom_tis_function_path="a.b"), "only slime's two TIS functions"),
    (dict(use_kl_loss=1), r"--use-kl-loss 1: loss.use_kl_loss=1: give True or False"),
    (dict(calculate_per_token_loss="yes"), "--calculate-per-token-loss"),
])
def test_a_namespace_is_as_strict(changes, match):
    with pytest.raises(ValueError, match=match):
        train_config_from_slime_args(_slime_namespace(**changes), base=BASE)


@pytest.mark.parametrize("bad", [[1, 2], 3, {"eps_clip": 0.3}])
def test_not_a_command_line(bad):
    with pytest.raises(ValueError, match="command-line string, a list of strings or a namespace"):
        train_config_from_slime_args(bad, base=BASE)


def test_base_must_be_a_trainconfig():
    with pytest.raises(ValueError, match="base=.*give a TrainConfig"):
        train_config_from_slime_args("", base=LossConfig())


def _flags_of(cfg: TrainConfig) -> list[str]:
    """slime's command line for the fields of ``cfg`` the table maps (the test's inverse)."""
    out = []
    for m in TRAIN_FLAGS:
        if m.section == "mode":
            out += [m.flag] if cfg.mode == "per_token" else []
            continue
        if m.section == "layout" and m.field == "ep":
            out += [m.flag, str(cfg.ep)]
            continue
        if m.section == "layout":
            out += [m.flag] if getattr(cfg, m.field) else []
            continue
        v = getattr(getattr(cfg, m.section), m.field)
        action = m.kwargs.get("action")
        if action == "store_true":
            out += [m.flag] if v else []
        elif action == "store_false":
            out += [] if v else [m.flag]
        elif m.field == "tis_function":
            out += [m.flag, next(p for p, f in TIS_FUNCTION_PATHS.items() if f == v)]
        elif v is not None:
            out += [m.flag, repr(v) if isinstance(v, float) else str(v)]
    return out


@pytest.mark.parametrize("cfg", [
    TrainConfig(),
    TrainConfig(mode="per_token", loss=LossConfig(
        advantage_estimator="reinforce_plus_plus", eps_clip=0.15, eps_clip_high=0.3,
        eps_clip_c=2.5, use_kl_loss=True, kl_loss_coef=1e-3, kl_loss_type="k3",
        use_unbiased_kl=True, kl_coef=0.02, entropy_coef=1e-4, gamma=0.97,
        normalize_advantages=True, rewards_normalization=False, grpo_std_normalization=False,
        use_tis=True, tis_function="icepop", tis_clip=1.7, tis_clip_low=0.3,
        use_rollout_logprobs=True, reward_key="acc", moe_aux_loss_coeff=1e-3,
        moe_z_loss_coeff=1e-4),
        data=DataConfig(seed=11, n_samples_per_prompt=2, rollout_batch_size=6),
        optim=OptimConfig(lr=1e-6, min_lr=1e-7, lr_decay_style="constant",
                          lr_warmup_fraction=0.05, weight_decay=0.01, adam_beta1=0.85,
                          adam_beta2=0.95, adam_eps=1e-5, clip_grad=0.7, distributed=True)),
], ids=["defaults", "everything_moved"])
def test_round_trip_through_slimes_command_line(cfg):
    """A config written as slime's flags reads back equal, onto a base holding none of it."""
    assert _quiet(_flags_of(cfg), base=TrainConfig()) == cfg


def test_without_the_train_extra_the_extras_message_surfaces():
    code = textwrap.dedent("""\
        import sys

        class _Missing:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "megatron":
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
                return None

        sys.meta_path.insert(0, _Missing())
        from varbatch_kit.compat.slime import train_config_from_slime_args
        try:
            train_config_from_slime_args("--eps-clip 0.2")
        except ImportError as e:
            print(type(e).__name__, "|", e)
        """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == (
        "MissingExtraError | varbatch_kit.train needs the [train] extra: "
        "pip install 'varbatch_kit[train]' (missing: megatron.core)")
