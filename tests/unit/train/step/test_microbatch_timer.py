"""MicroBatchTimer: phase boundaries on a hand-driven clock, finalize wrapping, busy/straggler."""

from types import SimpleNamespace

import pytest

from varbatch_kit.train.step.microbatch_timer import MicroBatchTimer, busy_and_straggler


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_forward_and_backward_follow_the_schedule_boundaries():
    clock = Clock()
    timer = MicroBatchTimer(clock=clock)
    calls = []
    config = SimpleNamespace(finalize_model_grads_func=lambda *a, **k: calls.append(clock.t))
    timer.attach(config)
    loss = timer.wrap_loss(lambda x: x * 2)
    # micro-batch 0: forward 0 -> 1.5 (loss returns), backward until the next forward at 4
    timer.forward_start([3, 5])
    clock.t = 1.5
    assert loss(21) == 42
    clock.t = 4.0
    timer.forward_start([7])
    clock.t = 4.5
    loss(0)
    clock.t = 6.0  # last backward ends where the gradient finalisation starts
    config.finalize_model_grads_func([None])
    clock.t = 9.0  # the all-reduce wait is not backward time
    timer.detach()
    assert calls == [6.0]
    assert timer.records == [{"lengths": [3, 5], "fwd_s": 1.5, "bwd_s": 2.5},
                             {"lengths": [7], "fwd_s": 0.5, "bwd_s": 1.5}]
    # detach restored the original, and a second timer never stacks wrappers
    assert not hasattr(config.finalize_model_grads_func, "_varbatch_kit_original_finalize")
    first, second = MicroBatchTimer(clock=clock), MicroBatchTimer(clock=clock)
    first.attach(config)
    second.attach(config)
    assert config.finalize_model_grads_func._varbatch_kit_original_finalize is first._original


def test_without_finalize_the_block_end_closes_the_last_backward():
    clock = Clock()
    timer = MicroBatchTimer(clock=clock)
    with timer.around_finalize(SimpleNamespace(finalize_model_grads_func=None)):
        timer.forward_start([4])
        clock.t = 1.0
        timer.forward_end()
        clock.t = 3.0
    assert timer.records == [{"lengths": [4], "fwd_s": 1.0, "bwd_s": 2.0}]


def test_misuse_raises():
    timer = MicroBatchTimer()
    with pytest.raises(RuntimeError, match="without forward_start"):
        timer.forward_end()
    timer.forward_start([1])
    with pytest.raises(RuntimeError, match="twice"):
        timer.forward_start([1])


def test_busy_and_straggler():
    per_rank = [[{"fwd_s": 1.0, "bwd_s": 2.0}, {"fwd_s": 0.5, "bwd_s": 0.5}],
                [{"fwd_s": 1.0, "bwd_s": 1.0}]]
    busy, wait = busy_and_straggler(per_rank)
    assert busy == [4.0, 2.0] and wait == [0.0, 2.0]
