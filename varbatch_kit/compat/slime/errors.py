"""The one exception type raised through :mod:`varbatch_kit.compat.slime`.

slime checks its inputs with ``assert``, so code written against slime catches
``AssertionError``; new code expects ``ValueError`` (the project's convention
for errors a user can cause). :class:`SlimeCompatError` is both, and its
message starts with the wording slime's own message uses (``num_rollouts
(3) < global_batch_size (4)``, ``dp_size``, ``k_partitions``, ...), followed
by our explanation of what would work.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

__all__ = ["SlimeCompatError", "raises_slime_errors"]

F = TypeVar("F", bound=Callable)


class SlimeCompatError(ValueError, AssertionError):
    """A bad input to a slime-compatible function: a ``ValueError`` and an ``AssertionError``."""


def raises_slime_errors(fn: F) -> F:
    """Re-raise a ``ValueError`` or ``AssertionError`` escaping ``fn`` as ``SlimeCompatError``.

    The message is kept; the original exception is chained as ``__cause__``.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SlimeCompatError:
            raise
        except (ValueError, AssertionError) as e:
            raise SlimeCompatError(str(e)) from e

    return wrapper  # type: ignore[return-value]
