"""``varbatch-kit export RUN_DIR OUT_DIR``: a trained run's weights as a Hugging Face checkpoint.

Examples::

    varbatch-kit train --model.path DIR --model.num-layers 2 --run.save-params-at 3 \\
        --run.max-steps 3 --out runs/a
    varbatch-kit export runs/a hf_out            # the final step
    varbatch-kit export runs/a/run00-<label> hf_out --step 2 --overwrite

``RUN_DIR`` is a run's output folder (``runNN-<label>``, or the ``--out`` folder of a
single run). Its ``meta.json`` names the model (the input checkpoint and the kept
layers); the weights are ``params_stepN.pt`` (``--run.save-params-at``) or the
checkpoint of that step (``--checkpoint.save-every``). ``OUT_DIR`` receives
config.json, model.safetensors and the input's tokenizer files, which
``transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads
(:mod:`varbatch_kit.train.runs.run_export`, :mod:`varbatch_kit.train.model.hf_export`).
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_parser"]


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("export", help="write a trained run's weights as a Hugging Face "
                              "checkpoint", description=__doc__.splitlines()[0],
                              epilog=__doc__.split("\n\n", 1)[1],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's output folder")
    p.add_argument("out_dir", metavar="OUT_DIR", help="the Hugging Face checkpoint folder to write")
    p.add_argument("--step", type=int, default=None,
                   help="the step whose weights to export (default: the final step)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="dtype of the written tensors (default: the run's, float32)")
    p.add_argument("--overwrite", action="store_true", help="replace an occupied OUT_DIR")
    p.set_defaults(func=_export)


def _export(args: argparse.Namespace) -> int:
    from varbatch_kit.train.runs.run_export import export_run, find_run_dir

    run_dir = find_run_dir(args.run_dir)
    out = export_run(run_dir, args.out_dir, step=args.step, dtype=args.dtype,
                     overwrite=args.overwrite)
    print(f"# {run_dir.name}: Hugging Face checkpoint written to {out}")
    return 0
