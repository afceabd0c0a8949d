"""Peak memory of the log-prob step: the float64 ``[R, V]`` path against the chunked one.

The log-prob step is what the training step runs on the response rows' logits
``[R, V]`` (float32, the model's output): per-token log-prob, entropy and
argmax hit, then the backward to the logits. Before: the path
``train.batch.response_token_stats`` ran until the chunked one replaced it
(logits cast to float64, a full ``log_softmax``, ``exp`` for the entropy;
:func:`float64_path`). After:
:func:`varbatch_kit.report.objective.token_stats.chunked_token_stats` (float32
chunks of tokens, per-token float64 sums, softmax recomputed in backward).

At a 152k vocabulary and 16k response tokens the float64 path needs tens of
GB, more than this machine has, so the figures come from a tracker over the
step run on ``meta`` tensors (shapes and dtypes, no data): the engine's CPU tracker
(:class:`~varbatch_kit.train.step.peak_memory.LiveTensorBytes`),
a ``TorchDispatchMode`` that counts the bytes of every tensor storage an op
creates until the storage is freed. The peak counts every live tensor byte:
the input logits, what the step allocates, and the gradient it returns. Two
cross-checks: torch's own ``MemTracker`` (``torch.distributed._tools.mem_tracker``,
slow to import, so only here) on the same full-size step; and, at a small size
where both paths fit, the same step on real tensors in a fresh process, its
peak resident memory (``VmHWM``, reset after the logits are made) above the
resident memory it started from, with glibc's mmap threshold fixed so freed
tensors leave the process.

Run: ``python -m benchmarks.logprob_memory`` (``--quick``: a smaller
cross-check); writes ``build/bench/logprob_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from varbatch_kit.report.objective.token_stats import (
    DEFAULT_CHUNK_ELEMENTS,
    chunked_token_stats,
)
from varbatch_kit.train.step.peak_memory import LiveTensorBytes

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 152_064  # Qwen2.5 / Qwen3's padded vocabulary
RESPONSE_TOKENS = 16_384
CASES = [  # (temperature, entropy_grad): the default step, and one with an entropy bonus
    (1.0, False), (0.8, True)]
GOAL = 4.0


def float64_path(logits, targets, temperature, entropy_grad):
    """The log-prob step as ``response_token_stats`` computed it before (float64 ``[R, V]``)."""
    x = logits.double()
    if temperature != 1.0:
        x = x / float(temperature)
    logp_all = torch.log_softmax(x, dim=-1)
    logprob = logp_all.gather(-1, targets[:, None])[:, 0]
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    with torch.no_grad():
        correct = (logp_all.argmax(-1) == targets).double()
    return {"logprob": logprob, "entropy": entropy if entropy_grad else entropy.detach(),
            "correct": correct}


def chunked_path(logits, targets, temperature, entropy_grad, chunk_tokens=None):
    """The log-prob step now (:mod:`varbatch_kit.report.objective.token_stats`)."""
    return chunked_token_stats(logits, targets, temperature=temperature,
                               entropy_grad=entropy_grad, chunk_tokens=chunk_tokens)


PATHS = {"float64": float64_path, "chunked": chunked_path}


def _step(path: str, logits, targets, temperature, entropy_grad, chunk_tokens):
    """Forward and backward of the log-prob step; the logits' gradient is made, then dropped."""
    kw = {"chunk_tokens": chunk_tokens} if path == "chunked" else {}
    out = PATHS[path](logits, targets, temperature, entropy_grad, **kw)
    loss = out["logprob"].sum()
    if entropy_grad:
        loss = loss + 0.01 * out["entropy"].sum()
    (grad,) = torch.autograd.grad(loss, logits)
    return grad.shape


def _step_inputs(rows: int, vocab: int, device: str):
    logits = torch.empty(rows, vocab, device=device).requires_grad_(True)
    return logits, torch.zeros(rows, dtype=torch.long, device=device)


