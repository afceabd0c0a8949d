"""Stable import path: ``varbatch_kit.widgets`` is the module :mod:`varbatch_kit.ui.widgets`."""

import sys

from varbatch_kit.ui import widgets as _module

sys.modules[__name__] = _module
