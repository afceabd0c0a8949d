"""Field checks shared by the training sub-configs: ValueErrors naming the field, the
value and what works; ``documented`` declares a field with its help (``metadata["help"]``)."""

from __future__ import annotations

import math
from dataclasses import field
from typing import Any

from varbatch_kit.checks import interval_text, is_int, number_in

__all__ = ["documented", "need_bool", "need_choice", "need_int", "need_number"]


def documented(default: Any, help: str, **meta: Any):  # noqa: A002 - the CLI word
    """A dataclass field with its documentation (``metadata["help"]``, the CLI flag's help)."""
    if isinstance(default, (list, tuple)):
        return field(default=tuple(default), metadata={"help": help, **meta})
    return field(default=default, metadata={"help": help, **meta})


def need_int(owner: str, name: str, v: Any, lo: int, *, optional: bool = False) -> None:
    """``owner.name`` must be an integer >= ``lo`` (or None when ``optional``).

    A Python int only (:func:`varbatch_kit.checks.is_int` with ``numpy=False``):
    the config is stored as given and serialised for the workers.
    """
    if optional and v is None:
        return
    if not is_int(v, numpy=False) or v < lo:
        what = "a positive integer" if lo == 1 else f"an integer >= {lo}"
        raise ValueError(f"{owner}.{name}={v!r}: give {what}" + (" or None" if optional else ""))


def need_number(owner: str, name: str, v: Any, *, lo: float, lo_open: bool = False,
                 hi: float | None = None, hi_open: bool = False, optional: bool = False) -> None:
    """``owner.name`` must be a finite number in the given interval (or None).

    A Python int or float only, as :func:`need_int`; the interval is
    :func:`varbatch_kit.checks.number_in`'s.
    """
    if optional and v is None:
        return
    bounds = {"lo": lo, "hi": math.inf if hi is None else hi, "lo_open": lo_open,
              "hi_open": hi_open}
    ok = isinstance(v, (int, float))
    if ok:
        try:
            number_in(f"{owner}.{name}", v, **bounds)
        except ValueError:
            ok = False
    if not ok:
        raise ValueError(f"{owner}.{name}={v!r}: give a number in {interval_text(**bounds)}"
                         + (" or None" if optional else ""))


def need_choice(owner: str, name: str, v: Any, choices: tuple[str, ...]) -> None:
    """``owner.name`` must be one of ``choices``."""
    if v not in choices:
        raise ValueError(f"{owner}.{name}={v!r}: choose one of {choices}")


def need_bool(owner: str, name: str, v: Any) -> None:
    """``owner.name`` must be True or False (a bool, not 0/1 or a string)."""
    if not isinstance(v, bool):
        raise ValueError(f"{owner}.{name}={v!r}: give True or False")
