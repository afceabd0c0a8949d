"""How long does a training checkpoint take to save and to load?

Trains a few steps with ``save_every=1`` through the real launcher (torchrun,
one CPU worker, gloo), reads the per-checkpoint timings rank 0 records in
``OUT/checkpoints.jsonl`` (``save_s``: state gathered on CPU, serialised,
written, fsynced and renamed; ``write_s``: the part in
:func:`varbatch_kit.train.runs.checkpoint.save_checkpoint`), then cuts the run back
to its first checkpoint and resumes it: ``meta.json``'s ``checkpoint_load_s``
is the time to read the files and restore model, optimizer, LR scheduler and
RNG. Models: the default toy GPT, and SmolLM2-135M-Instruct truncated to its
first 2 layers (the real-model configuration of the tests; skipped when the
checkpoint cannot be materialised, see :mod:`varbatch_kit.train.model.smollm2`).

Run: ``python -m benchmarks.checkpoint`` (``--quick``: 2 steps instead of 4);
writes ``build/bench/checkpoint.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from varbatch_kit import Rollouts, ScheduleConfig
from varbatch_kit.train import (
    CheckpointConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    TrainConfig,
    run,
)

ROOT = Path(__file__).resolve().parent.parent


def _smollm2(models_dir: Path) -> str | None:
    from varbatch_kit.train.model.smollm2 import SmolLM2Unavailable, smollm2_checkpoint

    try:
        return str(smollm2_checkpoint(models_dir))
    except SmolLM2Unavailable as e:
        print(f"SmolLM2 skipped: {e}")
        return None


def measure(name: str, cfg: TrainConfig, rollouts: Rollouts, work: Path) -> dict:
    """Save timings of every checkpoint of a fresh run, and the load time of one resume."""
    t0 = time.perf_counter()
    first = run(cfg, rollouts, out_dir=work, progress=False)
    fresh_wall = time.perf_counter() - t0
    saves = [json.loads(x) for x in (first.out_dir / "checkpoints.jsonl").read_text().splitlines()]
    # cut back to the first checkpoint kept and resume from it
    ckpts = sorted((first.out_dir / "checkpoints").glob("step_*"))
    for p in ckpts[1:]:
        shutil.rmtree(p)
    (first.out_dir / "done").unlink()
    t0 = time.perf_counter()
    resumed = run(cfg, rollouts, out_dir=work, progress=False, resume=True)
    resume_wall = time.perf_counter() - t0
    assert resumed.losses.tolist() == first.losses.tolist()
    return {
        "model": name, "parameters": first.meta["parameters"], "steps": len(first.steps),
        "checkpoint_bytes": saves[-1]["bytes"],
        "save_s_median": statistics.median(s["save_s"] for s in saves),
        "save_s_max": max(s["save_s"] for s in saves),
        "write_s_median": statistics.median(s["write_s"] for s in saves),
        "load_s": resumed.meta["checkpoint_load_s"],
        "resumed_from_step": resumed.meta["resumed_from_step"],
        "fresh_launch_s": fresh_wall, "resume_launch_s": resume_wall,
        "step_time_s_median": float(first.steps["step_time_s"].median()),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 steps per model instead of 4")
    parser.add_argument("--no-smollm2", action="store_true", help="the toy model only")
    parser.add_argument("--models", type=Path, default=ROOT / "build" / "models",
                        help="where the SmolLM2 checkpoint is cached (default build/models)")
    args = parser.parse_args(argv)
    steps = 2 if args.quick else 4
    rollouts = Rollouts.synthetic(4 * steps, samples_per_rollout=(1, 2), prompt_len=(4, 8),
                                  response_len=12, response_sigma=0.5, max_response_len=24,
                                  seed=3)
    sched = ScheduleConfig(global_batch_size=4, max_tokens_per_gpu=256)
    every = CheckpointConfig(save_every=1, keep_last=steps)
    models = [("toy GPT (default TrainConfig)", TrainConfig(schedule=sched, checkpoint=every))]
    smol = None if args.no_smollm2 else _smollm2(args.models)
    if smol is not None:
        models.append(("SmolLM2-135M, first 2 of 30 layers", TrainConfig(
            schedule=sched, model=ModelConfig(path=str(smol), num_layers=2),
            optim=OptimConfig(lr=1e-4, min_lr=1e-4), checkpoint=every,
            run=RunConfig(timeout_s=1800))))
    rows = []
    with tempfile.TemporaryDirectory(prefix="varbatch_ckpt_bench_") as tmp:
        for k, (name, cfg) in enumerate(models):
            rows.append(measure(name, cfg, rollouts, Path(tmp) / f"m{k}"))
    print(f"checkpoint save / load, CPU, one worker, {steps} steps, save_every=1")
    print(f"{'model':38s} {'params':>11s} {'MB':>8s} {'save s':>8s} {'(max)':>7s} "
          f"{'write s':>8s} {'load s':>7s} {'step s':>7s}")
    for r in rows:
        print(f"{r['model']:38s} {r['parameters']:11,d} {r['checkpoint_bytes'] / 1e6:8.1f} "
              f"{r['save_s_median']:8.3f} {r['save_s_max']:7.3f} {r['write_s_median']:8.3f} "
              f"{r['load_s']:7.3f} {r['step_time_s_median']:7.3f}")
    out = ROOT / "build" / "bench" / "checkpoint.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"steps": steps, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
