"""The report layer's boundary checks: integers, per-sample lists, positive numbers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from varbatch_kit.report import cp
from varbatch_kit.report.validation import as_int, check_samples, int_list, positive


def test_as_int_takes_python_numpy_and_0d_torch_integers():
    assert as_int("n", 3) == 3
    assert as_int("n", np.int32(4)) == 4 and type(as_int("n", np.int64(4))) is int
    assert as_int("n", torch.tensor(5)) == 5 and type(as_int("n", torch.tensor(5))) is int


@pytest.mark.parametrize("bad", [True, 2.0, "3", None, torch.tensor(2.0), torch.tensor(True),
                                 torch.tensor([1, 2]), np.float64(1.0)])
def test_as_int_refuses_what_is_not_an_integer_and_names_it(bad):
    with pytest.raises(ValueError, match=r"cp_size=.* is not an integer; pass an integer"):
        as_int("cp_size", bad)


def test_cp_uses_the_public_integer_check():
    assert cp.as_int is as_int
    assert not hasattr(cp, "_as_int")
    with pytest.raises(ValueError, match="cp_size=1.5 is not an integer"):
        cp.validate_cp(0, 1.5)


def test_int_list_names_the_entry():
    assert int_list("lens", torch.tensor([1, 2])) == [1, 2]
    with pytest.raises(ValueError, match=r"lens\[1\]=2.5 is not an integer"):
        int_list("lens", [1, 2.5])


def test_check_samples_and_positive():
    assert check_samples([5, 4], [2, 0], [torch.ones(2), torch.ones(0)]) == ([5, 4], [2, 0])
    # a response may be the whole sequence (no prompt); one token longer may not
    assert check_samples([3], [3], [torch.ones(3)]) == ([3], [3])
    with pytest.raises(ValueError, match=r"response_lengths\[0\]=6 > total_lengths\[0\]=5"):
        check_samples([5], [6], [torch.ones(6)])
    assert positive("n", torch.tensor(2)) == 2.0
    for bad in (0, -1, True, float("nan"), -float("inf")):
        with pytest.raises(ValueError, match="must be a positive number"):
            positive("n", bad)
    with pytest.raises(ValueError, match="not finite"):
        positive("n", float("inf"))
