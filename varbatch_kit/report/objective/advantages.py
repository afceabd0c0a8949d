"""Per-token advantages and returns from per-sample scalars, KL and critic values.

Every function works on per-sample lists of 1-D response tensors (full
responses, not CP-local pieces). Returns are computed with a plain backward
recurrence, in the dtype of each sample's tensors, all samples of one dtype
in one batched recurrence (so the cost is the longest response, not the sum).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "ESTIMATORS",
    "broadcast_advantages",
    "discounted_returns",
    "gae",
    "reinforce_pp_baseline_advantages",
    "reinforce_pp_returns",
    "estimate_advantages",
]

#: the advantage estimators :func:`estimate_advantages` knows
ESTIMATORS = ("grpo", "gspo", "cispo", "ppo", "reinforce_plus_plus",
              "reinforce_plus_plus_baseline")


def _check_lengths(**lists: Sequence) -> int:
    sizes = {k: len(v) for k, v in lists.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"per-sample inputs differ in length: {sizes}; pass one entry per "
                         "sample to each")
    return next(iter(sizes.values()))


def broadcast_advantages(scalars: Sequence[float] | torch.Tensor,
                         like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """GRPO / GSPO / CISPO: sample i's scalar on every token of ``like[i]`` (its dtype)."""
    _check_lengths(scalars=scalars, like=like)
    return [torch.full_like(x, float(s)) for s, x in zip(scalars, like, strict=True)]


def discounted_returns(rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma * G_{t+1}`` along the last axis (``G`` past the end is 0)."""
    out = torch.empty_like(rewards)
    acc = torch.zeros_like(rewards[..., 0]) if rewards.shape[-1] else None
    for t in reversed(range(rewards.shape[-1])):
        acc = rewards[..., t] + gamma * acc
        out[..., t] = acc
    return out


def _row_returns(rows: Sequence[torch.Tensor], gamma: float) -> list[torch.Tensor]:
    """:func:`discounted_returns` of each 1-D row, one recurrence per dtype and device.

    Rows are zero-padded at the end into one ``[n, T]`` batch (a zero past the
    end leaves every earlier return unchanged, bit for bit).
    """
    out: list[torch.Tensor | None] = [None] * len(rows)
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault((r.dtype, r.device), []).append(i)
    for idx in groups.values():
        width = max(rows[i].numel() for i in idx)
        batch = rows[idx[0]].new_zeros(len(idx), width)
        for j, i in enumerate(idx):
            batch[j, : rows[i].numel()] = rows[i]
        ret = discounted_returns(batch, gamma)
        for j, i in enumerate(idx):
            out[i] = ret[j, : rows[i].numel()].clone()
    return out  # type: ignore[return-value]


def reinforce_pp_returns(scalars: Sequence[float] | torch.Tensor, kl: Sequence[torch.Tensor],
                         loss_masks: Sequence[torch.Tensor], kl_coef: float,
                         gamma: float) -> list[torch.Tensor]:
    """REINFORCE++: token rewards ``-kl_coef * kl * mask``, the sample's scalar added at its
    last unmasked token, then discounted returns with ``gamma``.

    A sample whose mask is all zeros has no last token: ValueError.
    """
    _check_lengths(scalars=scalars, kl=kl, loss_masks=loss_masks)
    rewards = []
    for i, (s, k, m) in enumerate(zip(scalars, kl, loss_masks, strict=True)):
        live = torch.nonzero(m).flatten()
        if live.numel() == 0:
            raise ValueError(f"Sequence at index {i} is fully masked. (loss_masks[{i}] has no "
                             "nonzero entry; REINFORCE++ puts the reward on the last unmasked "
                             "token, so every sample needs one)")
        r = -kl_coef * (k * m)
        r[live[-1]] += s
        rewards.append(r)
    return _row_returns(rewards, gamma)


def reinforce_pp_baseline_advantages(scalars: Sequence[float] | torch.Tensor,
                                     kl: Sequence[torch.Tensor],
                                     kl_coef: float) -> list[torch.Tensor]:
    """REINFORCE++-baseline: ``scalar - kl_coef * kl`` per token (the baseline is already in
    the scalar: rewards minus their group mean)."""
    _check_lengths(scalars=scalars, kl=kl)
    return [torch.full_like(k, float(s)) - kl_coef * k for s, k in zip(scalars, kl, strict=True)]


def gae(rewards: Sequence[torch.Tensor], values: Sequence[torch.Tensor], gamma: float,
        lambd: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Generalised advantage estimation per sample: ``(advantages, returns)``.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` (``V`` past the end is 0),
    ``A_t = delta_t + gamma * lambd * A_{t+1}``, ``returns = A + V``.
    """
    _check_lengths(rewards=rewards, values=values)
    deltas = []
    for r, v in zip(rewards, values, strict=True):
        if r.shape != v.shape or r.ndim != 1:
            raise ValueError(f"rewards and values differ in shape: {tuple(r.shape)} vs "
                             f"{tuple(v.shape)}; pass 1-D per-token tensors of one response "
                             "each")
        nxt = torch.cat([v[1:], v.new_zeros(1)])
        deltas.append(r + gamma * nxt - v)
    advs = _row_returns(deltas, gamma * lambd)
    return advs, [a + v for a, v in zip(advs, values, strict=True)]


def estimate_advantages(estimator: str, scalars: Sequence[float] | torch.Tensor,
                        kl: Sequence[torch.Tensor], loss_masks: Sequence[torch.Tensor], *,
                        kl_coef: float = 0.0, gamma: float = 1.0, lambd: float = 1.0,
                        values: Sequence[torch.Tensor] | None = None
                        ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(advantages, returns)`` per sample for ``estimator`` (:data:`ESTIMATORS`).

    ``scalars`` are the post-processed per-sample rewards (float32), ``kl``
    the per-token KL to the reference (zeros without a KL penalty).

    - grpo / gspo / cispo: the scalar on every token, advantages = returns
      (the KL is not added);
    - reinforce_plus_plus: :func:`reinforce_pp_returns`, advantages = returns;
    - reinforce_plus_plus_baseline: :func:`reinforce_pp_baseline_advantages`;
    - ppo: token rewards ``-kl_coef * kl`` with the scalar added at the *last
      token* (masked or not), then :func:`gae` with the critic's ``values``
      (in their dtype).
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"advantage_estimator {estimator} is not supported; estimator="
                         f"{estimator!r}, use one of {ESTIMATORS}")
    scalars = torch.as_tensor(scalars, dtype=torch.float32)
    if estimator in ("grpo", "gspo", "cispo"):
        adv = broadcast_advantages(scalars, kl)
        return adv, list(adv)
    if estimator == "reinforce_plus_plus":
        ret = reinforce_pp_returns(scalars, kl, loss_masks, kl_coef, gamma)
        return list(ret), ret
    if estimator == "reinforce_plus_plus_baseline":
        adv = reinforce_pp_baseline_advantages(scalars, kl, kl_coef)
        return adv, adv
    if values is None:
        raise ValueError("estimator='ppo' needs the critic's values (values=None); pass one "
                         "tensor per sample")
    _check_lengths(scalars=scalars, kl=kl, values=values)
    rewards = []
    for s, k in zip(scalars, kl, strict=True):
        r = k * -kl_coef
        r[-1] += s
        rewards.append(r)
    dtype = values[0].dtype
    return gae([r.to(dtype) for r in rewards], [v.to(dtype) for v in values], gamma, lambd)
