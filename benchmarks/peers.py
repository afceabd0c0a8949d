"""Peers side by side: every framework's packing and distribution next to slime's and ours.

On the bundled traces and the 4k / 16k / 64k synthetic math-style batches of
``benchmarks/run.py`` (4 steps each, cap 16384, Qwen3-8B), for dp 16 / 64 / 128:
slime's ``first_fit+flops_kk`` and ``flops_kk+flops_kk`` and our
``balanced+balanced`` (``build_schedule``), ``balanced+balanced·cal`` (the
same, balancing the step-time model of ``sim_s`` itself:
``ScheduleConfig(workload=cost_model)``, the machine's own cost instead of
FLOPs), and each peer of :mod:`varbatch_kit.policies.peers` run on every
step's samples. The last lines say how far ``balanced+balanced·cal`` is from
the best other scheduler of each cell under ``sim_s`` (the target: within
1.01x everywhere).

Columns: ``time_s`` (scheduling, all steps), ``mbs`` / ``mb_bound``
(``ceil(tokens/cap)`` per step, summed), ``viol`` (micro-batches of two or
more samples over the cap), ``busiest/LB`` (busiest rank's FLOPs /
``max(step FLOPs / dp, largest sample)``, mean over steps), the peer figures
of ``analysis.quality`` (``bin_eff``, ``cv`` and ``max/mean`` of per-rank
FLOPs, ``spread/mean``, ``slot_imb`` the mean per-slot max/mean cost), and
``sim_s``: simulated time of all steps, a micro-batch costing
``c0 + c1 sum L + c2 sum L^2`` seconds, a rank the sum of its micro-batches,
a step its slowest rank; ``sim_h100_s`` the same with the FLOPs model the
FLOPs-aware schedules balance (Qwen3-8B on H100, :data:`H100`). The cost model
of ``sim_s`` is ``build/bench/cost_model.json``
(``varbatch_kit.analysis.cost_model``) when both exist; otherwise an
uncalibrated one derived from the FLOPs estimate (see :func:`cost_model`),
and the table says so. ``impl`` says whose code scheduled: ``ours``,
``package <name>==<version>`` (the peer's own balancing kernels, imported
from ``--peer-packages DIR``, inside our transcription of its trainer's glue)
or ``transcription``; with the packages, ``ours=pkg`` says whether our code
alone gives the very same plan (every rank, every micro-batch). A peer that
refuses a step (a sample over its cap) shows ``refused``.

Run ``python -m benchmarks.peers`` (``--quick``: 4k and 16k, dp 16 and 64,
the math trace only). The peers' packages, for ``--peer-packages`` (their
balancing modules are imported with the top-level ``__init__`` skipped; verl's
needs ray and tensordict, AReaL's numba; OpenRLHF's needs only torch)::

    pip install --no-deps --target build/peer-packages verl==0.9.1 areal==1.0.4 \
        openrlhf==0.11.2 ray==2.60.0 tensordict==0.15.3 numba==0.68.1 llvmlite==0.50.0 \
        msgpack==1.2.4 colorlog==6.12.0 pyvers==0.2.3 cloudpickle==3.1.3
    python -m benchmarks.peers --peer-packages build/peer-packages
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

from benchmarks._peer_loading import load_bare
from varbatch_kit import ModelShape, ScheduleConfig, build_schedule
from varbatch_kit.analysis.quality import plan_quality
from varbatch_kit.core.hardware import (
    DEFAULT_EFFICIENCY,
    DEFAULT_MICROBATCH_OVERHEAD_S,
    HARDWARE,
)
from varbatch_kit.core.schedule import step_rollout_groups
from varbatch_kit.core.traces import bundled_traces, read_trace
from varbatch_kit.core.workload import Workload
from varbatch_kit.policies.peers import PEER_SCHEDULERS, PEER_SOURCES, PeerRefusal

MODEL = ModelShape.preset("qwen3-8b")
CAP = 16384
STEPS = 4
OURS = [("first_fit", "flops_kk"), ("flops_kk", "flops_kk"), ("balanced", "balanced")]
#: the scheduler name of ``balanced`` balancing the step-time model of ``sim_s`` (its workload)
CALIBRATED = "balanced+balanced·cal"
#: how far it may be from the best other scheduler of a cell (``sim_s``)
CALIBRATED_TARGET = 1.01
OUT = Path("build/bench/peers.json")
COST_MODEL = Path("build/bench/cost_model.json")
# the real packages' kernels are pure Python: above this many samples per batch their cells
# use our transcription instead (a note says so)
PACKAGE_LIMIT = 16384


# ---------------------------------------------------------------------------- cost model
class _InlineCost:
    """``t = c0 + c1 * sum L + c2 * sum L^2`` seconds per micro-batch."""

    def __init__(self, c0: float, c1: float, c2: float) -> None:
        self.c0, self.c1, self.c2 = c0, c1, c2

    def workload(self) -> Workload:
        """The same coefficients as a balancing workload (``ScheduleConfig(workload=...)``)."""
        return Workload(self.c0, self.c1, self.c2)

    def seconds(self, sum_len, sum_len_sq):
        return self.c0 + self.c1 * np.asarray(sum_len, float) + self.c2 * np.asarray(sum_len_sq,
                                                                                      float)


def uncalibrated(model: ModelShape = MODEL, peak_flops: float = HARDWARE["H100"].peak_flops,
                 efficiency: float = DEFAULT_EFFICIENCY,
                 overhead_s: float = DEFAULT_MICROBATCH_OVERHEAD_S) -> _InlineCost:
    """Coefficients from the FLOPs estimate: forward + backward = 3x forward at
    ``peak * efficiency`` (the H100 profile's dense bf16 peak at the simulator's default
    efficiency, 0.45), plus its default 4 ms per micro-batch. ``forward_flops(L) = a L + b L^2``
    is read off two lengths.
    """
    f1, f2 = (float(x) for x in model.forward_flops(np.array([1000, 2000])))
    b = (f2 - 2 * f1) / (2000.0**2 - 2 * 1000.0**2)
    a = (f1 - b * 1000.0**2) / 1000.0
    rate = peak_flops * efficiency
    return _InlineCost(overhead_s, 3 * a / rate, 3 * b / rate)


#: the model the schedules are balanced for (Qwen3-8B FLOPs on H100): a second step-time column
H100 = uncalibrated()


def cost_model(path: Path = COST_MODEL):
    """(model, label): the calibrated model when it can be loaded, else :func:`uncalibrated`."""
    try:
        from varbatch_kit.analysis.cost_model import MicroBatchCostModel  # another helper's
    except ImportError:
        return uncalibrated(), "uncalibrated (no varbatch_kit.analysis.cost_model)"
    if not Path(path).exists():
        return uncalibrated(), f"uncalibrated (no {path})"
    return MicroBatchCostModel.load(path), f"calibrated ({path})"


def step_seconds(cm, rank_micro_batches, lengths) -> float:
    """Slowest rank's summed micro-batch seconds."""
    worst = 0.0
    for mbs in rank_micro_batches:
        if not mbs:
            continue
        s1 = np.array([float(lengths[m].sum()) for m in mbs])
        s2 = np.array([float((lengths[m].astype(np.float64) ** 2).sum()) for m in mbs])
        try:
            t = float(np.sum(cm.seconds(s1, s2)))
        except (TypeError, ValueError):
            t = float(sum(cm.seconds(a, b) for a, b in zip(s1, s2)))
        worst = max(worst, t)
    return worst


