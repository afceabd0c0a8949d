"""What does writing a run's parameter file cost, written whole or in pieces?

:func:`~varbatch_kit.train.step.tensor_files.save_tensors` writes the parameter, gradient
and log-prob files of a run in pieces of at most 1 MiB
(:data:`~varbatch_kit.train.step.tensor_files.WRITE_PIECE`), the bytes ``torch.save``
would write. This benchmark saves the same 336 MB of float64 tensors (20 tensors: the
parameters of SmolLM2-135M truncated to 4 layers, as the layout matrices save them twice per
run) with ``torch.save`` to the path, no CRC-32 (**whole**: how the engine saved them before)
and with ``save_tensors`` (**pieces**), alternating A and B in one process and one folder
that keeps every file until the end (as a run folder keeps its files: each write takes fresh
page cache), checks that both read back bitwise, and prints the median seconds (wall, and CPU
of the process) and their ratio, pair by pair.

On the CI machine, a virtual machine whose free memory is handed back to its host, the
whole writes make the page cache take fresh 2 MiB folios (about 7x the copy); elsewhere the
two sides are expected to be alike.

Run: ``python -m benchmarks.file_writes`` (``--quick``: 3 pairs instead of 7; ``--dir`` the
folder to write in, default ``build/bench/file_writes``); writes
``build/bench/file_writes.json``.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

from benchmarks._ab import ROOT, paired, pairs_text, write

#: 20 tensors of 2.1M float64 values: 336 MB, truncated SmolLM2's parameters in float64
TENSORS, VALUES = 20, 42_000_000 // 20


def _whole(obj, path: Path) -> None:
    import torch
    from torch.utils.serialization import config as serialization_config

    with serialization_config.patch({"save.compute_crc32": False}):
        torch.save(obj, path)


def _timed(fn, obj, path: Path) -> tuple[float, float]:
    t, c = time.perf_counter(), time.process_time()
    fn(obj, path)
    return time.perf_counter() - t, time.process_time() - c


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 pairs instead of 7 (2 GB of "
                        "files instead of 4.7 GB, removed at the end)")
    parser.add_argument("--dir", type=Path, default=ROOT / "build" / "bench" / "file_writes",
                        help="the folder to write the files in (removed afterwards)")
    args = parser.parse_args(argv)
    import torch

    from varbatch_kit.train.step.tensor_files import save_tensors

    g = torch.Generator().manual_seed(0)
    obj = {f"layer{i}.weight": torch.randn(VALUES, dtype=torch.float64, generator=g)
           for i in range(TENSORS)}
    size_mb = sum(t.numel() * 8 for t in obj.values()) / 1e6
    args.dir.mkdir(parents=True, exist_ok=True)
    walls: dict[str, list[float]] = {"whole": [], "pieces": []}
    cpus: dict[str, list[float]] = {"whole": [], "pieces": []}
    try:
        for k in range(3 if args.quick else 7):
            for side, fn in (("whole", _whole), ("pieces", save_tensors)):
                path = args.dir / f"{side}{k}.pt"
                wall, cpu = _timed(fn, obj, path)
                back = torch.load(path, weights_only=True, mmap=True)
                if not all(torch.equal(back[n], obj[n]) for n in obj):
                    raise AssertionError(f"{side}: the file does not read back bitwise")
                del back
                walls[side].append(wall)
                cpus[side].append(cpu)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    wall_row = paired("whole", walls["whole"], "pieces", walls["pieces"], "s")
    cpu_row = paired("whole", cpus["whole"], "pieces", cpus["pieces"], "cpu_s")
    print(f"a {size_mb:.0f} MB float64 parameter file, torch.save written whole against "
          f"save_tensors in 1 MiB pieces ({wall_row['pairs']} pairs)")
    for name, row, unit in (("wall", wall_row, "s"), ("CPU", cpu_row, "cpu_s")):
        print(f"  {name}: whole {row[f'whole_{unit}_median']:.3f} s, pieces "
              f"{row[f'pieces_{unit}_median']:.3f} s; whole / pieces "
              f"{row['ratio_whole_over_pieces_median']:.2f} ({pairs_text(row)})")
    out = write("file_writes", {"size_mb": size_mb, "wall": wall_row, "cpu": cpu_row})
    print(f"  wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
