"""A CPU worker's arithmetic (train/parallel/process_setup.py ``cpu_numerics``)."""

import torch

from varbatch_kit.train.parallel.process_setup import cpu_numerics


def test_a_cpu_worker_flushes_subnormal_floats_to_zero():
    """After the first optimizer step a float32 softmax over SmolLM2's 49k vocabulary holds
    subnormal probabilities, and x86 arithmetic on them is tens of times slower (its second
    training step took 24.8 s instead of 3.2 s). A worker's threads are set and subnormals
    flushed: an operand below float32's smallest normal reads as zero."""
    tiny = torch.tensor([1e-39, 1e-30], dtype=torch.float32)  # subnormal, normal
    saved = torch.get_num_threads()
    assert (tiny * 1.0)[0] > 0  # torch's default keeps subnormals
    try:
        cpu_numerics(1)
        assert torch.get_num_threads() == 1
        out = tiny * 1.0
        assert out[0] == 0 and out[1] == tiny[1]
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(saved)
    assert (tiny * 1.0)[0] > 0


def test_a_one_process_group_flushes_inside_and_restores_the_callers_arithmetic():
    """``single_process`` (calibration, tests: training in the caller's own process) sets a
    worker's arithmetic while it runs and gives the caller's back."""
    from varbatch_kit.train.parallel.process_setup import single_process

    tiny = torch.tensor([1e-39], dtype=torch.float32)
    with single_process("cpu"):
        assert (tiny * 1.0)[0] == 0
    assert (tiny * 1.0)[0] > 0
