"""Wall time of every micro-batch's forward and backward pass on one rank, for every
megatron-core schedule (no pipelining, 1F1B, interleaved).

Each of megatron's schedules calls, per micro-batch and model chunk, its module-level
``schedules.forward_step`` (our ``forward_step_func`` and the loss function it returns)
and later ``schedules.backward_step`` on that forward's output; after the last backward
it calls ``config.finalize_model_grads_func`` (the DDP gradient all-reduce).
:meth:`MicroBatchTimer.around` wraps those two functions for the duration of one schedule,
so that:

- **forward** of a micro-batch on a chunk: megatron's ``forward_step`` call, loss included;
- **backward**: the ``backward_step`` call on that forward's output;
- the schedule's **span** runs from its start to the gradient finalisation (the all-reduce,
  where a fast rank waits for the slowest, is not counted); under pipelining the span minus
  the stage's forward and backward work is its **idle** time (p2p waits: the bubble).

:meth:`MicroBatchTimer.forward` / :meth:`MicroBatchTimer.backward` time a pass run by hand
(the calibration's loop, no schedule). On CUDA every boundary calls
``torch.cuda.synchronize()`` first, so the times are those of the kernels, not of their
launches. :func:`gather_timings` collects every rank's records on all ranks
(``all_gather_object``); :func:`busy_and_straggler` turns them into each rank's busy time and
its straggler wait (slowest rank's busy time minus its own).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence

__all__ = ["MicroBatchTimer", "busy_and_straggler", "gather_timings"]


class MicroBatchTimer:
    """Forward and backward wall time of every micro-batch (on every model chunk) of one step
    on one rank, and the schedule's span and idle time.

    Set :attr:`lengths` (the micro-batch's sample lengths) in the ``forward_step_func`` before
    the model runs; run megatron's schedule inside :meth:`around`. :attr:`records` then holds
    one ``{"lengths", "chunk", "fwd_s", "bwd_s"}`` per micro-batch and chunk, in forward order.
    """

    def __init__(self, *, cuda: bool = False, clock: Callable[[], float] = time.perf_counter):
        self._cuda = bool(cuda)
        self._clock = clock
        self.records: list[dict] = []
        self.lengths: list[int] = []
        self.span_s = float("nan")
        self._pending: dict[int, int] = {}  # forward output (its id) -> its record
        self._start: float | None = None
        self._end: float | None = None

    def _now(self) -> float:
        if self._cuda:
            import torch

            torch.cuda.synchronize()
        return self._clock()

    @staticmethod
    def _key(output) -> int:
        return id(output[0] if isinstance(output, (list, tuple)) else output)

    # ----------------------------------------------------------------- one pass
    def forward(self, fn: Callable, *args, chunk: int = 0, **kwargs):
        """``fn(*args, **kwargs)`` timed as a micro-batch's forward pass (of model chunk
        ``chunk``), recorded under :attr:`lengths` as they are when it returns; its result."""
        t0 = self._now()
        out = fn(*args, **kwargs)
        self.records.append({"lengths": [int(n) for n in self.lengths], "chunk": chunk,
                             "fwd_s": self._now() - t0, "bwd_s": 0.0})
        return out

    def backward(self, fn: Callable, *args, record: int = -1, **kwargs):
        """``fn(*args, **kwargs)`` timed as the backward pass of record ``record`` (default:
        the last forward); its result."""
        if not self.records:
            raise RuntimeError("backward without a timed forward")
        t0 = self._now()
        out = fn(*args, **kwargs)
        self.records[record]["bwd_s"] += self._now() - t0
        return out

    # ----------------------------------------------------------------- a schedule
    @property
    def busy_s(self) -> float:
        """Forward and backward seconds of every record."""
        return float(sum(r["fwd_s"] + r["bwd_s"] for r in self.records))

    @property
    def idle_s(self) -> float:
        """The schedule's span minus this rank's forward and backward work."""
        return self.span_s - self.busy_s

    def _end_span(self) -> None:
        if self._end is None:
            self._end = self._now()

    @contextlib.contextmanager
    def around(self, config, chunks: Sequence = ()):
        """Time one megatron schedule run inside the block: its ``forward_step`` and
        ``backward_step`` calls (``chunks``: the model chunks, to name a record's chunk; a
        DDP wrapper or its module) and its span, up to ``config.finalize_model_grads_func``.
        Everything is restored on exit."""
        from megatron.core.pipeline_parallel import schedules

        from varbatch_kit.train.model.gpt import unwrap_model

        fwd, bwd = schedules.forward_step, schedules.backward_step
        finalize = getattr(config, "finalize_model_grads_func", None)
        index = {id(c): k for k, m in enumerate(chunks) for c in (m, unwrap_model(m))}

        def timed_forward(forward_step_func, data_iterator, model, *args, **kwargs):
            out = self.forward(fwd, forward_step_func, data_iterator, model, *args,
                               chunk=index.get(id(model), 0), **kwargs)
            self._pending[self._key(out[0])] = len(self.records) - 1
            return out

        def timed_backward(input_tensor, output_tensor, *args, **kwargs):
            k = self._pending.pop(self._key(output_tensor), None)
            if k is None:  # not a forward of this block (never seen): run it untimed
                return bwd(input_tensor, output_tensor, *args, **kwargs)
            return self.backward(bwd, input_tensor, output_tensor, *args, record=k, **kwargs)

        def timed_finalize(*args, **kwargs):
            self._end_span()
            return finalize(*args, **kwargs)

        schedules.forward_step, schedules.backward_step = timed_forward, timed_backward
        if finalize is not None:
            config.finalize_model_grads_func = timed_finalize
        self._start, self._end = self._now(), None
        try:
            yield self
        finally:
            self._end_span()
            self.span_s = self._end - self._start
            schedules.forward_step, schedules.backward_step = fwd, bwd
            if finalize is not None:
                config.finalize_model_grads_func = finalize


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