# ---------------------------------------------------------------------------- peer packages
def package_kernels(dirs: list[str]) -> tuple[dict, dict, list[str]]:
    """(kernels per peer, impl label per peer, notes) from the packages importable in ``dirs``."""
    for d in reversed(dirs):
        if d not in sys.path:
            sys.path.insert(0, d)
    kernels, labels, notes = {}, {}, []

    def version(pkg):
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return "?"

    try:
        sb = load_bare("verl.utils.seqlen_balancing")
        kernels["verl"] = {"kk": sb.get_seqlen_balanced_partitions}
        labels["verl"] = f"package verl=={version('verl')}"
    except Exception as e:  # noqa: BLE001 - any import failure means: use the transcription
        notes.append(f"verl package not importable ({type(e).__name__}: {e}); transcription")
    try:
        sp = load_bare("areal.utils.seqpack")
        sp.logger.setLevel(logging.ERROR)  # one warning line per KK fallback otherwise
        v = f"package areal=={version('areal')}"
        kernels["areal"] = {"dispatch": sp.balanced_greedy_partition,
                            "allocate": sp.ffd_allocate}
        kernels["areal_kk"] = {"dispatch": sp.balanced_greedy_partition,
                               "allocate": sp.kk_allocate}
        labels["areal"] = labels["areal_kk"] = v
    except Exception as e:  # noqa: BLE001
        notes.append(f"areal package not importable ({type(e).__name__}: {e}); transcription")
    try:
        ob = load_bare("openrlhf.utils.seqlen_balancing")
        kernels["openrlhf"] = {
            "count": lambda v, c: ob.get_minimum_num_micro_batch_size(v, c, 1, 1),
            "kk": ob.get_seqlen_balanced_partitions}
        labels["openrlhf"] = f"package openrlhf=={version('openrlhf')}"
    except Exception as e:  # noqa: BLE001
        notes.append(f"openrlhf package not importable ({type(e).__name__}: {e}); "
                     "transcription")
    return kernels, labels, notes