def traced_peak(path: str, rows: int, vocab: int, *, temperature: float = 1.0,
                entropy_grad: bool = False, chunk_tokens: int | None = None,
                device: str = "meta") -> dict:
    """Peak live tensor bytes of the step (``LiveTensorBytes``), and the inputs' bytes."""
    logits, targets = _step_inputs(rows, vocab, device)
    tracker = LiveTensorBytes()
    tracker.track(logits, targets)
    with tracker:
        _step(path, logits, targets, temperature, entropy_grad, chunk_tokens)
    input_bytes = logits.untyped_storage().nbytes() + targets.untyped_storage().nbytes()
    return {"peak_bytes": int(tracker.peak), "input_bytes": int(input_bytes)}


def memtracker_peak(path: str, rows: int, vocab: int, *, temperature: float = 1.0,
                    entropy_grad: bool = False) -> int:
    """The same peak by torch's ``MemTracker`` (meta tensors), the tracker's cross-check."""
    from torch.distributed._tools.mem_tracker import MemTracker

    logits, targets = _step_inputs(rows, vocab, "meta")
    tracker = MemTracker()
    tracker.track_external(logits, targets)
    with tracker:
        _step(path, logits, targets, temperature, entropy_grad, None)
    return int(tracker.get_tracker_snapshot("peak")[torch.device("meta")]["Total"])


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _rss_child(spec: dict) -> dict:
    """In a fresh process: the step on real tensors, peak RSS above the RSS it started from."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(spec["rows"], spec["vocab"], generator=g) * 3).requires_grad_(True)
    targets = torch.randint(0, spec["vocab"], (spec["rows"],), generator=g)
    # warm up the kernels (and their one-off allocations) on a sliver, then reset the peak
    _step(spec["path"], logits[:2].detach().requires_grad_(True), targets[:2],
          spec["temperature"], spec["entropy_grad"], spec["chunk_tokens"])
    base = _rss_kib("VmRSS")
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    except OSError:
        pass
    _step(spec["path"], logits, targets, spec["temperature"], spec["entropy_grad"],
          spec["chunk_tokens"])
    return {"rss_above_start_bytes": (_rss_kib("VmHWM") - base) * 1024}


def rss_peak(path: str, rows: int, vocab: int, *, temperature: float = 1.0,
             entropy_grad: bool = False, chunk_tokens: int | None = None) -> int:
    """Peak resident bytes the step added in a fresh process (the logits already made)."""
    spec = {"path": path, "rows": rows, "vocab": vocab, "temperature": temperature,
            "entropy_grad": entropy_grad, "chunk_tokens": chunk_tokens}
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "benchmarks.logprob_memory", "--rss-child",
                           json.dumps(spec)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600, check=True)
    return int(json.loads(done.stdout.strip().splitlines()[-1])["rss_above_start_bytes"])


def full_size_rows(rows: int = RESPONSE_TOKENS, vocab: int = VOCAB) -> list[dict]:
    """Before and after at the full size (meta tensors), per case."""
    out = []
    for temperature, entropy_grad in CASES:
        kw = {"temperature": temperature, "entropy_grad": entropy_grad}
        before = traced_peak("float64", rows, vocab, **kw)
        after = traced_peak("chunked", rows, vocab, **kw)
        out.append({
            "rows": rows, "vocab": vocab, "temperature": temperature,
            "entropy_grad": entropy_grad, "logits_bytes": before["input_bytes"],
            "memtracker_before_bytes": memtracker_peak("float64", rows, vocab, **kw),
            "memtracker_after_bytes": memtracker_peak("chunked", rows, vocab, **kw),
            "before_peak_bytes": before["peak_bytes"], "after_peak_bytes": after["peak_bytes"],
            "ratio": before["peak_bytes"] / after["peak_bytes"],
            "before_added_bytes": before["peak_bytes"] - before["input_bytes"],
            "after_added_bytes": after["peak_bytes"] - after["input_bytes"],
        })
        out[-1]["added_ratio"] = out[-1]["before_added_bytes"] / out[-1]["after_added_bytes"]
    return out


def cross_check_rows(rows: int, vocab: int, chunk_tokens: int) -> list[dict]:
    """Tracker (meta) against real peak RSS, both above the logits, at a size that fits."""
    out = []
    for path in PATHS:
        for temperature, entropy_grad in CASES:
            kw = {"temperature": temperature, "entropy_grad": entropy_grad,
                  "chunk_tokens": chunk_tokens if path == "chunked" else None}
            traced = traced_peak(path, rows, vocab, **kw)
            rss = rss_peak(path, rows, vocab, **kw)
            added = traced["peak_bytes"] - traced["input_bytes"]
            out.append({"path": path, "rows": rows, "vocab": vocab, **kw,
                        "traced_added_bytes": added, "rss_added_bytes": rss,
                        "rss/traced": rss / added})
    return out


def _gb(b: float) -> str:
    return f"{b / 1e9:8.2f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller cross-check")
    parser.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rss_child is not None:
        print(json.dumps(_rss_child(json.loads(args.rss_child))))
        return
    full = full_size_rows()
    print(f"log-prob step (forward + backward), {RESPONSE_TOKENS} response tokens x {VOCAB} "
          "vocabulary, float32 logits; peak live tensor bytes (LiveTensorBytes on meta tensors)")
    print(f"{'temperature':>11s} {'entropy grad':>12s} {'logits GB':>9s} | {'peak GB: before':>15s}"
          f" {'after':>8s} {'ratio':>6s} | {'added GB: before':>16s} {'after':>8s} {'ratio':>6s}")
    for r in full:
        print(f"{r['temperature']:11.2f} {str(r['entropy_grad']):>12s} {_gb(r['logits_bytes']):>9s}"
              f" | {_gb(r['before_peak_bytes']):>15s} {_gb(r['after_peak_bytes'])} "
              f"{r['ratio']:5.2f}x | {_gb(r['before_added_bytes']):>16s} "
              f"{_gb(r['after_added_bytes'])} {r['added_ratio']:5.2f}x")
    agree = all(r["memtracker_before_bytes"] == r["before_peak_bytes"]
                and r["memtracker_after_bytes"] == r["after_peak_bytes"] for r in full)
    print(f"   torch's MemTracker on the same steps: {'the same peaks' if agree else 'DIFFERS: '}"
          + ("" if agree else str([(r["memtracker_before_bytes"], r["memtracker_after_bytes"])
                                   for r in full])))
    worst = min(r["ratio"] for r in full)
    print(f"   peak includes the input logits and the gradient returned; 'added' is above the "
          f"logits. Goal: peak falls >= {GOAL:g}x: {'met' if worst >= GOAL else 'MISSED'} "
          f"(worst {worst:.2f}x)\n")
    rows, vocab = (256, 16_384) if args.quick else (1024, 16_384)
    # the full size's share of the tokens per chunk (110 of 16384 at the default chunk)
    chunk = max(1, rows * (DEFAULT_CHUNK_ELEMENTS // VOCAB) // RESPONSE_TOKENS)
    check = cross_check_rows(rows, vocab, chunk)
    print(f"cross-check at {rows} x {vocab} (chunk {chunk} tokens): tracker vs real peak RSS in "
          "a fresh process, both above the logits")
    print(f"{'path':>8s} {'temperature':>11s} {'entropy grad':>12s} {'traced MB':>10s} "
          f"{'RSS MB':>8s} {'RSS/traced':>10s}")
    for r in check:
        print(f"{r['path']:>8s} {r['temperature']:11.2f} {str(r['entropy_grad']):>12s} "
              f"{r['traced_added_bytes'] / 1e6:10.1f} {r['rss_added_bytes'] / 1e6:8.1f} "
              f"{r['rss/traced']:10.3f}")
    out = ROOT / "build" / "bench" / "logprob_memory.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"full_size": full, "cross_check": check, "goal": GOAL}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
