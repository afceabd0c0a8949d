"""A ready module for slime's ``--custom-rollout-log-function-path``: installs ``balanced``.

Pass it to slime (``varbatch_kit`` installed in slime's environment)::

    --custom-rollout-log-function-path varbatch_kit.compat.slime.slime_hook.log_rollout_data

slime imports this module in its rollout manager's process the first time it logs a
rollout, just before it splits that rollout by DP rank; importing it there (where
``slime.ray.rollout`` is loaded) calls :func:`varbatch_kit.compat.slime.install`, so
from the first rollout on the schedule is varbatch_kit's (see
:mod:`varbatch_kit.compat.slime.patch` for why this flag). :func:`log_rollout_data`
installs again (a no-op when installed) and returns ``False``: slime's own rollout
logging still runs. Imported anywhere else (no ``slime.ray.rollout`` loaded), the module
does nothing until :func:`log_rollout_data` is called.

The policy is read from the environment of that process: ``VARBATCH_KIT_PACKING``
(default ``balanced``; ``slime`` = slime's own schedule through varbatch_kit) and
``VARBATCH_KIT_DISTRIBUTION`` (default: the one the packing requires, else slime's
flags). Ray actors get their environment from the job, not from the driver's shell: put
them in the ``env_vars`` of ``ray job submit --runtime-env-json`` (as slime's scripts
pass ``PYTHONPATH``). A user who already has a rollout-log function calls ``install()`` at
the top of that function's module instead.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from varbatch_kit.compat.slime.patch import CALL_SITE, install

__all__ = ["DISTRIBUTION_ENV", "PACKING_ENV", "log_rollout_data", "uninstall"]

PACKING_ENV = "VARBATCH_KIT_PACKING"
DISTRIBUTION_ENV = "VARBATCH_KIT_DISTRIBUTION"


def _policy_from_env() -> tuple[str | None, str | None]:
    packing = os.environ.get(PACKING_ENV, "balanced").strip()
    distribution = os.environ.get(DISTRIBUTION_ENV, "").strip() or None
    return (None if packing in ("", "slime") else packing), distribution


_state: dict[str, Any] = {"uninstall": None, "disabled": False}


def _install() -> None:
    if not _state["disabled"]:
        _state["uninstall"] = install(*_policy_from_env())


def uninstall() -> None:
    """Put slime's own ``build_dp_schedule`` back, and stop :func:`log_rollout_data` installing."""
    _state["disabled"] = True
    if _state["uninstall"] is not None:
        _state["uninstall"]()


def log_rollout_data(rollout_id: int, args: Any, samples: Any, rollout_extra_metrics: Any,
                     rollout_time: float) -> bool:
    """slime's rollout-log hook signature: installs the policy, returns ``False`` (slime logs)."""
    _install()
    return False


if CALL_SITE[0] in sys.modules:  # slime's rollout manager process
    _install()
