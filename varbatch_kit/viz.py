"""Stable import path: ``varbatch_kit.viz`` is the module :mod:`varbatch_kit.ui.viz`."""

import sys

from varbatch_kit.ui import viz as _module

sys.modules[__name__] = _module
