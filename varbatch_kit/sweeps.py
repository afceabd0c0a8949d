"""Stable import path: ``varbatch_kit.sweeps`` is :mod:`varbatch_kit.analysis.sweeps`."""

import sys

from varbatch_kit.analysis import sweeps as _module

sys.modules[__name__] = _module
