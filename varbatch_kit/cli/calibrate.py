"""``varbatch-kit calibrate``: time synthetic micro-batches on this device, write the cost model.

Examples::

    varbatch-kit calibrate --out cost_model.json
    varbatch-kit calibrate --model.num-layers 2 --model.hidden-size 128 \\
        --model.num-attention-heads 4 --max-tokens 4096 --repeats 3 \\
        --out build/cost_model.json --csv build/calibration.csv

Builds the training engine's model (the toy GPT, or ``--model.path DIR``; the
``--model.*`` flags are generated from :class:`~varbatch_kit.train.ModelConfig`) with
per-sample packed attention, times forward and backward of micro-batches
that vary ``sum L`` and ``sum L^2`` independently, fits
``t = c0 + c1 sum L + c2 sum L^2`` and reports R² on held-out random
micro-batches (:mod:`varbatch_kit.train.measure.calibration`). The JSON loads with
``MicroBatchCostModel.load`` and goes to ``simulate(schedule, hardware=model)``.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_parser"]


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("calibrate", help="fit the micro-batch cost model on this device",
                              description=__doc__.splitlines()[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    from varbatch_kit.train.config.cli_flags import add_config_flags

    add_config_flags(p, groups=("model",))  # --model.path, --model.num-layers, ...
    s = p.add_argument_group("sweep")
    s.add_argument("--max-tokens", type=int, default=2048,
                   help="largest micro-batch in tokens (default 2048)")
    s.add_argument("--budgets", type=int, default=4,
                   help="token budgets of the grid, geometric up to --max-tokens (default 4)")
    s.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="samples per micro-batch of the grid (default 1 2 4 8)")
    s.add_argument("--min-len", type=int, default=16, help="shortest sample (default 16)")
    s.add_argument("--heldout", type=int, default=8,
                   help="random held-out micro-batches judged by R2 (default 8)")
    s.add_argument("--repeats", type=int, default=3, help="timed passes each (default 3)")
    s.add_argument("--warmup", type=int, default=2, help="untimed passes first (default 2)")
    s.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    s.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    s.add_argument("--seed", type=int, default=0)
    o = p.add_argument_group("output")
    o.add_argument("--out", default="cost_model.json",
                   help="model JSON to write (default cost_model.json)")
    o.add_argument("--csv", default=None, help="also write the measurements to this CSV")
    o.add_argument("--record", default=None,
                   help="also write the whole calibration (settings, model, measurements) as "
                        "JSON to this file")
    o.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_calibrate)


def _calibrate(args: argparse.Namespace) -> int:
    from varbatch_kit.train.config.cli_flags import config_kwargs
    from varbatch_kit.train.config.train_config import TrainConfig
    from varbatch_kit.train.measure.calibration import (
        calibrate,
        grid_compositions,
        random_compositions,
    )

    cfg = TrainConfig(**config_kwargs(args, groups=("model",)))
    grid = grid_compositions(args.max_tokens, budgets=args.budgets, splits=args.splits,
                             min_len=args.min_len)
    held = (random_compositions(args.heldout, args.max_tokens, min_len=args.min_len,
                                seed=args.seed + 1) if args.heldout else [])
    cal = calibrate(cfg, compositions=grid, heldout=held, repeats=args.repeats,
                    warmup=args.warmup, threads=args.threads, device=args.device,
                    seed=args.seed, progress=not args.quiet)
    path = cal.model.save(args.out)
    if args.csv:
        cal.table().to_csv(args.csv, index=False)
    if args.record:
        cal.save(args.record)
    s = cal.fit.summary()
    print(cal.model.describe())
    print(f"held-out R2 {s['r2_heldout']:.4f} on {s['n_heldout']} micro-batches "
          f"(rmse {s['rmse_heldout_s'] * 1e3:.3g} ms); fitted on {s['n_fit']}; "
          f"{cal.info['wall_s']:.1f} s")
    print(f"wrote {path}")
    return 0
