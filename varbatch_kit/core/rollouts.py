"""`Rollouts`: the per-sample table of one rollout batch.

A *rollout* is one execution of the policy; it emits one training sample
normally and several under compact / subagent flows. Every sample carries the
id of its rollout. Lengths are token counts: ``total_len = prompt_len +
response_len``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from varbatch_kit.checks import positive_int

__all__ = ["Rollouts"]


def _as_int_array(name: str, values) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array of token counts, got shape {arr.shape}")
    if arr.dtype == bool:
        raise ValueError(f"{name} must hold integers, got booleans")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if not np.issubdtype(arr.dtype, np.number):
            raw = list(values) if not isinstance(values, np.ndarray) else arr.tolist()
            i, bad = next(((j, v) for j, v in enumerate(raw)
                           if isinstance(v, (bool, np.bool_))
                           or not isinstance(v, (int, float, np.integer, np.floating))),
                          (0, raw[0] if raw else None))
            raise ValueError(
                f"{name}[{i}] = {bad!r} is a {type(bad).__name__}, not a token count; "
                f"{name} must hold integers")
        bad = ~np.isfinite(arr) | (arr != np.round(arr))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"{name}[{i}] = {arr[i].item()!r} is not an integer token count")
    return arr.astype(np.int64)


@dataclass(frozen=True, eq=False)
class Rollouts:
    """Per-sample table of a rollout batch.

    Parameters
    ----------
    prompt_len, response_len:
        Token counts per sample. ``prompt_len >= 0``, ``response_len >= 1``.
    rollout_id:
        Id of the rollout each sample belongs to (any integers). Defaults to
        one rollout per sample (``0..n-1``). Rollouts are ordered by first
        appearance.
    loss_masks:
        Optional list of 0/1 arrays, one per sample, each of length
        ``response_len[i]``. Defaults to all ones.
    extra:
        Optional pandas DataFrame of further per-sample fields (one row per
        sample, same order; e.g. a slime dump's ``reward``, ``status``,
        ``group_index``, ``tokens``: see :func:`varbatch_kit.core.traces.read_trace`).
        Stored with a fresh ``0..n-1`` index; :meth:`subset` keeps the rows of
        the kept samples and :meth:`to_frame` joins the columns.

    Example
    -------
    >>> r = Rollouts(prompt_len=[4, 4], response_len=[8, 3], rollout_id=[0, 0])
    >>> r.total_len.tolist(), r.num_rollouts
    ([12, 7], 1)
    """

    prompt_len: np.ndarray
    response_len: np.ndarray
    rollout_id: np.ndarray | None = None
    loss_masks: Sequence[np.ndarray] | None = field(default=None, repr=False)
    extra: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        prompt = _as_int_array("prompt_len", self.prompt_len)
        response = _as_int_array("response_len", self.response_len)
        n = response.size
        if n == 0:
            raise ValueError("Rollouts is empty: response_len has no samples; pass at least one")
        if prompt.size != n:
            raise ValueError(
                f"prompt_len has {prompt.size} entries but response_len has {n}: "
                "pass one entry per sample in both"
            )
        if (prompt < 0).any():
            i = int(np.flatnonzero(prompt < 0)[0])
            raise ValueError(f"prompt_len[{i}] = {prompt[i]} is negative; lengths are >= 0")
        if (response < 1).any():
            i = int(np.flatnonzero(response < 1)[0])
            raise ValueError(
                f"response_len[{i}] = {response[i]} is not positive; every sample needs >= 1 "
                "response token"
            )
        if self.rollout_id is None:
            rid = np.arange(n, dtype=np.int64)
        else:
            rid = _as_int_array("rollout_id", self.rollout_id)
            if rid.size != n:
                raise ValueError(
                    f"rollout_id has {rid.size} entries but response_len has {n}: "
                    "pass one rollout id per sample"
                )
        masks = None
        if self.loss_masks is not None:
            if len(self.loss_masks) != n:
                raise ValueError(
                    f"loss_masks has {len(self.loss_masks)} entries but there are {n} samples"
                )
            masks = []
            for i, m in enumerate(self.loss_masks):
                m = np.asarray(m)
                if m.ndim != 1 or m.size != response[i]:
                    raise ValueError(
                        f"loss_masks[{i}] has length {m.size} but response_len[{i}] = "
                        f"{response[i]}: a mask has one 0/1 entry per response token"
                    )
                if not np.isin(m, (0, 1)).all():
                    raise ValueError(f"loss_masks[{i}] holds values other than 0 and 1")
                masks.append(m.astype(np.int8))
        for name, arr in (("prompt_len", prompt), ("response_len", response), ("rollout_id", rid)):
            arr.setflags(write=False)
            object.__setattr__(self, name, arr)
        object.__setattr__(self, "loss_masks", masks)
        if self.extra is not None:
            import pandas as pd

            if not isinstance(self.extra, pd.DataFrame):
                raise ValueError(
                    f"extra must be a pandas DataFrame with one row per sample, got "
                    f"{type(self.extra).__name__}"
                )
            if len(self.extra) != n:
                raise ValueError(
                    f"extra has {len(self.extra)} rows but there are {n} samples: pass one row "
                    "per sample, in sample order"
                )
            object.__setattr__(self, "extra", self.extra.reset_index(drop=True))
        total = prompt + response
        total.setflags(write=False)
        object.__setattr__(self, "_total_len", total)

    # ------------------------------------------------------------------ basics
    @property
    def total_len(self) -> np.ndarray:
        """Prompt + response tokens per sample (int64)."""
        return self._total_len  # type: ignore[attr-defined]

    def __len__(self) -> int:
        return int(self.response_len.size)

    @property
    def num_samples(self) -> int:
        return len(self)

    @property
    def num_rollouts(self) -> int:
        return int(np.unique(self.rollout_id).size)

    def rollout_order(self) -> tuple[np.ndarray, list[np.ndarray]]:
        """Rollout ids in order of first appearance, and each one's sample positions.

        Positions within a rollout keep their original order.
        """
        ids, positions, offsets = self.rollout_order_flat()
        return ids, np.split(positions, offsets[1:-1])

    def rollout_order_flat(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`rollout_order` without one array per rollout: the ids, every sample's
        position rollout after rollout, and ``offsets`` (``ids.size + 1`` of them): rollout
        ``j``'s samples are ``positions[offsets[j]:offsets[j + 1]]``."""
        ids, first, inverse = np.unique(self.rollout_id, return_index=True, return_inverse=True)
        order = np.argsort(first, kind="stable")  # rank of each unique id by first appearance
        rank_of_unique = np.empty_like(order)
        rank_of_unique[order] = np.arange(order.size)
        group = rank_of_unique[inverse.reshape(-1)]
        by_group = np.argsort(group, kind="stable")
        offsets = np.zeros(order.size + 1, dtype=np.int64)
        np.cumsum(np.bincount(group, minlength=order.size), out=offsets[1:])
        return ids[order], by_group, offsets

    def mask_sums(self) -> np.ndarray:
        """Number of loss-bearing response tokens per sample."""
        if self.loss_masks is None:
            return self.response_len.copy()
        return np.array([int(m.sum()) for m in self.loss_masks], dtype=np.int64)

    def rollout_mask_sums(self) -> np.ndarray:
        """Per sample, the loss-bearing tokens of its whole rollout (slime's ``rollout_mask_sums``).

        The per-rollout denominator: the sum of :meth:`mask_sums` over every
        sample sharing sample i's rollout id, computed over this whole table.
        """
        _, inverse = np.unique(self.rollout_id, return_inverse=True)
        per_rollout = np.bincount(inverse.reshape(-1), weights=self.mask_sums(),
                                  minlength=int(inverse.max()) + 1)
        return per_rollout[inverse.reshape(-1)].astype(np.int64)

    def masks(self) -> list[np.ndarray]:
        """Loss masks per sample (all ones when none were given)."""
        if self.loss_masks is not None:
            return list(self.loss_masks)
        return [np.ones(int(r), dtype=np.int8) for r in self.response_len]

    def subset(self, indices) -> Rollouts:
        """The samples at ``indices`` (in that order) as a new table."""
        idx = np.asarray(indices, dtype=np.int64)
        masks = None if self.loss_masks is None else [self.loss_masks[i] for i in idx]
        extra = None if self.extra is None else self.extra.iloc[idx]
        return Rollouts(self.prompt_len[idx], self.response_len[idx], self.rollout_id[idx], masks,
                        extra=extra)

    def without_columns(self, *names: str) -> Rollouts:
        """The same samples without the ``extra`` columns ``names`` (e.g. a given
        ``advantage``, so that training computes the advantages from the rewards)."""
        missing = [n for n in names if self.extra is None or n not in self.extra.columns]
        if missing:
            have = [] if self.extra is None else list(self.extra.columns)
            raise ValueError(f"without_columns: no column(s) {missing} in Rollouts.extra; it "
                             f"has {have}")
        return Rollouts(self.prompt_len, self.response_len, self.rollout_id, self.loss_masks,
                        extra=self.extra.drop(columns=list(names)))

    def to_frame(self, *, extra: bool = True):
        """A pandas DataFrame with one row per sample.

        Columns ``prompt_len``, ``response_len``, ``total_len``, ``rollout_id``
        and, with ``extra`` (default), the columns of :attr:`extra`; an extra
        column named like one of those four gets the suffix ``_given`` (a
        slime dump's ``rollout_id`` as given, None for the samples slime
        numbers itself, becomes ``rollout_id_given``).
        """
        import pandas as pd

        frame = pd.DataFrame(
            {
                "prompt_len": self.prompt_len,
                "response_len": self.response_len,
                "total_len": self.total_len,
                "rollout_id": self.rollout_id,
            }
        )
        if extra and self.extra is not None:
            more = self.extra.rename(
                columns={c: f"{c}_given" for c in self.extra.columns if c in frame.columns})
            frame = pd.concat([frame, more], axis=1)
        return frame

    def __repr__(self) -> str:
        t = self.total_len
        return (
            f"Rollouts({len(self)} samples, {self.num_rollouts} rollouts, "
            f"tokens min/median/max {t.min()}/{int(np.median(t))}/{t.max()}, "
            f"total {int(t.sum())})"
        )

    # ----------------------------------------------------------- constructors
    @classmethod
    def synthetic(
        cls,
        n_rollouts: int,
        *,
        samples_per_rollout: tuple[int, int] = (1, 1),
        prompt_len: tuple[int, int] | int = (128, 1024),
        response_len: float = 2048.0,
        response_sigma: float = 1.0,
        max_response_len: int = 8192,
        seed: int = 0,
    ) -> Rollouts:
        """A seeded synthetic batch with long-tailed response lengths.

        Parameters
        ----------
        n_rollouts:
            Number of rollouts.
        samples_per_rollout:
            ``(lo, hi)`` inclusive: each rollout emits a uniform number of
            samples in that range (multi-sample rollouts when ``hi > 1``).
        prompt_len:
            An int, or ``(lo, hi)`` inclusive uniform range, drawn once per
            rollout; later samples of a multi-sample rollout get a longer
            prompt (agentic flows carry earlier turns as context).
        response_len:
            Median of the log-normal response length.
        response_sigma:
            Shape of the log-normal (1.0 is strongly long-tailed).
        max_response_len:
            Truncation: longer responses are cut to exactly this length,
            which shows as a spike at the max like real rollouts.
        seed:
            Seed of ``numpy.random.default_rng``; same seed, same batch.
        """
        positive_int("n_rollouts", n_rollouts, whole_floats=True)
        lo, hi = samples_per_rollout
        if not (1 <= lo <= hi):
            raise ValueError(
                f"samples_per_rollout={samples_per_rollout!r} must be (lo, hi) with 1 <= lo <= hi"
            )
        if isinstance(prompt_len, (int, np.integer)):
            p_lo = p_hi = int(prompt_len)
        else:
            p_lo, p_hi = (int(v) for v in prompt_len)
        if not (0 <= p_lo <= p_hi):
            raise ValueError(f"prompt_len={prompt_len!r} must be an int or (lo, hi) with 0<=lo<=hi")
        if response_len <= 0 or response_sigma < 0:
            raise ValueError(
                f"response_len={response_len!r} must be > 0 and response_sigma="
                f"{response_sigma!r} >= 0"
            )
        if max_response_len < 1:
            raise ValueError(f"max_response_len={max_response_len!r} must be >= 1")
        rng = np.random.default_rng(seed)
        n_rollouts = int(n_rollouts)
        counts = rng.integers(lo, hi + 1, size=n_rollouts)
        rid = np.repeat(np.arange(n_rollouts, dtype=np.int64), counts)
        n = rid.size
        base_prompt = rng.integers(p_lo, p_hi + 1, size=n_rollouts)
        # later samples of a multi-sample rollout carry a summary of earlier turns
        turn = np.arange(n) - np.repeat(np.cumsum(counts) - counts, counts)
        prompt = base_prompt[rid] + turn * rng.integers(0, max(p_lo, 1) + 1, size=n)
        raw = rng.lognormal(mean=np.log(response_len), sigma=response_sigma, size=n)
        response = np.clip(np.ceil(raw), 1, max_response_len).astype(np.int64)
        return cls(prompt_len=prompt, response_len=response, rollout_id=rid)
