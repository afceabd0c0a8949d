"""Stable import path: ``varbatch_kit.simulate`` is :mod:`varbatch_kit.analysis.simulate`."""

import sys

from varbatch_kit.analysis import simulate as _module

sys.modules[__name__] = _module
