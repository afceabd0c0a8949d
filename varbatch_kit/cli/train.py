"""``varbatch-kit train`` and ``varbatch-kit compare``: train a megatron-core GPT on rollouts.

Examples::

    varbatch-kit train --dp 2 --global-batch-size 8 --max-tokens-per-gpu 256 --rollouts 240
    varbatch-kit train --run.max-steps 20 --checkpoint.save-every 5 --out run1  # killed? then:
    varbatch-kit train --run.max-steps 20 --checkpoint.save-every 5 --resume run1
    varbatch-kit train --dp 4 --nodes.nnodes 2 --nodes.node-rank R \\
        --nodes.rdzv-endpoint node0:29400 --out /shared/r
    varbatch-kit train --model.path DIR --model.num-layers 2 --optim.lr 1e-4
    varbatch-kit train --pp 2 --vpp 2 --mb-group 2 --model.num-layers 4 --tp 2
    varbatch-kit compare --dp 1 2 --cp 1 2 --packing static first_fit \\
        --micro-batch-size 2 --max-tokens-per-gpu 64 --mode per_rollout_mean per_token \\
        --run.max-steps 3 --csv comparison.csv
    varbatch-kit compare --tp 1 2 --pp 1 2 --model.num-layers 4 --run.max-steps 3
    varbatch-kit train --slime-args="--advantage-estimator grpo --eps-clip 0.2 --use-kl-loss"

The training flags are generated from :class:`~varbatch_kit.train.TrainConfig`'s
fields and carry their names, words joined by dashes: ``--GROUP.FIELD`` for a
sub-config's field (``--optim.lr``, ``--run.timeout-s``, ``--model.num-layers``),
``--mode``, ``--tp``, ``--sequence-parallel`` (``--no-sequence-parallel``), ``--cp-impl``,
``--precision``; the layout flags are
ScheduleConfig's fields (``--dp``, ``--cp``, ``--pp``, ``--vpp``, ``--mb-group``,
``--global-batch-size``). Both commands take the same options; ``compare`` accepts
several values for ``--dp``, ``--cp``, ``--pp``, ``--vpp``, ``--mb-group``, ``--tp``,
``--cp-impl``, ``--cp-mode``, ``--packing``, ``--distribution`` and ``--mode`` and runs
every combination on the same rollouts and seed (static packings use
``--micro-batch-size``, token-capped ones ``--max-tokens-per-gpu``). The
rollouts come from ``--trace`` (a file or a bundled trace name) or from the
seeded synthetic generator. Context parallelism runs all-gather style by default
(each CP rank computes its zigzag share, K/V all-gathered) on CPU and GPU alike;
``--cp-impl emulated`` is the reference (every CP rank runs the full forward and keeps
its slice). A bad option is a
``ValueError``: message on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from typing import Any

__all__ = ["add_parser", "configs_from_args", "rollouts_from_args"]

#: TrainConfig's generated flags that ``compare`` takes several values of
MANY_CONFIG_FLAGS = ("mode", "tp", "ep", "cp_impl")

RUN_COLUMNS = ["step", "rollouts", "samples", "tokens", "num_microbatches", "loss", "nll",
               "token_acc", "grad_norm", "lr", "step_time_s"]
COMPARE_COLUMNS = ["config", "label", "step", "samples", "num_microbatches", "loss",
                   "grad_norm", "loss_rel_diff", "grad_norm_rel_diff", "param_rel_diff"]


def _common(p: argparse.ArgumentParser, many: bool) -> None:
    from varbatch_kit.train.config.cli_flags import add_config_flags
    from varbatch_kit.train.config.train_config import DEFAULT_MAX_TOKENS_PER_GPU

    nargs = "+" if many else None
    several = " (several values: every combination)" if many else ""
    d = p.add_argument_group("rollouts (a trace, or the synthetic generator)")
    d.add_argument("--trace", default=None, help="trace file (.jsonl/.parquet/slime .pt) or "
                   "bundled trace name")
    d.add_argument("--rollouts", type=int, default=240, help="synthetic rollouts (default 240)")
    d.add_argument("--samples-per-rollout", type=int, nargs=2, default=(1, 2),
                   metavar=("LO", "HI"), help="samples per rollout, inclusive (default 1 2)")
    d.add_argument("--prompt-len", type=int, nargs=2, default=(4, 8), metavar=("LO", "HI"),
                   help="prompt length range (default 4 8)")
    d.add_argument("--response-len", type=float, default=12.0,
                   help="median response length (default 12)")
    d.add_argument("--response-sigma", type=float, default=0.5,
                   help="log-normal shape of response lengths (default 0.5)")
    d.add_argument("--max-response-len", type=int, default=24,
                   help="response truncation length (default 24)")
    d.add_argument("--data-seed", type=int, default=0, help="synthetic generator seed")

    s = p.add_argument_group("layout and scheduling")
    s.add_argument("--dp", type=int, nargs=nargs, default=[1] if many else 1,
                   help="data-parallel size" + several)
    s.add_argument("--cp", type=int, nargs=nargs, default=[1] if many else 1,
                   help="context-parallel size (all-gather CP unless --cp-impl emulated)" + several)
    s.add_argument("--pp", type=int, nargs=nargs, default=[1] if many else 1,
                   help="pipeline-parallel stages (megatron's 1F1B schedule; the model's layers "
                        "must split evenly over pp * vpp chunks)" + several)
    s.add_argument("--vpp", type=int, nargs=nargs, default=[1] if many else 1,
                   help="virtual pipeline chunks per stage (interleaved schedule, needs "
                        "--pp >= 2)" + several)
    s.add_argument("--mb-group", type=int, nargs=nargs, default=[1] if many else 1,
                   help="micro-batches per virtual stage group of the interleaved schedule "
                        "(>= pp when vpp > 1)" + several)
    s.add_argument("--global-batch-size", type=int, default=8, help="rollouts per step")
    s.add_argument("--micro-batch-size", type=int, default=None,
                   help="samples per micro-batch (static packing)")
    s.add_argument("--max-tokens-per-gpu", type=int, default=None,
                   help="token cap per GPU (token-capped packings; default "
                   f"{DEFAULT_MAX_TOKENS_PER_GPU} when neither size is given)")
    s.add_argument("--packing", nargs=nargs, default=None,
                   help="packing policy (default: from the size given)" + several)
    s.add_argument("--distribution", nargs=nargs, default=None,
                   help="distribution policy (default: ScheduleConfig's, strided)" + several)
    s.add_argument("--cp-mode", nargs=nargs, default=["fixed"] if many else "fixed",
                   choices=["fixed", "dynamic"],
                   help="fixed: every micro-batch over all cp ranks of its replica; dynamic: a "
                        "CP degree and group per micro-batch (needs --cp >= 2 and "
                        "--max-tokens-per-gpu)" + several)

    add_config_flags(p, many=MANY_CONFIG_FLAGS if many else ())
    p.add_argument("--slime-args", default=None, metavar="FLAGS",
                   help="slime's own command line (quoted: --slime-args=\"--advantage-estimator "
                        "grpo --eps-clip 0.2 --use-kl-loss ...\"), applied last to every "
                        "configuration through compat.slime.train_config_from_slime_args: the "
                        "loss, data, optimiser and layout fields it names replace this "
                        "command's; a flag the engine does not implement is an error")

    r = p.add_argument_group("output")
    r.add_argument("--out", default=None, help="output folder (default: a new temp folder)")
    r.add_argument("--csv", default=None, help="also write the full table to this CSV file")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    if not many:
        r.add_argument("--resume", default=None, metavar="DIR",
                       help="continue the run in DIR (an earlier --out) from its newest "
                            "checkpoint; without one it starts from scratch")


def add_parser(subparsers: Any) -> None:
    """Add ``train`` and ``compare`` to the dispatcher's subparsers."""
    fmt = argparse.RawDescriptionHelpFormatter
    t = subparsers.add_parser("train", help="train a megatron-core GPT on rollouts",
                              description=__doc__.split("\n\n")[0], formatter_class=fmt)
    _common(t, many=False)
    t.set_defaults(func=_train)
    c = subparsers.add_parser("compare", help="train several layouts/modes, compare reports",
                              description=__doc__.split("\n\n")[0], formatter_class=fmt)
    _common(c, many=True)
    c.set_defaults(func=_compare)


