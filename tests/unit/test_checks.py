"""The shared integer and range checks (``varbatch_kit.checks``): values, bool, numpy, messages."""

from __future__ import annotations

import math

import numpy as np
import pytest

from varbatch_kit.checks import (
    as_int,
    int_in_range,
    interval_text,
    is_int,
    nonnegative_int,
    number_in,
    positive_int,
)


@pytest.mark.parametrize(("value", "numpy", "whole", "expected"), [
    (3, True, False, True), (0, True, False, True), (-2, True, False, True),
    (np.int64(3), True, False, True), (np.int8(-1), True, False, True),
    (np.int64(3), False, False, False),
    (True, True, False, False), (False, True, True, False), (np.bool_(True), True, True, False),
    (2.0, True, False, False), (2.0, True, True, True), (np.float64(4.0), True, True, True),
    (2.5, True, True, False), (math.inf, True, True, False), (math.nan, True, True, False),
    ("3", True, True, False), (None, True, True, False),
])
def test_is_int(value, numpy, whole, expected):
    assert is_int(value, numpy=numpy, whole_floats=whole) is expected


def test_positive_int_returns_a_python_int():
    for v in (1, 7, np.int64(7), np.uint16(7)):
        out = positive_int("dp", v)
        assert out == int(v) and type(out) is int
    assert positive_int("k", 3.0, whole_floats=True) == 3
    assert type(positive_int("k", 3.0, whole_floats=True)) is int


@pytest.mark.parametrize(("value", "kw"), [
    (0, {}), (-1, {}), (True, {}), (1.0, {}), (2.5, {"whole_floats": True}), ("2", {}),
    (None, {}), (np.int64(2), {"numpy": False}),
])
def test_positive_int_refuses(value, kw):
    with pytest.raises(ValueError, match=rf"^dp must be a positive integer, got {re_repr(value)}$"):
        positive_int("dp", value, **kw)


def test_positive_int_note_says_what_it_counts():
    with pytest.raises(ValueError, match=r"^pp must be a positive integer \(pipeline stages\), "
                                         r"got 0$"):
        positive_int("pp", 0, note=" (pipeline stages)")


def test_nonnegative_int():
    assert nonnegative_int("warmup", 0) == 0
    assert nonnegative_int("n_fit", np.int32(5)) == 5
    for bad in (-1, True, 0.0, None):
        msg = rf"^warmup must be an integer >= 0, got {re_repr(bad)}$"
        with pytest.raises(ValueError, match=msg):
            nonnegative_int("warmup", bad)


def test_as_int():
    assert as_int("n", np.int16(-4)) == -4
    assert type(as_int("n", np.int16(-4))) is int
    for bad in (True, 1.5, "1", None):
        msg = rf"^n={re_repr(bad)} is not an integer; pass an integer$"
        with pytest.raises(ValueError, match=msg):
            as_int("n", bad)


def test_int_in_range():
    assert int_in_range("step", 0, 0, 3) == 0
    assert int_in_range("step", np.int64(2), 0, 3) == 2
    for bad in (3, -1, True, 1.0):
        msg = rf"^step={re_repr(bad)} is out of range: pass an integer in 0\.\.2$"
        with pytest.raises(ValueError, match=msg):
            int_in_range("step", bad, 0, 3)
    msg = r"^step=5 is out of range: the schedule has steps 0\.\.1$"
    with pytest.raises(ValueError, match=msg):
        int_in_range("step", 5, 0, 2, what="the schedule has steps 0..1")


def test_number_in():
    assert number_in("eps", 0.5, 0, 1, lo_open=True, hi_open=True) == 0.5
    assert number_in("x", 0, 0) == 0.0 and type(number_in("x", 0, 0)) is float
    assert number_in("x", np.float32(1.0), 0, 1) == 1.0
    assert number_in("x", 1e300, 0) == 1e300
    for bad in (0, 1, True, math.nan, math.inf, "0.5", None):
        with pytest.raises(ValueError, match=rf"^eps must be a finite number in \(0, 1\), "
                                             rf"e\.g\. 0\.2, got {re_repr(bad)}$"):
            number_in("eps", bad, 0, 1, lo_open=True, hi_open=True, note=", e.g. 0.2")
    with pytest.raises(ValueError, match=r"^x must be a finite number in \[0, inf\), got -1$"):
        number_in("x", -1, 0)
    assert number_in("c0", -1e9, -math.inf) == -1e9
    with pytest.raises(ValueError, match=r"^c0 must be a finite number, got nan$"):
        number_in("c0", math.nan, -math.inf)


def re_repr(v) -> str:
    import re

    return re.escape(repr(v))


def test_interval_text():
    assert interval_text(0, 1) == "[0, 1]"
    assert interval_text(0, 1, lo_open=True, hi_open=True) == "(0, 1)"
    assert interval_text(0.5) == "[0.5, inf)"


def test_int_in_range_names_a_flag_as_typed():
    with pytest.raises(ValueError, match=r"^--step 9 is out of range: the schedule has 4 steps, "
                                         r"0\.\.3$"):
        int_in_range("--step", 9, 0, 4, what="the schedule has 4 steps, 0..3")
