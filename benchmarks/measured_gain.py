"""The large-gain case of ``benchmarks.measured``: one micro-batch per rank on a compact slime dump.

Where the policies differ by 1-3 %, this machine's noise decides the
measured order. This case is one where the simulator predicts a large gain:
the compact rollouts (several samples each) of the realistic slime dump
(``tests/golden/realistic_dump/rollout_0.pt``, written by slime's own
``Sample`` and ``save_debug_rollout_data``), three rollouts per step, dp=2,
``--max-tokens-per-gpu 32768``: each step fits one micro-batch per rank.
slime's dynamic options then all cut a step the same way, one bin split
in two by tokens (or Karmarkar-Karp on the toy model's FLOPs into that one
bin), while this CPU's measured cost weighs ``L^2`` more than either.

- **slime's best flag**: :func:`varbatch_kit.compat.slime.recommend` on the
  user's command line (:func:`user_flags`), simulated with the calibrated
  cost model, the global batch size kept (the same steps): the fastest safe
  slime flags.
- **ours**: ``balanced`` at the user's cap with the calibrated workload
  (``ScheduleConfig(workload=cost_model)``).

Both train ``rounds`` times in turn; the verdict
(:func:`benchmarks._intervals.gain_verdict`): the measured gain of ours over
slime's best flag is at least half the predicted one, and the 95 % intervals
over rounds of the two mean step times separate. The dump's lengths only are
used (the toy model's vocabulary is not the dump's tokenizer's).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

DUMP = Path(__file__).resolve().parents[1] / "tests" / "golden" / "realistic_dump" / "rollout_0.pt"

#: ``rollouts``: how many of the dump's compact rollouts (None: all 71)
FULL = {"rollouts": None, "gbs": 3, "cap": 32768, "rounds": 5}
QUICK = {"rollouts": 24, "gbs": 3, "cap": 32768, "rounds": 3}


def compact_rollouts(n: int | None = None, path: Path = DUMP):
    """The dump's rollouts of two or more samples (the first ``n`` of them), lengths only."""
    from varbatch_kit import Rollouts, read_trace

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dump = read_trace(path)
    _, groups = dump.rollout_order()
    groups = [g for g in groups if len(g) >= 2][:n]
    keep = np.sort(np.concatenate(groups))
    return Rollouts(prompt_len=dump.prompt_len[keep], response_len=dump.response_len[keep],
                    rollout_id=dump.rollout_id[keep])


def user_flags(num_rollouts: int, p: dict) -> str:
    """The user's slime command line: dp=2, ``gbs`` rollouts per step, the cap, --balance-data."""
    rollouts = num_rollouts - num_rollouts % p["gbs"]
    return (f"--actor-num-gpus-per-node 2 --rollout-batch-size {rollouts} "
            f"--n-samples-per-prompt 1 --num-steps-per-rollout {rollouts // p['gbs']} "
            f"--use-dynamic-batch-size --max-tokens-per-gpu {p['cap']} --balance-data")


def schedules(rollouts, p: dict, model, shape):
    """``(recommendation, slime's best ScheduleConfig, ours)`` for the case.

    ``model``: the calibrated ``MicroBatchCostModel`` (the simulator's and our
    workload); ``shape``: the trained model's :class:`ModelShape` (slime's FLOPs).
    """
    from varbatch_kit.compat.slime import recommend

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rec = recommend(rollouts, user_flags(rollouts.num_rollouts, p), shape, hardware=model,
                        vary_global_batch_size=False)
    ours = rec.user_config.with_(packing="balanced", distribution="balanced", workload=model)
    return rec, rec.config, ours
