"""Figure families; :mod:`varbatch_kit.ui.viz` gathers them under one name."""
