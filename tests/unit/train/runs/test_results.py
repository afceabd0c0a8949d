"""``param_rel_diff``: ``||a - b|| / ||b||`` over all tensors flattened together, checked on
numbers worked out by hand and against the one-vector definition on random tensors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from varbatch_kit.train.runs.results import param_rel_diff


def test_by_hand():
    b = {"w": torch.tensor([3.0, 0.0]), "v": torch.tensor([[4.0]])}  # ||b|| = 5
    a = {"w": torch.tensor([3.0, 1.0]), "v": torch.tensor([[4.0]])}  # a - b = (0, 1, 0)
    assert param_rel_diff(a, b) == pytest.approx(1 / 5, rel=1e-15)
    assert param_rel_diff(b, b) == 0.0
    zero = {"w": torch.zeros(2)}
    assert param_rel_diff(zero, zero) == 0.0 and param_rel_diff({"w": torch.ones(2)}, zero) == 1.0


def test_parameter_sets_must_match():
    with pytest.raises(ValueError, match="parameter sets differ"):
        param_rel_diff({"w": torch.ones(1)}, {"v": torch.ones(1)})


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=5), st.integers(0, 2**31 - 1),
       st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
def test_equals_the_norm_of_the_flattened_difference(sizes, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    b = {f"p{i}": torch.randn(n, generator=g).to(dtype) for i, n in enumerate(sizes)}
    a = {k: (v.double() + 1e-3 * torch.randn(v.shape, generator=g, dtype=torch.float64)).to(
        dtype) for k, v in b.items()}
    flat_a = torch.cat([a[k].double() for k in b])
    flat_b = torch.cat([b[k].double() for k in b])
    want = float((flat_a - flat_b).norm() / flat_b.norm())
    assert math.isclose(param_rel_diff(a, b), want, rel_tol=1e-12)
