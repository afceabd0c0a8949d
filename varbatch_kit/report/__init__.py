"""Layout-invariant metric reports: reducers, report modes, CP slicing, step reduction.

Pure torch math: the CP rank and size and the process group are arguments,
never globals. See ``docs/reference_semantics.md`` (section 5).
"""

from varbatch_kit.report.reducers import *  # noqa: F401,F403
from varbatch_kit.report.reducers import __all__ as _reducer_names

__all__ = list(_reducer_names)
