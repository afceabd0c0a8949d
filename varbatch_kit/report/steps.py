"""A training step's report from its micro-batches' sums, and the rollout-side log.

The group is an argument (None: a single process); nothing asks a global.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from varbatch_kit.report.cp import reference_cp_size, validate_cp
from varbatch_kit.report.validation import positive

# ---------------------------------------------------------------------------
# Step reduction and logging
# ---------------------------------------------------------------------------


def _collective_device(group: Any) -> torch.device:
    """The device a tensor collective on ``group`` needs: CUDA for NCCL, else CPU.

    A ``group`` that torch.distributed does not know (a stand-in object, as
    slime's single-process tests pass with a patched ``dist.all_reduce``) gets
    CPU: the collective itself then decides whether the group is usable.
    """
    try:
        backend = dist.get_backend(group)
    except (ValueError, RuntimeError, TypeError, AttributeError):
        return torch.device("cpu")
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_train_step_metrics(
    microbatch_values: Sequence[torch.Tensor],
    *,
    keys: Sequence[str],
    divisor: float | None,
    cp_size: int | Sequence[int] = 1,
    group: Any = None,
) -> dict[str, float]:
    """Sum per-micro-batch ``[slot0, sum_1, ..., sum_k]`` vectors, all-reduce, divide.

    The vectors of this rank's micro-batches are summed (float64), all-reduced
    (sum) over ``group`` (the DP x CP group; ``None``: single process, no
    communication), and each metric sum is divided by ``divisor`` (the step's
    report divisor, e.g. the rollout count) or, with ``divisor=None`` (slime's
    per-token path), by ``slot0 / cp_size``: every CP rank counted its samples'
    tokens in full (computed as ``sum * cp_size / slot0``, slime's operations, so
    the float is slime's to the last bit). A zero token count reports 0, never
    NaN. A rank with no micro-batches passes an empty sequence. The sums are
    float64 on the CPU and move, for the all-reduce only, to the device the
    group's backend needs (CUDA for NCCL).

    Dynamic CP (a degree per sample): ``cp_size`` is the step's reference
    degree ``K`` (:attr:`StepNormalizers.reference_cp`), or the per-sample
    degrees themselves (their lcm is taken); slot 0 then holds ``K * N``
    (:meth:`ReportMode.count_slot` with ``reference_cp=K``).
    """
    keys = list(keys)
    cp_size = reference_cp_size(cp_size)
    if divisor is not None:
        divisor = positive("divisor (step batch size)", divisor)
    width = len(keys) + 1
    total = torch.zeros(width, dtype=torch.float64)
    for j, v in enumerate(microbatch_values):
        v = torch.as_tensor(v).detach().to(device="cpu", dtype=torch.float64).reshape(-1)
        if v.numel() != width:
            raise ValueError(
                f"microbatch_values[{j}] has {v.numel()} entries but keys={keys} needs "
                f"{width} (slot 0 = token count or 0, then one sum per key)"
            )
        total += v
    if group is not None:
        device = _collective_device(group)
        reduced = total.to(device)
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM, group=group)
        total = reduced.cpu()
    sums = [float(total[i + 1].item()) for i in range(len(keys))]
    if divisor is None:
        count = float(total[0].item())
        if count >= cp_size:  # ``sum * cp / count``: slime's operations, so the same float
            return {k: v * cp_size / count for k, v in zip(keys, sums)}
        divisor = 1.0  # no token counted (slot0 < cp): clamp, report 0, never NaN
    return {k: v / divisor for k, v in zip(keys, sums)}


def rollout_log_metric_contribution(
    per_rank_reducer_sum: float | torch.Tensor,
    *,
    cp_size: int,
    num_rollouts: int,
    dp_size: int,
) -> tuple[float, float]:
    """A rank's ``(sum, count)`` log entry for a rollout-side metric.

    ``per_rank_reducer_sum`` is the rank's reducer value over its CP-local
    pieces (the per-rollout-mean reducer of :func:`make_reducer`). Every rank of
    the DP x CP group emits ``(cp * reducer_sum, num_rollouts / dp)``; gathered
    over that group, ``sum(sums) / sum(counts) = cp * S / (cp * num_rollouts) =
    S / num_rollouts``, which for a one-step rollout is the train-step report.

    Under dynamic CP (a degree per sample) ``cp_size`` stays the pool's CP
    size (``dp * cp`` ranks emit an entry): the ranks' reducer sums still add
    up to ``S``, whatever degree cut each sample, so the quotient is unchanged.
    """
    _, cp_size = validate_cp(0, cp_size)
    dp = positive("dp_size", dp_size)
    n = positive("num_rollouts", num_rollouts)
    if isinstance(per_rank_reducer_sum, torch.Tensor):
        per_rank_reducer_sum = float(per_rank_reducer_sum.detach().item())
    return cp_size * float(per_rank_reducer_sum), n / dp


def _scalar(key: str, rank: int, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"log entry {key!r} on rank {rank} is a tensor of shape {tuple(value.shape)}; "
                f"pass a scalar or a (sum, count) pair"
            )
        return float(value.detach().item())
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    raise ValueError(
        f"log entry {key!r} on rank {rank} is {value!r}; pass a number or a (sum, count) pair"
    )


def reduce_log_dicts(log_dicts: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Combine the per-rank log dicts of a group (pure; one dict per rank).

    A ``(sum, count)`` entry reports ``sum(sums) / sum(counts)`` (0 when both
    are 0); a scalar entry reports its mean over ranks. Every rank must log the
    same keys, and a key must be a pair on every rank or a scalar on every rank.
    """
    if not log_dicts:
        raise ValueError("log_dicts is empty; pass one log dict per rank")
    keys = list(log_dicts[0])
    for r, d in enumerate(log_dicts):
        if set(d) != set(keys):
            raise ValueError(
                f"rank {r} logs keys {sorted(d)} but rank 0 logs {sorted(keys)}; every rank "
                f"of the group must log the same keys"
            )
    out: dict[str, float] = {}
    for key in keys:
        is_pair = [isinstance(d[key], (tuple, list)) for d in log_dicts]
        if any(is_pair) and not all(is_pair):
            pairs = [r for r, p in enumerate(is_pair) if p]
            scalars = [r for r, p in enumerate(is_pair) if not p]
            raise ValueError(
                f"log entry {key!r} is a (sum, count) pair on ranks {pairs} but a scalar on "
                f"ranks {scalars}; log it the same way on every rank"
            )
        if all(is_pair):
            sums, counts = 0.0, 0.0
            for r, d in enumerate(log_dicts):
                if len(d[key]) != 2:
                    raise ValueError(
                        f"log entry {key!r} on rank {r} is {d[key]!r}; a pair must be (sum, count)"
                    )
                sums += _scalar(key, r, d[key][0])
                counts += _scalar(key, r, d[key][1])
            if counts == 0:
                if sums != 0:
                    raise ValueError(
                        f"log entry {key!r} has total count 0 but total sum {sums}; a (sum, "
                        f"count) pair needs a positive count wherever its sum is non-zero"
                    )
                out[key] = 0.0
            else:
                out[key] = sums / counts
        else:
            out[key] = sum(_scalar(key, r, d[key]) for r, d in enumerate(log_dicts)) / len(
                log_dicts
            )
    return out


def gather_and_reduce_log_dict(
    log_dict: Mapping[str, Any], *, group: Any = None
) -> dict[str, float]:
    """Gather every rank's log dict over ``group`` and reduce (:func:`reduce_log_dicts`).

    Uses ``all_gather_object``, so every rank gets the reduced dict and every
    rank raises the same ``ValueError`` on inconsistent entries (no rank is
    left waiting in a later collective). ``group=None``: single process.
    """
    if group is None:
        return reduce_log_dicts([dict(log_dict)])
    world = dist.get_world_size(group)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, dict(log_dict), group=group)
    return reduce_log_dicts(gathered)
