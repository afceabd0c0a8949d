"""What the explorers' controls share: the choice lists and the control helpers.

The option lists of the ``dp``, ``cp``, ``vpp``, ``mb_group`` and
``hardware`` dropdowns, the token-cap slider's range, whether a packing runs
on the dynamic (token-capped) path, and the rule that a packing which works
with one distribution only selects it, and the check of the batch and the model preset
an explorer is made with. Used by
:class:`~varbatch_kit.ui.packing_explorer.PackingExplorer` and
:class:`~varbatch_kit.ui.balance_explorer.BalanceExplorer`.
"""

from __future__ import annotations

import math

from varbatch_kit.core.config import packing_batching
from varbatch_kit.core.flops import available_presets
from varbatch_kit.core.hardware import HARDWARE
from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.policies.registry import PACKERS
from varbatch_kit.ui.explorer_engine import Explorer

__all__ = ["CP_CHOICES", "DP_CHOICES", "MB_GROUP_CHOICES", "VPP_CHOICES"]

DP_CHOICES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
CP_CHOICES = [1, 2, 4, 8]
VPP_CHOICES = [1, 2, 4]
MB_GROUP_CHOICES = [1, 2, 4, 8]


def _check_batch_and_preset(rollouts, model: str) -> None:
    """ValueError unless ``rollouts`` is a :class:`Rollouts` and ``model`` a preset name."""
    if not isinstance(rollouts, Rollouts):
        raise ValueError(  # noqa: TRY004 - the project reports user errors as ValueError
            f"rollouts must be a Rollouts, got {type(rollouts).__name__}")
    presets = available_presets()
    if model not in presets:
        raise ValueError(f"model={model!r} is not a preset; choose one of {presets}")


def _hardware_profiles() -> list[str]:
    """Hardware profile names of the step-time simulator."""
    return list(HARDWARE)


def _packing_is_dynamic(name: str) -> bool:
    """Whether the packing ``name`` runs on the dynamic path (an unknown name: assume so)."""
    try:
        return packing_batching(name) == "dynamic"
    except ValueError:  # config() then reports the unknown name
        return True


def _follow_required_distribution(explorer: Explorer) -> None:
    """A packing that works with one distribution only selects it (without a second update)."""
    spec = PACKERS.get(explorer.controls["packing"].value)
    required = getattr(spec, "requires_distribution", None)
    dist = explorer.controls["distribution"]
    if required is not None and dist.value != required and required in dist.options:
        explorer._suspend = True
        try:
            dist.value = required
        finally:
            explorer._suspend = False


def _cap_range(rollouts: Rollouts, cap: int | None = None) -> tuple[int, int]:
    """The cap slider's range: 512 to twice the longest sample (and the config's cap, kept)."""
    longest = int(rollouts.total_len.max())
    hi = max(65536, 1 << math.ceil(math.log2(2 * longest)))
    if cap is None:
        return 512, hi
    return min(512, cap), max(hi, cap)