def rollouts_from_args(args: argparse.Namespace):
    from varbatch_kit.core.rollouts import Rollouts
    from varbatch_kit.core.traces import bundled_traces, read_trace

    if args.trace:
        named = bundled_traces()
        return read_trace(named.get(args.trace, args.trace))
    return Rollouts.synthetic(
        args.rollouts, samples_per_rollout=tuple(args.samples_per_rollout),
        prompt_len=tuple(args.prompt_len), response_len=args.response_len,
        response_sigma=args.response_sigma, max_response_len=args.max_response_len,
        seed=args.data_seed)


def _as_list(v):
    return list(v) if isinstance(v, (list, tuple)) else [v]


def configs_from_args(args: argparse.Namespace):
    """Every combination of the (possibly multi-valued) layout and mode options; the other
    training flags (generated from TrainConfig's fields, :mod:`varbatch_kit.train.config.cli_flags`)
    fill its sub-configs."""
    from varbatch_kit.core.config import ScheduleConfig
    from varbatch_kit.train.config.cli_flags import config_kwargs
    from varbatch_kit.train.config.train_config import TrainConfig

    packings = _as_list(args.packing) if args.packing else [None]
    layouts = itertools.product(
        _as_list(args.dp), _as_list(args.cp), _as_list(args.pp), _as_list(args.vpp),
        _as_list(args.mb_group), _as_list(args.cp_mode), packings,
        _as_list(args.distribution) if args.distribution else [None])
    chosen = list(itertools.product(*(_as_list(getattr(args, d)) for d in MANY_CONFIG_FLAGS)))
    configs = []
    for (dp, cp, pp, vpp, mb_group, cp_mode, packing, dist), picked in itertools.product(
            layouts, chosen):
        sizes = _batching(args.micro_batch_size, args.max_tokens_per_gpu, packing)
        if dist is not None:
            sizes["distribution"] = dist
        schedule = ScheduleConfig(dp=dp, cp=cp, pp=pp, vpp=vpp, mb_group=mb_group,
                                  cp_mode=cp_mode, global_batch_size=args.global_batch_size,
                                  packing=packing, **sizes)
        config = TrainConfig(schedule=schedule, **config_kwargs(
            args, chosen=dict(zip(MANY_CONFIG_FLAGS, picked, strict=True))))
        if args.slime_args is not None:
            from varbatch_kit.compat.slime.train_flags import train_config_from_slime_args

            config = train_config_from_slime_args(args.slime_args, base=config)
        configs.append(config)
    return configs