# ---------------------------------------------------------------------------- measuring
def _aggregate(rows_of_steps: list[dict]) -> dict:
    keys_sum = ("time_s", "mbs", "mb_bound", "viol", "sim_s", "sim_h100_s")
    keys_mean = ("busiest/LB", "cv", "max/mean", "spread/mean", "slot_imb")
    out = {k: float(sum(r[k] for r in rows_of_steps)) for k in keys_sum}
    out.update({k: float(np.mean([r[k] for r in rows_of_steps])) for k in keys_mean})
    out["bin_eff"] = out["mb_bound"] / out["mbs"]
    return out


def _step_row(rank_mbs, lengths, flops, cap, dp, cm, secs) -> dict:
    q = plan_quality(rank_mbs, lengths, cap=cap, costs=flops)
    rank_flops = np.array([sum(float(flops[m].sum()) for m in r) for r in rank_mbs])
    bound = max(float(flops.sum()) / dp, float(flops.max()))
    return {"time_s": secs, "mbs": q["micro_batches"], "mb_bound": q["mb_lower_bound"],
            "viol": q["cap_violations"], "busiest/LB": float(rank_flops.max()) / bound,
            "cv": q["cost_cv"], "max/mean": q["cost_imbalance"],
            "spread/mean": q["cost_spread"] / float(rank_flops.mean()),
            "slot_imb": q["slot_imbalance_mean"],
            "sim_s": step_seconds(cm, rank_mbs, lengths),
            "sim_h100_s": step_seconds(H100, rank_mbs, lengths)}


