"""What does a CPU launch cost before its ranks train? Agents forked by the agent server
against fresh interpreters.

A notebook or the test suite makes many small launches. Each side here is one fresh
launching process that makes ``LAUNCHES`` one-step launches of the toy GPT at dp 2 (the
smallest real launch: the cost is nearly all start-up), **served**
(:mod:`varbatch_kit.train.runs.agent_server`: torch, megatron and the worker imported once
per launching process) against **fresh** (``VARBATCH_KIT_FRESH_AGENTS=1``: each agent a
new interpreter importing them), alternating A and B. It prints the median CPU seconds
per launch (user + system of the launching process and all its descendants, over the
launches, the server's own start included) and the median wall time of a launch after the
first, and the ratios served/fresh, pair by pair. Every launch must report the same loss.

Run: ``python -m benchmarks.launch_overhead`` (``--quick``: 2 pairs instead of 5); writes
``build/bench/launch_overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import textwrap

from benchmarks._ab import ROOT, paired, pairs_text, write

LAUNCHES = 6
SIDE = """
    import json, sys, tempfile, time
    from pathlib import Path
    import numpy as np
    from varbatch_kit import Rollouts
    from varbatch_kit.train import TrainConfig, run
    rng = np.random.default_rng(0)
    rollouts = Rollouts(rng.integers(3, 8, 8), rng.integers(4, 12, 8), np.arange(8) // 2)
    cfg = TrainConfig().with_(dp=2, global_batch_size=4, max_tokens_per_gpu=32, max_steps=1,
                              n_samples_per_prompt=2, num_layers=1, hidden_size=16,
                              num_attention_heads=2, ffn_hidden_size=32, vocab_size=64,
                              max_seq_len=64)
    walls, losses = [], []
    with tempfile.TemporaryDirectory() as d:
        for k in range({launches}):
            t = time.perf_counter()
            r = run(cfg, rollouts, out_dir=Path(d) / str(k), progress=False)
            walls.append(time.perf_counter() - t)
            losses.append(float(r.steps["loss"].iloc[0]))
    print(json.dumps(dict(walls=walls, losses=losses)))
"""


def one_side(served: bool, launches: int) -> tuple[float, float, list[float]]:
    """(CPU seconds per launch, median wall of a launch after the first, losses)."""
    env = {**os.environ, "VARBATCH_KIT_FRESH_AGENTS": "0" if served else "1"}
    code = textwrap.dedent(SIDE.format(launches=launches))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, env=env, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    walls = sorted(out["walls"][1:])
    return cpu / launches, walls[len(walls) // 2], out["losses"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 pairs instead of 5")
    args = parser.parse_args(argv)
    pairs = 2 if args.quick else 5
    one_side(True, 2)  # warm-up: the page cache, .pyc files
    cpu = {"served": [], "fresh": []}
    wall = {"served": [], "fresh": []}
    losses = set()
    for _ in range(pairs):
        for side in ("served", "fresh"):
            c, w, ls = one_side(side == "served", LAUNCHES)
            cpu[side].append(c)
            wall[side].append(w)
            losses.update(ls)
    if len(losses) != 1:
        raise SystemExit(f"the launches disagree on the loss: {sorted(losses)}")
    row = {"launches_per_process": LAUNCHES,
           "cpu": paired("served", cpu["served"], "fresh", cpu["fresh"], "cpu_s_per_launch"),
           "wall": paired("served", wall["served"], "fresh", wall["fresh"], "wall_s_per_launch")}
    c, w = row["cpu"], row["wall"]
    print(f"a one-step dp 2 toy launch, {LAUNCHES} per process, {pairs} pair(s): CPU per launch "
          f"served {c['served_cpu_s_per_launch_median']:.2f} s, fresh "
          f"{c['fresh_cpu_s_per_launch_median']:.2f} s, ratio "
          f"{c['ratio_served_over_fresh_median']:.2f} ({pairs_text(c)}); wall of a launch "
          f"after the first: served {w['served_wall_s_per_launch_median']:.2f} s, fresh "
          f"{w['fresh_wall_s_per_launch_median']:.2f} s, ratio "
          f"{w['ratio_served_over_fresh_median']:.2f} ({pairs_text(w)}); same loss in every "
          "launch")
    write("launch_overhead", row)


if __name__ == "__main__":
    main()
