"""How fast is a slime dump read? The restricted loader against torch's two loaders.

Generates a dump shaped like a slime ``--save-debug-rollout-data`` file of about 37 MB
(``{"rollout_id": k, "samples": [Sample.to_dict(), ...]}``: per sample the token ids,
loss mask and rollout log-probs as Python lists, prompt and response text, reward,
status), then times, in this process and interleaved (median of the runs):

- ``torch.load(weights_only=False)``: unrestricted, the speed of the file (and unsafe);
- ``torch.load(weights_only=True)``: torch's restricted, pure-Python unpickler;
- varbatch_kit's loader (:mod:`varbatch_kit.core.slime_dumps`): the C unpickler restricted
  to the same globals, file read only (``_load_pt``);
- ``read_slime_dump`` whole (load and conversion to ``Rollouts``), first read and a second
  read of the unchanged file (the per-process cache).

The target: varbatch_kit's loader within 1.5x of the unrestricted load. Run:
``python -m benchmarks.dump_loading`` (``--quick``: a 9 MB dump, 3 runs); writes
``build/bench/dump_loading.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def make_dump(path: Path, samples: int, seed: int = 0) -> int:
    """A slime-shaped dump of ``samples`` samples at ``path``; returns its size in bytes."""
    import torch

    rng = random.Random(seed)
    out = []
    for i in range(samples):
        prompt, resp = rng.randint(200, 2000), rng.randint(500, 6000)
        out.append({
            "group_index": i // 8, "index": i, "prompt": "p" * 3 * prompt,
            "tokens": [rng.randrange(150_000) for _ in range(prompt + resp)],
            "response": "r" * 3 * resp, "response_length": resp, "label": "1",
            "reward": rng.random(), "loss_mask": [1] * resp,
            "rollout_log_probs": [-rng.random() for _ in range(resp)],
            "status": "completed", "metadata": {}, "rollout_id": i // 8,
            "weight_versions": ["3"]})
    torch.save({"rollout_id": 3, "samples": out}, path)
    return path.stat().st_size


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 9 MB dump, 3 runs")
    args = parser.parse_args(argv)
    import torch

    from varbatch_kit.core import slime_dumps

    runs = 3 if args.quick else 5
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rollout_3.pt"
        size = make_dump(path, 128 if args.quick else 512)
        ways = {
            "torch.load unrestricted": lambda: torch.load(path, weights_only=False),
            "torch.load weights_only": lambda: torch.load(path, weights_only=True),
            "varbatch_kit loader": lambda: slime_dumps._load_pt(path),
        }
        times: dict[str, list[float]] = {k: [] for k in ways}
        for _ in range(runs):  # interleaved: load drifts alike for all three
            for name, fn in ways.items():
                times[name].append(_time(fn))
        slime_dumps._READ.clear()
        first = _time(lambda: slime_dumps.read_slime_dump(path))
        again = _time(lambda: slime_dumps.read_slime_dump(path))
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["torch.load unrestricted"]
    print(f"dump of {size / 1e6:.1f} MB, median of {runs} runs:")
    for name, t in med.items():
        print(f"  {name:26s} {t:7.2f} s  {t / base:5.2f}x the unrestricted load")
    print(f"  read_slime_dump, first read {first:.2f} s; the same file again {again:.3f} s "
          "(cached)")
    out = {"bytes": size, "runs": runs, "median_s": med,
           "ratio_to_unrestricted": {k: t / base for k, t in med.items()},
           "read_slime_dump_s": first, "read_slime_dump_again_s": again}
    dest = ROOT / "build" / "bench" / "dump_loading.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
