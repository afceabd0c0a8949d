"""ScheduleConfig derived values and the mapping from slime's flags."""

import pytest

from varbatch_kit import ScheduleConfig
from varbatch_kit.core.config import batching_fields, decide_batching, packing_batching


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


# ------------------------------------------------ the one batching decision
@pytest.mark.parametrize("kwargs, batching", [
    ({"micro_batch_size": 4}, "static"),
    ({"max_tokens_per_gpu": 4096}, "dynamic"),
    # a named packing decides; the other path's size is ignored
    ({"micro_batch_size": 4, "max_tokens_per_gpu": 4096, "packing": "static"}, "static"),
    ({"micro_batch_size": 4, "max_tokens_per_gpu": 4096, "packing": "first_fit"}, "dynamic"),
    ({"micro_batch_size": 4, "packing": "static"}, "static"),
    ({"max_tokens_per_gpu": 4096, "packing": "flops_kk"}, "dynamic"),
])
def test_decide_batching_truth_table(kwargs, batching):
    assert decide_batching(**kwargs) == batching
    fields = batching_fields(**kwargs)
    if batching == "static":
        assert fields == {"micro_batch_size": 4, "max_tokens_per_gpu": None}
    else:
        assert fields == {"micro_batch_size": None, "max_tokens_per_gpu": 4096}
    config = ScheduleConfig(packing=kwargs.get("packing"), **fields)
    assert config.batching == batching and config.dynamic == (batching == "dynamic")


@pytest.mark.parametrize("kwargs, match", [
    ({}, r"set exactly one of micro_batch_size .* got micro_batch_size=None, "
         r"max_tokens_per_gpu=None"),
    ({"micro_batch_size": 4, "max_tokens_per_gpu": 4096},
     r"set exactly one of micro_batch_size .* got micro_batch_size=4, max_tokens_per_gpu=4096; "
     r"to let a packing pick, pass both with packing= to batching_fields"),
    ({"max_tokens_per_gpu": 4096, "packing": "static"},
     r"packing='static' needs micro_batch_size \(static batching\); with max_tokens_per_gpu "
     r"use a dynamic packing such as 'first_fit'"),
    ({"packing": "static"}, r"packing='static' needs micro_batch_size \(static batching\)$"),
    ({"micro_batch_size": 4, "packing": "first_fit"},
     r"packing='first_fit' packs under a token cap: set max_tokens_per_gpu \(dynamic "
     r"batching\) instead of micro_batch_size"),
    ({"packing": "ffd"}, r"packing='ffd' packs under a token cap: set max_tokens_per_gpu"),
    ({"micro_batch_size": 4, "packing": "nope"}, "unknown packing 'nope'; choose one of"),
])
def test_decide_batching_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        decide_batching(**kwargs)
    with pytest.raises(ValueError, match=match):
        batching_fields(**kwargs)
    if "packing" not in kwargs:  # the constructor decides with the same function
        with pytest.raises(ValueError, match=match):
            ScheduleConfig(**kwargs)


def test_packing_batching_follows_the_registry():
    assert packing_batching("static") == "static"
    assert {packing_batching(n) for n in ("first_fit", "ffd", "flops_kk", "balanced")} == {
        "dynamic"}
    with pytest.raises(ValueError, match="unknown packing 'x'"):
        packing_batching("x")


def test_with_batching_switches_paths_and_keeps_every_other_field():
    kept = {"dp": 2, "cp": 2, "pp": 4, "microbatch_order": "min_bubble",
            "alignment_fallback": "drop_rollouts", "cp_sizes": "divisors",
            "distribution": "flops_kk", "global_batch_size": 8}
    dyn = ScheduleConfig(max_tokens_per_gpu=1000, log_probs_max_tokens_per_gpu=3000, **kept)
    static = dyn.with_batching(packing="static", micro_batch_size=2, max_tokens_per_gpu=1000)
    assert (static.batching, static.micro_batch_size, static.max_tokens_per_gpu) == (
        "static", 2, None)
    assert static.log_probs_max_tokens_per_gpu is None  # a dynamic-only cap is cleared
    assert all(getattr(static, k) == v for k, v in kept.items())
    back = static.with_batching(packing="first_fit", max_tokens_per_gpu=500, micro_batch_size=2)
    assert (back.batching, back.max_tokens_per_gpu, back.micro_batch_size, back.packing) == (
        "dynamic", 500, None, "first_fit")
    assert all(getattr(back, k) == v for k, v in kept.items())
    # a size alone picks the path; the packing follows as in with_
    assert dyn.with_batching(micro_batch_size=3).packing == "static"
    assert static.with_batching(max_tokens_per_gpu=64).packing == "first_fit"
    # the packing's size falls back to the config's own; none there is an error
    assert dyn.with_batching(packing="ffd").max_tokens_per_gpu == 1000
    with pytest.raises(ValueError, match="packing='static' needs micro_batch_size"):
        dyn.with_batching(packing="static")
    with pytest.raises(ValueError, match="set exactly one of micro_batch_size"):
        dyn.with_batching(micro_batch_size=2, max_tokens_per_gpu=100)
    assert dyn.with_batching(dp=4) == dyn.with_(dp=4)  # no size, no packing: plain with_
    # a static switch through with_ clears the log-prob cap as well
    assert dyn.with_(micro_batch_size=2).log_probs_max_tokens_per_gpu is None


def test_config_is_hashable_and_equal_by_value():
    a = ScheduleConfig(dp=4, max_tokens_per_gpu=2048, pp=2, microbatch_order="small_ends")
    b = ScheduleConfig(dp=4, max_tokens_per_gpu=2048, pp=2, microbatch_order="small_ends",
                       packing="first_fit", distribution="strided")  # the defaults, named
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert {a: 1}[b] == 1
    for change in ({"pp": 4}, {"microbatch_order": "arrival"}, {"cp_sizes": "divisors"},
                   {"alignment_fallback": "drop_rollouts"}, {"max_tokens_per_gpu": 1024}):
        other = a.with_(**change)
        assert other != a and other not in {a}


def test_batching_errors_name_the_settings_in_the_callers_words():
    """A caller with its own names for the settings (the CLI's flags) passes them: the error
    is written in them, nothing rewritten afterwards; unnamed keys keep the defaults."""
    words = {"micro_batch_size": "--mbs", "packing": "--pack"}
    with pytest.raises(ValueError, match=r"^--pack='static' needs --mbs \(static batching\); "
                                         r"with max_tokens_per_gpu use a dynamic packing"):
        decide_batching(max_tokens_per_gpu=64, packing="static", words=words)
    with pytest.raises(ValueError, match=r"^set exactly one of micro_batch_size .* pass both "
                                         r"with packing= to batching_fields$"):
        batching_fields(micro_batch_size=2, max_tokens_per_gpu=64)
