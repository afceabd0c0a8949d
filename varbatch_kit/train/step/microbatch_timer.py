"""Wall time of every micro-batch's forward and backward pass on one rank.

megatron-core's no-pipelining schedule runs, for each micro-batch in turn,
``forward_step`` (our ``forward_step_func`` and then the loss function it
returns) and then the backward pass; after the last backward it calls
``config.finalize_model_grads_func`` (the DDP gradient all-reduce). So the
boundaries between the phases are visible from the training step's own
callbacks:

- **forward** of micro-batch ``i``: from the entry into ``forward_step_func``
  to the return of its loss function;
- **backward** of micro-batch ``i``: from that return to the entry into the
  next ``forward_step_func``, or, for the last micro-batch, to the entry into
  ``finalize_model_grads_func`` (so the gradient all-reduce, where a fast
  rank waits for the slowest one, is *not* counted as backward time).

On CUDA every boundary calls ``torch.cuda.synchronize()`` first, so the
times are those of the kernels, not of their launches.

:class:`MicroBatchTimer` records the boundaries; :func:`gather_timings`
collects every rank's list on all ranks (``all_gather_object``);
:func:`busy_and_straggler` turns them into each rank's busy time and its
straggler wait (slowest rank's busy time minus its own).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from functools import wraps

__all__ = ["MicroBatchTimer", "busy_and_straggler", "gather_timings"]

_ORIGINAL = "_varbatch_kit_original_finalize"


class MicroBatchTimer:
    """Forward and backward wall time of each micro-batch of one training step on one rank.

    Call :meth:`forward_start` when a micro-batch's forward begins (with its
    sample lengths), wrap its loss function with :meth:`wrap_loss` (the
    forward ends when it returns), and run the schedule between
    :meth:`attach` and :meth:`detach` (or inside :meth:`around_finalize`):
    the last backward ends when the gradient finalisation starts, or at
    :meth:`detach`. :attr:`records` then holds
    one ``{"lengths": [...], "fwd_s": ..., "bwd_s": ...}`` per micro-batch, in
    training order.
    """

    def __init__(self, *, cuda: bool = False, clock: Callable[[], float] = time.perf_counter):
        self._cuda = bool(cuda)
        self._clock = clock
        self.records: list[dict] = []
        self._fwd_start: float | None = None
        self._bwd_start: float | None = None
        self._lengths: list[int] = []
        self._config = None
        self._original = None

    def _now(self) -> float:
        if self._cuda:
            import torch

            torch.cuda.synchronize()
        return self._clock()

    def _close_backward(self, now: float) -> None:
        if self._bwd_start is not None:
            self.records[-1]["bwd_s"] = now - self._bwd_start
            self._bwd_start = None

    def forward_start(self, lengths: Sequence[int]) -> None:
        """A micro-batch of samples of these total lengths starts its forward pass."""
        now = self._now()
        self._close_backward(now)
        if self._fwd_start is not None:
            raise RuntimeError("forward_start called twice without the loss function returning")
        self._lengths = [int(n) for n in lengths]
        self._fwd_start = now

    def forward_end(self) -> None:
        """The micro-batch's loss is computed: the forward pass ends, the backward begins."""
        now = self._now()
        if self._fwd_start is None:
            raise RuntimeError("forward_end without forward_start")
        self.records.append({"lengths": self._lengths, "fwd_s": now - self._fwd_start,
                             "bwd_s": float("nan")})
        self._fwd_start = None
        self._bwd_start = now

    def finish(self) -> None:
        """The last backward pass ends now (idempotent)."""
        self._close_backward(self._now())

    def wrap_loss(self, loss_func: Callable) -> Callable:
        """``loss_func`` that calls :meth:`forward_end` after it returns."""
        @wraps(loss_func)
        def timed(*args, **kwargs):
            out = loss_func(*args, **kwargs)
            self.forward_end()
            return out
        return timed

    def attach(self, config) -> None:
        """Before a megatron schedule: wrap ``config.finalize_model_grads_func`` so the last
        backward ends where the gradient all-reduce starts (a wrapper left by an earlier timer
        is replaced, never stacked). :meth:`detach` restores it."""
        current = getattr(config, "finalize_model_grads_func", None)
        original = getattr(current, _ORIGINAL, current)
        self._config, self._original = config, original
        if original is None:
            return

        @wraps(original)
        def finalize(*args, **kwargs):
            self.finish()
            return original(*args, **kwargs)

        setattr(finalize, _ORIGINAL, original)
        config.finalize_model_grads_func = finalize

    def detach(self) -> None:
        """After the schedule: restore the config's gradient finalisation; end the last backward
        (if no finalisation ended it)."""
        config = getattr(self, "_config", None)
        if config is not None and self._original is not None:
            config.finalize_model_grads_func = self._original
        self._config = None
        self.finish()

    @contextlib.contextmanager
    def around_finalize(self, config):
        """:meth:`attach` for the duration of a ``with`` block, then :meth:`detach`."""
        self.attach(config)
        try:
            yield self
        finally:
            self.detach()


def gather_timings(records: list[dict]) -> list[list[dict]]:
    """Every rank's micro-batch records, indexed by world rank (a collective: all ranks call it)."""
    import torch.distributed as dist

    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, records)
    return out


def busy_and_straggler(per_rank: Sequence[Sequence[dict]]) -> tuple[list[float], list[float]]:
    """Each rank's busy time (sum of its micro-batches' forward + backward seconds) and its
    straggler wait (the busiest rank's busy time minus its own)."""
    busy = [float(sum(r["fwd_s"] + r["bwd_s"] for r in recs)) for recs in per_rank]
    slowest = max(busy) if busy else 0.0
    return busy, [slowest - b for b in busy]
