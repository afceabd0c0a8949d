"""The RL loop's pure parts: the weights hash and the bitwise sync check."""

from __future__ import annotations

import torch

from varbatch_kit.train.rl.rl_loop import _sync_exact, weights_hash


def test_the_hash_sees_every_bit_name_and_dtype_but_not_dict_order():
    a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.5])}
    assert weights_hash(a) == weights_hash(dict(reversed(list(a.items()))))
    flipped = {**a, "w": torch.tensor([1.0, torch.nextafter(torch.tensor(2.0),
                                                            torch.tensor(3.0)).item()])}
    assert weights_hash(flipped) != weights_hash(a)
    assert weights_hash({**a, "w": a["w"].double()}) != weights_hash(a)
    assert weights_hash({"v": a["w"], "b": a["b"]}) != weights_hash(a)


def test_the_sync_check_is_bitwise_and_dtype_strict():
    trained = {"w": torch.tensor([1.0, 2.0]), "extra": torch.zeros(1)}
    assert _sync_exact(trained, {"w": torch.tensor([1.0, 2.0])})
    assert not _sync_exact(trained, {"w": torch.tensor([1.0, 2.0 + 2 ** -20])})
    assert not _sync_exact(trained, {"w": torch.tensor([1.0, 2.0]).double()})
    assert not _sync_exact(trained, {"missing": torch.zeros(1)})
