"""Put a varbatch_kit policy into a slime run: :func:`install` replaces slime's DP schedule.

Where slime builds the schedule (commit 624b824a): ``RolloutManager._split_train_data_by_dp``
in ``slime/ray/rollout.py`` calls ``build_dp_schedule(self.args, ...)``, a name that module
binds with ``from slime.utils.dp_schedule import build_dp_schedule``. The call looks the
name up in ``slime.ray.rollout``'s globals each time, so :func:`install` replaces
**the attribute ``build_dp_schedule`` of the module ``slime.ray.rollout``** (patching
``slime.utils.dp_schedule.build_dp_schedule`` would change nothing: the name was bound
at import). The replacement is :func:`varbatch_kit.compat.slime.build_dp_schedule`,
called with slime's arguments and the chosen policy (``args.varbatch_packing`` /
``args.varbatch_distribution``); it returns slime's 4-tuple, which slime's training
actors consume unchanged.

Which process: ``RolloutManager`` is a Ray actor, its own Python process; the driver
(``train.py``) and the Megatron training actors are other processes, so a patch made
there does not reach it. The module that calls :func:`install` must be imported **in the
rollout manager's process, before its first** ``_split_train_data_by_dp``. slime's
``--custom-rollout-log-function-path`` does that: ``RolloutManager.generate`` calls
``log_rollout_data`` (``slime/observability/rollout_metrics.py``), which imports the
module with ``load_function`` and calls the function *before* converting the samples
and splitting them by DP rank, in every rollout, also when replaying dumps
(``--load-debug-rollout-data``). The function returns ``False`` so slime's own logging
still runs. :mod:`varbatch_kit.compat.slime.slime_hook` is such a module, ready to pass::

    --custom-rollout-log-function-path varbatch_kit.compat.slime.slime_hook.log_rollout_data

Also in that process, at ``RolloutManager.__init__``: ``--custom-reward-post-process-path``
and ``--custom-convert-samples-to-train-data-path`` (they replace slime's reward
normalisation / sample conversion, so only for a user who already has one), and the
non-``custom`` ``--rollout-function-path`` / ``--data-source-path``. Not these:
``--custom-generate-function-path`` and ``--custom-rm-path`` are loaded only while samples
are generated (never when dumps are replayed); the Megatron-side paths
(``--custom-loss-function-path``, ``--custom-megatron-init-path``,
``--custom-model-provider-path``, ``--custom-advantage-function-path``,
``--custom-tis-function-path``, ...) are loaded in the training actors, the wrong process.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

from varbatch_kit.compat.slime.errors import SlimeCompatError
from varbatch_kit.compat.slime.schedule import build_dp_schedule as _build_dp_schedule
from varbatch_kit.policies.registry import DISTRIBUTIONS, PACKERS

__all__ = ["CALL_SITE", "SlimeNotImportableError", "install", "installed_policy"]

#: (module, attribute) that slime's rollout manager calls to build the DP schedule
CALL_SITE = ("slime.ray.rollout", "build_dp_schedule")

_MARK = "__varbatch_kit_policy__"


class SlimeNotImportableError(ImportError):
    """slime's rollout module cannot be imported in this process, so there is nothing to patch."""


class _WithPolicy:
    """slime's args with ``varbatch_packing`` / ``varbatch_distribution`` set; the rest read
    through (slime's namespace itself is not modified)."""

    def __init__(self, args: Any, packing: str | None, distribution: str | None):
        self._args = args
        self.varbatch_packing = packing
        self.varbatch_distribution = distribution

    def __getattr__(self, name: str) -> Any:
        return getattr(self._args, name)


def _make_replacement(original: Callable, packing: str | None,
                      distribution: str | None) -> Callable:
    def build_dp_schedule(args, train_parallel_config, total_lengths, *, global_batch_size,
                          rollout_indices):
        """slime's ``build_dp_schedule`` replaced by varbatch_kit (see ``installed_policy``)."""
        return _build_dp_schedule(_WithPolicy(args, packing, distribution),
                                  train_parallel_config, total_lengths,
                                  global_batch_size=global_batch_size,
                                  rollout_indices=rollout_indices)

    setattr(build_dp_schedule, _MARK, (packing, distribution))
    build_dp_schedule.__wrapped_original__ = original
    return build_dp_schedule


def _call_site_module(module: str):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise SlimeNotImportableError(
            f"varbatch_kit.compat.slime.install() replaces {module}.{CALL_SITE[1]}, but "
            f"{module} cannot be imported here ({e}). Call install() inside slime's rollout "
            "manager process, e.g. from the module passed with "
            "--custom-rollout-log-function-path "
            "(varbatch_kit.compat.slime.slime_hook.log_rollout_data), with slime and its "
            "dependencies installed") from e


def installed_policy(module: str = CALL_SITE[0]) -> tuple[str | None, str | None] | None:
    """``(packing, distribution)`` installed in ``module`` (already imported), or None."""
    mod = sys.modules.get(module)
    fn = getattr(mod, CALL_SITE[1], None) if mod is not None else None
    return getattr(fn, _MARK, None)


def install(packing: str | None = "balanced", distribution: str | None = None, *,
            module: str = CALL_SITE[0]) -> Callable[[], None]:
    """Make slime's rollout manager build its DP schedule with a varbatch_kit policy.

    Replaces ``slime.ray.rollout.build_dp_schedule`` (the name
    ``RolloutManager._split_train_data_by_dp`` calls) by
    :func:`varbatch_kit.compat.slime.build_dp_schedule` with
    ``args.varbatch_packing=packing`` and ``args.varbatch_distribution=distribution``
    (registered names; None: the one the packing requires, else slime's flags decide).
    ``install(packing=None, distribution=None)`` runs slime's own schedule through
    varbatch_kit (equal to slime's output). Call it in the rollout manager's process (the
    module docstring says which flag does that: ``--custom-rollout-log-function-path``).

    Idempotent: installing the same policy again changes nothing; another policy
    replaces the first, and slime's original stays underneath, so one uninstall
    restores it. Returns ``uninstall()``, which
    puts slime's function back (a no-op when it is already back, or when someone else
    has replaced the attribute since). A name that is not registered is a
    :class:`SlimeCompatError` listing the choices; a process without slime raises
    :class:`SlimeNotImportableError` (an ``ImportError``).
    """
    for kind, name, table in (("packing", packing, PACKERS),
                              ("distribution", distribution, DISTRIBUTIONS)):
        if name is not None and (not isinstance(name, str) or name not in table):
            raise SlimeCompatError(
                f"install({kind}={name!r}): not a registered {kind}; choose one of "
                f"{sorted(table)}, or None" + (" (slime's own schedule)"
                                               if kind == "packing" else ""))
    mod = _call_site_module(module)
    attr = CALL_SITE[1]
    if not hasattr(mod, attr):
        raise SlimeCompatError(
            f"{module} has no attribute {attr!r}: this slime version builds its DP schedule "
            "elsewhere; install() supports slime's layout of commit 624b824a "
            "(slime/ray/rollout.py calls build_dp_schedule)")
    current = getattr(mod, attr)
    original = getattr(current, "__wrapped_original__", current)
    if getattr(current, _MARK, None) != (packing, distribution):  # same policy: left as it is
        setattr(mod, attr, _make_replacement(original, packing, distribution))

    def uninstall() -> None:
        """Put slime's own ``build_dp_schedule`` back (if ours is still the one installed)."""
        if getattr(getattr(mod, attr, None), "__wrapped_original__", None) is original:
            setattr(mod, attr, original)

    return uninstall
