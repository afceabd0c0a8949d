"""A plotly figure shown in an ``ipywidgets.Output``, redrawn from the kernel.

The explorers keep their figure as a plain ``plotly.graph_objects.Figure``
(updated in place, read by tests and the static export) and show it through
:class:`FigureOutput`: an ``Output`` widget holding one plotly mime bundle
(``application/vnd.plotly.v1+json``, drawn by JupyterLab's plotly renderer),
replaced after every update.

Why not ``plotly.graph_objects.FigureWidget``: it is an anywidget, whose
front end gives a model 2 s to load its module (plotly's bundle, 5 MB) and
from then on drops every message of a model that missed it. ``FigureWidget``
opens its comm without the figure and sends the traces in a message right
after, so on a loaded machine the figure stayed an empty pair of axes and
never followed a control again (a fresh-clone CI run saw it; the browser
tests reproduce it by shortening that deadline). ``Output`` is a core
ipywidgets widget with no such deadline.
"""

from __future__ import annotations

import json

import ipywidgets as W
import plotly.graph_objects as go
import plotly.io as pio

MIMETYPE = "application/vnd.plotly.v1+json"


class FigureOutput:
    """Show ``figure`` in :attr:`widget` (CSS class ``css_class``); :meth:`redraw` after edits.

    Parameters
    ----------
    figure : plotly.graph_objects.Figure
        The figure; edit it in place, then call :meth:`redraw`.
    css_class : str
        A CSS class for the ``Output`` widget (a stable hook for browser tests).
    """

    def __init__(self, figure: go.Figure, css_class: str) -> None:
        if not isinstance(figure, go.Figure):
            raise ValueError(  # noqa: TRY004 - the project reports user errors as ValueError
                f"figure must be a plotly.graph_objects.Figure, got {type(figure).__name__}")
        self.figure = figure
        self.widget = W.Output(layout=W.Layout(width="100%"))
        self.widget.add_class(css_class)
        self.redraws = 0
        self._shown: str | None = None
        self.redraw()

    def bundle(self) -> dict:
        """The mime bundle that draws the figure as it is now."""
        data = pio.renderers["plotly_mimetype"].to_mimebundle(self.figure.to_dict())
        title = self.figure.layout.title.text or "plotly figure"
        data["text/plain"] = f"<{title}: {len(self.figure.data)} traces>"
        return data

    def redraw(self) -> bool:
        """Send the figure to the front end; ``False`` (nothing sent) when it did not change."""
        data = self.bundle()
        key = json.dumps(data[MIMETYPE], sort_keys=True)
        if key == self._shown:
            return False
        self._shown = key
        self.widget.outputs = ({"output_type": "display_data", "data": data, "metadata": {}},)
        self.redraws += 1
        return True

    def close(self) -> None:
        self.widget.close()
