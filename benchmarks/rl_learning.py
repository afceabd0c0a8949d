"""Does the RL loop learn? SmolLM2-135M-Instruct at full depth on this CPU, sync and async.

:func:`varbatch_kit.train.rl_loop` on single-digit arithmetic (``a + b`` / ``a - b``,
``1 <= a, b <= 9``, seeded anew every iteration) with the format reward
(:func:`~varbatch_kit.train.rl.generate.answer_and_format_reward`: 0.75 for the right
number, 0.25 for the number alone, in slime's custom-RM signature), GRPO advantages, one
trainer for the whole loop (its Adam and LR go on), float32, one training rank of one thread
and generation on one thread: on 2 cores, async mode generates on one while the other trains.

Per iteration: the reward mean over its prompt groups (each group's mean is one value) with a
95 % Student-t interval (``benchmarks/_intervals.py``), the groups' spread, the wall times and
the policy lag; per mode the first two iterations pooled against the last two (the rise,
resolved where the intervals do not overlap) and the loop's wall time. Both modes see the same
questions (seeded by iteration) and start from the same weights.

``python -m benchmarks.rl_learning`` (``--quick``: 2 iterations of 4 prompts, the mechanics
only; ``--modes sync``; ``--record`` also writes ``data/runs/rl_loop_smollm2_cpu.json``, the
recorded run the package ships and notebook 07 plots); writes ``build/bench/rl_learning.json``.
About 9 minutes (sync) and 6 (async) at the defaults on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

from benchmarks._intervals import interval, separated

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "data" / "runs" / "rl_loop_smollm2_cpu.json"
#: the trainer: the whole model, a constant LR, 16 rollouts a step
TRAIN = dict(num_layers=None, lr=2e-5, min_lr=2e-5, lr_decay_style="constant",
             global_batch_size=16, max_tokens_per_gpu=4096, packing="first_fit",
             rollout_temperature=1.0, precision="fp32", timeout_s=1800, threads_per_worker=1,
             advantage_estimator="grpo")
#: the loop: 16 questions x 4 rollouts an iteration (4 steps), one turn, short answers
LOOP = dict(prompts=16, iterations=12, n_samples_per_prompt=4, turns=1, max_new_tokens=6,
            reward="varbatch_kit.train.rl.generate.answer_and_format_reward", seed=0)


def group_means(out_dir: Path, iteration: int, n_samples: int) -> list[float]:
    """The mean reward of each prompt group of one iteration (its rollouts trace)."""
    from varbatch_kit import read_trace

    frame = read_trace(out_dir / f"iter{iteration:02d}" / "rollouts.jsonl").to_frame()
    per_rollout = frame.groupby("rollout_id")["reward"].first()
    groups = per_rollout.groupby(per_rollout.index // n_samples).mean()
    return [float(v) for v in groups]


def run_mode(mode: str, config, loop: dict, out_dir: Path) -> dict:
    from varbatch_kit.train import rl_loop

    if out_dir.exists():
        shutil.rmtree(out_dir)
    t0 = time.perf_counter()
    res = rl_loop(config, out_dir=out_dir, mode=mode, progress=True, device="cpu", **loop)
    wall = time.perf_counter() - t0
    rows = []
    for rec in res.iterations.to_dict("records"):
        k = int(rec["iteration"])
        groups = group_means(out_dir, k, loop["n_samples_per_prompt"])
        ci = interval(groups)
        rows.append({"iteration": k, "reward_mean": ci.mean, "lo": ci.lo, "hi": ci.hi,
                     "groups": groups, "reward_mean_samples": rec["reward_mean"],
                     "policy_lag_batches": rec["policy_lag_batches"],
                     "steps": rec["steps"], "samples": rec["samples"],
                     "generate_s": rec["generate_s"], "train_s": rec["train_s"],
                     "trainer_s": rec["trainer_s"], "export_s": rec["export_s"],
                     "ppo_kl": rec.get("ppo_kl"), "pg_clipfrac": rec.get("pg_clipfrac"),
                     "train_rollout_logprob_abs_diff": rec.get("train_rollout_logprob_abs_diff"),
                     "sync_exact": bool(rec["sync_exact"]),
                     "zero_advantages": bool(rec["zero_advantages"])})
    lags = [int(r["policy_lag"]) for r in res.steps.to_dict("records")]
    shutil.rmtree(out_dir)  # a GB a iteration (the trainer's weights and the export)
    head = [v for r in rows[:2] for v in r["groups"]]
    tail = [v for r in rows[-2:] for v in r["groups"]]
    first, last = interval(head), interval(tail)
    return {"mode": mode, "wall_s": wall, "iterations": rows,
            "first_two": first.as_dict(), "last_two": last.as_dict(),
            "rise": last.mean - first.mean,
            "rise_resolved": bool(separated(first, last) and last.mean > first.mean),
            "policy_lag_steps": [min(lags), max(lags)],
            "steps": res.steps.to_dict("records")}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 iterations of 4 prompts")
    ap.add_argument("--modes", default="sync,async", help="comma-separated: sync, async")
    ap.add_argument("--iterations", type=int, default=None)
    ap.add_argument("--record", action="store_true",
                    help=f"also write {RECORD.relative_to(ROOT)} (notebook 07's cached run)")
    ap.add_argument("--out", default=str(ROOT / "build" / "bench" / "rl_learning"))
    args = ap.parse_args(argv)
    import torch

    from varbatch_kit.train import TrainConfig
    from varbatch_kit.train.model.smollm2 import smollm2_checkpoint

    loop = dict(LOOP)
    if args.quick:
        loop.update(iterations=2, prompts=4)
    if args.iterations:
        loop["iterations"] = args.iterations
    config = TrainConfig().with_(path=str(smollm2_checkpoint()), **TRAIN)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    out = Path(args.out)
    result = {"model": "SmolLM2-135M-Instruct", "train": TRAIN, "loop": loop,
              "cpu_count": os.cpu_count(), "torch": torch.__version__, "modes": {}}
    for mode in modes:
        print(f"== {mode}: {loop['iterations']} iterations", flush=True)
        r = run_mode(mode, config, loop, out / mode)
        result["modes"][mode] = r
        for row in r["iterations"]:
            print(f"  iteration {row['iteration']}: reward {row['reward_mean']:.3f} "
                  f"[{row['lo']:.3f}, {row['hi']:.3f}]  generate {row['generate_s']:.0f} s  "
                  f"train wait {row['train_s']:.0f} s  trainer {row['trainer_s']:.0f} s  "
                  f"lag {row['policy_lag_batches']}", flush=True)
        print(f"  first two {r['first_two']['mean']:.3f} [{r['first_two']['lo']:.3f}, "
              f"{r['first_two']['hi']:.3f}] -> last two {r['last_two']['mean']:.3f} "
              f"[{r['last_two']['lo']:.3f}, {r['last_two']['hi']:.3f}]: rise "
              f"{r['rise']:+.3f}, {'resolved' if r['rise_resolved'] else 'not resolved'}; "
              f"wall {r['wall_s']:.0f} s; policy lag {r['policy_lag_steps'][0]}-"
              f"{r['policy_lag_steps'][1]} optimizer steps", flush=True)
    if "sync" in result["modes"] and "async" in result["modes"]:
        s, a = result["modes"]["sync"]["wall_s"], result["modes"]["async"]["wall_s"]
        result["async_over_sync_wall"] = a / s
        print(f"async / sync wall: {a / s:.3f} ({a:.0f} s / {s:.0f} s)")
    target = ROOT / "build" / "bench" / "rl_learning.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=1, default=float)
    target.write_text(text)
    if args.record:
        RECORD.write_text(text)
    return result


if __name__ == "__main__":
    main()
