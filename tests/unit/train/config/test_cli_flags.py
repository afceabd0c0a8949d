"""The train CLI's flags (train/config/cli_flags.py and cli/train.py)."""

from __future__ import annotations

import argparse

import pytest


def test_cli_builds_every_combination():
    from varbatch_kit.cli import train as cli

    p = argparse.ArgumentParser()
    cli.add_parser(p.add_subparsers())
    a = p.parse_args(["compare", "--dp", "1", "2", "--cp", "1", "2", "--packing", "static",
                      "first_fit", "--micro-batch-size", "2", "--max-tokens-per-gpu", "64",
                      "--mode", "per_rollout_mean", "per_token", "--run.max-steps", "3"])
    configs = cli.configs_from_args(a)
    assert len(configs) == 16
    assert {(c.dp, c.cp, c.schedule.packing, c.mode) for c in configs} == {
        (dp, cp, pk, m) for dp in (1, 2) for cp in (1, 2) for pk in ("static", "first_fit")
        for m in ("per_rollout_mean", "per_token")}
    static = [c for c in configs if c.schedule.packing == "static"]
    assert all(c.schedule.micro_batch_size == 2 and c.run.max_steps == 3 for c in static)
    a = p.parse_args(["train", "--packing", "static"])
    with pytest.raises(ValueError, match="micro-batch-size"):
        cli.configs_from_args(a)
    a = p.parse_args(["train", "--dp", "2", "--rollouts", "16"])
    (c,) = cli.configs_from_args(a)
    assert c.dp == 2 and c.schedule.max_tokens_per_gpu == 256
    assert len(cli.rollouts_from_args(a).rollout_order()[0]) == 16
    a = p.parse_args(["compare", "--dp", "2", "--cp", "2", "--cp-mode", "fixed", "dynamic",
                      "--max-tokens-per-gpu", "64"])
    assert [c.schedule.cp_mode for c in cli.configs_from_args(a)] == ["fixed", "dynamic"]
    a = p.parse_args(["train", "--cp-mode", "dynamic"])  # cp=1: nothing to choose
    with pytest.raises(ValueError, match="cp >= 2"):
        cli.configs_from_args(a)


def test_cli_batching_is_core_configs_decision_in_flag_words():
    """``core.config.batching_fields`` decides the path; the errors name the CLI's flags."""
    from varbatch_kit.cli import train as cli

    p = argparse.ArgumentParser()
    cli.add_parser(p.add_subparsers())

    def schedule(*argv):
        (c,) = cli.configs_from_args(p.parse_args(["train", *argv]))
        return c.schedule.micro_batch_size, c.schedule.max_tokens_per_gpu, c.schedule.packing

    assert schedule() == (None, 256, "first_fit")
    assert schedule("--packing", "ffd") == (None, 256, "ffd")
    assert schedule("--micro-batch-size", "2") == (2, None, "static")
    assert schedule("--max-tokens-per-gpu", "64") == (None, 64, "first_fit")
    both = ("--micro-batch-size", "2", "--max-tokens-per-gpu", "64")
    assert schedule(*both, "--packing", "static") == (2, None, "static")
    assert schedule(*both, "--packing", "first_fit") == (None, 64, "first_fit")
    for argv, msg in [
        (["--packing", "static"],
         r"^--packing='static' needs --micro-batch-size \(static batching\)$"),
        (["--packing", "first_fit", "--micro-batch-size", "2"],
         r"^--packing='first_fit' packs under a token cap: set --max-tokens-per-gpu \(dynamic "
         r"batching\) instead of --micro-batch-size, or use --packing='static'$"),
        (list(both), r"^set exactly one of --micro-batch-size \(static batching\) and "
                     r"--max-tokens-per-gpu \(dynamic batching\); got --micro-batch-size=2, "
                     r"--max-tokens-per-gpu=64; to let a packing pick, give --packing too$"),
    ]:
        with pytest.raises(ValueError, match=msg):
            schedule(*argv)


def _parser():
    from varbatch_kit.cli import train as cli

    p = argparse.ArgumentParser()
    cli.add_parser(p.add_subparsers())
    return p, cli


def test_every_layout_has_flags_and_compare_takes_lists_of_them():
    p, cli = _parser()
    (c,) = cli.configs_from_args(p.parse_args(
        ["train", "--pp", "2", "--vpp", "2", "--mb-group", "2", "--tp", "2",
         "--cp-impl", "emulated", "--model.num-layers", "4"]))
    assert (c.schedule.pp, c.schedule.vpp, c.schedule.mb_group, c.tp, c.cp_impl) == (
        2, 2, 2, 2, "emulated")
    assert c.model.num_layers == 4
    configs = cli.configs_from_args(p.parse_args(
        ["compare", "--tp", "1", "2", "--pp", "1", "2", "--dp", "1", "2",
         "--cp-impl", "allgather", "emulated", "--mode", "per_token", "per_rollout_mean"]))
    assert len(configs) == 32
    assert {(c.tp, c.schedule.pp, c.dp, c.cp_impl, c.mode) for c in configs} == {
        (tp, pp, dp, impl, m) for tp in (1, 2) for pp in (1, 2) for dp in (1, 2)
        for impl in ("allgather", "emulated") for m in ("per_token", "per_rollout_mean")}
    vpps = cli.configs_from_args(p.parse_args(
        ["compare", "--pp", "2", "--vpp", "1", "2", "--mb-group", "2", "3",
         "--model.num-layers", "4"]))
    assert [(c.schedule.vpp, c.schedule.mb_group) for c in vpps] == [(1, 2), (1, 3), (2, 2),
                                                                        (2, 3)]


def test_one_flag_spelling_words_joined_by_dashes():
    from varbatch_kit.train.config.cli_flags import flag_fields

    p, _ = _parser()
    flags = [a for action in p._subparsers._group_actions[0].choices["compare"]._actions
             for a in action.option_strings]
    assert "--cp-impl" in flags and "--run.max-steps" in flags and "--mb-group" in flags
    assert [f for f in flags if "_" in f] == []
    assert all("_" not in flag for _, flag, _, _ in flag_fields())
    with pytest.raises(SystemExit):  # the underscore spelling is gone, not an alias
        p.parse_args(["train", "--cp_impl", "emulated"])


def test_slime_args_set_what_they_name_on_every_configuration():
    p, cli = _parser()
    slime = ("--advantage-estimator reinforce_plus_plus --eps-clip 0.1 --eps-clip-high 0.3 "
             "--use-kl-loss --kl-loss-coef 0.02 --lr 2e-5 --min-lr 1e-6")
    configs = cli.configs_from_args(p.parse_args(
        ["compare", "--dp", "1", "2", "--optim.lr", "1e-3", "--slime-args", slime]))
    assert [c.dp for c in configs] == [1, 2]
    for c in configs:
        assert c.loss.advantage_estimator == "reinforce_plus_plus"
        assert (c.loss.eps_clip, c.loss.eps_clip_high) == (0.1, 0.3)
        assert c.loss.use_kl_loss and c.loss.kl_loss_coef == 0.02
        assert c.optim.lr == 2e-5  # slime's flag, applied last
    (plain,) = cli.configs_from_args(p.parse_args(["train", "--optim.lr", "1e-3"]))
    assert plain.optim.lr == 1e-3 and plain.loss.advantage_estimator != "reinforce_plus_plus"
    with pytest.raises(ValueError, match="use-opsm"):
        cli.configs_from_args(p.parse_args(["train", "--slime-args=--use-opsm"]))
