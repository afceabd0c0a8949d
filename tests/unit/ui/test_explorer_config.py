"""Explorers change the user's config with ``with_batching`` and cache on the frozen config.

A control moves -> ``explorer.config()`` is the passed config with that one
change: the fields no control shows (pp, microbatch_order,
alignment_fallback, cp_sizes, the log-prob cap) are kept, the packing
control picks static or dynamic batching, and the compute cache is keyed on
a :class:`ComputeKey` holding that config.
"""


import pytest
from _factories import TINY, background_error

from varbatch_kit import Rollouts, ScheduleConfig, build_schedule
from varbatch_kit.ui import widgets
from varbatch_kit.ui.explorer_engine import ComputeKey

#: fields no control of the packing explorer shows
HIDDEN = {"pp": 4, "microbatch_order": "min_bubble", "alignment_fallback": "drop_rollouts",
          "cp_sizes": "divisors"}


@pytest.fixture(scope="module")
def batch():
    return Rollouts.synthetic(256, samples_per_rollout=(1, 3), prompt_len=(16, 128),
                              response_len=300.0, max_response_len=2048, seed=3)


@pytest.fixture()
def user_config():
    return ScheduleConfig(dp=4, global_batch_size=64, max_tokens_per_gpu=2048,
                          distribution="flops_kk", log_probs_max_tokens_per_gpu=4096, **HIDDEN)


@pytest.fixture()
def explorer(batch, user_config):
    ex = widgets.packing_explorer(batch, TINY, config=user_config)
    yield ex
    ex.close()


def counting(ex):
    """Record every key the explorer computes (cache misses)."""
    calls = []
    real = ex._compute

    def compute(key):
        calls.append(key)
        return real(key)

    ex._compute = compute
    return calls


def test_untouched_controls_give_back_the_passed_config(explorer, user_config):
    assert explorer.config() == user_config
    assert explorer.schedule.config == user_config


def test_a_control_move_keeps_every_field_no_control_shows(explorer, user_config, batch):
    explorer.controls["max_tokens_per_gpu"].value = 1024  # like a user: the observer fires
    c = explorer.config()
    assert c == user_config.with_(max_tokens_per_gpu=1024)
    assert {k: getattr(c, k) for k in HIDDEN} == HIDDEN
    assert c.log_probs_max_tokens_per_gpu == 4096
    assert explorer.last_error is None
    # the schedule shown was built from that config: the order and fallback were applied
    assert explorer.schedule.config == c
    expected = build_schedule(batch, c, TINY)
    for got, want in zip(explorer.schedule.steps, expected.steps):
        assert got.rank_bins == want.rank_bins
        assert [list(mb) for mb in got.micro_batches] == [list(mb) for mb in want.micro_batches]
    explorer.set(dp=8, global_batch_size=32, distribution="strided")
    c = explorer.config()
    assert (c.dp, c.global_batch_size, c.distribution, c.max_tokens_per_gpu) == (
        8, 32, "strided", 1024)
    assert {k: getattr(c, k) for k in HIDDEN} == HIDDEN


def test_the_packing_control_switches_batching_and_keeps_the_rest(explorer, user_config):
    explorer.controls["packing"].value = "static"
    explorer.set(micro_batch_size=2)
    c = explorer.config()
    assert (c.batching, c.packing, c.micro_batch_size, c.max_tokens_per_gpu) == (
        "static", "static", 2, None)
    assert c.log_probs_max_tokens_per_gpu is None  # a cap of dynamic batching only
    assert {k: getattr(c, k) for k in HIDDEN} == HIDDEN
    assert (c.dp, c.distribution) == (4, "flops_kk")
    explorer.controls["packing"].value = "first_fit"
    back = explorer.config()
    assert back == user_config  # the cap slider kept its value; the log-prob cap returns
    assert back.log_probs_max_tokens_per_gpu == 4096


def test_cp_mode_control_keeps_cp_sizes(batch):
    # pp stays 1: the simulator of the dynamic view does not pipeline dynamic CP plans
    ex = widgets.packing_explorer(batch, TINY, config=ScheduleConfig(
        dp=2, cp=6, global_batch_size=64, max_tokens_per_gpu=2048, cp_sizes="divisors",
        microbatch_order="small_ends", alignment_fallback="drop_rollouts"))
    ex.set(cp_mode="dynamic")
    c = ex.config()
    assert (c.cp_mode, c.cp_sizes, c.microbatch_order, c.alignment_fallback) == (
        "dynamic", "divisors", "small_ends", "drop_rollouts")
    assert c.cp_degrees == (1, 2, 3, 6)  # divisors of 6, not 1, 2, 4, 6
    assert ex.last_error is None and ex.schedule.config == c
    ex.close()


