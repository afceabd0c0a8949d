"""varbatch_kit.cli.experiment_cache: one computation per set of inputs, never a stale one."""

from __future__ import annotations

import pandas as pd
import pytest

pytest.importorskip("varbatch_kit.train")

from varbatch_kit import Rollouts, ScheduleConfig  # noqa: E402
from varbatch_kit.cli import experiment_cache as ec  # noqa: E402
from varbatch_kit.train import TrainConfig
from varbatch_kit.train.runs import comparison


def _configs(lr=1e-3):
    return [TrainConfig().with_(schedule=ScheduleConfig(dp=dp, global_batch_size=4,
                                                                max_tokens_per_gpu=64), lr=lr)
            for dp in (1, 2)]


@pytest.fixture
def fake_compare(monkeypatch):
    calls = []

    def compare(configs, rollouts, *, reference=None, out_dir=None, progress=True, runs=None,
                keep_params=True):
        # a folder cached_compare removes, unless the runs are asked for; only the references
        # write parameter files into a folder that is removed
        assert (out_dir is not None) != (runs is not None)
        assert keep_params is (runs is not None)
        calls.append(len(configs))
        if runs is not None:
            runs.append("a run")
        return pd.DataFrame({"config": range(len(configs)), "loss": [0.5 + len(calls)] * len(
            configs), "num_microbatches": [(1, 2)] * len(configs)})

    monkeypatch.setattr(comparison, "compare", compare)
    return calls


def test_cache_off_without_a_directory(monkeypatch, fake_compare):
    monkeypatch.delenv(ec.CACHE_ENV, raising=False)
    assert ec.cache_dir() is None
    r = Rollouts.synthetic(8, seed=0)
    ec.cached_compare(_configs(), r, progress=False)
    ec.cached_compare(_configs(), r, progress=False)
    assert fake_compare == [2, 2]  # computed each time


def test_second_caller_reads_the_first_callers_table(tmp_path, monkeypatch, fake_compare):
    monkeypatch.setenv(ec.CACHE_ENV, str(tmp_path / "c"))
    assert ec.cache_dir() == tmp_path / "c"
    r = Rollouts.synthetic(8, seed=0)
    runs: list = []
    first = ec.cached_compare(_configs(), r, progress=False, runs=runs)
    again: list = []
    second = ec.cached_compare(_configs(), Rollouts.synthetic(8, seed=0), runs=again)
    assert fake_compare == [2] and runs == ["a run"] and again == []
    pd.testing.assert_frame_equal(first, second)
    assert second["num_microbatches"].tolist() == [(1, 2), (1, 2)]
    assert len(list((tmp_path / "c").glob("compare-*.pkl"))) == 1


def test_any_changed_input_is_another_entry(tmp_path, fake_compare, monkeypatch):
    r = Rollouts.synthetic(8, seed=0)
    ec.cached_compare(_configs(), r, cache_dir=tmp_path)
    ec.cached_compare(_configs(lr=2e-3), r, cache_dir=tmp_path)  # a config field
    ec.cached_compare(_configs(), Rollouts.synthetic(8, seed=1), cache_dir=tmp_path)  # the data
    ec.cached_compare(_configs(), r, cache_dir=tmp_path, reference=1)
    ec.cached_compare(_configs()[:1], r, cache_dir=tmp_path)
    assert fake_compare == [2, 2, 2, 2, 1]
    # a change of the package source (or of a library version) names another entry too
    key = ec.cache_key("compare", x=1)
    monkeypatch.setattr(ec, "source_hash", lambda: "other source")
    assert ec.cache_key("compare", x=1) != key
    monkeypatch.setattr(ec, "_versions", lambda: {"torch": "0"})
    assert ec.cache_key("compare", x=1) != key


def test_source_hash_covers_the_package_files():
    h = ec.source_hash()
    assert len(h) == 64 and h == ec.source_hash()


def test_cached_rollouts_refuses_the_arguments_it_sets(tmp_path):
    with pytest.raises(ValueError, match="trace_path"):
        ec.cached_rollouts(tmp_path, cache_dir=tmp_path, trace_path=tmp_path / "x.jsonl")
