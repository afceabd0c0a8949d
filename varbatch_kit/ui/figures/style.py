"""The look shared by every figure: palette, template, the legend row below the plot,
headroom above bars, SI-prefixed numbers."""

from __future__ import annotations

from typing import Any

import numpy as np
from plotly.colors import qualitative

PALETTE = qualitative.Dark24
OVER_CAP_COLOR = "#d62728"
TEMPLATE = "plotly_white"



#: the colour of a single-sample rollout in a step that also has multi-sample (compact)
#: rollouts, so the compact siblings, in the palette's colours, stand out
SINGLE_SAMPLE_COLOR = "#d0d0d0"
#: the packing figure's sample colours: ``PALETTE[i]`` for ``i < len(PALETTE)``, then
#: :data:`SINGLE_SAMPLE_COLOR` at ``len(PALETTE)``. Bars get colour strings, never numbers
#: and a colorscale: plotly.js warns "Invalid color specifier" once per such bar
ROLLOUT_COLORS = np.array([*PALETTE, SINGLE_SAMPLE_COLOR], dtype=object)


#: Legend placement of every figure: a horizontal row at the bottom of the figure, in a
#: margin it reserves (``yref="container"``), so tick labels and axis titles are pushed
#: above it and it never covers a subplot title, an axis title or a bar.
LEGEND_BELOW = {"orientation": "h", "yref": "container", "y": 0, "yanchor": "bottom",
                "x": 0.5, "xanchor": "center"}
#: Head-room above the tallest bar of a bar panel (fraction of the data span).
HEADROOM = 0.1


def headroom(*values: Any, frac: float = HEADROOM) -> list[float]:
    """A y range from 0 (or ``frac`` below the lowest negative value) to ``frac`` above the
    tallest value, so bars never touch the top of their panel."""
    arrays = [np.asarray(v, dtype=np.float64).ravel() for v in values]
    v = np.concatenate(arrays) if arrays else np.zeros(0)
    v = v[np.isfinite(v)]
    hi = max(float(v.max()), 0.0) if v.size else 0.0
    lo = min(float(v.min()), 0.0) if v.size else 0.0
    span = hi - lo
    if span == 0:
        return [0.0, 1.0]
    return [lo - frac * span if lo < 0 else 0.0, hi + frac * span]
