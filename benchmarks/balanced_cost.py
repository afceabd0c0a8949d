"""Is ``balanced`` ever slower than slime's default? Its fixed cost, size by size.

slime's default with dynamic batching and ``--balance-data`` (first-fit micro-batches under
the token cap, then Karmarkar-Karp of their FLOPs over the DP ranks) against
``ScheduleConfig(packing="balanced")`` (FLOPs-balanced micro-batches, distribution and the
sample-level search of :mod:`varbatch_kit.policies.balance`), both building the 4 steps of
the same rollouts for Qwen3-8B: synthetic math-style batches from 256 to 65536 samples at
dp 64 (the issue's axis), and the bundled traces at dp 8, 16 and 64, token caps 16384 and
32768. Each time is the best of three runs; the ratio ``balanced / slime`` is printed per
cell (below 1: balanced is faster), with both schedules' busiest rank against the FLOPs lower
bound (``busiest/LB``, mean over steps: what the time buys).

slime's side is slime's own ``slime.utils.dp_schedule.build_dp_schedule`` when a slime
checkout is given (``--slime-src DIR`` or ``$SLIME_SRC``; its ``slime/utils`` is imported
from there, nothing else), else the plain-Python transcription in ``benchmarks/baseline.py``
(which gives the same schedule; slime's own code measured about 2x slower than it at 5.2k
samples, so the transcription is the harder baseline). Run ``python -m benchmarks.balanced_cost``
(``--quick``: fewer cells); writes ``build/bench/balanced_cost.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
SIZES = (256, 1024, 2048, 5200, 20000, 65536)
CAPS = (16384, 32768)
TRACE_DPS = (8, 16, 64)


def _best_of(fn, *args, runs: int = 3) -> float:
    """The shortest of ``runs`` timings of ``fn(*args)``, seconds."""
    times = []
    for _ in range(runs):
        gc.collect()
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return min(times)


def slime_default(slime_src: str | None, model):
    """``(name, fn(rollouts, dp, cap))``: slime's default schedule builder, its own code when
    ``slime_src`` is a checkout, else the in-project transcription."""
    if slime_src:
        sys.path.insert(0, str(slime_src))
        from slime.utils.dp_schedule import build_dp_schedule

        def run(r, dp, cap):
            args = SimpleNamespace(
                micro_batch_size=1, use_dynamic_batch_size=True, max_tokens_per_gpu=cap,
                balance_data=True, balance_by_flops=False, num_layers=model.num_layers,
                hidden_size=model.hidden_size, num_attention_heads=model.num_attention_heads,
                num_query_groups=model.num_query_groups, kv_channels=model.kv_channels,
                ffn_hidden_size=model.ffn_hidden_size, vocab_size=model.vocab_size,
                num_experts=None)
            tpc = dict(dp_size=dp, cp_size=1, vpp_size=1, microbatch_group_size_per_vp_stage=1)
            return build_dp_schedule(args, tpc, r.total_len.tolist(),
                                     global_batch_size=r.num_rollouts // 4,
                                     rollout_indices=r.rollout_id.tolist())

        return f"slime's build_dp_schedule ({slime_src})", run
    from benchmarks import baseline

    def run(r, dp, cap):
        return baseline.build_dp_schedule(
            r.total_len.tolist(), r.rollout_id.tolist(), model.forward_flops(r.total_len),
            dp=dp, gbs=r.num_rollouts // 4, cap=cap, balance=True)

    return "slime's algorithm transcribed (benchmarks/baseline.py)", run


def cells(quick: bool):
    """``(name, rollouts, dp)`` of every cell."""
    from benchmarks.run import synthetic
    from varbatch_kit.core.traces import bundled_traces, read_trace

    sizes = SIZES[:4] if quick else SIZES
    for n in sizes:
        yield f"synthetic {n}", synthetic(n, seed=n), 64
    for name, path in bundled_traces().items():
        r = read_trace(path)
        for dp in ((64,) if quick else TRACE_DPS):
            yield name, r, dp


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="sizes up to 5200, dp 64 only")
    parser.add_argument("--slime-src", default=os.environ.get("SLIME_SRC"), metavar="DIR",
                        help="a slime checkout: time slime's own build_dp_schedule")
    args = parser.parse_args(argv)
    import pandas as pd

    from varbatch_kit import ModelShape, ScheduleConfig, build_schedule
    from varbatch_kit.analysis.quality import step_quality

    model = ModelShape.preset("qwen3-8b")
    label, slime = slime_default(args.slime_src, model)
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the long-context trace's over-cap samples, each cell
        for name, r, dp in cells(args.quick):
            for cap in CAPS:
                try:
                    slime(r, dp, cap)
                except AssertionError:  # slime: fewer samples in a step than ranks
                    continue
                cfg = ScheduleConfig(dp=dp, global_batch_size=r.num_rollouts // 4,
                                     max_tokens_per_gpu=cap, packing="balanced")
                ours = build_schedule(r, cfg, model)
                theirs = build_schedule(r, cfg.with_(packing="first_fit",
                                                     distribution="flops_kk"), model)
                t_slime = _best_of(slime, r, dp, cap)
                t_ours = _best_of(build_schedule, r, cfg, model)
                rows.append({
                    "rollouts": name, "samples": r.num_samples, "dp": dp, "cap": cap,
                    "slime_ms": 1e3 * t_slime, "balanced_ms": 1e3 * t_ours,
                    "ratio": t_ours / t_slime,
                    "slime busiest/LB": step_quality(theirs)["makespan_ratio"].mean(),
                    "balanced busiest/LB": step_quality(ours)["makespan_ratio"].mean()})
    df = pd.DataFrame(rows)
    print(f"balanced against slime's default (--balance-data), 4 steps, Qwen3-8B; slime: {label}")
    print(df.to_string(index=False, float_format=lambda v: f"{v:.4f}" if v < 2 else f"{v:.1f}"))
    at64 = df[df.dp == 64]
    print(f"  dp 64: balanced / slime {at64.ratio.min():.2f} .. {at64.ratio.max():.2f} "
          f"(slower in {int((at64.ratio > 1).sum())} of {len(at64)} cells); all cells: worst "
          f"{df.ratio.max():.2f} ({df.loc[df.ratio.idxmax(), 'rollouts']}, dp "
          f"{df.loc[df.ratio.idxmax(), 'dp']}, cap {df.loc[df.ratio.idxmax(), 'cap']}); "
          f"never slower: {'met' if df.ratio.max() <= 1 else 'MISSED'}")
    out = ROOT / "build" / "bench"
    out.mkdir(parents=True, exist_ok=True)
    (out / "balanced_cost.json").write_text(json.dumps(
        {"slime": label, "cells": rows}, indent=1, default=float))


if __name__ == "__main__":
    main()
