"""slime flags map onto ScheduleConfig: strings, lists and namespaces, parsed strictly."""

import shlex
import warnings
from types import SimpleNamespace

import pytest

from varbatch_kit.compat.slime.flags import schedule_config_from_slime_args


@pytest.mark.parametrize("cmd,expected", [
    ("--global-batch-size 64 --micro-batch-size 2 --actor-num-gpus-per-node 8",
     dict(dp=8, global_batch_size=64, micro_batch_size=2, packing="static",
          distribution="strided")),
    ("--global-batch-size 64 --balance-data --actor-num-nodes 2 --actor-num-gpus-per-node 8 "
     "--tensor-model-parallel-size 2",
     dict(dp=8, packing="static", distribution="flops_kk", micro_batch_size=1)),
    ("--global-batch-size 32 --use-dynamic-batch-size --max-tokens-per-gpu 16384 "
     "--context-parallel-size 2 --actor-num-gpus-per-node 8",
     dict(dp=4, cp=2, max_tokens_per_gpu=16384, packing="first_fit", distribution="strided")),
    ("--global-batch-size 32 --use-dynamic-batch-size --max-tokens-per-gpu 8192 "
     "--balance-by-flops --dp-size 16 --rollout-batch-size 9 --lr 1e-6",
     dict(dp=16, packing="flops_kk", distribution="flops_kk")),
    ("--global-batch-size 32 --micro-batch-size 1 --actor-num-gpus-per-node 8 "
     "--pipeline-model-parallel-size 2 --virtual-pipeline-model-parallel-size 2",
     dict(dp=4, vpp=2, mb_group=2)),
])
def test_from_slime_cmdline(cmd, expected):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # --rollout-batch-size, --lr: ignored, warned below
        c = schedule_config_from_slime_args(cmd)
        as_list = schedule_config_from_slime_args(shlex.split(cmd))
    for k, v in expected.items():
        assert getattr(c, k) == v, k
    assert as_list == c


def test_from_slime_namespace_and_dp_override():
    ns = SimpleNamespace(global_batch_size=16, micro_batch_size=None, use_dynamic_batch_size=True,
                         max_tokens_per_gpu=2048, balance_data=True, balance_by_flops=False)
    c = schedule_config_from_slime_args(ns, dp=4)
    assert (c.dp, c.packing, c.distribution, c.cap) == (4, "first_fit", "flops_kk", 2048)


@pytest.mark.parametrize("cmd,match", [
    ("--micro-batch-size 1", "lack --global-batch-size"),
    ("--global-batch-size 4 --use-dynamic-batch-size", "needs --max-tokens-per-gpu"),
    ("--global-batch-size 4 --balance-by-flops", "requires --use-dynamic-batch-size"),
    ("--global-batch-size 4 --actor-num-gpus-per-node 6 --tensor-model-parallel-size 4",
     "not divisible by tp\\*pp\\*cp = 4"),
])
def test_from_slime_errors(cmd, match):
    with pytest.raises(ValueError, match=match):
        schedule_config_from_slime_args(cmd)


def test_bad_value_is_a_value_error_naming_the_flag(capsys):
    with pytest.raises(ValueError, match="--global-batch-size.*'abc'"):
        schedule_config_from_slime_args("--global-batch-size abc")
    with pytest.raises(ValueError, match="--max-tokens-per-gpu.*positive"):
        schedule_config_from_slime_args(["--global-batch-size", "4", "--max-tokens-per-gpu", "0"])
    assert capsys.readouterr().err == ""  # no argparse usage printed


def test_abbreviations_are_refused():
    with pytest.raises(ValueError, match="abbreviations.*--balance-data"):
        schedule_config_from_slime_args("--global-batch-size 4 --balance-dat")


def test_ignored_flags_are_listed_in_one_warning():
    with pytest.warns(UserWarning, match="ignored: --lr, --frobnicate$") as rec:
        c = schedule_config_from_slime_args(
            "--global-batch-size 4 --lr 1e-6 --frobnicate 8 --balance-data")
    assert len(rec) == 1
    assert c.distribution == "flops_kk"


def test_list_argv_reads_every_flag():
    c = schedule_config_from_slime_args(
        ["--global-batch-size", "8", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "512"])
    assert (c.global_batch_size, c.cap, c.packing) == (8, 512, "first_fit")


def test_not_a_command_line():
    with pytest.raises(ValueError, match="command-line string, a list of strings"):
        schedule_config_from_slime_args([1, 2])


# slime (utils/arguments.py): global_batch_size = rollout_batch_size * n_samples_per_prompt
# // num_steps_per_rollout; the product is the rollouts one rollout step generates
@pytest.mark.parametrize("cmd,gbs", [
    ("--rollout-batch-size 32 --n-samples-per-prompt 8 --num-steps-per-rollout 4", 64),
    ("--rollout-batch-size 64 --n-samples-per-prompt 4 --num-steps-per-rollout 1", 256),
    ("--rollout-batch-size 10 --n-samples-per-prompt 3 --num-steps-per-rollout 4", 7),  # floor
    ("--rollout-batch-size 16 --num-steps-per-rollout 2", 8),  # n_samples_per_prompt: 1
    ("--rollout-batch-size 32 --n-samples-per-prompt 8 --num-steps-per-rollout 4 "
     "--global-batch-size 64", 64),  # given and equal
    ("--global-batch-size 12 --rollout-batch-size 32 --n-samples-per-prompt 8", 12),
])
def test_global_batch_size_derived_as_slime_does(cmd, gbs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rollout flags are read, not "ignored"
        c = schedule_config_from_slime_args(cmd + " --actor-num-gpus-per-node 4")
    assert c.global_batch_size == gbs


@pytest.mark.parametrize("cmd,match", [
    ("--num-steps-per-rollout 2", "needs --rollout-batch-size"),
    ("--rollout-batch-size 32 --n-samples-per-prompt 8 --num-steps-per-rollout 4 "
     "--global-batch-size 32", "--global-batch-size 32 is not .* = 64"),
    ("--rollout-batch-size 1 --num-steps-per-rollout 2", "= 0: a step needs at least one"),
    ("--rollout-batch-size 8 --n-samples-per-prompt 4", "lack --global-batch-size"),
])
def test_global_batch_size_derivation_errors(cmd, match):
    with pytest.raises(ValueError, match=match):
        schedule_config_from_slime_args(cmd)


def test_a_misspelled_flag_gets_a_suggestion_and_slimes_other_flags_none():
    """A typo of a flag the schedule reads is named with the flag it resembles; slime's own
    flags that only look alike (--expert-model-parallel-size, 0.86 alike) are not."""
    with pytest.warns(UserWarning) as got:
        schedule_config_from_slime_args(
            "--global-batch-size 4 --balanse-data --use-dynamic-batch-size "
            "--max-token-per-gpu 64 --max-tokens-per-gpu 64 --expert-model-parallel-size 2")
    (w,) = got
    text = str(w.message)
    assert "--balanse-data (did you mean --balance-data?)" in text
    assert "--max-token-per-gpu (did you mean --max-tokens-per-gpu?)" in text
    assert text.endswith(", --expert-model-parallel-size")
    assert text.count("did you mean") == 2
