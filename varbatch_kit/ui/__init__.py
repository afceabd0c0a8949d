"""Notebook shells: plotly figures (:mod:`~varbatch_kit.ui.viz`) and ipywidgets explorers.

Figures take computed values and return a ``plotly.graph_objects.Figure``;
nothing here computes a schedule statistic of its own.
"""
