"""A ready module for slime's ``--custom-rollout-log-function-path``: installs ``balanced``.

Pass it to slime (``varbatch_kit`` installed in slime's environment)::

    --custom-rollout-log-function-path varbatch_kit.compat.slime.slime_hook.log_rollout_data

slime imports this module in its rollout manager's process the first time it logs a
rollout, just before it splits that rollout by DP rank; importing it calls
:func:`varbatch_kit.compat.slime.install`, so from the first rollout on the schedule is
varbatch_kit's (see :mod:`varbatch_kit.compat.slime.patch` for why this flag).
:func:`log_rollout_data` returns ``False``: slime's own rollout logging still runs.

The policy is read from the environment of that process: ``VARBATCH_KIT_PACKING``
(default ``balanced``; ``slime`` = slime's own schedule through varbatch_kit) and
``VARBATCH_KIT_DISTRIBUTION`` (default: the one the packing requires, else slime's
flags). A user who already has a rollout-log function calls ``install()`` at the top of
that function's module instead.
"""

from __future__ import annotations

import os
from typing import Any

from varbatch_kit.compat.slime.patch import install

__all__ = ["DISTRIBUTION_ENV", "PACKING_ENV", "log_rollout_data", "uninstall"]

PACKING_ENV = "VARBATCH_KIT_PACKING"
DISTRIBUTION_ENV = "VARBATCH_KIT_DISTRIBUTION"


def _policy_from_env() -> tuple[str | None, str | None]:
    packing = os.environ.get(PACKING_ENV, "balanced").strip()
    distribution = os.environ.get(DISTRIBUTION_ENV, "").strip() or None
    return (None if packing in ("", "slime") else packing), distribution


#: puts slime's own ``build_dp_schedule`` back
uninstall = install(*_policy_from_env())


def log_rollout_data(rollout_id: int, args: Any, samples: Any, rollout_extra_metrics: Any,
                     rollout_time: float) -> bool:
    """slime's rollout-log hook signature; does nothing and returns ``False`` (slime logs)."""
    return False
