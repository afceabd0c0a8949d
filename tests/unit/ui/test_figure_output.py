"""FigureOutput, and the explorers drawn through it: what the front end receives is the figure."""

import base64

import ipywidgets as W
import numpy as np
import plotly.graph_objects as go
import pytest
from _factories import TINY

from varbatch_kit import Rollouts, ScheduleConfig
from varbatch_kit.ui import widgets
from varbatch_kit.ui.figure_output import MIMETYPE, FigureOutput


def shown(out: FigureOutput) -> dict:
    """The plotly JSON the Output widget holds (what JupyterLab draws)."""
    (output,) = out.widget.outputs
    assert output["output_type"] == "display_data"
    return output["data"][MIMETYPE]


def values(a) -> list:
    """An array as the front end reads it: a plain list, or plotly's base64 typed array."""
    if isinstance(a, dict):
        return np.frombuffer(base64.b64decode(a["bdata"]), dtype=a["dtype"]).tolist()
    return list(a)


def test_the_output_holds_the_figure_and_follows_in_place_edits():
    fig = go.Figure(go.Bar(x=[0, 1, 2], y=np.array([3, 1, 2])), layout_title_text="three")
    out = FigureOutput(fig, "vbk-test")
    assert values(shown(out)["data"][0]["y"]) == [3, 1, 2]
    assert "vbk-test" in out.widget._dom_classes
    assert shown(out)["data"][0]["type"] == "bar"
    assert shown(out)["layout"]["title"]["text"] == "three"
    fig.data[0].y = [7, 8, 9]
    fig.layout.title.text = "edited"
    assert shown(out)["layout"]["title"]["text"] == "three"  # nothing sent before redraw()
    assert out.redraw() is True
    assert shown(out)["layout"]["title"]["text"] == "edited"
    assert values(shown(out)["data"][0]["y"]) == [7, 8, 9]
    assert out.redraw() is False and out.redraws == 2  # unchanged: nothing sent


def test_a_figure_that_is_not_a_plotly_figure_is_refused():
    with pytest.raises(ValueError, match="plotly.graph_objects.Figure"):
        FigureOutput({"data": []}, "vbk-test")


def _widget_tree(w):
    yield w
    for child in getattr(w, "children", ()):
        yield from _widget_tree(child)


@pytest.fixture()
def batch():
    return Rollouts.synthetic(128, samples_per_rollout=(1, 3), prompt_len=(16, 128),
                              response_len=300.0, max_response_len=2048, seed=3)


def test_no_explorer_depends_on_an_anywidget(batch):
    """anywidget's front end drops every message of a model whose module took over 2 s to
    load (plotly's FigureWidget stayed an empty pair of axes under load): none in the tree."""
    cfg = ScheduleConfig(dp=4, global_batch_size=32, max_tokens_per_gpu=2048)
    for ex in (widgets.packing_explorer(batch, TINY, config=cfg),
               widgets.balance_explorer(batch, config=cfg)):
        try:
            tree = list(_widget_tree(ex.widget))
            assert not [w for w in tree if hasattr(w, "_esm")], [type(w) for w in tree]
            assert not [w for w in tree if isinstance(w, go.FigureWidget)]
            assert ex.figure_output.widget in tree
            assert isinstance(ex.figure_output.widget, W.Output)
        finally:
            ex.close()


def test_every_update_reaches_the_output(batch):
    ex = widgets.packing_explorer(batch, TINY, config=ScheduleConfig(
        dp=4, global_batch_size=32, max_tokens_per_gpu=2048, distribution="flops_kk"))
    try:
        def bars():
            return len(values(shown(ex.figure_output)["data"][1]["y"]))
        assert bars() == len(ex.figure.data[1].y) == ex.state["micro_batches"]
        ex.set(max_tokens_per_gpu=1024)
        assert bars() == len(ex.figure.data[1].y) == ex.state["micro_batches"]
        ex.set(dp=4096)  # impossible: the title says the last valid layout is shown
        assert "last valid layout" in shown(ex.figure_output)["layout"]["title"]["text"]
        ex.set(dp=4, cp=2)  # the CP plan below follows too
        assert shown(ex.cp_output)["layout"]["title"]["text"] == ex.cp_figure.layout.title.text
        assert "fixed CP" in ex.cp_figure.layout.title.text
    finally:
        ex.close()
    assert ex.figure_output.widget.comm is None and ex.cp_output.widget.comm is None
