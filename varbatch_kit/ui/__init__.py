"""Notebook shells: plotly figures (:mod:`~varbatch_kit.ui.viz`) and ipywidgets explorers.

Figures take computed values and return a ``plotly.graph_objects.Figure``;
nothing here computes a schedule statistic of its own.

Needs the ``[ui]`` extra (``pip install 'varbatch_kit[ui]'``): importing any
module of this package without plotly or ipywidgets raises an ``ImportError``
that says so.
"""

from varbatch_kit._extras import require

require(__name__, "ui", ("plotly", "ipywidgets"))
