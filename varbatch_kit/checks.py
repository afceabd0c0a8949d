"""The integer and range checks every layer shares: a ``ValueError`` naming the
parameter, the value and what is allowed.

A neutral module at the top of the package (like :mod:`varbatch_kit.resources`):
``policies``, the lowest layer, uses it, and so does every layer above.

Which values count as integers:

- by default a Python ``int`` or a numpy integer (anything
  :class:`numbers.Integral`); ``bool`` never (``True`` is not a count);
- ``numpy=False``: a Python ``int`` only, for fields stored as given (a config
  that is serialised later);
- ``whole_floats=True``: also a float with a whole value (``2.0``), for the
  callers that always took one.

Each check returns the value as a Python ``int`` (or ``float`` for
:func:`number_in`).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["as_int", "int_in_range", "interval_text", "is_int", "nonnegative_int", "number_in",
           "positive_int"]


def is_int(value: Any, *, numpy: bool = True, whole_floats: bool = False) -> bool:
    """Whether ``value`` counts as an integer (see the module docstring); ``bool`` never."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    if numpy and isinstance(value, numbers.Integral):
        return True
    return (whole_floats and isinstance(value, numbers.Real) and math.isfinite(value)
            and float(value).is_integer())


def as_int(name: str, value: Any, *, numpy: bool = True, whole_floats: bool = False) -> int:
    """``value`` as a Python int; ``ValueError`` ``"NAME=VALUE is not an integer; ..."`` else."""
    if not is_int(value, numpy=numpy, whole_floats=whole_floats):
        raise ValueError(f"{name}={value!r} is not an integer; pass an integer")
    return int(value)


def positive_int(name: str, value: Any, *, note: str = "", numpy: bool = True,
                 whole_floats: bool = False) -> int:
    """``value`` (an integer >= 1) as a Python int.

    Else ``ValueError`` ``"NAME must be a positive integer{note}, got VALUE"``;
    ``note`` says what the number counts, e.g. ``" (pipeline stages)"``.
    """
    if not is_int(value, numpy=numpy, whole_floats=whole_floats) or value < 1:
        raise ValueError(f"{name} must be a positive integer{note}, got {value!r}")
    return int(value)


def nonnegative_int(name: str, value: Any, *, note: str = "", numpy: bool = True,
                    whole_floats: bool = False) -> int:
    """``value`` (an integer >= 0) as a Python int; else ``"NAME must be an integer >= 0, got"``."""
    if not is_int(value, numpy=numpy, whole_floats=whole_floats) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0{note}, got {value!r}")
    return int(value)


def int_in_range(name: str, value: Any, lo: int, hi: int, *, what: str | None = None) -> int:
    """``value``, an integer with ``lo <= value < hi``, as a Python int.

    Else ``ValueError`` ``"NAME=VALUE is out of range: WHAT"``; ``what`` names
    the valid values (default ``"pass an integer in LO..HI-1"``), e.g.
    ``"the schedule has steps 0..4"``. A command-line flag (a ``name`` that
    starts with ``--``) reads as typed: ``"--step 9 is out of range: ..."``.
    """
    if not is_int(value) or not lo <= value < hi:
        allowed = what if what is not None else f"pass an integer in {lo}..{hi - 1}"
        given = f"{name} {value}" if name.startswith("--") else f"{name}={value!r}"
        raise ValueError(f"{given} is out of range: {allowed}")
    return int(value)


def number_in(name: str, value: Any, lo: float, hi: float = math.inf, *,
              lo_open: bool = False, hi_open: bool = False, note: str = "") -> float:
    """``value``, a finite real number in the interval from ``lo`` to ``hi``, as a float.

    The ends are closed unless ``lo_open`` / ``hi_open``; ``hi=inf`` means no
    upper end (``lo=-inf, hi=inf``: any finite number). ``bool`` is refused.
    Else ``ValueError`` ``"NAME must be a finite number in [LO, HI]{note}, got
    VALUE"`` (without the interval for any finite number).
    """
    ok = (isinstance(value, numbers.Real) and not isinstance(value, bool)
          and math.isfinite(value) and (value > lo if lo_open else value >= lo)
          and (value < hi if hi_open or hi == math.inf else value <= hi))
    if not ok:
        where = "" if lo == -math.inf and hi == math.inf else \
            f" in {interval_text(lo, hi, lo_open=lo_open, hi_open=hi_open)}"
        raise ValueError(f"{name} must be a finite number{where}{note}, got {value!r}")
    return float(value)


def interval_text(lo: float, hi: float = math.inf, *, lo_open: bool = False,
                  hi_open: bool = False) -> str:
    """The interval of :func:`number_in` as text: ``"(0, 1]"``, ``"[0, inf)"``."""
    hi_s = "inf)" if hi == math.inf else f"{hi:g}{')' if hi_open else ']'}"
    return f"{'(' if lo_open else '['}{lo:g}, {hi_s}"
