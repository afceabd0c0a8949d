"""How much do CPU training workers gain from keeping large allocations in glibc's heap?

glibc serves every allocation above 32 MiB with a fresh ``mmap`` that the kernel zero-fills
page by page; a float64 LM head's gradient and logits are hundreds of MiB every micro-batch.
The launcher sets :data:`varbatch_kit.train.runs.launch.CPU_MALLOC_ENV` for CPU workers (a
value the user set wins). This benchmark trains the same launch (SmolLM2-135M truncated to 4
layers, float64, 3 runs of 2 steps: the shape of the layout-matrix tests) with that setting
(**heap**) and with glibc's defaults set explicitly (**mmap**), alternating A and B, and
prints the median wall times and their ratio, pair by pair.

Run: ``python -m benchmarks.worker_malloc`` (``--quick``: 1 pair instead of 3); writes
``build/bench/worker_malloc.json``. Needs the SmolLM2 checkpoint (skipped without it).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from benchmarks._ab import ROOT, paired, pairs_text, write
from varbatch_kit import Rollouts
from varbatch_kit.train import TrainConfig, compare

#: glibc's own defaults, set explicitly: the launcher then leaves them (the user's value wins)
GLIBC_DEFAULTS = {"MALLOC_MMAP_MAX_": "65536", "MALLOC_TRIM_THRESHOLD_": str(128 * 1024)}


def _rollouts() -> Rollouts:
    rng = np.random.default_rng(11)
    counts = [1, 2, 1, 1, 2, 1] * 2
    rid = np.repeat(np.arange(len(counts)), counts)
    resp = rng.integers(5, 50, rid.size)
    resp[0] = 100
    return Rollouts(rng.integers(3, 7, rid.size), resp, rid)


def _launch(path: str, env: dict, work: Path) -> float:
    base = TrainConfig().with_(path=path, num_layers=4, max_steps=2, global_batch_size=6,
                               max_tokens_per_gpu=64, packing="first_fit", precision="fp64",
                               save_params_at=(1, 2), timeout_s=900)
    configs = [base.with_(label=f"run {k}", mode=m)
               for k, m in enumerate(("per_rollout_mean", "per_token", "per_rollout_mean"))]
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        t0 = time.perf_counter()
        compare(configs, _rollouts(), out_dir=work, progress=False)
        return time.perf_counter() - t0
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 pair instead of 3")
    parser.add_argument("--models", default=os.environ.get("VARBATCH_KIT_MODELS",
                                                           str(ROOT / "build" / "models")))
    args = parser.parse_args(argv)
    from varbatch_kit.train.model.smollm2 import SmolLM2Unavailable, smollm2_checkpoint

    try:
        path = str(smollm2_checkpoint(Path(args.models)))
    except SmolLM2Unavailable as e:
        print(f"worker_malloc skipped: {e}")
        return
    pairs = 1 if args.quick else 3
    # the data's one long sample is over the cap on purpose (it trains alone, as in the
    # layout matrices): said once here, not by every launch
    from varbatch_kit.core.build import OversizeSampleWarning

    print("one sample of 106 tokens trains alone over the 64-token cap (the matrices' shape)")
    heap, mmap = [], []
    with tempfile.TemporaryDirectory(prefix="varbatch_malloc_") as tmp, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", OversizeSampleWarning)
        _launch(path, {}, Path(tmp) / "warm")  # page cache, checkpoint files, imports
        for k in range(pairs):
            heap.append(_launch(path, {}, Path(tmp) / f"heap{k}"))
            mmap.append(_launch(path, GLIBC_DEFAULTS, Path(tmp) / f"mmap{k}"))
    row = paired("heap", heap, "mmap", mmap, "s")
    print(f"CPU workers, SmolLM2 4 layers float64, 3 runs x 2 steps, {pairs} pair(s): "
          f"heap {row['heap_s_median']:.1f} s, mmap (glibc defaults) "
          f"{row['mmap_s_median']:.1f} s, ratio heap/mmap {row['ratio_heap_over_mmap_median']:.2f}"
          f" ({pairs_text(row)})")
    write("worker_malloc", row)

if __name__ == "__main__":
    main()
