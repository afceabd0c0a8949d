"""Field checks shared by the training sub-configs: ValueErrors naming the field, the
value and what works; ``documented`` declares a field with its help (``metadata["help"]``)."""

from __future__ import annotations

import math
from dataclasses import field
from typing import Any

__all__ = ["documented", "need_choice", "need_int", "need_number"]


def documented(default: Any, help: str, **meta: Any):  # noqa: A002 - the CLI word
    """A dataclass field with its documentation (``metadata["help"]``, the CLI flag's help)."""
    if isinstance(default, (list, tuple)):
        return field(default=tuple(default), metadata={"help": help, **meta})
    return field(default=default, metadata={"help": help, **meta})


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def need_int(owner: str, name: str, v: Any, lo: int, *, optional: bool = False) -> None:
    """``owner.name`` must be an integer >= ``lo`` (or None when ``optional``)."""
    if optional and v is None:
        return
    if not _is_int(v) or v < lo:
        what = "a positive integer" if lo == 1 else f"an integer >= {lo}"
        raise ValueError(f"{owner}.{name}={v!r}: give {what}" + (" or None" if optional else ""))


def need_number(owner: str, name: str, v: Any, *, lo: float, lo_open: bool = False,
                 hi: float | None = None, hi_open: bool = False, optional: bool = False) -> None:
    """``owner.name`` must be a finite number in the given interval (or None)."""
    if optional and v is None:
        return
    ok = (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
          and (v > lo if lo_open else v >= lo)
          and (hi is None or (v < hi if hi_open else v <= hi)))
    if not ok:
        lo_s = f"{'(' if lo_open else '['}{lo:g}"
        hi_s = f"{hi:g}{')' if hi_open else ']'}" if hi is not None else "inf)"
        raise ValueError(f"{owner}.{name}={v!r}: give a number in {lo_s}, {hi_s}"
                         + (" or None" if optional else ""))


def need_choice(owner: str, name: str, v: Any, choices: tuple[str, ...]) -> None:
    """``owner.name`` must be one of ``choices``."""
    if v not in choices:
        raise ValueError(f"{owner}.{name}={v!r}: choose one of {choices}")
