"""``varbatch-kit train`` and ``varbatch-kit compare``: train a megatron-core GPT on rollouts.

Examples::

    varbatch-kit train --dp 2 --global-batch-size 8 --max-tokens-per-gpu 256 --rollouts 240
    varbatch-kit train --steps 20 --save-every 5 --out run1     # killed? continue it:
    varbatch-kit train --steps 20 --save-every 5 --resume run1
    varbatch-kit train --dp 4 --nnodes 2 --node-rank R --rdzv-endpoint node0:29400 --out /shared/r
    varbatch-kit compare --dp 1 2 --cp 1 2 --packing static first_fit \\
        --micro-batch-size 2 --max-tokens-per-gpu 64 --mode per_rollout_mean per_token \\
        --steps 3 --csv comparison.csv

Both commands take the same options; ``compare`` accepts several values for
``--dp``, ``--cp``, ``--cp-mode``, ``--packing``, ``--distribution`` and ``--mode`` and runs
every combination on the same rollouts and seed (static packings use
``--micro-batch-size``, token-capped ones ``--max-tokens-per-gpu``). The
rollouts come from ``--trace`` (a file or a bundled trace name) or from the
seeded synthetic generator. On CPU, context parallelism is emulated at the
loss level (every CP rank runs the full forward). A bad option is a
``ValueError``: message on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from typing import Any

__all__ = ["add_parser", "configs_from_args", "rollouts_from_args"]

RUN_COLUMNS = ["step", "rollouts", "samples", "tokens", "num_microbatches", "loss", "nll",
               "token_acc", "grad_norm", "lr", "step_time_s"]
COMPARE_COLUMNS = ["config", "label", "step", "samples", "num_microbatches", "loss",
                   "grad_norm", "loss_rel_diff", "grad_norm_rel_diff", "param_rel_diff"]


def _common(p: argparse.ArgumentParser, many: bool) -> None:
    from varbatch_kit.train.config import TrainConfig

    D = TrainConfig()
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
                   help="context-parallel size, emulated on CPU" + several)
    s.add_argument("--global-batch-size", type=int, default=8, help="rollouts per step")
    s.add_argument("--micro-batch-size", type=int, default=None,
                   help="samples per micro-batch (static packing)")
    s.add_argument("--max-tokens-per-gpu", type=int, default=None,
                   help="token cap per GPU (token-capped packings; default 256 when neither "
                   "size is given)")
    s.add_argument("--packing", nargs=nargs, default=None,
                   help="packing policy (default: from the size given)" + several)
    s.add_argument("--distribution", nargs=nargs, default=None,
                   help="distribution policy (default: ScheduleConfig's, strided)" + several)
    s.add_argument("--cp-mode", nargs=nargs, default=["fixed"] if many else "fixed",
                   choices=["fixed", "dynamic"],
                   help="fixed: every micro-batch over all cp ranks of its replica; dynamic: a "
                        "CP degree and group per micro-batch (needs --cp >= 2 and "
                        "--max-tokens-per-gpu)" + several)

    m = p.add_argument_group("model and optimisation (defaults: TrainConfig's)")
    m.add_argument("--model", default=None, metavar="DIR",
                   help="a Hugging Face checkpoint directory (Llama/Qwen2/Qwen3/Mistral; "
                        "--layers N keeps its first N layers); default: the tiny toy GPT")
    m.add_argument("--mode", nargs=nargs, default=[D.mode] if many else D.mode,
                   help=f"loss/report mode (default {D.mode})" + several)
    m.add_argument("--layers", type=int, default=None,
                   help=f"layers (toy GPT: {D.num_layers}; --model: all of the checkpoint's)")
    m.add_argument("--hidden", type=int, default=None, help=f"toy GPT only ({D.hidden_size})")
    m.add_argument("--heads", type=int, default=None,
                   help=f"toy GPT only ({D.num_attention_heads})")
    m.add_argument("--ffn", type=int, default=None,
                   help="toy GPT only: FFN width (default 4*hidden)")
    m.add_argument("--vocab", type=int, default=None, help=f"toy GPT only ({D.vocab_size})")
    m.add_argument("--lr", type=float, default=D.lr)
    m.add_argument("--min-lr", type=float, default=D.min_lr)
    m.add_argument("--lr-decay-style", default=D.lr_decay_style,
                   choices=["constant", "linear", "cosine"])
    m.add_argument("--lr-warmup-fraction", type=float, default=D.lr_warmup_fraction)
    m.add_argument("--lr-increment", default=D.lr_increment,
                   choices=["auto", "rollouts", "samples"])
    m.add_argument("--clip-grad", type=float, default=D.clip_grad)
    m.add_argument("--weight-decay", type=float, default=D.weight_decay)
    m.add_argument("--seed", type=int, default=D.seed, help="model init and toy-task seed")
    m.add_argument("--n-samples-per-prompt", type=int, default=D.n_samples_per_prompt,
                   help="GRPO group size (rollouts)")

    r = p.add_argument_group("run")
    r.add_argument("--steps", type=int, default=None, help="train at most this many steps")
    r.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    r.add_argument("--timeout", type=float, default=D.timeout_s,
                   help="seconds per configuration")
    r.add_argument("--save-params-at", type=int, nargs="*", default=[],
                   help="save parameters after these steps (1-based)")
    r.add_argument("--out", default=None, help="output folder (default: a new temp folder)")
    r.add_argument("--csv", default=None, help="also write the full table to this CSV file")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.add_argument("--step-timeout", type=float, default=None,
                   help="seconds a step may take after the previous report (default: none)")

    k = p.add_argument_group("checkpoints and several nodes (docs/checkpoints.md)")
    k.add_argument("--save-every", type=int, default=D.save_every,
                   help="checkpoint after every N-th step (default 0: off)")
    k.add_argument("--keep-last", type=int, default=D.keep_last,
                   help=f"complete checkpoints kept (default {D.keep_last})")
    if not many:
        k.add_argument("--resume", default=None, metavar="DIR",
                       help="continue the run in DIR (an earlier --out) from its newest "
                            "checkpoint; without one it starts from scratch")
    k.add_argument("--nnodes", type=int, default=D.nnodes,
                   help="nodes of the job (torchrun's c10d rendezvous; default 1)")
    k.add_argument("--node-rank", type=int, default=D.node_rank,
                   help="this node (0 hosts the rendezvous; default 0)")
    k.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="node 0's address for the rendezvous (needed with --nnodes > 1)")
    k.add_argument("--rdzv-timeout", type=float, default=D.rdzv_timeout_s,
                   help=f"seconds to wait for every node to join (default {D.rdzv_timeout_s:g})")


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
    """Every combination of the (possibly multi-valued) layout and mode options."""
    from varbatch_kit.core.config import ScheduleConfig
    from varbatch_kit.policies.registry import get_packer
    from varbatch_kit.train.config import TrainConfig

    mbs, mtpg = args.micro_batch_size, args.max_tokens_per_gpu
    packings = _as_list(args.packing) if args.packing else [None]
    if mbs is None and mtpg is None:
        needs_static = any(p is not None and not get_packer(p).dynamic for p in packings)
        if needs_static:
            raise ValueError("a static packing needs --micro-batch-size")
        mtpg = 256
    configs = []
    for dp, cp, cp_mode, packing, dist, mode in itertools.product(
            _as_list(args.dp), _as_list(args.cp), _as_list(args.cp_mode), packings,
            _as_list(args.distribution) if args.distribution else [None], _as_list(args.mode)):
        if packing is None:
            if mbs is not None and mtpg is not None:
                raise ValueError("both --micro-batch-size and --max-tokens-per-gpu given: "
                                 "name the --packing (static or a token-capped one)")
            dynamic = mtpg is not None
        else:
            dynamic = get_packer(packing).dynamic
        if dynamic and mtpg is None:
            raise ValueError(f"packing {packing!r} is token-capped: give --max-tokens-per-gpu")
        if not dynamic and mbs is None:
            raise ValueError(f"packing {packing!r} is static: give --micro-batch-size")
        sizes = {"max_tokens_per_gpu": mtpg} if dynamic else {"micro_batch_size": mbs}
        if dist is not None:
            sizes["distribution"] = dist
        schedule = ScheduleConfig(dp=dp, cp=cp, cp_mode=cp_mode,
                                  global_batch_size=args.global_batch_size, packing=packing,
                                  **sizes)
        configs.append(TrainConfig(
            schedule=schedule, mode=mode, model=args.model, num_layers=args.layers,
            hidden_size=args.hidden,
            num_attention_heads=args.heads, ffn_hidden_size=args.ffn, vocab_size=args.vocab,
            lr=args.lr, min_lr=args.min_lr, lr_decay_style=args.lr_decay_style,
            lr_warmup_fraction=args.lr_warmup_fraction, lr_increment=args.lr_increment,
            clip_grad=args.clip_grad, weight_decay=args.weight_decay, seed=args.seed,
            n_samples_per_prompt=args.n_samples_per_prompt, max_steps=args.steps,
            device=args.device, timeout_s=args.timeout,
            save_params_at=tuple(args.save_params_at), save_every=args.save_every,
            keep_last=args.keep_last, nnodes=args.nnodes, node_rank=args.node_rank,
            rdzv_endpoint=args.rdzv_endpoint, rdzv_timeout_s=args.rdzv_timeout,
            step_timeout_s=args.step_timeout))
    return configs


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
    note = " (CP emulated at the loss level)" if config.cp > 1 else ""
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
    if any(c.cp > 1 for c in configs):
        print("# cp > 1 is emulated at the loss level (full forward on every CP rank)")
    return 0
