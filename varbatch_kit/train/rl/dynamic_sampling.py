"""Dynamic sampling: generate prompt groups until a rollout batch of kept groups is full.

slime's rollout (``--dynamic-sampling-filter-path``, ``--over-sampling-batch-size``)
generates ``over_sampling_batch_size`` prompts at a time, judges every finished group with
the filter, and keeps generating until ``rollout_batch_size`` groups were kept; a group the
filter rejects is dropped unless its verdict says ``keep_when_insufficient`` and dropping it
would leave fewer candidates (kept groups and groups not judged yet) than the batch needs.
That filtering is what makes the number of samples per step vary in DAPO-style training.

:func:`collect_groups` does the same one round after another (generation here is
synchronous): round ``r`` generates the next ``over_sampling_batch_size`` prompts, its
groups are judged in prompt order, and the kept groups (the first ``rollout_batch_size``)
are renumbered into one :class:`~varbatch_kit.Rollouts`: group ``g`` (the ``g``-th kept)
gets ``group_index`` ``g`` and rollout ids ``g * n + j``. :class:`SamplingLog` says what
happened (groups generated, kept, dropped and why, rounds).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from varbatch_kit.checks import positive_int
from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.train.rl.task import Sample, filter_group

__all__ = ["MAX_ROUNDS", "SamplingLog", "collect_groups", "group_samples"]

#: rounds of generation without filling the batch after which :func:`collect_groups` gives up
MAX_ROUNDS = 16


@dataclass
class SamplingLog:
    """What :func:`collect_groups` did: rounds of generation, groups generated / kept /
    dropped, and the drop reasons with their counts."""

    rounds: int = 0
    generated: int = 0
    kept: int = 0
    dropped: int = 0
    reasons: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"sampling_rounds": self.rounds, "groups_generated": self.generated,
                "groups_kept": self.kept, "groups_dropped": self.dropped,
                "drop_reasons": dict(self.reasons)}


def group_samples(rollouts: Rollouts, group: int) -> list[Sample]:
    """The samples of prompt group ``group`` as the filter sees them (their reward is their
    rollout's, as the engine trains them)."""
    ex = rollouts.extra
    rows = np.flatnonzero(ex["group_index"].to_numpy() == group)
    return [Sample(index=int(rollouts.rollout_id[i]), group_index=int(group),
                   prompt=str(ex["question"].iloc[i]), response=str(ex["response"].iloc[i]),
                   label=ex["answer"].iloc[i], tokens=list(ex["tokens"].iloc[i]),
                   response_length=int(rollouts.response_len[i]),
                   reward=float(ex["reward"].iloc[i])) for i in rows]


def _renumbered(parts: list[tuple[Rollouts, int]], n: int) -> Rollouts:
    """The kept groups ``(rollouts of their round, group)`` as one batch, renumbered."""
    import pandas as pd

    prompt, response, rid, frames = [], [], [], []
    for g, (r, group) in enumerate(parts):
        rows = np.flatnonzero(r.extra["group_index"].to_numpy() == group)
        prompt.append(r.prompt_len[rows])
        response.append(r.response_len[rows])
        rid.append(g * n + (r.rollout_id[rows] - group * n))
        frames.append(r.extra.iloc[rows].assign(group_index=g))
    return Rollouts(prompt_len=np.concatenate(prompt), response_len=np.concatenate(response),
                    rollout_id=np.concatenate(rid),
                    extra=pd.concat(frames, ignore_index=True))


def collect_groups(generate: Callable[[int, int], Rollouts], *, batch_size: int,
                   n_samples_per_prompt: int, over_sampling_batch_size: int | None = None,
                   group_filter: Callable | None = None, args: Any = None,
                   max_rounds: int = MAX_ROUNDS) -> tuple[Rollouts, SamplingLog]:
    """Generate and filter prompt groups until ``batch_size`` are kept (module docstring).

    ``generate(count, round)`` returns the rollouts of the next ``count`` prompts (groups
    ``0 .. count-1``, rollout ids ``group * n_samples_per_prompt + j``);
    ``over_sampling_batch_size`` defaults to ``batch_size``; ``group_filter`` and ``args``
    as in :func:`~varbatch_kit.train.rl.task.filter_group`. Raises ``RuntimeError`` after
    ``max_rounds`` rounds without a full batch, naming the drop reasons.
    """
    positive_int("rollout_batch_size", batch_size)
    positive_int("n_samples_per_prompt", n_samples_per_prompt)
    over = batch_size if over_sampling_batch_size is None else over_sampling_batch_size
    positive_int("over_sampling_batch_size", over)
    log, reasons, kept = SamplingLog(), Counter(), []
    while len(kept) < batch_size:
        if log.rounds >= max_rounds:
            raise RuntimeError(
                f"dynamic sampling kept {len(kept)} of the {batch_size} prompt groups a "
                f"rollout batch needs after {log.rounds} rounds of {over} prompts "
                f"({log.dropped} dropped: {dict(reasons) or 'no reason given'}): the filter "
                "rejects almost every group (e.g. every reward equal), loosen it or use "
                "keep_when_insufficient")
        rollouts = generate(over, log.rounds)
        log.rounds += 1
        groups = sorted(set(rollouts.extra["group_index"].tolist()))
        log.generated += len(groups)
        for pos, g in enumerate(groups):
            if len(kept) >= batch_size:
                break
            verdict = filter_group(group_filter, args, group_samples(rollouts, g))
            candidates = len(kept) + len(groups) - pos  # kept, this one and those not judged
            if verdict.keep or (verdict.keep_when_insufficient and candidates <= batch_size):
                kept.append((rollouts, g))
                continue
            log.dropped += 1
            if verdict.reason:
                reasons[verdict.reason] += 1
    log.kept, log.reasons = len(kept), dict(reasons)
    return _renumbered(kept, n_samples_per_prompt), log
