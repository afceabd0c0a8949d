"""The recommend explorer: compat.slime.recommend on the slime flags typed in it.

Its figures are the recommendation's own (one search, no second path): the summary's
times, the command line and the table rows are checked against a direct ``recommend``
call; a flag slime refuses shows in the error box and the last result stays.
"""

import warnings
from pathlib import Path

import pytest

from varbatch_kit import ModelShape, read_trace
from varbatch_kit.compat.slime import recommend
from varbatch_kit.ui import widgets

DUMP = Path(__file__).parents[2] / "golden" / "dumps" / "rollout_12.pt"
ARGS = ("--actor-num-gpus-per-node 2 --rollout-batch-size 4 --n-samples-per-prompt 4 "
        "--num-steps-per-rollout 2 --use-dynamic-batch-size --max-tokens-per-gpu 64")


@pytest.fixture(scope="module")
def rollouts():
    return read_trace(DUMP)


@pytest.fixture()
def explorer(rollouts):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ex = widgets.recommend_explorer(rollouts, ARGS, "qwen3-8b", max_tokens_headroom=2.0)
    yield ex
    ex.close()


def test_the_explorer_shows_the_recommendation_of_its_flags(explorer, rollouts):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rec = recommend(rollouts, ARGS, ModelShape.preset("qwen3-8b"), max_tokens_headroom=2.0)
    s = explorer.state
    assert s["command"] == rec.command and s["changes"] == dict(rec.changes)
    assert s["user_s"] == pytest.approx(rec.user["time_s"])
    assert s["best_s"] == pytest.approx(rec.best["time_s"]) and s["best_s"] <= s["user_s"]
    assert s["candidates"] == len(rec.table)
    html = explorer.details.value
    assert rec.command in html and "vbk-recommend-table" in html
    assert html.count("</tr>") == len(rec.table) + 1  # a row per candidate, and the header
    assert ">best<" in html and (">you<" in html or rec.best == rec.user)
    assert explorer.config().dp == 2  # the layout the flags describe
    assert rec.command in explorer.static_html()


def test_a_refused_flag_shows_in_the_error_box_and_the_last_result_stays(explorer):
    before = dict(explorer.state)
    explorer.set(slime_args=ARGS + " --max-tokens-per-gpu x")
    assert explorer.last_error and "max-tokens-per-gpu" in explorer.last_error
    assert explorer.error.layout.display != "none"
    assert {k: v for k, v in explorer.state.items() if k != "error"} == before  # the last result
    explorer.set(slime_args=ARGS)
    assert explorer.last_error is None


def test_the_headroom_control_reaches_the_search(explorer):
    wide = dict(explorer.state)
    explorer.set(max_tokens_headroom=1.0)
    assert wide["candidates"] > 0 and explorer.result.memory_limit <= 64
    caps = explorer.result.table["max_tokens_per_gpu"].dropna()
    assert (caps <= 64).all()


def test_bad_arguments_say_what_works(rollouts):
    with pytest.raises(ValueError, match="slime command line"):
        widgets.recommend_explorer(rollouts, "")
    with pytest.raises(ValueError, match="not a preset"):
        widgets.recommend_explorer(rollouts, ARGS, "nope")
