"""Stable import path: ``varbatch_kit.quality`` is :mod:`varbatch_kit.analysis.quality`."""

import sys

from varbatch_kit.analysis import quality as _module

sys.modules[__name__] = _module
