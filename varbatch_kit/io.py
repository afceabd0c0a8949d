"""Stable import path: ``varbatch_kit.io`` is the module :mod:`varbatch_kit.core.traces`."""

import sys

from varbatch_kit.core import traces as _module

sys.modules[__name__] = _module
