"""slime's (Megatron's) flags that decide a GPU's memory → ``MemoryLayout``.

======================================  =======================================
slime flag                              MemoryLayout field
======================================  =======================================
``--tensor-model-parallel-size``        ``tp``
``--sequence-parallel``                 ``sequence_parallel`` (off at tp 1)
``--bf16``, ``--fp16``                  ``precision = "bf16"`` (16-bit parameters
                                        and activations, fp32 main copies)
``--use-distributed-optimizer``         ``distributed_optimizer``
``--recompute-granularity``             ``recompute`` (``full`` / ``selective``)
the schedule's ``dp``, ``cp``, ``pp``,   the same fields
``vpp``, ``mb_group``
======================================  =======================================

Context parallelism is modelled as all-gather CP (each layer keeps the group's K/V), an
upper bound for Megatron's ring attention.
"""

from __future__ import annotations

import argparse
from typing import Any

from varbatch_kit.core.config import ScheduleConfig
from varbatch_kit.core.memory import MemoryLayout

__all__ = ["MEMORY_FLAG_TABLE", "memory_layout_from_slime_args"]

#: the memory flags, as ``(flag, argparse keyword arguments)`` rows of slime's parser (the
#: parallel sizes are schedule flags)
MEMORY_FLAG_TABLE: tuple[tuple[str, dict[str, Any]], ...] = (
    ("--bf16", {"action": "store_true"}),
    ("--fp16", {"action": "store_true"}),
    ("--sequence-parallel", {"action": "store_true"}),
    ("--use-distributed-optimizer", {"action": "store_true"}),
    ("--recompute-granularity", {"choices": ("full", "selective")}),
)


def memory_layout_from_slime_args(ns: argparse.Namespace, cfg: ScheduleConfig) -> MemoryLayout:
    """The memory layout of a parsed slime command line whose schedule is ``cfg``."""
    tp = int(getattr(ns, "tensor_model_parallel_size", None) or 1)
    half = bool(getattr(ns, "bf16", False) or getattr(ns, "fp16", False))
    return MemoryLayout(
        dp=cfg.dp, cp=cfg.cp, tp=tp, pp=cfg.pp, vpp=cfg.vpp,
        sequence_parallel=bool(getattr(ns, "sequence_parallel", False)) and tp > 1,
        precision="bf16" if half else "fp32",
        recompute=getattr(ns, "recompute_granularity", None) or "none",
        distributed_optimizer=bool(getattr(ns, "use_distributed_optimizer", False)),
        mb_group=cfg.mb_group if cfg.vpp > 1 else None)
