"""Silence megatron-core's notices that an optional accelerator library is missing.

megatron-core imports Transformer Engine and Apex when they are there and, when they are
not, says so at import time: a ``UserWarning`` per module ("Transformer Engine and Apex are
not installed. Falling back to Torch optimizers.", "Apex is not installed. Falling back to
Torch Norm", ...) and an INFO log line ("Using Megatron-FSDP without Transformer Engine.").
The engine never uses either library (its layers are megatron's local ones), so every
torchrun worker printed about eight of these lines on every run.

:func:`quiet_optional_dependency_warnings` hides exactly those: warning filters that match
their messages in megatron's modules, and a logging filter on the megatron logger that
writes the log line. Any other warning or log record of megatron, and the same words from
anywhere else, still show. Call it before the first ``import megatron``: the notices are
said while the modules import.

Standard library only: importable without megatron-core.
"""

from __future__ import annotations

import logging
import re
import warnings

__all__ = ["OPTIONAL_DEPENDENCY_LOGGERS", "OPTIONAL_DEPENDENCY_MESSAGES",
           "quiet_optional_dependency_warnings"]

#: the notices' messages (regular expressions matched at the start of the message)
OPTIONAL_DEPENDENCY_MESSAGES = (
    # megatron.core.optimizer, .optimizer.optimizer, .optimizer.clip_grads, megatron_fsdp
    r"Transformer Engine and Apex are not installed\. Falling back to ",
    # megatron.core.models.backends, .models.gpt.gpt_layer_specs (and the other model specs)
    r"Apex is not installed\. Falling back to Torch Norm",
)
#: the modules whose warnings are matched (a regular expression on the module's name)
_MEGATRON_MODULES = r"megatron(\.|$)"
#: the loggers of the log lines, and the lines (matched at the start of the message)
OPTIONAL_DEPENDENCY_LOGGERS = {
    "megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision":
        r"Using Megatron-FSDP without Transformer Engine\.",
}


class _DropOptionalDependencyNotice(logging.Filter):
    """Drops a logger's records whose message matches ``pattern``; passes every other."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


def quiet_optional_dependency_warnings() -> None:
    """Hide megatron-core's "Transformer Engine / Apex is not installed" notices.

    Installs one ``warnings`` filter per message of
    :data:`OPTIONAL_DEPENDENCY_MESSAGES` (``UserWarning`` from a ``megatron`` module only)
    and a filter on each logger of :data:`OPTIONAL_DEPENDENCY_LOGGERS` that drops its line.
    Idempotent: calling it again adds nothing. Call it before megatron is imported.
    """
    for message in OPTIONAL_DEPENDENCY_MESSAGES:
        # filterwarnings replaces an equal filter instead of adding a second one
        warnings.filterwarnings("ignore", message=message, category=UserWarning,
                                module=_MEGATRON_MODULES)
    for name, pattern in OPTIONAL_DEPENDENCY_LOGGERS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropOptionalDependencyNotice) for f in logger.filters):
            logger.addFilter(_DropOptionalDependencyNotice(pattern))
