"""slime's scheduling and metric functions, with slime's signatures and results.

Everything here is a thin adapter over varbatch_kit's core; see
``SLIME_SEMANTICS.md`` for the behaviour reproduced.
"""

from varbatch_kit.compat.slime_metrics import *  # noqa: F401,F403
from varbatch_kit.compat.slime_schedule import *  # noqa: F401,F403