def run_batch(name, rollouts, dps, cm, kernels, labels, package_limit, notes) -> list[dict]:
    gbs = max(1, rollouts.num_rollouts // STEPS)
    steps, _, _ = step_rollout_groups(rollouts, gbs)
    lengths = rollouts.total_len.astype(np.int64)
    flops = MODEL.forward_flops(lengths)
    n = int(lengths.size)
    rows = []
    for dp in dps:
        for packing, dist, workload in [(p, d, None) for p, d in OURS] + [
                ("balanced", "balanced", cm)]:
            cfg = ScheduleConfig(dp=dp, global_batch_size=gbs, max_tokens_per_gpu=CAP,
                                 packing=packing, distribution=dist, workload=workload)
            t0 = time.perf_counter()
            sched = build_schedule(rollouts, cfg, MODEL)
            secs = time.perf_counter() - t0
            per = []
            for st in sched.steps:
                idx = st.sample_indices
                local = np.empty(n, dtype=np.int64)
                local[idx] = np.arange(idx.size)
                ranks = [[local[m] for m in r] for r in st.ranks]
                per.append(_step_row(ranks, lengths[idx], flops[idx], CAP, dp, cm, 0.0))
            row = _aggregate(per)
            row["time_s"] = secs
            rows.append({"batch": name, "samples": n, "dp": dp,
                         "scheduler": CALIBRATED if workload is not None else f"{packing}+{dist}",
                         "ours=pkg": "",
                         "impl": "ours (slime's)" if packing != "balanced" else (
                             "ours, workload=sim_s model" if workload is not None else "ours"),
                         **row})
        for peer, fn in PEER_SCHEDULERS.items():
            use_pkg = peer in kernels and n <= package_limit
            if peer in kernels and not use_pkg:
                notes.add(f"{peer}: package kernels skipped above {package_limit} samples "
                          "(pure Python, minutes); transcription used")
            kw = {"kk": kernels[peer]["kk"]} if use_pkg and peer == "verl" else (
                {"kernels": kernels[peer]} if use_pkg else {})
            per, refused, same = [], None, True
            for _, idx in steps:
                lens_s = lengths[idx]
                t0 = time.perf_counter()
                try:
                    plan = fn(lens_s, dp=dp, cap=CAP, workload=flops[idx], **kw)
                except (PeerRefusal, RuntimeError, AssertionError) as e:  # the package's own
                    refused = str(e)[:200]
                    break
                secs = time.perf_counter() - t0
                if use_pkg:  # our code alone must give the very same plan
                    mine = fn(lens_s, dp=dp, cap=CAP, workload=flops[idx])
                    same &= _as_lists(mine) == _as_lists(plan)
                per.append(_step_row(plan.rank_micro_batches, lens_s, flops[idx], CAP, dp, cm,
                                     secs))
            if use_pkg:
                impl = labels[peer]
            elif PEER_SOURCES[peer].startswith("package"):
                impl = f"ours, read from {PEER_SOURCES[peer].split()[1]}"
            else:
                impl = "transcription"
            base = {"batch": name, "samples": n, "dp": dp, "scheduler": peer, "impl": impl,
                    "ours=pkg": ("yes" if same else "NO") if use_pkg and refused is None
                    else ""}
            if refused is not None:
                rows.append({**base, "refused": refused})
            else:
                rows.append({**base, **_aggregate(per)})
    return rows


def calibrated_verdict(df: pd.DataFrame, target: float = CALIBRATED_TARGET) -> dict:
    """Per cell (batch, dp): :data:`CALIBRATED`'s ``sim_s`` over the best other scheduler's.

    ``{"ratios": {"batch dp=N": ratio}, "worst": ..., "worst_cell": ..., "ok": worst <= target}``
    (refused peers do not count).
    """
    ratios = {}
    for (batch, dp), cell in df.groupby(["batch", "dp"], sort=False):
        mine = cell.loc[cell["scheduler"] == CALIBRATED, "sim_s"]
        others = cell.loc[cell["scheduler"] != CALIBRATED, "sim_s"].dropna()
        if mine.empty or others.empty:
            continue
        ratios[f"{batch} dp={dp}"] = float(mine.iloc[0] / others.min())
    worst_cell = max(ratios, key=ratios.get) if ratios else ""
    worst = ratios.get(worst_cell, float("nan"))
    return {"ratios": ratios, "worst": worst, "worst_cell": worst_cell,
            "ok": bool(ratios) and worst <= target}


def _as_lists(plan):
    return [[[int(i) for i in m] for m in r] for r in plan.rank_micro_batches]


def _fmt(spec):
    return lambda v: "-" if pd.isna(v) else format(v, spec)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4k and 16k, dp 16 and 64, math trace")
    ap.add_argument("--peer-packages", action="append", default=[], metavar="DIR",
                    help="folder holding verl / areal / openrlhf (pip --target); repeatable")
    ap.add_argument("--package-limit", type=int, default=PACKAGE_LIMIT,
                    help="largest batch the packages' pure-Python kernels are run on")
    ap.add_argument("--cost-model", type=Path, default=COST_MODEL)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    from benchmarks.run import synthetic

    cm, cm_label = cost_model(args.cost_model)
    kernels, labels, notes = package_kernels(args.peer_packages) if args.peer_packages else (
        {}, {}, ["no --peer-packages: every peer is our code"])
    dps = (16, 64) if args.quick else (16, 64, 128)
    sizes = (4096, 16384) if args.quick else (4096, 16384, 65536)
    traces = {k: v for k, v in bundled_traces().items() if not args.quick or k == "math"}
    batches = [(f"trace:{k}", read_trace(p)) for k, p in traces.items()]
    batches += [(f"synthetic:{n // 1024}k", synthetic(n, seed=n)) for n in sizes]
    t0, c0 = time.perf_counter(), time.process_time()
    rows, skip_notes = [], set()
    for name, r in batches:
        rows += run_batch(name, r, dps, cm, kernels, labels, args.package_limit, skip_notes)
    df = pd.DataFrame(rows)
    # step time relative to the best scheduler of the same batch and dp
    best = df.groupby(["batch", "dp"])["sim_s"].transform("min")
    df["sim/best"] = df["sim_s"] / best
    df["h100/best"] = df["sim_h100_s"] / df.groupby(["batch", "dp"])["sim_h100_s"].transform("min")
    cols = ["batch", "dp", "scheduler", "impl", "ours=pkg", "time_s", "mbs", "mb_bound",
            "bin_eff", "viol", "busiest/LB", "max/mean", "cv", "spread/mean", "slot_imb",
            "sim_s", "sim/best", "sim_h100_s", "h100/best"]
    if "refused" in df.columns:
        cols.append("refused")
        df["refused"] = df["refused"].map(lambda v: "" if pd.isna(v) else "refused")
    pd.set_option("display.width", 250)
    print("=" * 120)
    print(f"PEERS: packing + distribution, cap {CAP}, Qwen3-8B, {STEPS} steps per batch; "
          f"step time model: {cm_label}")
    print("=" * 120)
    fmt = {"time_s": ".3f", "mbs": ".0f", "mb_bound": ".0f", "bin_eff": ".4f", "viol": ".0f",
           "busiest/LB": ".4f", "max/mean": ".4f", "cv": ".4f", "spread/mean": ".4f",
           "slot_imb": ".3f", "sim_s": ".2f", "sim/best": ".4f", "sim_h100_s": ".2f",
           "h100/best": ".4f"}
    print(df.reindex(columns=cols).to_string(index=False,
                                             formatters={c: _fmt(f) for c, f in fmt.items()}))
    print("   sim_s: the step-time model above (calibrated: this machine's measured micro-batch "
          "cost of the CPU toy model, whose attention term outweighs the linear one from ~2k "
          "tokens); sim_h100_s: the FLOPs model the FLOPs-aware schedules balance (Qwen3-8B on "
          "H100 at 45%, 4 ms per micro-batch; attention outweighs linear only from ~51k tokens). "
          "A scheduler that weighs L^2 more (verl's 24576 L + L^2) gains under the first.")
    for note in list(notes) + sorted(skip_notes):
        print(f"   note: {note}")
    cal = calibrated_verdict(df)
    print(f"{CALIBRATED} (workload = the sim_s model, {cm_label}) against the best other "
          f"scheduler of each cell (sim_s): worst {cal['worst']:.4f}x at {cal['worst_cell']}; "
          f"within {CALIBRATED_TARGET}x in every cell: {cal['ok']}")
    print(f"total {time.perf_counter() - t0:.0f} s wall, {time.process_time() - c0:.0f} s CPU "
          "(the CPU figure is what a quiet machine would take)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"cap": CAP, "model": "qwen3-8b", "steps": STEPS, "cost_model": cm_label,
               "notes": list(notes) + sorted(skip_notes), "calibrated": cal,
               "rows": json.loads(df.to_json(orient="records"))}
    args.out.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
