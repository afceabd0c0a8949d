"""MicroBatchTimer: passes on a hand-driven clock, a megatron schedule timed per micro-batch and
chunk up to the grad sync, busy/straggler."""

from types import SimpleNamespace

import pytest

from varbatch_kit.train.step.microbatch_timer import MicroBatchTimer, busy_and_straggler


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_a_pass_run_by_hand_is_timed_forward_then_backward():
    clock = Clock()
    timer = MicroBatchTimer(clock=clock)

    def forward(x):
        clock.t += 1.5
        return x * 2

    timer.lengths = [3, 5]
    assert timer.forward(forward, 21) == 42
    clock.t += 10.0  # between the passes: not counted
    timer.backward(lambda: setattr(clock, "t", clock.t + 2.5))
    assert timer.records == [{"lengths": [3, 5], "chunk": 0, "fwd_s": 1.5, "bwd_s": 2.5}]
    with pytest.raises(RuntimeError, match="backward without a timed forward"):
        MicroBatchTimer().backward(lambda: None)


def test_a_megatron_schedule_is_timed_per_micro_batch_and_chunk_up_to_the_grad_sync():
    """Inside ``around``, megatron's module-level forward_step / backward_step (what every
    schedule calls) are timed, each backward matched to its forward's output; the span ends
    where the gradient finalisation starts; everything is restored afterwards."""
    from megatron.core.pipeline_parallel import schedules

    clock = Clock()
    timer = MicroBatchTimer(clock=clock)
    synced = []
    config = SimpleNamespace(finalize_model_grads_func=lambda *a: synced.append(clock.t))
    chunks = [SimpleNamespace(name="chunk0"), SimpleNamespace(name="chunk1")]
    saved = schedules.forward_step, schedules.backward_step

    def fake_schedule():  # an interleaved-like order: f(mb0,c0) f(mb0,c1) b(mb0,c1) b(mb0,c0)
        outs = []
        for k, (lengths, work) in enumerate([([4], 1.0), ([4], 2.0)]):
            def step_func(data_iterator, model, lengths=lengths, work=work):
                timer.lengths = lengths
                clock.t += work
            outs.append(schedules.forward_step(step_func, None, chunks[k])[0])
        clock.t += 0.5  # a p2p wait: idle
        for out, work in zip(reversed(outs), (3.0, 4.0)):
            schedules.backward_step(None, out, None)  # 1.0 s each (the stub below)
            clock.t += work  # between backward calls: idle
        config.finalize_model_grads_func()
        clock.t += 100.0  # the all-reduce wait: outside the span

    def forward_stub(func, it, model, *a, **k):
        func(it, model)
        return [object()], 1

    def backward_stub(inp, out, *a, **k):
        clock.t += 1.0

    schedules.forward_step, schedules.backward_step = forward_stub, backward_stub
    try:
        with timer.around(config, chunks):
            fake_schedule()
        assert (schedules.forward_step, schedules.backward_step) == (forward_stub,
                                                                     backward_stub)
    finally:
        schedules.forward_step, schedules.backward_step = saved
    assert [(r["chunk"], r["fwd_s"], r["bwd_s"]) for r in timer.records] == [
        (0, 1.0, 1.0), (1, 2.0, 1.0)]
    assert timer.span_s == 1.0 + 2.0 + 0.5 + (1.0 + 3.0) + (1.0 + 4.0)
    assert timer.busy_s == 5.0 and timer.idle_s == timer.span_s - 5.0
    assert len(synced) == 1 and config.finalize_model_grads_func is not None
    assert "timed_finalize" not in config.finalize_model_grads_func.__qualname__


def test_busy_and_straggler():
    per_rank = [[{"fwd_s": 1.0, "bwd_s": 2.0}, {"fwd_s": 0.5, "bwd_s": 0.5}],
                [{"fwd_s": 1.0, "bwd_s": 1.0}]]
    busy, wait = busy_and_straggler(per_rank)
    assert busy == [4.0, 2.0] and wait == [0.0, 2.0]