#: how core.config's batching errors name the settings here: this command's flags
FLAG_WORDS = {"micro_batch_size": "--micro-batch-size",
              "max_tokens_per_gpu": "--max-tokens-per-gpu", "packing": "--packing",
              "let_packing_pick": "give --packing too"}


def _batching(mbs: int | None, mtpg: int | None, packing: str | None) -> dict:
    """The two size fields for ``packing``: :func:`varbatch_kit.core.config.batching_fields`
    decides; a token-capped path with neither size given gets
    :data:`~varbatch_kit.train.config.train_config.DEFAULT_MAX_TOKENS_PER_GPU`. Its errors
    name this command's flags."""
    from varbatch_kit.core.config import batching_fields, packing_batching
    from varbatch_kit.train.config.train_config import DEFAULT_MAX_TOKENS_PER_GPU

    if mbs is None and mtpg is None and (packing is None
                                         or packing_batching(packing) == "dynamic"):
        mtpg = DEFAULT_MAX_TOKENS_PER_GPU
    return batching_fields(micro_batch_size=mbs, max_tokens_per_gpu=mtpg, packing=packing,
                           words=FLAG_WORDS)


def _print(table, columns) -> None:
    import pandas as pd

    cols = [c for c in columns if c in table.columns]
    with pd.option_context("display.width", 200, "display.max_rows", 500,
                           "display.max_columns", 50):
        print(table[cols].to_string(index=False))


def _train(args: argparse.Namespace) -> int:
    from varbatch_kit.train import TrainingError, run

    (config,) = configs_from_args(args)
    rollouts = rollouts_from_args(args)
    if args.resume and args.out and args.out != args.resume:
        raise ValueError(f"--resume {args.resume} continues the run in that folder; drop "
                         f"--out {args.out} (or give the same folder)")
    try:
        result = run(config, rollouts, out_dir=args.resume or args.out,
                     progress=not args.quiet, resume=bool(args.resume))
    except TrainingError as e:
        print(f"varbatch-kit train: training failed: {e}", file=sys.stderr)
        return 1
    _print(result.steps, RUN_COLUMNS)
    if args.csv:
        result.steps.to_csv(args.csv, index=False)
    note = (" (emulated CP: every CP rank ran the full forward)"
            if config.cp > 1 and config.cp_impl == "emulated" else "")
    print(f"# {config.name}{note}; reports in {result.jsonl_path}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from varbatch_kit.train import TrainingError, compare

    configs = configs_from_args(args)
    rollouts = rollouts_from_args(args)
    try:
        table = compare(configs, rollouts, out_dir=args.out, progress=not args.quiet)
    except TrainingError as e:
        print(f"varbatch-kit compare: training failed: {e}", file=sys.stderr)
        return 1
    _print(table, COMPARE_COLUMNS)
    if args.csv:
        table.to_csv(args.csv, index=False)
    if any(c.cp > 1 and c.cp_impl == "emulated" for c in configs):
        print("# cp_impl=emulated: every CP rank ran the full forward and kept its slice")
    return 0
