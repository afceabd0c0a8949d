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


def test_idle_iterations_are_warned_once_each_with_their_count():
    """Nothing silently: iterations whose advantages were all zero, and iterations whose
    training left the weights as they were, one warning each, with a count."""
    import warnings

    from varbatch_kit.train.rl.rl_loop import _warn_idle

    records = [dict(iteration=0, zero_advantages=True, generator_hash="a", trained_hash="b"),
               dict(iteration=1, zero_advantages=True, generator_hash="b", trained_hash="b"),
               dict(iteration=2, zero_advantages=False, generator_hash="b", trained_hash="c")]
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        _warn_idle(records)
    assert [str(w.message)[:60] for w in got] == [
        "rl_loop: 2 of 3 iterations had every advantage zero (iterati",
        "rl_loop: 1 of 3 iterations left the weights unchanged (itera"]
    assert "iterations [0, 1]" in str(got[0].message)
    assert "iterations [1]" in str(got[1].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _warn_idle(records[2:])  # a learning iteration: no warning
