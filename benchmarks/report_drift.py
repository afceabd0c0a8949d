"""How far do reported metrics move when only the parallel layout changes?

For each bundled trace (the bundled traces: realistic, long-tailed response
lengths; single- and multi-sample rollouts) the first steps are scheduled with
varbatch_kit's scheduler under several layouts (dp, cp, packing, distribution),
and every report mode of :mod:`varbatch_kit.report` is evaluated on each
layout exactly as a training loop computes it (per rank, per micro-batch, per
CP rank, then reduced). Two tables are printed:

1. the invariance matrix: modes x layouts, the largest relative difference to
   the unsplit value (one rank, one micro-batch, cp=1) over traces and steps;
2. the naive modes' drift per trace: median and max relative difference.

Per-token values are synthetic and stated, since the traces carry lengths only:
``x = -(0.8 + 0.3 * a_i - 0.25 * log(R_i / median R)) + 0.5 * noise`` with a
per-sample offset ``a_i ~ N(0, 1)``: a per-token loss that is lower for longer
responses, as token-level NLL/entropy typically is. ``--iid`` drops the length
term (drift from unequal micro-batch weights alone).

Run: ``python -m benchmarks.report_drift`` (``--quick`` for a smaller run).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from varbatch_kit import ModelShape, ScheduleConfig, build_schedule
from varbatch_kit.core.traces import bundled_traces, read_trace
from varbatch_kit.report import NAIVE_MODES, REPORT_MODES, report_under_layout

# (label, dp, cp, packing, distribution); the token cap is per GPU (slime's max_tokens_per_gpu)
LAYOUTS = [
    ("dp1cp1 ff", 1, 1, "first_fit", "strided"),
    ("dp2cp1 ff", 2, 1, "first_fit", "strided"),
    ("dp1cp2 ff", 1, 2, "first_fit", "strided"),
    ("dp2cp2 kk", 2, 2, "flops_kk", "flops_kk"),
    ("dp1cp4 ff", 1, 4, "first_fit", "strided"),
    ("dp4cp1 ff+kk", 4, 1, "first_fit", "flops_kk"),
    ("dp8cp1 ffd", 8, 1, "ffd", "strided"),
    ("dp4cp4 ff", 4, 4, "first_fit", "strided"),
]
LEGEND = (
    "ff = first_fit packing, strided distribution; kk = flops_kk packing and distribution; "
    "ff+kk = first_fit packing, flops_kk distribution; ffd = first-fit-decreasing, strided"
)


def token_values(response_len: np.ndarray, rng: np.random.Generator, iid: bool) -> torch.Tensor:
    """Synthetic per-token values for one step (flat, samples concatenated)."""
    median = float(np.median(response_len))
    out = []
    for r in response_len:
        offset = 0.8 + 0.3 * rng.standard_normal()
        if not iid:
            offset -= 0.25 * np.log(max(int(r), 1) / median)
        out.append(-(offset + 0.5 * rng.standard_normal(int(r))))
    return torch.from_numpy(np.concatenate(out)).to(torch.float64)


def run(
    gbs: int, steps: int, max_tokens: int, iid: bool, traces: list[str], seed: int
) -> tuple[dict, dict]:
    model = ModelShape.preset("qwen3-8b")
    matrix: dict[tuple[str, str], float] = {}
    drift: dict[tuple[str, str], list[float]] = {}
    paths = bundled_traces()
    unsplit: dict[tuple, float] = {}  # the same step under every layout: compute once
    for trace in traces:
        rollouts = read_trace(paths[trace])
        order = rollouts.rollout_order()[0][: gbs * steps]
        rollouts = rollouts.subset(np.sort(np.isin(rollouts.rollout_id, order).nonzero()[0]))
        masks_np = rollouts.masks()
        rng = np.random.default_rng(seed)
        values = token_values(rollouts.response_len, rng, iid).split(
            [int(r) for r in rollouts.response_len]
        )
        cap = max(max_tokens, int(rollouts.total_len.max()))  # a sample fits one GPU at cp=1
        for label, dp, cp, packing, distribution in LAYOUTS:
            config = ScheduleConfig(
                dp=dp,
                cp=cp,
                global_batch_size=gbs,
                max_tokens_per_gpu=-(-cap // cp),
                packing=packing,
                distribution=distribution,
            )
            schedule = build_schedule(rollouts, config, model)
            for step in schedule.steps:
                idx = [int(i) for i in step.sample_indices]
                local = {g: j for j, g in enumerate(idx)}
                layout = [[[local[int(g)] for g in mb] for mb in rank] for rank in step.dp_ranks]
                args = (
                    torch.cat([values[i] for i in idx]),
                    [int(rollouts.total_len[i]) for i in idx],
                    [int(rollouts.response_len[i]) for i in idx],
                    [torch.from_numpy(np.asarray(masks_np[i], dtype=np.float64)) for i in idx],
                    [int(rollouts.rollout_id[i]) for i in idx],
                )
                for mode in REPORT_MODES:
                    key = (trace, mode, tuple(idx))
                    if key not in unsplit:
                        unsplit[key] = report_under_layout(mode, *args)
                    base = unsplit[key]
                    got = report_under_layout(mode, *args, layout=layout, cp_size=cp)
                    rel = abs(got - base) / max(abs(base), 1e-300)
                    matrix[(mode, label)] = max(matrix.get((mode, label), 0.0), rel)
                    if mode in NAIVE_MODES:
                        drift.setdefault((trace, mode), []).append(rel)
    return matrix, drift


def print_tables(matrix: dict, drift: dict) -> None:
    labels = [layout[0] for layout in LAYOUTS]
    width = max(len(m) for m in REPORT_MODES) + 2
    print("\nInvariance matrix: max |layout - unsplit| / |unsplit| over traces and steps")
    print(LEGEND)
    print("mode".ljust(width) + "".join(f"{lab:>13}" for lab in labels) + f"{'max':>10}")
    for mode in REPORT_MODES:
        cells = [matrix[(mode, lab)] for lab in labels]
        tag = "  (naive)" if mode in NAIVE_MODES else ""
        print(
            mode.ljust(width) + "".join(f"{c:>13.1e}" for c in cells) + f"{max(cells):>10.1e}" + tag
        )
    print("\nNaive modes' drift on the bundled traces' length distributions")
    print(f"{'trace':<14}{'mode':<24}{'median':>10}{'max':>10}{'cases':>7}")
    for (trace, mode), rels in sorted(drift.items()):
        print(
            f"{trace:<14}{mode:<24}{100 * np.median(rels):>9.2f}%{100 * max(rels):>9.2f}%"
            f"{len(rels):>7}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gbs", type=int, default=32, help="rollouts per step")
    parser.add_argument("--steps", type=int, default=4, help="steps per trace")
    parser.add_argument("--max-tokens-per-gpu", type=int, default=16384)
    parser.add_argument("--iid", action="store_true", help="no length-correlated loss term")
    parser.add_argument("--traces", nargs="*", default=None, help="default: every bundled trace")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="gbs 16, 2 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.gbs, args.steps = 16, 2
    traces = args.traces or sorted(bundled_traces())
    start = time.perf_counter()
    matrix, drift = run(args.gbs, args.steps, args.max_tokens_per_gpu, args.iid, traces, args.seed)
    print(
        f"traces {traces}; {args.steps} steps of {args.gbs} rollouts each; "
        f"max_tokens_per_gpu {args.max_tokens_per_gpu}; values "
        f"{'iid' if args.iid else 'length-correlated'}; float64"
    )
    print_tables(matrix, drift)
    print(f"\n({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
