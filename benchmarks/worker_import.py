"""What does a CPU training worker pay before its first step, with and without
:func:`varbatch_kit.train.parallel.megatron_import.import_megatron`?

Every torchrun worker is a new interpreter that imports torch, megatron-core and the engine,
builds an optimizer and takes a step; a launch pays it once per rank. This benchmark runs
that start in fresh interpreters, **fast** (``import_megatron()``: ``torch.compile``
deferred, the collector paused during the import) against **plain** (the same imports,
megatron's notices hidden the same way), alternating A and B, and prints the median CPU
seconds (user + system of the child) and their ratio, pair by pair. torch's first
optimizer step imports ``torch._dynamo`` in both (``torch.optim``'s own step wrapper), so it
is in both figures.

Run: ``python -m benchmarks.worker_import`` (``--quick``: 3 pairs instead of 7); writes
``build/bench/worker_import.json``.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import textwrap

from benchmarks._ab import ROOT, paired, pairs_text, write

START = """
    import sys
    {prepare}
    import torch
    import varbatch_kit.train.runs.worker, varbatch_kit.train.model.gpt
    import varbatch_kit.train.step.train_step, varbatch_kit.train.step.pipeline_schedule
    import varbatch_kit.train.parallel.cpu_shim, varbatch_kit.train.runs.run_state
    from megatron.core.optimizer import OptimizerConfig  # noqa: F401
    p = torch.nn.Parameter(torch.ones(8))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.sum().backward()
    opt.step()
    print("inductor" if "torch._inductor" in sys.modules else "no inductor")
"""
PREPARE = {
    "fast": "from varbatch_kit.train.parallel.megatron_import import import_megatron\n"
            "    import_megatron()",
    "plain": "from varbatch_kit.train.parallel.megatron_warnings import "
             "quiet_optional_dependency_warnings\n"
             "    quiet_optional_dependency_warnings()\n"
             "    from varbatch_kit.train.parallel.megatron_import import WORKER_MODULES\n"
             "    import importlib\n"
             "    for m in WORKER_MODULES: importlib.import_module(m)",
}


def cpu_seconds(kind: str) -> tuple[float, str]:
    """User + system CPU of one fresh interpreter doing a worker's start, and what it says."""
    code = textwrap.dedent(START.format(prepare=PREPARE[kind]))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, res.stdout.strip().splitlines()[-1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 pairs instead of 7")
    args = parser.parse_args(argv)
    pairs = 3 if args.quick else 7
    cpu_seconds("fast")  # warm-up: the page cache, .pyc files
    fast, plain, said = [], [], {}
    for _ in range(pairs):
        for kind, out in (("fast", fast), ("plain", plain)):
            cpu, said[kind] = cpu_seconds(kind)
            out.append(cpu)
    row = {**paired("fast", fast, "plain", plain, "cpu_s"), "compiler_loaded": said}
    print(f"a worker's start (imports, first optimizer step), {pairs} pair(s): fast "
          f"{row['fast_cpu_s_median']:.2f} s CPU, plain {row['plain_cpu_s_median']:.2f} s, "
          f"ratio fast/plain {row['ratio_fast_over_plain_median']:.2f} ({pairs_text(row)}; "
          f"torch._inductor at the end: fast {said['fast']!r}, plain {said['plain']!r})")
    write("worker_import", row)

if __name__ == "__main__":
    main()