def test_slider_ranges_hold_the_passed_sizes(batch):
    ex = widgets.packing_explorer(batch, TINY, config=ScheduleConfig(
        dp=4, global_batch_size=64, max_tokens_per_gpu=256))
    assert ex.config().max_tokens_per_gpu == 256  # below the slider's usual 512
    ex.close()
    ex = widgets.packing_explorer(batch, TINY, config=ScheduleConfig(
        dp=1, global_batch_size=64, micro_batch_size=100))
    assert ex.config().micro_batch_size == 100  # above the slider's usual 64
    ex.close()


def test_controls_that_describe_no_config_show_the_error(batch):
    ex = widgets.packing_explorer(batch, TINY, config=ScheduleConfig(
        dp=4, global_batch_size=64, max_tokens_per_gpu=2048))
    ex.set(cp_mode="dynamic")  # cp=1: no CP degree to choose, the config is invalid
    with pytest.raises(ValueError, match="cp_mode='dynamic'") as err:
        ex.config()
    assert ex.last_error == str(err.value)
    assert ex.error.layout.display is None
    ex.set(cp_mode="fixed")
    assert ex.last_error is None
    ex.close()


def test_background_path_shows_an_invalid_config(batch):
    ex = background_error(
        lambda: widgets.packing_explorer(batch, TINY, config=ScheduleConfig(
            dp=4, global_batch_size=64, max_tokens_per_gpu=2048), debounce_s=0.0),
        lambda ex: setattr(ex.controls["cp_mode"], "value", "dynamic"))
    assert "cp_mode='dynamic'" in ex.last_error


# ------------------------------------------------------------------ cache
def test_cache_hits_on_an_equal_config_and_misses_on_a_different_one(explorer, user_config):
    calls = counting(explorer)
    explorer.set(dp=8)
    assert [k.config.dp for k in calls] == [8]
    explorer.set(dp=4)  # back to an equal config: no compute
    assert len(calls) == 1 and explorer.timings["schedule_ms"] == 0.0
    assert all(isinstance(k, ComputeKey) for k in explorer._cache)
    # a config built apart, equal by value (its defaults named), is the same key
    twin = ScheduleConfig(dp=4, global_batch_size=64, max_tokens_per_gpu=2048,
                          packing="first_fit", distribution="flops_kk",
                          log_probs_max_tokens_per_gpu=4096, **HIDDEN)
    assert twin is not user_config and ComputeKey.of(twin) in explorer._cache
    _, timing = explorer._cached_compute(ComputeKey.of(twin))
    assert timing["cached"] and len(calls) == 1
    # a field no control shows still tells configs apart
    other = ComputeKey.of(user_config.with_(microbatch_order="small_ends"))
    assert other not in explorer._cache
    _, timing = explorer._cached_compute(other)
    assert "cached" not in timing and calls[-1] == other and len(calls) == 2
    # the step control is not an input of the compute: moving it hits the cache
    explorer.set(step=1)
    assert len(calls) == 2


def test_balance_explorer_keeps_its_config_and_keys_on_model(batch):
    cfg = ScheduleConfig(dp=4, cp=2, global_batch_size=64, max_tokens_per_gpu=2048,
                         distribution="flops_kk", **HIDDEN)
    ex = widgets.balance_explorer(batch, "qwen3-8b", config=cfg)
    assert ex.config() == cfg
    calls = counting(ex)
    ex.set(dp=8, max_tokens_per_gpu=1024)
    assert ex.config() == cfg.with_(dp=8, max_tokens_per_gpu=1024)
    assert {k: getattr(ex.config(), k) for k in HIDDEN} == HIDDEN and ex.config().cp == 2
    ex.set(model="qwen2.5-0.5b")  # same config, another model: a miss
    assert len(calls) == 2 and calls[1]["model"] == "qwen2.5-0.5b"
    assert calls[0].config == calls[1].config
    ex.set(model="qwen3-8b")  # back: a hit
    assert len(calls) == 2
    with pytest.raises(KeyError, match="no input 'colour'"):
        calls[0]["colour"]
    ex.close()
    with pytest.raises(ValueError, match="batching='static'"):
        widgets.balance_explorer(batch, config=ScheduleConfig(dp=4, micro_batch_size=2))
