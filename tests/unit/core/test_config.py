"""ScheduleConfig derived values and the mapping from slime's flags."""

import pytest

from varbatch_kit import ScheduleConfig


def test_derived_values():
    c = ScheduleConfig(dp=4, cp=2, vpp=2, mb_group=3, global_batch_size=8,
                       max_tokens_per_gpu=1000)
    assert (c.cap, c.align, c.world_size, c.dynamic, c.packing) == (2000, 12, 8, True, "first_fit")
    s = ScheduleConfig(dp=4, mb_group=3, micro_batch_size=2)
    assert (s.cap, s.align, s.dynamic, s.packing) == (None, 4, False, "static")


def test_with_switches_path_and_default_packing():
    c = ScheduleConfig(dp=2, micro_batch_size=2)
    d = c.with_(max_tokens_per_gpu=4096)
    assert (d.micro_batch_size, d.max_tokens_per_gpu, d.packing) == (None, 4096, "first_fit")
    assert d.with_(micro_batch_size=1).packing == "static"
    assert d.with_(dp=8).dp == 8
    with pytest.raises(ValueError, match="dp must be a positive integer"):
        c.with_(dp=0)


def test_with_defaulted_distribution_follows_the_new_packing():
    c = ScheduleConfig(dp=2, max_tokens_per_gpu=100)
    b = c.with_(packing="balanced")
    assert (b.packing, b.distribution) == ("balanced", "balanced")
    back = b.with_(packing="first_fit")
    assert (back.packing, back.distribution) == ("first_fit", "strided")
    # equal to the config built directly with the same arguments
    assert b == ScheduleConfig(dp=2, max_tokens_per_gpu=100, packing="balanced")


def test_with_keeps_explicit_fields():
    c = ScheduleConfig(dp=2, max_tokens_per_gpu=100, packing="ffd", distribution="flops_kk")
    assert c.with_(dp=4).distribution == "flops_kk"
    assert c.with_(packing="first_fit").distribution == "flops_kk"
    with pytest.raises(ValueError, match="needs distribution='balanced'"):
        c.with_(packing="balanced")
    # an explicit dynamic packing is kept when only the cap changes
    assert c.with_(max_tokens_per_gpu=50).packing == "ffd"
