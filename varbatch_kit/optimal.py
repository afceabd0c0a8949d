"""Stable import path ``varbatch_kit.optimal``: the exact CP-SAT reference and the gap study.

The solver lives in :mod:`varbatch_kit.policies.optimal`, the study on random
small steps in :mod:`varbatch_kit.analysis.optimum_gap`.
"""

from varbatch_kit.analysis.optimum_gap import *  # noqa: F401,F403
from varbatch_kit.analysis.optimum_gap import __all__ as _gap_names
from varbatch_kit.policies.optimal import *  # noqa: F401,F403
from varbatch_kit.policies.optimal import __all__ as _solver_names

__all__ = [*_solver_names, *_gap_names]
