"""Pipeline-aware micro-batch order: the simulated 1F1B bubble of each order against arrival.

With ``pp > 1`` stages a DP rank runs its micro-batches through the
non-interleaved 1F1B pipeline; their order changes the bubble when their
costs differ. For the bundled traces and synthetic batches (dp=8, cap 16384
tokens per GPU, first-fit packing, strided distribution, Qwen3-8B FLOPs,
H100 at 45 %), every step is simulated with pp = 2, 4, 8 under the orders of
:mod:`varbatch_kit.policies.order` (``simulate(schedule, pp=pp, order=...)``:
the same micro-batches on the same ranks, only their order differs):

- ``arrival``: the order the distribution gives (slime's);
- ``small_ends``: small micro-batches at both ends (verl / ROLL);
- ``min_bubble``: ours, exact up to 8 micro-batches per rank, local search above.

Printed per (batch, pp): the mean micro-batches per rank, the busiest rank's
pipeline bubble summed over the steps (seconds) and the total simulated step
time, each order against arrival. A second table measures the local search
alone against the exact optimum on random costs (m <= 8).

Run: ``python -m benchmarks.pp_order`` (``--quick``: fewer steps and batches).
Writes ``build/bench/pp_order.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from varbatch_kit import ModelShape, Rollouts, ScheduleConfig, build_schedule
from varbatch_kit.analysis.simulate import simulate
from varbatch_kit.core.traces import bundled_traces, read_trace
from varbatch_kit.policies.order import min_bubble
from varbatch_kit.policies.pipeline import pipeline_makespan

OUT = Path("build/bench/pp_order.json")
ORDERS = ("arrival", "small_ends", "min_bubble")
PPS = (2, 4, 8)
DP, CAP = 8, 16384


def batches(quick: bool) -> dict[str, tuple[Rollouts, int]]:
    """name -> (rollouts, global_batch_size in rollouts)."""
    paths = bundled_traces()
    out = {
        "math": (read_trace(paths["math"]), 256),
        "agentic": (read_trace(paths["agentic"]), 64),
        "long_context": (read_trace(paths["long_context"]), 64),
        # a long tail: median 2k responses, up to 64k tokens (few long among many short)
        "synthetic_64k_tail": (Rollouts.synthetic(2048, prompt_len=(256, 2048),
                                                  response_len=2048.0, response_sigma=1.3,
                                                  max_response_len=65536, seed=7), 256),
        # few micro-batches per rank (m <= 8: the exact search)
        "synthetic_few_mbs": (Rollouts.synthetic(1024, prompt_len=(256, 1024),
                                                 response_len=3000.0, response_sigma=1.0,
                                                 max_response_len=16384, seed=8), 96),
    }
    if quick:
        out = {k: out[k] for k in ("long_context", "synthetic_64k_tail", "synthetic_few_mbs")}
    return out


def run_batch(rollouts: Rollouts, gbs: int, steps: int, model: ModelShape) -> list[dict]:
    keep = rollouts.rollout_order()[0][: gbs * steps]
    rollouts = rollouts.subset(np.flatnonzero(np.isin(rollouts.rollout_id, keep)))
    cfg = ScheduleConfig(dp=DP, global_batch_size=gbs, max_tokens_per_gpu=CAP)
    schedule = build_schedule(rollouts, cfg, model)
    rows = []
    for pp in PPS:
        row: dict = {"pp": pp, "steps": schedule.num_steps,
                     "mbs_per_rank": float(np.mean(schedule.num_microbatches))}
        for name in ORDERS:
            t0 = time.perf_counter()
            st = simulate(schedule, pp=pp, order=name, timelines=False).step_times
            row[name] = {"bubble_s": float(st["bubble_s"].sum()),
                         "time_s": float(st["time_s"].sum()),
                         "order_s": time.perf_counter() - t0}
        rows.append(row)
    return rows


def search_quality(trials: int, seed: int) -> dict:
    """The local search (no exhaustive step) against the exact optimum on random costs."""
    rng = np.random.default_rng(seed)
    gaps, hits = [], 0
    for _ in range(trials):
        m = int(rng.integers(4, 9))
        pp = int(rng.choice(PPS))
        c = rng.lognormal(0.0, 1.0, m)
        exact = min_bubble(c, 2 * c, pp)
        local = min_bubble(c, 2 * c, pp, exact_max=0)
        e = float(pipeline_makespan(c[exact], 2 * c[exact], pp))
        h = float(pipeline_makespan(c[local], 2 * c[local], pp))
        gaps.append(h / e - 1.0)
        hits += h <= e * (1 + 1e-12)
    return {"trials": trials, "mean_gap": float(np.mean(gaps)), "max_gap": float(np.max(gaps)),
            "optimal_share": hits / trials}


def print_table(results: dict) -> None:
    head = (f"{'batch':<20} {'pp':>2} {'mb/rank':>7} {'bubble arrival':>14} "
            f"{'small_ends':>16} {'min_bubble':>16} {'step time arrival':>17} "
            f"{'small_ends':>10} {'min_bubble':>10}")
    print(head)
    print("-" * len(head))
    for name, rows in results.items():
        for r in rows:
            a = r["arrival"]

            def rel(o: str, key: str, r=r, a=a) -> float:
                return r[o][key] / a[key] if a[key] > 0 else 1.0

            print(f"{name:<20} {r['pp']:>2} {r['mbs_per_rank']:>7.1f} {a['bubble_s']:>12.2f} s "
                  f"{r['small_ends']['bubble_s']:>7.2f} s {rel('small_ends', 'bubble_s'):>5.0%} "
                  f"{r['min_bubble']['bubble_s']:>7.2f} s {rel('min_bubble', 'bubble_s'):>5.0%} "
                  f"{a['time_s']:>15.1f} s {1 / rel('small_ends', 'time_s'):>9.3f}x "
                  f"{1 / rel('min_bubble', 'time_s'):>9.3f}x")
    print("bubble: the busiest rank's pipeline idle time, summed over steps (and % of arrival's); "
          "step time: summed over steps; x = speed-up over arrival")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="steps per batch")
    parser.add_argument("--quick", action="store_true", help="3 batches, 3 steps each")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    steps = 3 if args.quick else args.steps
    start = time.perf_counter()
    model = ModelShape.preset("qwen3-8b")
    results = {name: run_batch(r, gbs, steps, model) for name, (r, gbs) in
               batches(args.quick).items()}
    quality = search_quality(20 if args.quick else 100, seed=0)
    print(f"dp={DP}, max_tokens_per_gpu={CAP}, first_fit + strided, qwen3-8b, H100 at 45 %, "
          f"{steps} steps per batch")
    print_table(results)
    print(f"\nlocal search alone vs exact optimum ({quality['trials']} random cost vectors, "
          f"m = 4..8, pp in {PPS}): mean gap {quality['mean_gap']:.3%}, max "
          f"{quality['max_gap']:.3%}, optimal in {quality['optimal_share']:.0%}")
    elapsed = time.perf_counter() - start
    print(f"({elapsed:.1f} s)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "params": {"dp": DP, "max_tokens_per_gpu": CAP, "steps": steps, "model": "qwen3-8b",
                   "hardware": "H100", "efficiency": 0.45, "orders": list(ORDERS),
                   "pp": list(PPS)},
        "results": results, "search_quality": quality, "elapsed_s": elapsed}, indent=1))


if __name__ == "__main__":
    main()
